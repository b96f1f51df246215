"""Gang units in the engine (pure: no Dask, no torch): the width rule, gangs that
take all their workers at once, hold the free ones while they wait, end with a lost
rank, and keep every invariant under churn."""

from __future__ import annotations

import random

import pytest
from test_scheduler import Driver, Flight, Unit, new_models, random_shape

from cerebro_automl.engine import runs as runs_module
from cerebro_automl.engine import latin_order
from cerebro_automl.engine.gangs import gang_width
from cerebro_automl.engine.orders import gang_order
from cerebro_automl.engine.runs import RunState
from cerebro_automl.engine.scheduler import Scheduler
from cerebro_automl.protocol import (
    BudgetExtended,
    Discard,
    GangWidth,
    ModelStatus,
    Train,
    TrainGang,
    UnitCancelled,
    UnitDone,
)


# ------------------------------------------------------------------ the width
@pytest.mark.parametrize(
    ("live", "partitions", "batch", "cap", "width"),
    [
        (1, 8, None, None, 8),
        (2, 8, None, None, 4),
        (3, 8, None, None, 2),
        (5, 8, None, None, 1),
        (9, 8, None, None, 1),
        (1, 6, None, None, 2),  # 6 // 1 = 6: the largest power of two dividing 6 is 2
        (1, 8, 12, None, 4),  # 12 rows: 8 ranks would get 1.5
        (1, 8, 33, None, 1),
        (1, 4, 4, None, 2),  # 4 ranks would get 1 row each: a BatchNorm in training needs 2
        (1, 8, 2, None, 1),
        (1, 8, None, 2, 2),
        (1, 1, None, None, 1),
    ],
)
def test_the_width_is_the_largest_power_of_two_that_shares_the_partitions(live, partitions, batch, cap, width):
    assert gang_width(live, partitions, batch_size=batch, max_width=cap) == width


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_a_bad_live_count_names_the_rule(bad):
    with pytest.raises(ValueError, match=r"live is .*, but must be an int >= 1"):
        gang_width(bad, 8)


# ------------------------------------------------------------------ a driver
class GangDriver(Driver):
    """The test executor of test_scheduler, which also runs gang units: a TrainGang
    must name live, idle, distinct workers that hold its partitions; it ends as one
    UnitDone of its rank 0, or as a UnitCancelled when a rank's worker died."""

    def __init__(self, num_partitions: int, num_workers: int, **kwargs) -> None:
        super().__init__(num_partitions, num_workers, **kwargs)
        s = self.s
        self.s = Scheduler(
            num_partitions,
            sorted(self.live),
            seed=kwargs.get("seed", 0),
            order=kwargs.get("order", "fixed"),
            checkpoint=kwargs.get("checkpoint", False),
            replicas=s.replicas,
            speculate=s.speculate,
            prefetch=s.prefetch,
            gang=True,
        )
        self.gangs: list[TrainGang] = []
        self.rank_lost: set[int] = set()  # id() of gang flights that lost a rank

    def _absorb(self, out: list) -> None:
        for ins in out:
            if isinstance(ins, TrainGang):
                self._check_gang(ins)
                self.gangs.append(ins)
                for w in ins.workers:
                    self.worker_busy.setdefault(w, []).append(ins)
                self.model_busy[ins.model_id].append(ins)
                self.inflight.append(Flight(ins, self.gen[ins.model_id]))
            elif isinstance(ins, Discard) and self._discard_gang(ins):
                self.discards.append(ins)
            else:
                super()._absorb([ins])

    def _check_gang(self, g: TrainGang) -> None:
        k = len(g.partitions)
        assert k >= 2 and len(set(g.partitions)) == k and len(set(g.workers)) == k, g
        assert g.model_id not in self.dead, f"{g} for a stopped or failed model"
        assert not self.model_busy[g.model_id], f"{g}: model already runs {self.model_busy[g.model_id]}"
        for p, w in zip(g.partitions, g.workers, strict=True):
            assert w in self.live and w in self.held[p], f"{g}: {w} does not hold {p}"
            assert not self.worker_busy.get(w), f"{g}: {w} already runs {self.worker_busy[w]}"
        assert g.epoch_end == (g.step + k == self.P), g

    def _discard_gang(self, d: Discard) -> bool:
        for f in self.inflight + self.stale:
            g = f.ins
            if isinstance(g, TrainGang) and (g.model_id, g.partitions[0], g.workers[0]) == (
                d.model_id,
                d.partition,
                d.worker,
            ):
                f.discarded = True
                self._not_running(g)
                return True
        return False

    def forget_worker(self, worker: str) -> None:
        for f in [f for f in self.inflight if isinstance(f.ins, TrainGang) and worker in f.ins.workers]:
            if f.ins.workers[0] == worker:  # rank 0 died: nothing reports the unit's end
                self.inflight.remove(f)
                self._unbusy(f)
                self.stale.append(f)
            else:  # rank 0 fails when its collective times out
                self.rank_lost.add(id(f))
                self.worker_busy[worker] = [t for t in self.worker_busy.get(worker, []) if t is not f.ins]
        super().forget_worker(worker)

    def complete(self, f: Flight) -> list:
        g = f.ins
        if not isinstance(g, TrainGang):
            return super().complete(f)
        self.inflight.remove(f)
        self._unbusy(f)
        lead = (g.model_id, g.partitions[0], g.workers[0])
        if id(f) in self.rank_lost:
            return self.send(UnitCancelled(*lead, "a rank's worker died"))
        if f.gen == self.gen[g.model_id] and g.model_id not in self.dead and not f.discarded:
            for i, (p, w) in enumerate(zip(g.partitions, g.workers, strict=True)):
                self.kept[g.model_id].append(Unit(g.epoch, g.step + i, p, w))
        return self.send(UnitDone(*lead))

    def _unbusy(self, f: Flight) -> None:
        g = f.ins
        if not isinstance(g, TrainGang):
            return super()._unbusy(f)
        for w in g.workers:
            runs = [t for t in self.worker_busy.get(w, []) if t is not g]
            if runs:
                self.worker_busy[w] = runs
            else:
                self.worker_busy.pop(w, None)
        self._not_running(g)
        return None

    def give_widths(self, width) -> None:
        """Give every live model without one the width of its next epoch."""
        for model_id, status in self.s.statuses().items():
            m = self.s._state.models[model_id]
            epoch = m.epochs_done + 1
            if status in (ModelStatus.TRAINING, ModelStatus.EVALUATING) and epoch not in m.widths:
                given = width(model_id, epoch)
                self.send(GangWidth(model_id, epoch, *(given if isinstance(given, tuple) else (given,))))


def test_an_epoch_waits_for_its_width_and_a_lone_model_trains_on_every_worker():
    d = GangDriver(4, 4)
    d.start()
    d.lockstep_round()  # the partitions load
    d.send(new_models([2]))
    assert not d.inflight, "an epoch with no width started"
    d.give_widths(lambda m, e: gang_width(1, 4))
    [g] = d.gangs
    assert g.partitions == d.s._state.model_order(d.s._state.models[0], 0) and len(set(g.workers)) == 4
    d.lockstep_round()
    d.lockstep_round()  # the evaluation
    assert not d.inflight, "epoch 2 started with no width"
    d.send(GangWidth(0, 2, 2))
    assert [len(g.partitions) for g in d.gangs] == [4, 2]
    d.run(hook=lambda d: d.give_widths(lambda m, e: 2))
    assert [(g.step, g.epoch_end) for g in d.gangs] == [(0, True), (0, False), (2, True)]
    assert d.s.statuses() == {0: ModelStatus.PAUSED}
    assert d.s.units_trained == 8


def test_a_gang_holds_its_free_workers_until_its_busy_one_frees():
    """Model 0 trains single units; model 1's gang needs every worker: it holds the
    idle ones (model 0 gets none of them, prefetch queues nothing behind the busy
    one) and starts the moment the busy worker frees."""
    d = GangDriver(3, 3, prefetch=True)
    d.start()
    d.lockstep_round()
    d.send(new_models([1, 3]))
    d.send(GangWidth(0, 1, 1))
    [t] = d.trains
    d.send(GangWidth(1, 1, 3))
    assert not d.gangs and len(d.trains) == 1, "the gang or model 0 took a held worker"
    d.complete(next(f for f in d.inflight if f.ins is t))
    [g] = d.gangs
    assert g.model_id == 1 and set(g.workers) == {"w0", "w1", "w2"}


def test_width_one_is_plain_mop_and_the_weights_units_are_the_same():
    """Gang units on with width 1 everywhere: the same Trains as with gang units off."""

    def trains(gang: bool) -> list:
        d = GangDriver(3, 3) if gang else Driver(3, 3)
        d.start()
        d.send(new_models([2, 2, 1]))
        d.run(hook=(lambda d: d.give_widths(lambda m, e: 1)) if gang else None)
        return [(t.model_id, t.partition, t.epoch, t.step) for t in d.trains]

    assert sorted(trains(True)) == sorted(trains(False))


def test_a_lost_rank_ends_the_gang_and_the_unit_runs_again():
    d = GangDriver(2, 2)
    d.start()
    d.lockstep_round()
    d.send(new_models([1]))
    d.send(GangWidth(0, 1, 2))
    [g] = d.gangs
    out = d.lose_worker(g.workers[1])
    assert Discard(0, g.partitions[0], g.workers[0], restart=True) in out
    assert d.s.run_on(g.workers[0]).state is RunState.DISCARDED
    # Rank 0's collective times out: its end frees its worker; the partition lost
    # with the dead worker reloads on the survivor, and the epoch trains there.
    d.run()
    assert d.s.statuses() == {0: ModelStatus.PAUSED}
    assert sorted(u.partition for u in d.kept[0]) == [0, 1]


def test_a_lost_rank_0_ends_the_gang_and_frees_its_ranks():
    d = GangDriver(4, 4)
    d.start()
    d.lockstep_round()
    d.send(new_models([1]))
    d.send(GangWidth(0, 1, 2))
    [g] = d.gangs
    out = d.lose_worker(g.workers[0])
    assert Discard(0, g.partitions[0], g.workers[0]) in out
    # Its ranks' workers are free (the lost partition reloads before the gang runs again).
    assert [d.s.run_on(w) for w in g.workers[1:]] == [None] * (len(g.workers) - 1)
    d.run()
    assert d.s.statuses() == {0: ModelStatus.PAUSED}


def test_a_stopped_model_s_gang_keeps_its_workers_until_it_ends():
    d = GangDriver(2, 2)
    d.start()
    d.lockstep_round()
    d.send(new_models([1, 1]))
    d.send(GangWidth(0, 1, 2))
    d.stop(0)
    d.send(GangWidth(1, 1, 1))
    assert not d.trains, "a unit went to a worker the stopped gang still runs on"
    d.run()
    assert d.s.statuses() == {0: ModelStatus.STOPPED, 1: ModelStatus.PAUSED}


def test_an_epoch_keeps_its_width():
    d = GangDriver(2, 2)
    d.start()
    d.send(new_models([1]))
    d.send(GangWidth(0, 1, 2))
    d.send(GangWidth(0, 1, 2))  # the same again: nothing changes
    with pytest.raises(ValueError, match="epoch 1 was given width 2 on lane 0, and cannot be given 1 on lane 0"):
        d.s.handle(GangWidth(0, 1, 1))
    with pytest.raises(ValueError, match="width is 4, but must divide the 2 partitions"):
        d.s.handle(GangWidth(0, 2, 4))
    with pytest.raises(ValueError, match=r"GangWidth.lane is -1, but must be an int >= 0"):
        d.s.handle(GangWidth(0, 2, 1, -1))
    with pytest.raises(ValueError, match=r"GangWidth.width is 0, but must be an int >= 1"):
        d.s.handle(GangWidth(0, 2, 0))


def test_gang_units_and_unit_reports_are_refused_together():
    with pytest.raises(ValueError, match="gang is True with unit_reports"):
        Scheduler(2, ["w0"], gang=True, unit_reports=True)


# ------------------------------------------------------------------ churn
def gang_churn_run(seed: int) -> GangDriver:
    """test_scheduler's random sessions with gang units: widths come at random times,
    each a random power of two up to P, or the rule's; the invariants are checked
    after every event."""
    rng = random.Random(seed)
    shape = random_shape(rng)
    d = GangDriver(
        shape["P"],
        shape["W"],
        order=shape["order"],
        rng_seed=seed,
        deliver_stale=True,
        checkpoint=rng.random() < 0.5,
        replicas=shape["replicas"],
        speculate=shape["speculate"],
        timed=shape["timed"],
        prefetch=shape["prefetch"],
    )
    n = shape["n"] + rng.randint(0, 6)
    d.start()
    d.send(new_models([rng.randint(1, 3) for _ in range(n)]))
    widths = [w for w in (1, 2, 3, 4, 6) if shape["P"] % w == 0]
    spawned = iter(range(1000))

    def width(model_id: int, epoch: int) -> tuple[int, int]:
        if rng.random() < 0.5:
            return rng.choice(widths), rng.randrange(4)
        return gang_width(max(1, len(d.s.live_models())), shape["P"]), 0

    def disturb(d: GangDriver) -> None:
        if rng.random() < 0.3:
            d.give_widths(width)
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

    for _ in range(100_000):
        disturb(d)
        if not d.step():
            if d.s.active() or d.s.live_models():
                d.give_widths(width)
                continue
            return d
    raise AssertionError("the run did not end")


@pytest.mark.parametrize("seed", range(120))
def test_churn_with_gang_units_keeps_every_invariant_and_every_model_ends(seed):
    d = gang_churn_run(seed)
    assert set(d.s.statuses().values()) <= {ModelStatus.PAUSED, ModelStatus.STOPPED, ModelStatus.FAILED}
    for model_id, status in d.s.statuses().items():
        if status is not ModelStatus.PAUSED:
            continue
        # The units in the paused model's state: each epoch visits every partition once.
        by_epoch: dict[int, list[int]] = {}
        for u in d.kept[model_id]:
            by_epoch.setdefault(u.epoch, []).append(u.partition)
        for epoch, parts in by_epoch.items():
            assert sorted(parts) == list(range(d.P)), (model_id, epoch, parts)


def test_churn_with_gang_units_takes_the_rank_transitions(monkeypatch):
    moves: set = set()
    for key, work in list(runs_module.RUN_TRANSITIONS.items()):

        def recorded(registry, run, now, _work=work, _key=key):
            moves.add(_key)
            return _work(registry, run, now)

        monkeypatch.setitem(runs_module.RUN_TRANSITIONS, key, recorded)
    gangs = 0
    for seed in range(40):
        gangs += len(gang_churn_run(seed).gangs)
    assert gangs > 0
    assert {(None, RunState.RANK), (RunState.RANK, RunState.ENDED)} <= moves


@pytest.mark.parametrize("order", ["fixed", "cyclic"])
def test_a_model_trained_in_gangs_covers_its_epochs(order):
    """Every Train and TrainGang of a lone model, at widths 4, 2, 1: each epoch's
    partitions once, in the Latin order of fixed order (cyclic: epoch 0's permutation,
    cut into the same blocks every epoch)."""
    d = GangDriver(4, 4, order=order, seed=3)
    d.start()
    d.send(new_models([3]))
    d.run(hook=lambda d: d.give_widths(lambda m, e: {1: 4, 2: 2}.get(e, 1)))
    s = d.s._state
    for epoch in range(3):
        parts = [p for g in d.gangs if g.epoch == epoch for p in g.partitions]
        parts += [t.partition for t in d.trains if t.epoch == epoch]
        assert tuple(parts) == s.model_order(s.models[0], epoch)
        if order == "cyclic":  # epoch 0's permutation, in the epoch's blocks
            width, lane = s.models[0].widths.get(epoch + 1, (1, 0))
            assert tuple(parts) == gang_order(latin_order(3, 0, 0, 4), width, lane)
    assert all(isinstance(t, Train) for t in d.trains)


# ------------------------------------------------------------------ in the simulator
def _asha_widths(workers: int, cost, reproducible: bool, tuner: str = "asha"):
    from cerebro_automl.adapters.hyperband import asha, hyperband
    from cerebro_automl.adapters.search import grid_search
    from cerebro_automl.simulate import GangCost, SimulatedSession

    sim = SimulatedSession(workers=workers, partitions=8, seed=0, gang=GangCost(), unit_cost=cost)
    given: list[GangWidth] = []
    handle = sim._sim.handle

    def recording(event):
        if isinstance(event, GangWidth):
            given.append(event)
        return handle(event)

    sim._sim.handle = recording
    sampler = lambda rng: {"lr": float(rng.uniform(0, 1))}  # noqa: E731
    if tuner == "asha":
        asha(sim.spec, sim.data, sampler, min_epochs=1, max_epochs=9, eta=3, max_trials=27, metric="val_loss",
             session=sim, reproducible=reproducible)  # fmt: skip
    elif tuner == "grid":
        grid_search(sim.spec, sim.data, {"lr": [0.05, 0.5, 0.95]}, epochs=6, metric="val_loss", session=sim,
                    reproducible=reproducible)  # fmt: skip
    else:
        hyperband(sim.spec, sim.data, sampler, max_epochs=9, eta=3, metric="val_loss", session=sim,
                  reproducible=reproducible)  # fmt: skip
    return sorted((g.model_id, g.epoch, g.width, g.lane) for g in given), sim


def test_reproducible_widths_do_not_depend_on_timing_or_workers():
    """An ASHA search with reproducible=True gives every epoch the same width and lane
    whichever configurations are slow (the unit costs inverted) and on 8 or 16 workers:
    the widths come from the canonical order's logical times, never from the clock.
    (Widths from the models training at the moment differ here; so do widths decided
    by the session beside the stream, which the engine refuses.)"""
    from cerebro_automl.simulate import modelled_cost

    def cost(config):
        return modelled_cost(config, spread=8.0)

    def inverted(config):
        return 9.0 - modelled_cost(config, spread=8.0)

    first, sim = _asha_widths(8, cost, True)
    assert first == _asha_widths(8, inverted, True)[0] == _asha_widths(16, cost, True)[0]
    assert max(w for _, _, w, _ in first) >= 2  # the survivors do get gangs
    assert sim.timeline().utilization_total > 0


def test_reproducible_hyperband_decides_each_rung_s_widths_from_its_plan():
    """Hyperband with reproducible=True: every epoch of a rung gets its width as the rung
    starts, from the rung's models beside as many in each bracket, so the widths are the
    same whichever configurations are slow and on 8 or 16 workers. Without it, widths
    follow the models training as reports come, and here they differ."""
    from cerebro_automl.simulate import modelled_cost

    def cost(config):
        return modelled_cost(config, spread=8.0)

    def inverted(config):
        return 9.0 - modelled_cost(config, spread=8.0)

    first, sim = _asha_widths(8, cost, True, "hyperband")
    assert sim.gang.automatic  # the session it was given decides widths again once it returns
    assert first == _asha_widths(8, inverted, True, "hyperband")[0] == _asha_widths(16, cost, True, "hyperband")[0]
    # 3 brackets of max_epochs 9, whose last rungs train 1, 1 and 3 models to epoch 9: a
    # lone model counts as 3 live (width 2 of 8 partitions), each of 3 as 9 (width 1).
    assert sorted(width for _, epoch, width, _ in first if epoch == 9) == [1, 1, 1, 2, 2]
    assert _asha_widths(8, cost, False, "hyperband")[0] != _asha_widths(8, inverted, False, "hyperband")[0]


def test_a_reproducible_grid_gives_every_epoch_the_width_of_its_configs_count():
    """A grid of 3 configurations on 8 partitions: with reproducible=True every epoch of
    every model trains in gangs of 2, whichever models are slow; without, the widths
    follow the models still training, and here they differ."""
    from cerebro_automl.simulate import modelled_cost

    def cost(config):
        return modelled_cost(config, spread=8.0)

    def inverted(config):
        return 9.0 - modelled_cost(config, spread=8.0)

    first, _ = _asha_widths(8, cost, True, "grid")
    assert first == _asha_widths(8, inverted, True, "grid")[0] == _asha_widths(16, cost, True, "grid")[0]
    assert {width for _, _, width, _ in first} == {2} and len(first) == 3 * 6
    assert _asha_widths(8, cost, False, "grid")[0] != _asha_widths(8, inverted, False, "grid")[0]


def test_a_session_serves_the_next_search_after_a_reproducible_one():
    """A reproducible search decides the session's widths only while it runs: after a
    reproducible ASHA search, or a reproducible Hyperband one that fails, a search on the
    same session that is not reproducible gets the widths of the models training."""
    from cerebro_automl.adapters.hyperband import asha, hyperband, successive_halving
    from cerebro_automl.simulate import GangCost, SimulatedSession

    def sampler(rng):
        return {"lr": float(rng.uniform(0, 1))}

    def halving(sim):
        return successive_halving(sim.spec, sim.data, sampler, min_epochs=1, max_epochs=9, eta=3, n_configs=9,
                                  metric="val_loss", session=sim)  # fmt: skip

    alone = halving(SimulatedSession(workers=8, partitions=8, seed=0, gang=GangCost()))
    sim = SimulatedSession(workers=8, partitions=8, seed=0, gang=GangCost())
    asha(sim.spec, sim.data, sampler, min_epochs=1, max_epochs=9, eta=3, max_trials=9, metric="val_loss",
         session=sim, reproducible=True)  # fmt: skip
    assert sim.gang.automatic
    after = halving(sim)
    assert [(d.rung, len(d.promoted)) for d in after.decisions] == [(d.rung, len(d.promoted)) for d in alone.decisions]

    failing = SimulatedSession(workers=8, partitions=8, seed=0, gang=GangCost())
    add, added = failing.add, []

    def add_then_fail(config, **kwargs):
        added.append(config)
        if len(added) == 3:
            raise RuntimeError("the third model cannot be added")
        return add(config, **kwargs)

    failing.add = add_then_fail
    with pytest.raises(RuntimeError, match="third model"):
        hyperband(failing.spec, failing.data, sampler, max_epochs=9, eta=3, metric="val_loss", session=failing,
                  reproducible=True)  # fmt: skip
    assert failing.gang.automatic


def test_a_rung_s_mark_gives_its_epochs_the_rung_s_width_and_distinct_lanes():
    from cerebro_automl.engine import WidthDecisions

    w = WidthDecisions(8)
    w.automatic = False
    w.rung([5, 3], after=1, budget=3, sharing=2, place=1)  # 2 models, beside a rung of 2: 4 live
    given = [(g.model_id, g.epoch, g.width, g.lane) for g in w.decide([], lambda m: None)]
    assert given == [(3, 2, 2, 2), (3, 3, 2, 2), (5, 2, 2, 3), (5, 3, 2, 3)]
    assert w.decide([0], lambda m: None) == []  # decided once


def test_gang_units_shorten_the_tail_of_a_simulated_asha_search():
    from cerebro_automl.adapters.hyperband import asha
    from cerebro_automl.simulate import GangCost, SimulatedSession

    def makespan(gang):
        sim = SimulatedSession(workers=16, seed=0, gang=gang, order="dynamic")
        asha(
            sim.spec,
            sim.data,
            lambda rng: {"lr": float(rng.uniform(0, 1))},
            min_epochs=1,
            max_epochs=9,
            eta=3,
            max_trials=27,
            metric="val_loss",
            session=sim,
        )
        return sim.now, sim.timeline().utilization_total

    (mop, u_mop), (dp, u_dp) = makespan(None), makespan(GangCost())
    assert dp < 0.8 * mop and u_dp > u_mop


def test_a_rollback_past_its_reports_wants_the_width_after_them():
    """A model that reported epoch 2 and then lost its state trains epochs 1-2 again at
    their widths, and the epoch after its last report waits for a width at once (none
    would be decided otherwise: its next report is the one after that epoch)."""
    d = GangDriver(2, 2)
    d.start()
    d.lockstep_round()
    d.send(new_models([4]))
    m = d.s._state.models[0]
    while not (m.reported == 2 and m.status is ModelStatus.TRAINING):
        if m.epochs_done < 2:
            d.give_widths(lambda m, e: 1)
        assert d.step(), "ran out of work"
    d.lose_worker(m.state_worker)  # before the tuner comes back for reports
    assert m.epochs_done == 0
    assert d.s.widths_wanted() == [(0, 3)]  # epochs 1-2 keep their widths
    d.send(GangWidth(0, 3, 2))
    d.run(hook=lambda d: d.give_widths(lambda m, e: 1))
    assert d.s.statuses() == {0: ModelStatus.PAUSED}


def test_a_block_on_one_worker_trains_one_partition_at_a_time_and_the_next_blocks_stay_whole():
    """3 workers for 6 partitions: partitions i and i + 3 share a worker. A block of two
    holding both trains as two units; every gang still starts at a block boundary."""
    d = GangDriver(6, 3)
    d.start()
    d.lockstep_round()
    d.send(new_models([3]))
    d.run(hook=lambda d: d.give_widths(lambda m, e: 2))
    assert d.s.statuses() == {0: ModelStatus.PAUSED}
    assert d.gangs and all(g.step % 2 == 0 for g in d.gangs)
    s = d.s._state
    collided = [e for e in range(3) if any({p, p + 3} <= set(s.model_order(s.models[0], e)[b : b + 2])
                                           for p in range(3) for b in (0, 2, 4))]
    assert all(sum(t.epoch == e for t in d.trains) >= 2 for e in collided)


def test_a_resumed_stream_marks_the_epochs_it_trains_again():
    from cerebro_automl.engine import WidthDecisions

    w = WidthDecisions(8)
    w.automatic = False
    w.starting(0, after=0, budget=6, released=2)  # reports of epochs 1-2 are dropped: 1-4 wait
    w.starting(1, after=3, budget=4)
    assert [(g.model_id, g.epoch) for g in w.decide([0, 1], lambda m: None)] == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 4)]
