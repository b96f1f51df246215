"""Pure tests of the MOP scheduler (no Dask, no torch).

The scheduler is driven only through ``Scheduler.start()`` and
``Scheduler.handle(event)``; ``validate()`` runs after every step. The
``Driver`` below plays the executor: it keeps the instructions in flight,
completes them in an order drawn from a seeded ``random.Random`` and checks,
at every instruction, what an executor would rely on. With ``replicas`` > 1
partitions have several holders; with ``timed`` a virtual clock ticks between
completions, so that paces are learnt and ``speculate`` starts copies.
"""

from __future__ import annotations

import doctest
import random
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, get_args

import pytest

from cerebro_automl.protocol import Event
from cerebro_automl.protocol import (Abort, AskProgress, BudgetExtended, Checkpoint, Discard, Drop, Evaluate,
                                     EvaluationDone, Executing, Fail, ModelStatus, ModelStopped, ModelsAdded,
                                     NewModel, PartitionPlaced, Pause, Place, PlaceFailed, Release, Report,
                                     Rollback, Tick, Train, UnitDone, UnitFailed, UnitProgress, WorkerAdded,
                                     WorkerLost)
from cerebro_automl.engine import lifecycle
from cerebro_automl.engine import runs as runs_module
from cerebro_automl.engine.handlers import HANDLERS
from cerebro_automl.engine.runs import RunState
from cerebro_automl.engine import (HAND_OFF, PROGRESS_EVERY, SPECULATE_MIN_LATE, TRANSITIONS, Scheduler,
                                   TransitionError, latin_order)

ORDERS = ("fixed", "dynamic")


# ----------------------------------------------------------------------- helpers
def names(num_workers: int) -> list[str]:
    return [f"w{i}" for i in range(num_workers)]


def new_models(epochs: list[int] | int, n: int = 1, first_id: int = 0) -> ModelsAdded:
    budgets = epochs if isinstance(epochs, list) else [epochs] * n
    return ModelsAdded(tuple(NewModel(first_id + i, e) for i, e in enumerate(budgets)))


@dataclass(frozen=True)
class Unit:
    """A completed unit whose result the model kept."""
    epoch: int
    step: int
    partition: int
    worker: str


@dataclass
class Flight:
    """An instruction in flight; ``gen`` is the model's rollback count at issue;
    ``discarded``: a run that lost its speculative race or was restarted (its
    result never counts)."""
    ins: Train | Place | Evaluate
    gen: int = 0
    discarded: bool = False


class Driver:
    """Plays the executor for one scheduler; checks what an executor relies on.

    Every Train must name a live worker that holds the partition (as the driver
    saw it placed), whose worker is idle, and whose model runs nothing else (but
    the unit a speculative copy duplicates). Every Evaluate names a holder of
    each partition, and every Drop a holder.
    """

    def __init__(self, num_partitions: int, num_workers: int, *, seed: int = 0,
                 order: str = "fixed", rng_seed: int = 0, deliver_stale: bool = False,
                 checkpoint: bool = False, replicas: int = 1, speculate: bool = False,
                 timed: bool = False, prefetch: bool = False, unit_reports: bool = False) -> None:
        self.s = Scheduler(num_partitions, names(num_workers), seed=seed, order=order,
                           checkpoint=checkpoint, replicas=replicas, speculate=speculate,
                           prefetch=prefetch, unit_reports=unit_reports)
        self.P = num_partitions
        self.rng = random.Random(rng_seed)
        self.deliver_stale = deliver_stale
        self.timed = timed
        self.clock = 0.0
        self.live: set[str] = set(names(num_workers))
        self.held: dict[int, set[str]] = defaultdict(set)  # partition -> holders, as seen placed
        self.inflight: list[Flight] = []
        self.stale: list[Flight] = []             # died with their worker, maybe delivered
        self.worker_busy: dict[str, list[Train]] = {}  # sent, not ended (two with prefetch)
        self.model_busy: dict[int, list[Train]] = defaultdict(list)
        self.trains: list[Train] = []             # every Train, in issue order
        self.kept: dict[int, list[Unit]] = defaultdict(list)  # units in the model's state
        self.gen: Counter[int] = Counter()
        self.dead: set[int] = set()               # stopped or failed
        self.copies: list[Train] = []             # speculative copies, in issue order
        self.restarted: list[Train] = []          # straggling runs discarded to run again
        self.discards: list[Discard] = []
        self.drops: list[Drop] = []
        self.reports: list[Report] = []
        self.finishes: list[Pause] = []
        self.fails: list[Fail] = []
        self.rollbacks: list[Rollback] = []
        self.releases: list[Release] = []
        self.checkpoints: list[Checkpoint] = []
        self.aborts: list[Abort] = []
        self.asks: list[AskProgress] = []          # not answered yet
        self.unit_errors: dict[tuple[int, int, int], str] = {}  # (model, epoch, step)
        self.eval_errors: dict[tuple[int, int], str] = {}       # (model, epoch)

    # ---------------------------------------------------------------- events
    def start(self) -> list:
        out = self.s.start()
        self.s.validate()
        self._absorb(out)
        return out

    def send(self, event) -> list:
        out = self.s.handle(event)
        self.s.validate()
        self._absorb(out)
        return out

    def stop(self, model_id: int) -> list:
        self.dead.add(model_id)
        return self.send(ModelStopped(model_id))

    def add_worker(self, worker: str) -> list:
        self.live.add(worker)
        return self.send(WorkerAdded(worker))

    def lose_worker(self, worker: str) -> list:
        """The worker dies with its partitions and the units and placements on it."""
        self.forget_worker(worker)
        return self.send(WorkerLost(worker))

    def forget_worker(self, worker: str) -> None:
        """What the driver knows of a worker that died, before the scheduler is told."""
        self.live.discard(worker)
        for holders in self.held.values():
            holders.discard(worker)
        for f in [f for f in self.inflight if getattr(f.ins, "worker", None) == worker]:
            self.inflight.remove(f)
            self._unbusy(f)
            self.stale.append(f)

    def placed_on(self, worker: str) -> list[int]:
        return sorted(p for p, holders in self.held.items() if worker in holders)

    # ------------------------------------------------------------ completion
    def step(self) -> bool:
        """Complete one instruction in flight, chosen at random; False if none."""
        if self.timed and (self.inflight or self.stale):
            self.clock += self.rng.expovariate(1.0)
            self.send(Tick(self.clock))
        if self.asks and self.rng.random() < 0.5:
            self._answer(self.asks.pop(self.rng.randrange(len(self.asks))))
        if self.deliver_stale and self.stale and self.rng.random() < 0.3:
            f = self.stale.pop(self.rng.randrange(len(self.stale)))
            if isinstance(f.ins, Train):
                self.send(UnitDone(f.ins.model_id, f.ins.partition, f.ins.worker))
            elif isinstance(f.ins, Place):
                self.send(PartitionPlaced(f.ins.partition, f.ins.worker))
            return True
        if not self.inflight:
            return False
        self.complete(self.inflight[self.rng.randrange(len(self.inflight))])
        return True

    def complete(self, f: Flight) -> list:
        self.inflight.remove(f)
        ins = f.ins
        if isinstance(ins, Place):
            self.held[ins.partition].add(ins.worker)
            return self.send(PartitionPlaced(ins.partition, ins.worker))
        if isinstance(ins, Evaluate):
            error = self.eval_errors.get((ins.model_id, ins.epoch)) if not ins.unit else None
            return self.send(EvaluationDone(ins.model_id, ins.epoch, error, ins.unit))
        self._unbusy(f)
        error = self.unit_errors.get((ins.model_id, ins.epoch, ins.step))
        if error is not None and not f.discarded:
            return self.send(UnitFailed(ins.model_id, ins.partition, ins.worker, error))
        if f.gen == self.gen[ins.model_id] and ins.model_id not in self.dead and not f.discarded:
            # The first run of a unit to finish is the model's (its race partner is
            # discarded in the instructions this UnitDone returns).
            self.kept[ins.model_id].append(Unit(ins.epoch, ins.step, ins.partition, ins.worker))
        return self.send(UnitDone(ins.model_id, ins.partition, ins.worker))

    def run(self, hook: Callable[[Driver], None] | None = None, max_steps: int = 100_000) -> None:
        """Complete instructions until none is in flight; ``hook`` runs before each step."""
        for _ in range(max_steps):
            if hook is not None:
                hook(self)
            if not self.step():
                assert not self.s.active(), "scheduler is active but nothing is in flight"
                return
        raise AssertionError("the run did not end")

    def run_until(self, condition: Callable[[Driver], bool]) -> None:
        while not condition(self):
            assert self.step(), "ran out of work before the condition held"

    def lockstep_round(self) -> list[Train]:
        """Complete everything in flight now (Places, Evaluates, then Trains)."""
        batch = sorted(self.inflight, key=lambda f: isinstance(f.ins, Train))
        for f in batch:
            self.complete(f)
        return [f.ins for f in batch if isinstance(f.ins, Train)]

    # ------------------------------------------------------------- checking
    def _absorb(self, out: list) -> None:
        for ins in out:
            if isinstance(ins, Train):
                self._check_train(ins)
                (self.copies if ins.copy else self.trains).append(ins)
                self.worker_busy.setdefault(ins.worker, []).append(ins)
                self.model_busy[ins.model_id].append(ins)
                self.inflight.append(Flight(ins, self.gen[ins.model_id]))
            elif isinstance(ins, Place):
                assert ins.worker in self.live, f"{ins} names a dead worker"
                assert ins.worker not in self.held[ins.partition], f"{ins}: it holds it already"
                self.inflight.append(Flight(ins))
            elif isinstance(ins, Evaluate):
                assert len(ins.workers) == self.P, ins
                for p, w in enumerate(ins.workers):
                    assert w in self.held[p], f"{ins}: {w} does not hold partition {p}"
                self.inflight.append(Flight(ins))
            elif isinstance(ins, Drop):
                assert ins.worker in self.held[ins.partition], f"{ins}: it does not hold it"
                assert len(self.held[ins.partition]) >= 2, f"{ins}: the last holder"
                self.held[ins.partition].discard(ins.worker)
                self.drops.append(ins)
            elif isinstance(ins, Discard):
                self._discard(ins)
            elif isinstance(ins, Rollback):
                self.rollbacks.append(ins)
                self.gen[ins.model_id] += 1
                self.kept[ins.model_id] = [u for u in self.kept[ins.model_id]
                                           if u.epoch < ins.epoch]
            elif isinstance(ins, Report):
                self.reports.append(ins)
            elif isinstance(ins, Pause):
                self.finishes.append(ins)
            elif isinstance(ins, Fail):
                self.fails.append(ins)
                self.dead.add(ins.model_id)
            elif isinstance(ins, Release):
                self.releases.append(ins)
            elif isinstance(ins, Checkpoint):
                self.checkpoints.append(ins)
            elif isinstance(ins, Abort):
                self.aborts.append(ins)
            elif isinstance(ins, AskProgress):
                assert self.s.speculate and ins.runs, ins
                for model_id, partition, worker in ins.runs:
                    runs = self.worker_busy.get(worker, ())
                    assert worker not in self.live or \
                        any((t.model_id, t.partition) == (model_id, partition) for t in runs), \
                        f"{ins}: not running on {worker}"
                self.asks.append(ins)
            else:
                raise AssertionError(f"unknown instruction {ins!r}")

    def _answer(self, ask: AskProgress) -> None:
        """Some progress, late or never for some runs (they may have ended meanwhile):
        a random share done in a random time, slow or fast."""
        for model_id, partition, worker in ask.runs:
            if self.rng.random() < 0.8:
                self.send(UnitProgress(model_id, partition, worker, self.rng.choice((0.0, self.rng.random())),
                                       self.rng.expovariate(1.0)))

    def _check_train(self, t: Train) -> None:
        assert t.model_id not in self.dead, f"{t} for a stopped or failed model"
        assert t.worker in self.live, f"{t} names a dead worker"
        assert t.worker in self.held[t.partition], \
            f"{t}: partition {t.partition} is on {sorted(self.held[t.partition])}"
        # With prefetch a busy worker may be sent one more unit, to run after its own.
        assert len(self.worker_busy.get(t.worker, ())) < (2 if self.s.prefetch and not t.copy else 1), \
            f"{t}: worker already runs {self.worker_busy[t.worker]}"
        if t.copy:
            assert self.s.speculate, f"{t}: a copy without speculate"
            [running] = self.model_busy[t.model_id]
            assert (running.epoch, running.step, running.partition) == (t.epoch, t.step, t.partition), \
                f"{t} copies another unit than {running}"
            # (The running one may itself be a copy whose original died with its
            # worker: it is the model's unit now, and may be copied in turn.)
            assert running.worker != t.worker
        else:
            assert not self.model_busy[t.model_id], \
                f"{t}: model already runs {self.model_busy[t.model_id]}"
        assert t.epoch_end == (t.step == self.P - 1)

    def _discard(self, d: Discard) -> None:
        """The run on ``d.worker`` lost its race or is restarted: it no longer counts
        for its model."""
        self.discards.append(d)
        for f in self.inflight + self.stale:
            ins = f.ins
            if isinstance(ins, Train) and (ins.model_id, ins.partition, ins.worker) == \
                    (d.model_id, d.partition, d.worker) and not f.discarded:
                f.discarded = True
                if d.restart:
                    self.restarted.append(ins)
                self._not_running(ins)

    def _unbusy(self, f: Flight) -> None:
        ins = f.ins
        if isinstance(ins, Train):
            runs = [t for t in self.worker_busy[ins.worker] if t is not ins]
            if runs:
                self.worker_busy[ins.worker] = runs
            else:
                del self.worker_busy[ins.worker]
            self._not_running(ins)

    def _not_running(self, ins: Train) -> None:
        """By identity: a restarted unit's new run equals the one it replaces."""
        self.model_busy[ins.model_id] = [t for t in self.model_busy[ins.model_id] if t is not ins]

    # ------------------------------------------------------------- queries
    def trains_of(self, model_id: int) -> list[Train]:
        """The model's Trains, but the runs restarted (each ran again)."""
        restarted = {id(t) for t in self.restarted}
        return [t for t in self.trains if t.model_id == model_id and id(t) not in restarted]

    def reports_of(self, model_id: int) -> list[Report]:
        return [r for r in self.reports if r.model_id == model_id]

    def check_completed(self, model_id: int, epochs: int) -> None:
        """The model's state went through every partition once per epoch, reported
        each epoch once, in order, with the order it trained, and finished once."""
        kept = self.kept[model_id]
        assert [u.epoch for u in kept] == [e for e in range(epochs) for _ in range(self.P)]
        reports = self.reports_of(model_id)
        assert [r.epoch for r in reports] == list(range(1, epochs + 1))
        for e in range(epochs):
            units = kept[e * self.P:(e + 1) * self.P]
            assert [u.step for u in units] == list(range(self.P))
            assert sorted(u.partition for u in units) == list(range(self.P))
            assert reports[e].order == tuple(u.partition for u in units)
        assert [f.epochs for f in self.finishes if f.model_id == model_id] == [epochs]
        assert self.s.models[model_id].status is ModelStatus.PAUSED


def random_shape(rng: random.Random) -> dict:
    """P, W, n and order; replicas from 1 to W, speculation on half the runs with
    replicas, and a clock on those and on a third of the others."""
    shape = dict(P=rng.randint(1, 6), W=rng.randint(1, 4), n=rng.randint(1, 10),
                 order=rng.choice(ORDERS))
    replicas = rng.randint(1, shape["W"])
    speculate = replicas > 1 and rng.random() < 0.5
    return dict(shape, replicas=replicas, speculate=speculate, timed=speculate or rng.random() < 0.3,
                prefetch=rng.random() < 0.5)


def driver_of(shape: dict, **kwargs) -> Driver:
    return Driver(shape["P"], shape["W"], order=shape["order"], replicas=shape["replicas"],
                  speculate=shape["speculate"], timed=shape["timed"], prefetch=shape["prefetch"], **kwargs)


def random_run(seed: int, **overrides) -> tuple[Driver, list[int]]:
    """A session of a random shape run to the end; returns the driver and budgets."""
    rng = random.Random(seed)
    shape = {**random_shape(rng), **overrides}
    d = driver_of(shape, seed=seed, rng_seed=seed)
    budgets = [rng.randint(1, 3) for _ in range(shape["n"])]
    d.start()
    d.send(new_models(budgets))
    d.run()
    return d, budgets


SEEDS = range(100)


# ----------------------------------------------------------------- visits
@pytest.mark.parametrize("seed", SEEDS)
def test_every_model_visits_every_partition_once_per_epoch(seed):
    """Grouped by model and epoch, the Trains cover every partition exactly once."""
    d, budgets = random_run(seed)
    for m, epochs in enumerate(budgets):
        by_epoch = defaultdict(list)
        for t in d.trains_of(m):
            by_epoch[t.epoch].append(t)
        assert sorted(by_epoch) == list(range(epochs))
        for e, units in by_epoch.items():
            assert sorted(t.partition for t in units) == list(range(d.P)), (m, e)
            assert [t.step for t in units] == list(range(d.P))


@pytest.mark.parametrize("seed", SEEDS)
def test_one_report_per_epoch_in_order_and_one_finish(seed):
    """Each model reports epochs 1..budget once, in order, then finishes once."""
    d, budgets = random_run(seed)
    for m, epochs in enumerate(budgets):
        d.check_completed(m, epochs)
    assert len(d.finishes) == len(budgets)
    assert not d.fails and not d.rollbacks and not d.releases


@pytest.mark.parametrize("seed", range(60))
def test_fixed_order_follows_latin_order(seed):
    """With order="fixed", epoch e of the model with offset k is latin_order(seed, e, k, P)."""
    d, budgets = random_run(seed, order="fixed")
    for m, epochs in enumerate(budgets):
        trains = d.trains_of(m)
        reports = d.reports_of(m)
        for e in range(epochs):
            expected = latin_order(seed, e, m, d.P)  # offset = ordinal = model id here
            assert tuple(t.partition for t in trains if t.epoch == e) == expected
            assert reports[e].order == expected


@pytest.mark.parametrize("seed", range(30))
def test_cyclic_order_visits_every_epoch_as_the_first(seed):
    """With order="cyclic", every epoch of the model with offset k is epoch 0's Latin
    order: one ring of the partitions, walked from k."""
    d, budgets = random_run(seed, order="cyclic")
    for m, epochs in enumerate(budgets):
        trains = d.trains_of(m)
        for e in range(epochs):
            expected = latin_order(seed, 0, m, d.P)
            assert expected == latin_order(seed, e, m, d.P, cyclic=True)
            assert tuple(t.partition for t in trains if t.epoch == e) == expected
            assert d.reports_of(m)[e].order == expected


def test_explicit_offsets_are_used():
    """A NewModel's explicit offset, not its ordinal, picks its Latin order."""
    d = Driver(5, 2, seed=3)
    d.start()
    d.send(ModelsAdded((NewModel(7, 2, offset=3), NewModel(8, 1, offset=0))))
    d.run()
    for m, offset, epochs in ((7, 3, 2), (8, 0, 1)):
        for e in range(epochs):
            got = tuple(t.partition for t in d.trains_of(m) if t.epoch == e)
            assert got == latin_order(3, e, offset, 5)


@pytest.mark.parametrize("P", range(1, 9))
def test_latin_orders_never_collide_in_lock_step(P):
    """Models with different offsets need different partitions at every step."""
    for seed in range(5):
        for epoch in range(3):
            orders = [latin_order(seed, epoch, k, P) for k in range(P)]
            for order in orders:
                assert sorted(order) == list(range(P))
            for j in range(P):
                assert sorted(order[j] for order in orders) == list(range(P))
    assert latin_order(0, 0, 0, P) == latin_order(0, 0, P, P)  # offsets wrap modulo P


@pytest.mark.parametrize("seed", range(60))
def test_dynamic_report_order_is_a_permutation(seed):
    """With order="dynamic", every Report.order is a permutation of range(P)."""
    d, budgets = random_run(seed, order="dynamic")
    assert len(d.reports) == sum(budgets)
    for r in d.reports:
        assert sorted(r.order) == list(range(d.P))
        assert r.order == tuple(t.partition for t in d.trains_of(r.model_id)
                                if t.epoch == r.epoch - 1)


# ------------------------------------------------------------ concurrency
@pytest.mark.parametrize("seed", SEEDS)
def test_no_worker_or_model_runs_two_units_at_once(seed):
    """No worker or model is double-booked, also across stops, worker losses
    (rollbacks) and late results: the driver counts every unit in flight,
    including those whose result the scheduler will discard."""
    rng = random.Random(seed)
    shape = random_shape(rng)
    d = driver_of(shape, rng_seed=seed, deliver_stale=True)
    d.start()
    d.send(new_models(2, shape["n"]))
    peak = 0

    def disturb(d: Driver) -> None:
        nonlocal peak
        peak = max(peak, len(d.worker_busy))
        x = rng.random()
        alive = sorted(set(range(shape["n"])) - d.dead)
        if x < 0.01 and alive:
            d.stop(rng.choice(alive))
        elif x < 0.02 and len(d.live) > 1:
            d.lose_worker(rng.choice(sorted(d.live)))

    d.run(hook=disturb)
    # Replicas let a partition serve up to `replicas` units at once; with speculation
    # a model also keeps a copy and the runs that lost their races busy.
    assert peak <= (shape["W"] if shape["speculate"] else
                    min(shape["W"], shape["n"], shape["P"] * shape["replicas"]))
    assert peak >= 1 or not d.trains


@pytest.mark.parametrize("seed", range(60))
def test_train_only_where_the_partition_is(seed):
    """Every Train names the worker that holds its partition, also while partitions
    move: the driver checks each Train against the placements it completed."""
    rng = random.Random(seed)
    d = Driver(rng.randint(1, 6), 2, order=rng.choice(ORDERS), rng_seed=seed,
               replicas=rng.choice((1, 1, 2)))
    d.start()
    d.send(new_models(2, rng.randint(1, 8)))
    d.run_until(lambda d: len(d.trains) >= 1)
    d.add_worker("w2")      # rebalancing moves partitions while units run
    for _ in range(rng.randrange(10)):
        d.step()
    d.lose_worker("w0")     # re-placement after a loss
    d.run()
    seen = {t.worker for t in d.trains}
    assert seen <= {"w0", "w1", "w2"} and d.trains


# --------------------------------------------------------------- budgets
def test_model_pauses_when_budget_spent_and_extension_resumes():
    """A spent model is PAUSED; BudgetExtended trains exactly the extra epochs."""
    d = Driver(3, 2, rng_seed=1)
    d.start()
    d.send(new_models(1, n=2))
    d.run()
    assert all(m.status is ModelStatus.PAUSED for m in d.s.models.values())
    before = len(d.trains_of(0))
    assert before == 3
    d.send(BudgetExtended(0, 2))
    assert d.s.models[0].status is ModelStatus.TRAINING
    d.run()
    extra = d.trains_of(0)[before:]
    assert [t.epoch for t in extra] == [1, 1, 1, 2, 2, 2]
    assert [r.epoch for r in d.reports_of(0)] == [1, 2, 3]
    assert [f.epochs for f in d.finishes if f.model_id == 0] == [1, 3]
    assert len(d.trains_of(1)) == 3  # the other model stayed paused
    assert d.s.models[0].status is ModelStatus.PAUSED


def test_extension_while_training_adds_epochs_without_early_finish():
    """Extending a model that still trains moves its Pause to the new budget."""
    d = Driver(2, 2, rng_seed=2)
    d.start()
    d.send(new_models(1))
    d.run_until(lambda d: len(d.trains) >= 1)
    d.send(BudgetExtended(0, 1))
    d.run()
    d.check_completed(0, 2)


def test_extending_stopped_or_failed_model_raises():
    """BudgetExtended on a STOPPED or FAILED model raises ValueError."""
    d = Driver(2, 2, rng_seed=0)
    d.start()
    d.send(new_models(1, n=2))
    d.eval_errors[(1, 1)] = "nan loss"
    d.stop(0)
    d.run()
    assert d.s.models[1].status is ModelStatus.FAILED
    with pytest.raises(ValueError, match="stopped"):
        d.s.handle(BudgetExtended(0, 1))
    with pytest.raises(ValueError, match="failed"):
        d.s.handle(BudgetExtended(1, 1))
    d.send(ModelsAdded((NewModel(5, 1),)))
    with pytest.raises(ValueError, match="epochs is 0"):
        d.s.handle(BudgetExtended(5, 0))
    d.s.validate()


def test_stop_mid_epoch_ignores_the_unit_in_flight():
    """The stopped model's UnitDone frees the worker and yields no further Train."""
    d = Driver(1, 1)
    d.start()
    d.run_until(lambda d: d.held[0])
    (first,) = [i for i in d.send(new_models(2)) if isinstance(i, Train)]
    assert first.model_id == 0
    assert d.stop(0) == [Release(0)]
    assert d.s.models[0].status is ModelStatus.STOPPED
    out = d.send(new_models(1, first_id=1))
    assert not [i for i in out if isinstance(i, Train)]  # w0 still runs the stopped unit
    out = d.complete(d.inflight[0])
    assert out == [Train(1, 0, "w0", 0, 0, True)]  # the worker is free again
    d.run()
    assert d.trains_of(0) == [first]
    assert not d.reports_of(0)
    d.check_completed(1, 1)


def test_stopping_unknown_model_raises():
    """ModelStopped for an id never added raises ValueError naming it."""
    d = Driver(2, 1)
    d.start()
    with pytest.raises(ValueError, match="42"):
        d.s.handle(ModelStopped(42))
    d.s.validate()


def test_stop_twice_is_harmless():
    """Stopping an already stopped model emits nothing more."""
    d = Driver(2, 2)
    d.start()
    d.send(new_models(1))
    assert d.stop(0) == [Release(0)]
    assert d.stop(0) == []


# ----------------------------------------------------------------- failures
@pytest.mark.parametrize("seed", range(40))
def test_unit_failure_fails_only_that_model(seed):
    """UnitFailed emits Fail + Release for that model; the others finish."""
    rng = random.Random(seed)
    P, W, n = rng.randint(1, 5), rng.randint(1, 4), rng.randint(2, 6)
    d = Driver(P, W, order=rng.choice(ORDERS), rng_seed=seed)
    victim, epoch, step = rng.randrange(n), rng.randrange(2), rng.randrange(P)
    d.unit_errors[(victim, epoch, step)] = "boom"
    d.start()
    d.send(new_models(2, n))
    d.run()
    assert d.fails == [Fail(victim, "boom")]
    assert d.releases == [Release(victim)]
    last = d.trains_of(victim)[-1]
    assert (last.epoch, last.step) == (epoch, step)
    assert [r.epoch for r in d.reports_of(victim)] == list(range(1, epoch + 1))
    assert d.s.models[victim].status is ModelStatus.FAILED
    for m in set(range(n)) - {victim}:
        d.check_completed(m, 2)


@pytest.mark.parametrize("seed", range(40))
def test_evaluation_error_fails_the_model(seed):
    """EvaluationDone with an error fails the model: no Report for that epoch."""
    rng = random.Random(seed)
    P, W, n = rng.randint(1, 5), rng.randint(1, 4), rng.randint(2, 6)
    d = Driver(P, W, order=rng.choice(ORDERS), rng_seed=seed)
    victim, epoch = rng.randrange(n), rng.randint(1, 3)
    d.eval_errors[(victim, epoch)] = "nan"
    d.start()
    d.send(new_models(3, n))
    d.run()
    assert d.fails == [Fail(victim, "nan")] and d.releases == [Release(victim)]
    assert [r.epoch for r in d.reports_of(victim)] == list(range(1, epoch))
    assert max(t.epoch for t in d.trains_of(victim)) == epoch - 1
    assert not [f for f in d.finishes if f.model_id == victim]
    for m in set(range(n)) - {victim}:
        d.check_completed(m, 3)


def test_checkpoint_at_every_epoch_end():
    """With checkpoint=True every trained epoch emits one Checkpoint."""
    d = Driver(3, 2, rng_seed=4, checkpoint=True)
    d.start()
    d.send(new_models([2, 1]))
    d.run()
    assert sorted((c.model_id, c.epoch) for c in d.checkpoints) == [(0, 1), (0, 2), (1, 1)]


# ------------------------------------------------------------------- shapes
@pytest.mark.parametrize("order", ORDERS)
def test_more_partitions_than_workers(order):
    """P=6, W=2: each worker holds 3 partitions and still runs one unit at a time."""
    d = Driver(6, 2, order=order, rng_seed=5)
    d.start()
    d.send(new_models(2, n=5))
    d.run_until(lambda d: sum(map(len, d.held.values())) == 6)
    assert [d.placed_on(w) for w in ("w0", "w1")] == [[0, 2, 4], [1, 3, 5]]
    d.run()
    for m in range(5):
        d.check_completed(m, 2)
    assert {t.worker for t in d.trains} == {"w0", "w1"}


@pytest.mark.parametrize("order", ORDERS)
def test_fewer_models_than_workers(order):
    """n=1, W=3: the single model hops through all workers and completes."""
    d = Driver(3, 3, order=order, rng_seed=6)
    d.start()
    d.send(new_models(3))
    d.run()
    d.check_completed(0, 3)
    assert {t.worker for t in d.trains} == {"w0", "w1", "w2"}


def test_models_added_before_any_worker():
    """Models wait for a worker; the first WorkerAdded places every partition."""
    d = Driver(3, 0)
    assert d.start() == []
    d.send(new_models(1, n=2))
    out = d.add_worker("x")
    assert sorted(out, key=lambda i: i.partition) == [Place(p, "x") for p in range(3)]
    d.run()
    for m in range(2):
        d.check_completed(m, 1)


# ------------------------------------------------------------------ workers
@pytest.mark.parametrize("seed", range(30))
def test_worker_added_mid_run_gets_partitions_and_runs_units(seed):
    """WorkerAdded rebalances (Place to the newcomer), which then runs units."""
    d = Driver(6, 2, order=random.Random(seed).choice(ORDERS), rng_seed=seed)
    d.start()
    d.send(new_models(2, n=6))
    d.run_until(lambda d: len(d.trains) >= 8)
    out = d.add_worker("w2")
    placed_here = [i for i in out if isinstance(i, Place)]
    assert len(placed_here) == 2 and all(i.worker == "w2" for i in placed_here)
    n_before = len(d.trains)
    d.run()
    assert [len(d.placed_on(w)) for w in ("w0", "w1", "w2")] == [2, 2, 2]
    assert any(t.worker == "w2" for t in d.trains[n_before:])
    for m in range(6):
        d.check_completed(m, 2)


@pytest.mark.parametrize("seed", range(20))
def test_a_worker_that_joins_while_the_copies_load_gets_some_once_they_are_held(seed):
    """With two replicas on two workers, each loads every partition at the start. A
    worker that joins then finds no copy held yet to move: it gets its share once the
    loads end, and trains."""
    d = Driver(3, 2, replicas=2, order=random.Random(seed).choice(ORDERS), rng_seed=seed)
    d.start()
    d.send(new_models(2, n=6))
    assert d.add_worker("w2") == []  # every partition has its two copies, none held yet
    d.run_until(lambda d: any(isinstance(f.ins, Place) and f.ins.worker == "w2" for f in d.inflight))
    n_before = len(d.trains)
    d.run()
    assert sorted(len(d.placed_on(w)) for w in ("w0", "w1", "w2")) == [2, 2, 2]
    assert any(t.worker == "w2" for t in d.trains[n_before:])
    for m in range(6):
        d.check_completed(m, 2)


def test_a_partition_that_failed_to_load_on_a_worker_is_not_moved_there_again():
    """A move onto a newcomer fails: the donor keeps its copy and the newcomer is
    offered another partition, never the one that failed there."""
    d = Driver(2, 1, replicas=1)
    d.start()
    d.send(new_models(1, n=2))
    d.run_until(lambda d: len(d.placed_on("w0")) == 2)
    [move] = d.add_worker("w1")
    assert isinstance(move, Place) and move.worker == "w1"
    [f] = [f for f in d.inflight if f.ins == move]
    d.inflight.remove(f)
    out = d.send(PlaceFailed(move.partition, "w1", "MemoryError"))
    assert [i for i in out if isinstance(i, Place)] == [Place(1 - move.partition, "w1", 0)]
    assert (move.partition, "w1") in d.s.placement.failed


@pytest.mark.parametrize("seed", range(40))
def test_units_trained_counts_only_the_units_the_models_keep(seed):
    """The progress bar's count: with workers lost (rollbacks), races between copies
    and results of discarded runs delivered late, it ends at the budgets' units."""
    rng = random.Random(seed)
    shape = random_shape(rng)
    d = driver_of(shape, rng_seed=seed, deliver_stale=True)
    d.s.settings.max_unit_retries = 1000
    budgets = [rng.randint(1, 3) for _ in range(shape["n"])]
    d.start()
    d.send(new_models(budgets))
    spawned = iter(range(1000))

    def lose_now_and_then(d: Driver) -> None:
        if rng.random() < 0.03:
            d.lose_worker(rng.choice(sorted(d.live)))
            d.add_worker(f"n{next(spawned)}")

    d.run(hook=lose_now_and_then)
    for m, epochs in enumerate(budgets):
        d.check_completed(m, epochs)
    assert d.s.units_trained == sum(budgets) * shape["P"], (len(d.rollbacks), len(d.trains))


def test_a_unit_left_to_a_fast_holder_goes_to_the_slow_one_once_that_holder_hangs():
    """Units take 1 s on "fast" and 10 s on "slow", both holding the one partition: once
    the paces are learnt, a unit waits for "fast" rather than start on "slow". When a
    unit on "fast" hangs, a waiting unit goes to "slow" once the hung one is overdue
    by HAND_OFF x 10 - 1 s."""
    s = Scheduler(1, ["fast", "slow"], replicas=2)
    s.handle(Tick(0.0))
    for ins in s.start():
        s.handle(PartitionPlaced(ins.partition, ins.worker))
    now, hung_at = 0.0, None
    ends: dict[str, tuple[int, float]] = {}  # worker -> (model, when its unit ends)
    pending = s.handle(ModelsAdded(tuple(NewModel(i, 60) for i in range(3))))
    while now < 200:
        for ins in pending:
            if isinstance(ins, Train):
                if hung_at is not None and ins.worker == "slow":
                    assert now - hung_at <= 1 + HAND_OFF * 10 - 1 + 0.5, now - hung_at
                    return
                hang = ins.worker == "fast" and s.units_trained >= 60 and hung_at is None
                if hang:
                    hung_at = now
                    assert "slow" not in ends  # its paces learnt, the slow worker is passed over
                ends[ins.worker] = (ins.model_id, float("inf") if hang else now + (1 if ins.worker == "fast" else 10))
            elif isinstance(ins, Evaluate):
                pending.extend(s.handle(EvaluationDone(ins.model_id, ins.epoch)))
        worker, (model, end) = min(ends.items(), key=lambda item: item[1][1])
        now = min(end, now + 0.5)  # a Tick at least every 0.5 s, as a Session polls
        pending = s.handle(Tick(now))
        if end <= now:
            del ends[worker]
            pending += s.handle(UnitDone(model, 0, worker))
        s.validate()
    raise AssertionError("the unit waiting behind the hung one never went to the slow worker")


@pytest.mark.parametrize("seed", range(60))
def test_worker_lost_mid_unit_replaces_and_rolls_back(seed):
    """Losing a busy worker: its partitions go to survivors, models whose state it
    held roll back, and every model still completes with no duplicate report."""
    rng = random.Random(seed)
    P, n = rng.randint(2, 6), rng.randint(2, 8)
    d = Driver(P, 3, order=rng.choice(ORDERS), rng_seed=seed, deliver_stale=rng.random() < 0.5)
    d.start()
    d.send(new_models(2, n))
    enough = rng.randint(1, P * n)
    d.run_until(lambda d: len(d.trains) >= enough and "w1" in d.worker_busy)
    moving_in = [f.ins.partition for f in d.inflight
                 if isinstance(f.ins, Place) and f.ins.worker == "w1"]
    lost_parts = sorted(d.placed_on("w1") + moving_in)
    holders = {m: units[-1].worker for m, units in d.kept.items() if units}
    affected = {m for m, w in holders.items() if w == "w1"}
    out = d.lose_worker("w1")
    replaced = sorted(i.partition for i in out if isinstance(i, Place))
    assert replaced == lost_parts
    assert all(i.worker in {"w0", "w2"} for i in out if isinstance(i, Place))
    assert {r.model_id for r in out if isinstance(r, Rollback)} == affected
    d.run()
    for m in range(n):
        d.check_completed(m, 2)


@pytest.mark.parametrize("seed", range(20))
def test_losing_all_workers_then_adding_one_completes(seed):
    """With every worker gone nothing runs; a new worker takes all partitions."""
    d = Driver(3, 2, order=ORDERS[seed % 2], rng_seed=seed, deliver_stale=True)
    d.start()
    d.send(new_models(2, n=3))
    d.run_until(lambda d: len(d.trains) >= 5)
    d.lose_worker("w0")
    d.lose_worker("w1")
    assert all(isinstance(f.ins, Evaluate) for f in d.inflight)
    while d.step():  # only Evaluates and stale results are left: nothing can train
        assert not d.worker_busy
    out = d.add_worker("w9")
    assert sorted(i.partition for i in out if isinstance(i, Place)) == [0, 1, 2]
    d.run()
    for m in range(3):
        d.check_completed(m, 2)


@pytest.mark.parametrize("seed", range(10))
def test_evaluation_cut_short_by_a_lost_worker_is_repeated(seed):
    """A worker holding a validation shard dies mid-evaluation: the old result is
    ignored and the model is evaluated again once the shard is placed anew."""
    d = Driver(2, 2, rng_seed=seed)
    d.start()
    d.send(new_models(1))
    d.run_until(lambda d: any(isinstance(f.ins, Evaluate) for f in d.inflight))
    (old,) = d.inflight
    other = ({"w0", "w1"} - {d.kept[0][-1].worker}).pop()  # not the worker with the state
    out = d.lose_worker(other)
    assert [type(i) for i in out] == [Place]
    assert d.complete(old) == []  # no Report from an evaluation that lost a shard
    (place,) = d.inflight
    survivor = ({"w0", "w1"} - {other}).pop()
    assert d.complete(place) == [Evaluate(0, 1, (survivor, survivor))]
    d.run()
    d.check_completed(0, 1)


@pytest.mark.parametrize("seed", range(100))
def test_random_worker_churn_still_completes(seed):
    """Workers join and die at random (stale events delivered late): every model
    still completes, its reports match the order its final state trained in."""
    rng = random.Random(seed)
    shape = random_shape(rng)
    d = driver_of(shape, rng_seed=seed, deliver_stale=True, checkpoint=True)
    d.s.settings.max_unit_retries = 10**6  # a run of unlucky deaths would fail a model (tested elsewhere)
    budgets = [rng.randint(1, 3) for _ in range(shape["n"])]
    d.start()
    d.send(new_models(budgets))
    spawned = iter(range(100))

    def churn(d: Driver) -> None:
        x = rng.random()
        if x < 0.02:
            d.lose_worker(rng.choice(sorted(d.live)))
        if x >= 0.98 or not d.live:
            d.add_worker(f"n{next(spawned)}")

    d.run(hook=churn)
    for m, epochs in enumerate(budgets):
        d.check_completed(m, epochs)


# ---------------------------------------------------------- reproducibility
def fixed_sequences(d: Driver) -> dict[int, list[tuple[int, int]]]:
    seqs: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for t in d.trains:
        seqs[t.model_id].append((t.epoch, t.partition))
    return seqs


@pytest.mark.parametrize("order, seed", [("fixed", s) for s in range(30)] + [("cyclic", s) for s in range(10)])
def test_fixed_order_is_independent_of_timing_workers_and_pruning(order, seed):
    """order="fixed" (and "cyclic"): each model's (epoch, partition) sequence is the same
    whatever the completion order, the number of workers, prefetch, and other models being stopped."""
    P, n, epochs = 4, 6, 3
    reference = Driver(P, 1, seed=seed, rng_seed=0, order=order)
    reference.start()
    reference.send(new_models(epochs, n))
    reference.run()
    ref = fixed_sequences(reference)
    assert all(len(ref[m]) == P * epochs for m in range(n))
    for run in range(6):
        rng = random.Random(1000 * seed + run)
        d = Driver(P, 1 + run % 3, seed=seed, rng_seed=rng.randrange(2**32), prefetch=run % 2 == 1, order=order)
        d.start()
        d.send(new_models(epochs, n))
        victims = set(rng.sample(range(n), rng.randint(0, n - 1)))

        def prune(d: Driver) -> None:
            alive = sorted(victims - d.dead)
            if alive and rng.random() < 0.05:
                d.stop(rng.choice(alive))

        d.run(hook=prune)
        got = fixed_sequences(d)
        for m in range(n):
            if m in d.dead:
                assert got[m] == ref[m][:len(got[m])]
            else:
                assert got[m] == ref[m], (run, m)


# ------------------------------------------------------------ bad arguments
@pytest.mark.parametrize("kwargs, text", [
    (dict(num_partitions=0), "num_partitions is 0"),
    (dict(num_partitions=-2), "num_partitions is -2"),
    (dict(num_partitions=2.0), "num_partitions is 2.0"),
    (dict(num_partitions=2, order="random"), "order is 'random'"),
])
def test_bad_constructor_arguments_raise(kwargs, text):
    """Bad Scheduler arguments raise ValueError naming the value."""
    with pytest.raises(ValueError, match=text):
        Scheduler(**kwargs)


def test_models_added_with_zero_epochs_raises():
    """ModelsAdded with epochs 0 raises ValueError naming it."""
    d = Driver(2, 1)
    d.start()
    with pytest.raises(ValueError, match="epochs is 0"):
        d.s.handle(new_models(0))
    d.s.validate()


def test_rejected_models_added_changes_nothing():
    """A ModelsAdded rejected for one bad model adds none of its models."""
    d = Driver(2, 1)
    d.start()
    with pytest.raises(ValueError, match="epochs is 0"):
        d.s.handle(new_models([1, 0]))
    with pytest.raises(ValueError, match="already added"):
        d.s.handle(ModelsAdded((NewModel(3, 1), NewModel(3, 1))))
    d.s.validate()
    d.send(new_models([1, 1]))  # ids 0 and 1 are still free
    d.run()
    d.check_completed(0, 1)
    d.check_completed(1, 1)


def test_unknown_event_type_raises_type_error():
    """handle() rejects anything that is not a scheduler event."""
    d = Driver(2, 1)
    d.start()
    for bogus in (object(), "UnitDone", Place(0, "w0"), Train(0, 0, "w0", 0, 0, False)):
        with pytest.raises(TypeError, match="not a scheduler event"):
            d.s.handle(bogus)
    d.s.validate()


def test_start_twice_raises():
    """start() places the partitions once."""
    d = Driver(2, 2)
    d.start()
    with pytest.raises(RuntimeError):
        d.s.start()


# --------------------------------------------------------------- utilization
def lockstep_busy(d: Driver) -> list[int]:
    """Units run per lock-step round after the placement round (Evaluate-only rounds dropped)."""
    assert d.lockstep_round() == []  # the placement round: nothing can train yet
    busy = []
    while d.inflight:
        busy.append(len(d.lockstep_round()))
    return [b for b in busy if b]


def test_fixed_order_keeps_every_worker_busy_in_lock_step():
    """P=W=4, n=8, lock-step rounds: after placement every round runs 4 units."""
    d = Driver(4, 4, order="fixed", seed=11)
    d.start()
    d.send(new_models(3, n=8))
    busy = lockstep_busy(d)
    assert sum(busy) == 8 * 4 * 3
    assert busy == [4] * (8 * 3)


def test_colliding_offsets_idle_workers_in_lock_step():
    """The utilization check can fail: models sharing one offset collide."""
    d = Driver(4, 4, order="fixed", seed=11)
    d.start()
    d.send(ModelsAdded(tuple(NewModel(m, 3, offset=0) for m in range(8))))
    busy = lockstep_busy(d)
    assert sum(busy) == 8 * 4 * 3
    assert busy[:3] == [1, 2, 3] and len(busy) > 8 * 3


# ---------------------------------------------------------------- stragglers
def _timed_units(d: Driver, rounds: int, seconds: float = 1.0) -> float:
    """Lock-step rounds of ``seconds`` each, the clock ticking before each: every
    model learns a median unit time of ``seconds``. Returns the clock."""
    for _ in range(rounds):
        d.send(Tick(d.clock + seconds))
        d.clock += seconds
        d.lockstep_round()
    return d.clock


def _one_timed_model(seconds: float = 1.0) -> tuple[Driver, float, Train, str]:
    """One model on two workers holding both partitions, its median unit time learnt
    (``seconds``): the driver, the clock, the unit it runs now and the other (idle) worker."""
    d = Driver(2, 2, replicas=2, speculate=True)
    d.start()
    d.send(Tick(0.0))
    d.send(new_models(10))
    start = _timed_units(d, 8, seconds)
    [running] = [f.ins for f in d.inflight if isinstance(f.ins, Train)]
    return d, start, running, "w1" if running.worker == "w0" else "w0"


def _two_timed_models() -> tuple[Driver, float]:
    """Two models keeping both workers (holders of both partitions) busy, their median
    unit times learnt (1 s): the driver and the clock."""
    d = Driver(2, 2, replicas=2, speculate=True)
    d.start()
    d.send(Tick(0.0))
    d.send(new_models(10, n=2))
    return d, _timed_units(d, 8)


def _flight(d: Driver, worker: str) -> Flight:
    [f] = [f for f in d.inflight if isinstance(f.ins, Train) and f.ins.worker == worker]
    return f


def _finish(d: Driver, worker: str) -> list:
    """Complete the unit on ``worker``, and the evaluation it may end its epoch with."""
    out = d.complete(_flight(d, worker))
    for f in [f for f in d.inflight if isinstance(f.ins, Evaluate)]:
        out += d.complete(f)
    return out


def test_a_straggler_races_a_copy_on_an_idle_holder():
    """One model, two holders of every partition: a unit past 1.5x its median is
    copied onto the idle holder; the first run to finish counts, the other is discarded.
    The executor here never answers an AskProgress: the clock alone finds the straggler."""
    d, _, running, other = _one_timed_model()
    assert d.s.next_wakeup() == pytest.approx(d.clock + PROGRESS_EVERY)
    for k in range(1, 6):  # asked for its progress every quarter of a unit, until 1.5x
        out = d.send(Tick(d.clock + k * PROGRESS_EVERY + 0.01))
        assert out == [AskProgress(((running.model_id, running.partition, running.worker),))]
    assert d.s.next_wakeup() == pytest.approx(d.clock + 1.5)
    d.send(Tick(d.clock + 1.4))
    assert not d.copies
    d.send(Tick(d.clock + 1.6))
    [copy] = d.copies
    assert (copy.model_id, copy.partition, copy.step, copy.worker) == \
        (running.model_id, running.partition, running.step, other)
    out = d.complete(_flight(d, other))  # the copy wins
    assert Discard(running.model_id, running.partition, running.worker) in out
    assert d.s.restarts == 0 and d.s.copies_started == 1


def _stopped_mid_race() -> None:
    """A model stopped while its straggling unit races a copy: both runs still occupy
    their workers (orphaned) until they end, and neither counts."""
    d, _, running, other = _one_timed_model()
    d.send(Tick(d.clock + 1.6))
    [copy] = d.copies
    d.stop(running.model_id)
    assert {d.s.run_on(w).state for w in (running.worker, other)} == {RunState.ORPHANED}
    d.run()
    assert not d.s.active() and d.s.run_on(other) is None


def test_a_model_stopped_mid_race_orphans_both_runs():
    _stopped_mid_race()


def test_a_short_unit_is_a_straggler_only_once_it_is_late_by_the_minimum_too():
    """Units of 0.1 s: one run 3x as long, or projected to, is timing noise on a busy
    host, not a straggler; it becomes one only SPECULATE_MIN_LATE past its expected end."""
    d, _, running, other = _one_timed_model(seconds=0.1)
    run = (running.model_id, running.partition, running.worker)
    assert _ask(d, 0.2).runs == (run,)  # no more often than PROGRESS_INTERVAL
    assert d.send(UnitProgress(*run, fraction=0.5, seconds=0.15)) == []  # projects 0.3 s
    assert d.s.next_wakeup() == pytest.approx(d.clock + 0.4)
    d.send(Tick(d.clock + 0.55))
    assert not d.copies and d.s.copies_started == d.s.restarts == 0
    d.send(Tick(d.clock + 0.1 + SPECULATE_MIN_LATE + 0.01))
    [copy] = d.copies
    assert (copy.model_id, copy.partition, copy.worker) == (running.model_id, running.partition, other)


def test_a_unit_with_no_rows_done_is_restarted_without_teaching_an_endless_time():
    """Progress with no rows done projects no end: the unit is a straggler at once and,
    with no holder idle, restarted. What it teaches its worker's pace is the time it
    ran, not an infinite projection (which made the sample, and so possibly the pace
    and every expected time on that worker, infinite)."""
    d, start = _two_timed_models()
    slow = _flight(d, "w0").ins
    assert (slow.model_id, slow.partition, "w0") in _ask(d, 0.3).runs
    out = d.send(UnitProgress(slow.model_id, slow.partition, "w0", fraction=0.0, seconds=0.3))
    assert out == [Discard(slow.model_id, slow.partition, "w0", restart=True)]
    assert d.s.restarts == 1 and d.s.next_wakeup() != float("inf")
    d.s.validate()
    d.send(Tick(start + 0.4))
    assert d.s.pace("w0") < 2


def test_a_straggler_with_no_idle_holder_is_restarted_once():
    """Two models keep both workers busy. A straggler has no holder to race it: its
    run is discarded and the unit runs again from its start (here on the worker it
    straggled on, the first to free up); a rerun that straggles too runs on."""
    d, start = _two_timed_models()
    slow, fast = _flight(d, "w0").ins, _flight(d, "w1").ins
    d.send(Tick(start + 1.0))
    _finish(d, "w1")  # w1's unit ends on time; w1 takes its next unit
    assert _flight(d, "w1").ins != fast
    out = [i for i in d.send(Tick(start + 1.6)) if not isinstance(i, AskProgress)]  # never answered
    assert out == [Discard(slow.model_id, slow.partition, "w0", restart=True)]
    assert d.s.restarts == 1 and not d.copies
    out = _finish(d, "w0")  # the abandoned run stops; w0 frees up
    [rerun] = [i for i in out if isinstance(i, Train)]
    assert (rerun.model_id, rerun.epoch, rerun.step, rerun.partition, rerun.copy) == \
        (slow.model_id, slow.epoch, slow.step, slow.partition, False)
    d.send(Tick(start + 2.0))
    _finish(d, "w1")
    out = d.send(Tick(start + 1.6 + 1.6))  # the rerun straggles: no second restart
    assert not [i for i in out if isinstance(i, Discard)] and d.s.restarts == 1
    d.run()
    for model_id in (0, 1):
        d.check_completed(model_id, 10)


def _ask(d: Driver, seconds: float) -> AskProgress:
    """Tick ``seconds`` after the clock; return the AskProgress that follows."""
    [ask] = [i for i in d.send(Tick(d.clock + seconds)) if isinstance(i, AskProgress)]
    return ask


def test_progress_spots_a_straggler_a_quarter_of_the_way_in():
    """A unit a quarter of the way into its expected time that has done 1/16 of its
    rows projects to 4x: it is a straggler then, and a copy starts on the idle
    holder at once. One on pace is left alone, and asked again a quarter later."""
    d, _, running, other = _one_timed_model()
    run = (running.model_id, running.partition, running.worker)
    assert _ask(d, 0.25).runs == (run,)
    assert d.send(UnitProgress(*run, fraction=0.25, seconds=0.25)) == []  # on pace
    assert d.s.next_wakeup() == pytest.approx(d.clock + 0.5)
    assert _ask(d, 0.5).runs == (run,)
    out = d.send(UnitProgress(*run, fraction=0.5 / 4, seconds=0.5))
    assert [(i.model_id, i.partition, i.worker, i.copy) for i in out if isinstance(i, Train)] == \
        [(running.model_id, running.partition, other, True)]
    assert d.s.copies_started == 1
    assert d.s.next_wakeup() is None  # a unit with a copy is no longer watched


def test_progress_that_comes_too_soon_or_for_another_run_is_not_judged():
    """Progress after less than a quarter of the expected time (the unit queued on its
    worker), for a run that ended, or for a copy, changes nothing; a malformed one is refused."""
    d, _, running, _ = _one_timed_model()
    run = (running.model_id, running.partition, running.worker)
    _ask(d, 0.3)
    assert d.send(UnitProgress(*run, fraction=0.0, seconds=0.2)) == []
    assert d.send(UnitProgress(running.model_id, running.partition, "w9", 0.0, 5.0)) == []
    assert d.send(UnitProgress(running.model_id, (running.partition + 1) % 2, running.worker, 0.0, 5.0)) == []
    assert not d.copies and d.s.unit_of(running.model_id).progress is None
    for bad in (dict(fraction=1.5, seconds=1.0), dict(fraction=-0.1, seconds=1.0),
                dict(fraction=0.5, seconds=float("nan")), dict(fraction=True, seconds=1.0)):
        with pytest.raises(ValueError, match="UnitProgress"):
            d.s.handle(UnitProgress(*run, **bad))
    # A unit that has shown no progress at all half way in is a straggler too.
    out = d.send(UnitProgress(*run, fraction=0.0, seconds=0.5))
    assert [i.copy for i in out if isinstance(i, Train)] == [True]


def test_a_straggler_spotted_by_progress_with_no_idle_holder_is_restarted_only_if_that_pays():
    """Both workers busy: a unit projected to need more than a whole unit more is
    restarted at once; one nearly done although slow runs on."""
    d = Driver(2, 2, replicas=2, speculate=True)
    d.start()
    d.send(Tick(0.0))
    d.send(new_models(10, n=2))
    _timed_units(d, 8)
    slow, fast = _flight(d, "w0").ins, _flight(d, "w1").ins
    ask = _ask(d, 0.3)
    assert set(ask.runs) == {(slow.model_id, slow.partition, "w0"), (fast.model_id, fast.partition, "w1")}
    # 90% done after 0.3 s of running on its worker, but it queued there: 1.7 s late. Runs on.
    assert d.send(UnitProgress(fast.model_id, fast.partition, "w1", 0.9, 0.3)) == []
    out = d.send(UnitProgress(slow.model_id, slow.partition, "w0", 0.05, 0.3))
    assert out == [Discard(slow.model_id, slow.partition, "w0", restart=True)]
    assert d.s.restarts == 1


def test_a_straggler_projected_to_end_soon_is_looked_at_again_when_that_end_passes():
    """A unit 1.45 s into a 1 s median, 90% done: it projects past 1.5x, but to end
    in 0.16 s, sooner than a copy would, so it runs on. It then stalls: the scheduler
    names its projected end as a wake-up, and a Tick then copies it onto the idle
    holder (with no wake-up, nothing looked again until another event, seconds later)."""
    d, start, running, other = _one_timed_model()
    run = (running.model_id, running.partition, running.worker)
    assert _ask(d, 1.25).runs == (run,)
    d.send(Tick(start + 1.45))
    assert d.send(UnitProgress(*run, fraction=0.9, seconds=1.45)) == []
    end = start + 1.45 + 1.45 * 0.1 / 0.9
    assert d.s.next_wakeup() == pytest.approx(end)
    assert not [i for i in d.send(Tick(end - 0.01)) if isinstance(i, Train)]
    out = d.send(Tick(d.s.next_wakeup()))
    assert [(i.model_id, i.partition, i.worker, i.copy) for i in out if isinstance(i, Train)] == \
        [(running.model_id, running.partition, other, True)]


def test_a_straggler_no_holder_can_beat_yet_is_copied_once_the_slow_holder_can():
    """The idle holder runs units 4x slower, and the unit has had its one restart: a
    stalled unit with no progress reported is copied there only once it has run as
    long as the copy would take, at the wake-up the scheduler names."""
    d, start, running, other = _one_timed_model()
    for _ in range(3):  # units of another model: 1 s on the straggler's worker, 4 s on the other
        d.s.times.learn(99, running.worker, 1.0)
        d.s.times.learn(99, other, 4.0)
    assert d.s.pace(other) == pytest.approx(4 * d.s.pace(running.worker))
    m = d.s.models[running.model_id]
    m.restarted = (m.epochs_done, len(m.visited))  # as if this unit were its rerun
    out = d.send(Tick(start + 1.6))  # a straggler; a copy would take 4 s, it has run 1.6
    assert not [i for i in out if isinstance(i, (Train, Discard))]
    assert d.s.next_wakeup() == pytest.approx(start + d.s.times.expected(running.model_id, other))
    out = d.send(Tick(d.s.next_wakeup()))
    assert [(i.worker, i.copy) for i in out if isinstance(i, Train)] == [(other, True)]


def test_a_unit_that_stalls_after_reporting_on_pace_is_restarted_by_the_clock():
    """Progress on pace, then nothing: at 1.5x its expected time the unit is past the
    end its progress projected, and the clock's verdict (restart) holds."""
    d, start = _two_timed_models()
    slow = _flight(d, "w0").ins
    _ask(d, 0.3)
    assert d.send(UnitProgress(slow.model_id, slow.partition, "w0", 0.3, 0.3)) == []  # on pace
    out = [i for i in d.send(Tick(start + 1.6)) if not isinstance(i, AskProgress)]
    assert Discard(slow.model_id, slow.partition, "w0", restart=True) in out


# ------------------------------------------------------------ churn runs
def slots(s: Scheduler) -> dict[str, tuple]:
    """Each live worker's (model, partition) executing and queued behind it."""
    def key(run):
        return None if run is None else run.key
    return {w: (key(s.run_on(w)), key(s.queued_on(w))) for w in s.workers()}


def as_tuples(instructions: list) -> list[tuple]:
    return [(type(i).__name__, *vars(i).values()) for i in instructions]


def churn_run(seed: int, unit_reports: bool = False) -> Driver:
    """A random session with everything an executor can report: stops, extensions,
    failures, lost and new workers, stale events. The Driver validates the engine
    (both state machines, its indexes against a scan) after every event."""
    rng = random.Random(seed)
    shape = random_shape(rng)
    d = Driver(shape["P"], shape["W"], order=shape["order"], rng_seed=seed,
               deliver_stale=True, checkpoint=rng.random() < 0.5,
               replicas=shape["replicas"], speculate=shape["speculate"], timed=shape["timed"],
               prefetch=shape["prefetch"], unit_reports=unit_reports)
    n = shape["n"] + rng.randint(0, 10)
    d.start()
    d.send(new_models([rng.randint(1, 3) for _ in range(n)]))
    for _ in range(rng.randint(0, 3)):
        d.unit_errors[(rng.randrange(n), 0, rng.randrange(shape["P"]))] = "boom"
    d.eval_errors[(rng.randrange(n), 1)] = "nan"
    spawned = iter(range(1000))

    def disturb(d: Driver) -> None:
        x = rng.random()
        if x < 0.01:
            d.lose_worker(rng.choice(sorted(d.live)))
        if x >= 0.99 or not d.live:
            d.add_worker(f"n{next(spawned)}")
        elif 0.5 < x < 0.51:
            m = rng.randrange(len(d.s.models))
            if m not in d.dead:
                d.stop(m)
        elif 0.6 < x < 0.62:
            m = rng.randrange(len(d.s.models))
            if m not in d.dead:
                d.send(BudgetExtended(m, rng.randint(1, 2)))
        elif 0.7 < x < 0.705 and (not unit_reports or len(d.s.models) < 2 * n):
            # (Capped with unit reports, whose runs take more steps: new models would
            # otherwise keep coming faster than models end.)
            first = len(d.s.models)
            d.send(new_models(1, rng.randint(1, 3), first_id=first))

    d.run(hook=disturb)
    return d


@pytest.mark.parametrize("seed", range(150))
def test_churn_keeps_every_invariant_and_every_model_ends(seed):
    """Random sessions with every event an executor can report: the engine's
    invariants hold after each event, and every model ends stopped, failed or paused
    with nothing left in flight."""
    d = churn_run(seed)
    assert d.trains  # the run did train
    assert not d.s.active() and not d.s.live_models()
    assert set(d.s.statuses().values()) <= {ModelStatus.PAUSED, ModelStatus.STOPPED, ModelStatus.FAILED}


@pytest.mark.parametrize("seed", range(60))
def test_churn_with_unit_reports_reports_every_point_once_in_order(seed):
    """With reports inside epochs, the same random sessions keep every invariant; each
    model reports each (epoch, unit) point at most once, whatever rollbacks retrain,
    and an epoch's report follows those of all its units."""
    d = churn_run(seed, unit_reports=True)
    assert not d.s.active() and not d.s.live_models()
    for m in d.s.models:
        reports = [r for r in d.reports if r.model_id == m]
        points = [(r.epoch, r.unit or d.P) for r in reports]
        assert points == sorted(set(points)), points
        for epoch, unit in points:
            if unit == d.P and d.P > 1:
                assert (epoch, d.P - 1) in points, (m, points)
        # A report's order is a prefix of every later report's in its epoch (dynamic
        # order included: an epoch trained again follows the order reported).
        for r, later in zip(reports, reports[1:], strict=False):
            if later.epoch == r.epoch:
                assert later.order[: len(r.order)] == r.order, (m, r, later)


def test_unit_reports_evaluate_after_every_unit_and_hold_the_next():
    """A model evaluated inside its epoch gets no unit until that evaluation is done;
    its reports carry the unit and the partitions so far; the weights' units are the
    same as without reports inside epochs."""
    plain = Driver(3, 2, seed=1)
    plain.start()
    plain.send(new_models([2, 2]))
    plain.run()
    d = Driver(3, 2, seed=1, unit_reports=True)
    d.start()
    d.send(new_models([2, 2]))
    d.run_until(lambda d: any(isinstance(f.ins, Evaluate) and f.ins.unit for f in d.inflight))
    evaluating = next(f.ins for f in d.inflight if isinstance(f.ins, Evaluate))
    assert evaluating.unit == 1 and d.s.status(evaluating.model_id) is ModelStatus.EVALUATING
    assert not any(isinstance(f.ins, Train) and f.ins.model_id == evaluating.model_id for f in d.inflight)
    d.run()
    assert [(r.epoch, r.unit) for r in d.reports if r.model_id == 0] == [
        (1, 1), (1, 2), (1, None), (2, 1), (2, 2), (2, None)
    ]
    unit_report = next(r for r in d.reports if r.model_id == 0 and r.unit == 2)
    assert len(unit_report.order) == 2
    assert d.kept == plain.kept


def test_a_model_stopped_while_evaluated_inside_its_epoch_ends_there():
    d = Driver(3, 1, unit_reports=True)
    d.start()
    d.send(new_models([3]))
    d.run_until(lambda d: any(r.unit == 1 for r in d.reports))
    d.stop(0)
    d.run()
    assert d.s.status(0) is ModelStatus.STOPPED
    assert [(r.epoch, r.unit) for r in d.reports] == [(1, 1)]


# ------------------------------------------------------------------ lifecycle
def test_every_event_of_the_protocol_has_a_handler():
    assert set(HANDLERS) == set(get_args(Event))


def _record_moves(monkeypatch) -> set:
    """Record each model status change the engine makes, as (from, to)."""
    moves: set = set()
    for key, work in list(lifecycle.TRANSITIONS.items()):
        def recorded(state, m, _key=key, _work=work, **info):
            moves.add(_key)
            return _work(state, m, **info)
        monkeypatch.setitem(lifecycle.TRANSITIONS, key, recorded)
    return moves


def test_every_transition_in_the_table_happens_and_no_other(monkeypatch):
    """Random sessions with stops, extensions, failures and churn take every listed
    transition (none is dead), and move refuses the rest; a paused model fails only
    when a worker dies running its work (a discarded run of it), shown here."""
    moves = _record_moves(monkeypatch)
    for seed in range(60):
        churn_run(seed)
    d = Driver(1, 2)
    d.s.settings.max_unit_retries = 0
    d.start()
    d.send(new_models([1]))
    d.run()
    assert d.s.models[0].status is ModelStatus.PAUSED
    w = d.s.models[0].state_worker
    d.forget_worker(w)
    d.send(WorkerLost(w, Executing(0)))
    assert d.s.models[0].status is ModelStatus.FAILED
    assert moves == set(TRANSITIONS)


def _record_run_moves(monkeypatch) -> set:
    moves: set = set()
    for key, work in list(runs_module.RUN_TRANSITIONS.items()):
        def recorded(registry, run, now, _key=key, _work=work):
            moves.add(_key)
            return _work(registry, run, now)
        monkeypatch.setitem(runs_module.RUN_TRANSITIONS, key, recorded)
    return moves


def test_every_run_transition_in_the_table_happens(monkeypatch):
    """Churn with speculation and prefetch takes every change of a unit run's state
    that the runs table lists: none is dead (a gang rank's, in test_gang_engine)."""
    moves = _record_run_moves(monkeypatch)
    for seed in range(150):
        churn_run(seed)
    _stopped_mid_race()
    gang_moves = {(None, RunState.RANK), (RunState.RANK, RunState.ENDED)}
    assert moves == set(runs_module.RUN_TRANSITIONS) - gang_moves


def test_a_run_state_change_not_in_the_table_raises():
    registry = runs_module.Runs()
    registry.add_worker("w0")
    run = registry.new(0, 0, "w0", runs_module.RunState.RUNNING, 0.0)
    with pytest.raises(runs_module.RunTransitionError, match="cannot go from running to queued"):
        registry.move(run, runs_module.RunState.QUEUED)


def test_a_status_change_not_in_the_table_raises():
    d = Driver(1, 1)
    d.start()
    d.send(new_models([1]))
    d.stop(0)
    with pytest.raises(TransitionError, match="model 0 cannot go from stopped to training"):
        lifecycle.move(d.s._state, d.s.models[0], ModelStatus.TRAINING)


# --------------------------------------------------------------------- timing
def test_the_doctests_of_the_pure_modules_hold():
    from cerebro_automl.engine import orders, placement, scheduler, timing

    for module in (scheduler, orders, placement, timing):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_unit_times_learn_paces_and_typical_durations():
    from cerebro_automl.engine.timing import MIN_TIMINGS, TIMINGS_KEPT, UnitTimes

    times = UnitTimes()
    assert times.pace("a") == 1.0 and times.typical(0) is None and times.expected(0, "a") is None
    for _ in range(MIN_TIMINGS):
        times.learn(0, "a", 2.0)
    assert times.typical(0) == 2.0 and times.pace("a") == 1.0  # a pace needs MIN_TIMINGS samples
    times.learn(0, "a", 2.0)
    for _ in range(MIN_TIMINGS):
        times.learn(0, "slow", 6.0)
    assert times.pace("a") == 1.0 and times.pace("slow") == 3.0
    assert times.typical(0) == 2.0  # durations are divided by their worker's pace
    assert times.expected(0, "slow") == 6.0
    assert times.pace("new") == 2.0  # a worker not timed yet: the median of the timed ones
    # A unit overtaken by a copy after 8 s teaches a lower bound of the pace of its worker.
    for _ in range(MIN_TIMINGS):
        times.overtaken(0, "stuck", 8.0)
    assert times.pace("stuck") == 4.0
    times.forget_worker("stuck")
    assert times.pace("stuck") == 2.0
    for _ in range(TIMINGS_KEPT):  # only the newest TIMINGS_KEPT count
        times.learn(1, "a", 5.0)
    assert times.typical(1) == 5.0
    times.overtaken(2, "b", 1.0)  # a model never timed teaches nothing
    assert times.pace("b") == 2.0 and times.typical(2) is None


def test_unit_times_divide_durations_by_the_pace_learnt_since():
    """A model timed on workers whose paces were not known yet: once they are, its
    typical duration follows, so a unit's expected time is what it really takes
    there (here the first units of every model were slow: a warm-up)."""
    from cerebro_automl.engine.timing import UnitTimes

    times = UnitTimes()
    for model_id in range(4):
        times.learn(model_id, "a", 3.0)  # warm-up
        for _ in range(6):
            times.learn(model_id, "a", 0.3)
            times.learn(model_id, "b", 0.3)
    late = 9
    for _ in range(3):
        times.learn(late, "b", 0.3)
    for model_id in (0, 3, late):
        assert times.expected(model_id, "a") == pytest.approx(0.3)
        assert times.expected(model_id, "b") == pytest.approx(0.3)
        assert times.expected(model_id, "new") == pytest.approx(0.3)


# ------------------------------------------------------------------- prefetch
def test_prefetch_sends_each_busy_worker_its_next_unit():
    """With more ready models than workers, every worker runs one unit and has the
    next one reserved behind it; when the unit ahead ends, the reserved one starts
    (it is not sent again) and the worker is sent a new one to run after it."""
    d = Driver(2, 2, prefetch=True)
    d.start()
    d.lockstep_round()  # the placements
    out = d.send(new_models([1] * 6))
    assert [(t.model_id, t.partition, t.worker) for t in out if isinstance(t, Train)] == \
        [(0, 0, "w0"), (1, 1, "w1"), (2, 0, "w0"), (3, 1, "w1")]
    assert slots(d.s) == {"w0": ((0, 0), (2, 0)), "w1": ((1, 1), (3, 1))}
    [ahead] = [f for f in d.inflight if f.ins.model_id == 0]
    out = d.complete(ahead)
    assert d.s.run_on("w0").key == (2, 0) and [t.worker for t in out if isinstance(t, Train)] == ["w0"]
    d.run()
    for m in range(6):
        d.check_completed(m, 1)


def test_a_reserved_unit_may_end_before_the_one_ahead_of_it():
    """The unit ahead may still wait for its input state while the reserved one runs:
    either may end first, and each counts for its own model."""
    d = Driver(1, 1, prefetch=True)
    d.start()
    d.lockstep_round()
    d.send(new_models([2, 2]))
    assert slots(d.s) == {"w0": ((0, 0), (1, 0))}
    [behind] = [f for f in d.inflight if f.ins.model_id == 1]
    d.complete(behind)
    assert slots(d.s) == {"w0": ((0, 0), None)} and d.s.models[1].status is ModelStatus.EVALUATING
    d.run()
    d.check_completed(0, 2)
    d.check_completed(1, 2)


def test_a_discarded_reserved_unit_holds_its_slot_until_it_ends():
    """A model stopped while its unit waits behind another: the unit may already run,
    so its slot is kept (the executor reports its end) and nothing else is reserved
    there meanwhile; the unit ahead still counts."""
    d = Driver(1, 1, prefetch=True)
    d.start()
    d.lockstep_round()
    d.send(new_models([1, 1, 1]))
    assert d.s.queued_on("w0").key == (1, 0)
    assert not [i for i in d.stop(1) if isinstance(i, Train)]
    assert d.s.queued_on("w0").state is RunState.ORPHANED
    [ahead] = [f for f in d.inflight if f.ins.model_id == 0]
    out = d.complete(ahead)  # the discarded unit moves up: the worker runs it
    assert d.s.run_on("w0").key == (1, 0) and d.s.run_on("w0").state is RunState.ORPHANED
    assert [t.model_id for t in out if isinstance(t, Train)] == [2]  # reserved behind it
    d.run()
    d.check_completed(0, 1)
    d.check_completed(2, 1)


def test_the_engine_names_the_worker_a_given_state_goes_to():
    """A resumed or warm-started state goes to the live workers in turn (by model id),
    so that many resumed models spread; with no worker alive, nowhere."""
    d = Driver(2, 3)
    d.start()
    assert [d.s.state_home(i) for i in range(4)] == ["w0", "w1", "w2", "w0"]
    d.lose_worker("w1")
    assert [d.s.state_home(i) for i in range(2)] == ["w0", "w2"]
    empty = Scheduler(1, [])
    empty.start()
    assert empty.state_home(0) is None


def test_without_validation_data_an_evaluation_names_the_worker_holding_the_state():
    """No validation rows: the epoch's training figures are read from the state, so the one
    Evaluate names the worker that ran the epoch's last unit, whatever partitions it holds."""
    s = Scheduler(3, names(2), has_validation=False)
    pending = list(s.start())
    evaluations, last = [], None
    for place in [i for i in pending if isinstance(i, Place)]:
        pending += s.handle(PartitionPlaced(place.partition, place.worker))
    pending += s.handle(new_models(2, n=2))
    while pending:
        ins = pending.pop(0)
        if isinstance(ins, Train):
            last = {**(last or {}), ins.model_id: ins.worker}
            pending += s.handle(UnitDone(ins.model_id, ins.partition, ins.worker))
        elif isinstance(ins, Evaluate):
            evaluations.append((ins.workers, last[ins.model_id]))
            pending += s.handle(EvaluationDone(ins.model_id, ins.epoch))
    assert len(evaluations) == 4 and {len(w) for w, _ in evaluations} == {1}
    assert all(workers == (holder,) for workers, holder in evaluations)
    assert {holder for _, holder in evaluations} == {"w0", "w1"}  # not only partition 0's holder


# ------------------------------------------------------- a resume's replayed epochs
def test_a_model_resumed_at_its_whole_budget_starts_paused():
    """A resume's model whose budget the run before trained (its reports replayed by
    the session) starts PAUSED with its Pause, and trains nothing."""
    d = Driver(3, 2, rng_seed=1)
    d.start()
    out = d.send(ModelsAdded((NewModel(0, 2, start_epoch=2, state_worker="w0"), NewModel(1, 2))))
    assert d.s.models[0].status is ModelStatus.PAUSED
    assert [(f.model_id, f.epochs) for f in out if isinstance(f, Pause)] == [(0, 2)]
    d.run()
    assert d.trains_of(0) == [] and len(d.trains_of(1)) == 6


def test_an_extension_continued_from_a_checkpoint_trains_only_the_epochs_after_it():
    d = Driver(3, 2, rng_seed=1)
    d.start()
    d.send(new_models(1))
    d.run()
    trained = len(d.trains_of(0))
    out = d.send(BudgetExtended(0, 3, resumed_epoch=3, state_worker="w1"))  # epochs 2-3 came from the journal
    m = d.s.models[0]
    assert m.status is ModelStatus.TRAINING and (m.epochs_done, m.budget, m.state_worker) == (3, 4, "w1")
    d.run()
    assert [t.epoch for t in d.trains_of(0)[trained:]] == [3, 3, 3]
    assert [r.epoch for r in d.reports_of(0)] == [1, 4]
    assert d.s.models[0].status is ModelStatus.PAUSED
    out = d.send(BudgetExtended(0, 2, resumed_epoch=6, state_worker="gone"))  # to the whole new budget
    assert [(p.model_id, p.epochs) for p in out if isinstance(p, Pause)] == [(0, 6)]
    assert [r.epoch for r in out if isinstance(r, Rollback)] == [6]  # its worker is gone: the driver's copy
    with pytest.raises(ValueError, match=r"resumed_epoch is 9, but must be an int in \[7, 7\]"):
        d.send(BudgetExtended(0, 1, resumed_epoch=9))
    d.send(BudgetExtended(0, 1))
    with pytest.raises(ValueError, match="only a paused model continues from a checkpoint"):
        d.send(BudgetExtended(0, 1, resumed_epoch=7))


def test_a_continuation_must_move_the_model_forward():
    d = Driver(2, 2, rng_seed=1)
    d.start()
    d.send(new_models(1))
    d.run()
    for bad in (1, True):
        with pytest.raises(ValueError, match=rf"resumed_epoch is {bad!r}, but must be an int in \[2, 2\]"):
            d.send(BudgetExtended(0, 1, resumed_epoch=bad))
