"""A virtual-time executor: the real MOP scheduler driven with modelled costs.

The simulator runs :class:`~cerebro_automl.engine.Scheduler` itself (not a
copy of it) against a discrete-event clock: a ``Place`` finishes after a load
time, a ``Train`` after the model's unit cost (times a straggler factor) plus a
hop when the model's state was last on another worker, an ``Evaluate`` after
one shard task on every partition's worker. Each completion goes back to the
scheduler as the event a real executor would send. Nothing is trained, so a
study of 128 workers and 512 models takes seconds; it answers which visit
order to use, how many models keep a cluster busy and what stragglers cost.

Workers run one task at a time, first come first served: evaluation shards
queue beside training units, as they do on a Dask worker. ``busy`` counts
compute only (train and evaluation); hops and loads are idle time.

Replicas and speculation run as on a cluster: with replicas the clock reaches
the scheduler as a ``Tick`` before every completion, and at the times
``Scheduler.next_wakeup`` names (a session polls at least that often), and an
``AskProgress`` is answered at once with how far each running unit has come. A
speculative copy or a restarted unit draws its own straggler factor; the run
that loses its race or is restarted stops at once (a unit checks after every
batch whether its result is still wanted) or is dropped if it was still queued. Workers may join mid-run
(``joins``).

Example:
    >>> r = simulate([1.0] * 8, workers=8, epochs=2)
    >>> r.makespan, round(r.utilization, 3)
    (16.0, 1.0)
    >>> rows = sweep(workers=(2,), ratios=(1, 2), spreads=(1,), epochs=1)
    >>> [(row["models"], row["order"]) for row in rows]
    [(2, 'fixed'), (2, 'dynamic'), (4, 'fixed'), (4, 'dynamic')]

Run ``python -m cerebro_automl.simulate`` for the sweep table (``--help``).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..checks import check_int
from ..engine import ORDERS, Scheduler, gang_width
from ..protocol import (
    AskProgress,
    Discard,
    Evaluate,
    EvaluationDone,
    Event,
    GangWidth,
    ModelsAdded,
    NewModel,
    PartitionPlaced,
    Pause,
    Place,
    Report,
    Tick,
    Train,
    TrainGang,
    UnitDone,
    UnitProgress,
    WorkerAdded,
)

__all__ = [
    "Stragglers",
    "GangCost",
    "SimulationResult",
    "simulate",
    "sweep",
    "spread_costs",
    "hop_seconds",
    "allreduce_seconds",
    "format_table",
]


@dataclass(frozen=True)
class Stragglers:
    """Slow workers and slow units.

    Args:
        slow_workers: the first ``slow_workers`` workers (in sorted name order)
            run every task ``slowdown`` times slower.
        slowdown: the factor of a slow worker (>= 1).
        unit_rate: the chance that one train unit, anywhere, is a straggler.
        unit_slowdown: the factor of a straggling unit (>= 1).
    """

    slow_workers: int = 0
    slowdown: float = 2.0
    unit_rate: float = 0.0
    unit_slowdown: float = 4.0

    def __post_init__(self) -> None:
        check_int("slow_workers", self.slow_workers, 0)
        _check_number("slowdown", self.slowdown, least=1.0)
        _check_number("unit_slowdown", self.unit_slowdown, least=1.0)
        if not isinstance(self.unit_rate, (int, float)) or not 0.0 <= self.unit_rate <= 1.0:
            raise ValueError(f"unit_rate is {self.unit_rate!r}, but must be a number in [0, 1]")


def allreduce_seconds(gradient_bytes: float, ranks: int, bandwidth: float = 1.25e10, latency: float = 2e-5) -> float:
    """Seconds of one ring all-reduce of ``gradient_bytes`` over ``ranks``: each rank
    sends and receives ``2 (k - 1) / k`` of the bytes in ``2 (k - 1)`` steps (default
    bandwidth 1.25e10 bytes/s, 100 Gbit/s; latency 20 us per step).

    >>> allreduce_seconds(1e9, 1), round(allreduce_seconds(1.25e9, 2, bandwidth=1.25e9, latency=0.0), 6)
    (0.0, 1.0)
    """
    _check_number("gradient_bytes", gradient_bytes, least=0.0)
    check_int("ranks", ranks)
    _check_number("bandwidth", bandwidth, least=0.0, strict=True)
    _check_number("latency", latency, least=0.0)
    k = ranks
    return 2 * (k - 1) * latency + 2 * (k - 1) / k * gradient_bytes / bandwidth


@dataclass(frozen=True)
class GangCost:
    """What a gang unit costs (the engine's gang units, see
    :mod:`cerebro_automl.engine.gangs`): each of k ranks trains one whole partition at
    ``1/k`` of the batch, so ``k * steps_per_unit`` steps, each followed by an
    all-reduce of ``gradient_bytes`` (:func:`allreduce_seconds`, not overlapped with
    compute). ``max_width`` caps the width the engine's rule gives.
    """

    gradient_bytes: float = 4.4e7  # ResNet-18's 11M float32 parameters
    steps_per_unit: int = 50
    bandwidth: float = 1.25e10
    latency: float = 2e-5
    max_width: int | None = None

    def __post_init__(self) -> None:
        _check_number("gradient_bytes", self.gradient_bytes, least=0.0)
        check_int("steps_per_unit", self.steps_per_unit)
        _check_number("bandwidth", self.bandwidth, least=0.0, strict=True)
        _check_number("latency", self.latency, least=0.0)
        check_int("max_width", self.max_width, optional=True)

    def overhead(self, ranks: int) -> float:
        """Seconds a gang unit of ``ranks`` spends in all-reduces."""
        per_step = allreduce_seconds(self.gradient_bytes, ranks, self.bandwidth, self.latency)
        return ranks * self.steps_per_unit * per_step


@dataclass(frozen=True)
class SimulationResult:
    """What one simulated session did, in virtual seconds.

    ``utilization = busy / (workers * makespan)``; ``lower_bound`` is
    ``max(total work / workers, longest model chain)`` from the nominal costs
    (no hops, no stragglers) and ``efficiency = lower_bound / makespan`` (1.0:
    no schedule could be shorter). With workers joining mid-run, ``workers *
    makespan`` is the worker-seconds they were there, and total work / workers
    becomes the time by which the workers present could have done the work.
    ``copies``: speculative copies started; ``copies_won``: those that finished
    first; ``restarts``: straggling units restarted (no holder idle to race
    them); ``wasted``: compute spent on runs that lost their race or were
    restarted (in ``busy``).
    ``decision_*_us`` time ``Scheduler.handle`` per event, in wall-clock
    microseconds of this machine (``time.perf_counter``);
    ``decision_cpu_max_us`` is the slowest event in CPU time of the thread
    (``time.thread_time``), which leaves out the time another process held the
    core: on a busy machine the wall-clock maximum measures the machine.
    """

    workers: int
    models: int
    partitions: int
    epochs: int
    order: str
    makespan: float
    busy: float
    utilization: float
    lower_bound: float
    efficiency: float
    units: int
    hops: int
    replicas: int
    speculate: bool
    copies: int
    copies_won: int
    restarts: int
    wasted: float
    events: int
    decision_mean_us: float
    decision_p99_us: float
    decision_max_us: float
    decision_cpu_max_us: float
    wall_seconds: float
    reports: tuple[Report, ...] = field(default=(), repr=False)  # with record=True
    trains: tuple[tuple[float, Train | TrainGang], ...] = field(default=(), repr=False)  # (start, Train)

    def row(self) -> dict[str, Any]:
        """The scalar fields, for a table or JSON."""
        return {k: v for k, v in asdict(self).items() if k not in ("reports", "trains")}


def spread_costs(models: int, spread: float, seed: int = 0) -> list[float]:
    """``models`` unit costs from 1 to ``spread`` seconds, evenly spaced on a log
    scale and shuffled by ``seed`` (so the costliest model is not always last).

    >>> sorted(spread_costs(3, 4.0))
    [1.0, 2.0, 4.0]
    """
    check_int("models", models)
    _check_number("spread", spread, least=1.0)
    costs = np.geomspace(1.0, spread, models) if models > 1 else np.ones(1)
    return [float(c) for c in np.random.default_rng(seed).permutation(costs)]


def hop_seconds(state_bytes: float, bandwidth: float = 1.25e9, latency: float = 0.0) -> float:
    """Seconds to move one model state: ``latency + state_bytes / bandwidth``
    (default bandwidth 1.25e9 bytes/s, 10 Gbit/s).

    >>> hop_seconds(12e6, bandwidth=1.2e9, latency=0.002)
    0.012
    """
    _check_number("state_bytes", state_bytes, least=0.0)
    _check_number("bandwidth", bandwidth, least=0.0, strict=True)
    _check_number("latency", latency, least=0.0)
    return round(latency + state_bytes / bandwidth, 12)


def simulate(
    unit_costs: Sequence[float],
    workers: int,
    *,
    epochs: int = 5,
    partitions: int | None = None,
    order: str = "fixed",
    seed: int = 0,
    hop: float | Sequence[float] = 0.0,
    eval_costs: float | Sequence[float] = 0.0,
    load_seconds: float = 0.0,
    stragglers: Stragglers | None = None,
    replicas: int = 1,
    speculate: bool = False,
    joins: Sequence[float] = (),
    validate: bool = False,
    record: bool = False,
    prefetch: bool = False,
    gang: GangCost | None = None,
) -> SimulationResult:
    """Run one session of ``len(unit_costs)`` models in virtual time.

    Args:
        unit_costs: seconds of one unit (one pass over one partition) per model.
        workers: p, the number of workers.
        epochs: every model's budget.
        partitions: P (default ``workers``): with one replica, partition i lives
            on worker i mod p.
        order: the scheduler's visit order (``ORDERS``).
        seed: the session seed (Latin permutations) and the straggler draws.
        hop: seconds to move a model's state to another worker, one number or
            one per model (see :func:`hop_seconds`).
        eval_costs: seconds of one model's evaluation over all validation
            shards (split evenly into one task per partition), one or per model.
        load_seconds: seconds to place one partition on its worker.
        stragglers: slow workers or slow units (:class:`Stragglers`).
        replicas: how many workers hold each partition (``Scheduler(replicas=)``).
        speculate: speculative copies of straggling units (``replicas >= 2``).
        joins: virtual times at which one more worker joins, each (never slow).
        validate: call ``Scheduler.validate()`` after every event (slow; tests).
        record: keep the Reports and every Train with its start time.
        prefetch: send each busy worker its next unit (``Scheduler(prefetch=)``); it
            waits in the worker's queue. The simulator has no driver round trip for
            it to hide, so it shows only what committing a unit early costs.
        gang: gang units, at their cost (:class:`GangCost`): each epoch's width is
            the engine's rule for the models training when the epoch is due (the
            ``lower_bound`` and ``efficiency`` assume no gang units).

    >>> simulate([2.0, 1.0], workers=2, epochs=1).makespan
    4.0
    """
    costs = _per_model("unit_costs", unit_costs, None)
    n = len(costs)
    check_int("workers", workers)
    check_int("epochs", epochs)
    check_int("partitions", partitions, optional=True)
    if order not in ORDERS:
        raise ValueError(f"order is {order!r}, but must be one of {ORDERS}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed is {seed!r}, but must be an int")
    hops = _per_model("hop", hop, n)
    evals = _per_model("eval_costs", eval_costs, n)
    _check_number("load_seconds", load_seconds, least=0.0)
    if stragglers is not None and not isinstance(stragglers, Stragglers):
        raise TypeError(f"stragglers is {type(stragglers).__name__}, but must be a Stragglers or None")
    check_int("replicas", replicas)
    if replicas > workers:
        raise ValueError(f"replicas is {replicas}, but must be <= the {workers} workers")
    joins = sorted(_per_model("joins", joins, None, allow_empty=True))
    P = workers if partitions is None else partitions
    sim = _Simulation(
        costs,
        workers,
        P,
        order,
        seed,
        hops,
        evals,
        load_seconds,
        stragglers or Stragglers(),
        validate,
        record,
        replicas,
        speculate,
        joins,
        prefetch,
        gang,
    )
    started = time.perf_counter()
    sim.run(epochs)
    wall = time.perf_counter() - started
    work = sum(epochs * (P * c + e) for c, e in zip(costs, evals, strict=True))
    chain = max(epochs * (P * c + e / P) for c, e in zip(costs, evals, strict=True))
    bound = max(_time_to_do(work, workers, joins), chain)
    capacity = workers * sim.now + sum(max(0.0, sim.now - t) for t in joins)
    decisions = np.asarray(sim.decisions) * 1e6
    cpu = np.asarray(sim.cpu) * 1e6
    return SimulationResult(
        workers,
        n,
        P,
        epochs,
        order,
        sim.now,
        sim.busy,
        sim.busy / capacity if sim.now > 0 else 1.0,
        bound,
        bound / sim.now if sim.now > 0 else 1.0,
        sim.units,
        sim.hops,
        replicas,
        speculate,
        sim.copies,
        sim.copies_won,
        sim.s.restarts,
        sim.wasted,
        len(decisions),
        float(decisions.mean()),
        float(np.percentile(decisions, 99)),
        float(decisions.max()),
        float(cpu.max()),
        wall,
        tuple(sim.reports),
        tuple(sim.trains),
    )


def _time_to_do(work: float, workers: int, joins: Sequence[float]) -> float:
    """The time by which ``workers`` at start plus one per join time could do ``work``."""
    done, now, present = 0.0, 0.0, workers
    for t in [*list(joins), math.inf]:
        if done + present * (t - now) >= work:
            return now + (work - done) / present
        done += present * (t - now)
        now, present = t, present + 1
    raise AssertionError("unreachable")


class _Simulation:
    """The event loop: a heap of (time, sequence, kind, worker) and one FIFO per worker.
    A heap entry is a worker's task ending ("task"), a worker joining ("join"), a
    time the scheduler asked to be told of ("wake") or the answer to an AskProgress
    ("progress", its events in ``answers``)."""

    def __init__(
        self,
        costs,
        workers,
        P,
        order,
        seed,
        hops,
        evals,
        load_seconds,
        stragglers,
        validate,
        record,
        replicas,
        speculate,
        joins,
        prefetch,
        gang: GangCost | None = None,
    ) -> None:
        self.costs, self.hop_cost, self.evals, self.load = costs, hops, evals, load_seconds
        self.gang = gang
        self.widths_automatic = True  # False: a session gives the widths (see tuners)
        self.P, self.validate, self.record = P, validate, record
        self.names = [f"w{i:04d}" for i in range(workers)]
        self.factor = {
            w: (stragglers.slowdown if i < stragglers.slow_workers else 1.0) for i, w in enumerate(self.names)
        }
        self.unit_rate, self.unit_slowdown = stragglers.unit_rate, stragglers.unit_slowdown
        self.rng = np.random.default_rng([seed, 1])
        self.s = Scheduler(
            P,
            self.names,
            seed=seed,
            order=order,
            replicas=replicas,
            speculate=speculate,
            prefetch=prefetch,
            gang=gang is not None,
        )
        self.now, self.busy, self.units, self.hops = 0.0, 0.0, 0, 0
        self.copies, self.copies_won, self.wasted = 0, 0, 0.0
        self.decisions: list[float] = []
        self.cpu: list[float] = []
        self.reports: list[Report] = []
        self.trains: list[tuple[float, Train | TrainGang]] = []
        self.queues: dict[str, deque] = {w: deque() for w in self.names}
        self.running: dict[str, tuple] = {}
        self.running_since: dict[str, tuple[int, float]] = {}  # worker -> (heap seq of its end, compute start)
        self.heap: list[tuple[float, int, str, str]] = []
        self.seq = 0
        self.ticked: float | None = None  # the clock the scheduler last saw
        self.wakes: set[float] = set()  # wake-ups on the heap
        self.state_at: dict[int, str] = {}  # model -> worker holding its newest state
        self.discarded: set[tuple[str, int, int]] = set()  # (worker, model, partition) lost races
        self.shards_left: dict[tuple[int, int], int] = {}
        self.answers: dict[int, list[UnitProgress]] = {}  # heap seq -> a progress answer's events
        self.finished = 0
        for i, t in enumerate(joins):
            self.push(t, "join", f"w{workers + i:04d}")

    def run(self, epochs: int) -> None:
        self.dispatch(self.s.start())
        self.handle(ModelsAdded(tuple(NewModel(m, epochs) for m in range(len(self.costs)))))
        while self.heap and (self.finished < len(self.costs) or self.s.active()):
            self.step()
        if self.finished != len(self.costs) or self.s.active():
            raise RuntimeError(
                f"the simulation stalled: {self.finished} of {len(self.costs)} models finished"
            )  # a scheduler bug, never a user error

    def step(self) -> None:
        """Advance the clock to the next event on the heap and handle it."""
        self.now, seq, kind, w = heapq.heappop(self.heap)
        if kind == "wake":
            self.wakes.discard(self.now)
            self.tick()
        elif kind == "join":
            self.queues[w], self.factor[w] = deque(), 1.0
            self.handle(WorkerAdded(w))
        elif kind == "progress":
            for event in self.answers.pop(seq):
                self.handle(event)
        elif self.running_since[w][0] == seq:  # else: the end of a run abandoned meanwhile
            task = self.running.pop(w)
            self.start_next(w)
            done = self.complete(task, w)
            if done is not None:
                self.handle(done)

    def tick(self) -> None:
        if self.ticked != self.now:
            self.ticked = self.now
            self.handle(Tick(self.now))

    def handle(self, event: Event) -> None:
        if self.s.replicas > 1 and not isinstance(event, Tick):
            self.tick()  # as a Session does: the clock only matters with replicas
        cpu, started = time.thread_time(), time.perf_counter()
        out = self.s.handle(event)
        self.decisions.append(time.perf_counter() - started)
        self.cpu.append(time.thread_time() - cpu)
        if self.validate:
            self.s.validate()
        self.dispatch(out)
        if self.gang is not None and self.widths_automatic:
            self.give_widths()
        wake = self.s.next_wakeup()
        if wake is not None and wake not in self.wakes:
            self.wakes.add(wake)
            self.push(wake, "wake", "")

    def give_widths(self) -> None:
        """With no tuner: every epoch waiting for its width gets the rule's, for the
        models training now."""
        assert self.gang is not None
        wanted = self.s.widths_wanted()
        if wanted:
            live = self.s.live_models()
            for model_id, epoch in wanted:
                width = gang_width(len(live), self.P, max_width=self.gang.max_width)
                self.handle(GangWidth(model_id, epoch, width, live.index(model_id)))

    def dispatch(self, instructions: list) -> None:
        for ins in instructions:
            if isinstance(ins, Place):
                self.submit(ins.worker, ("place", ins, self.load))
            elif isinstance(ins, Train):
                self.submit(ins.worker, ("train", ins, self.costs[ins.model_id]))
            elif isinstance(ins, TrainGang):
                waiting = set(ins.workers)  # the ranks not yet started on their workers
                for w in ins.workers:
                    self.submit(w, ("rank", ins, waiting))
            elif isinstance(ins, Discard):
                self.discard(ins)
            elif isinstance(ins, AskProgress):
                self.answer(ins)
            elif isinstance(ins, Evaluate):
                per_shard = self.evals[ins.model_id] / self.P
                self.shards_left[(ins.model_id, ins.epoch)] = self.P
                for p in range(self.P):
                    self.submit(ins.workers[p], ("eval", ins, per_shard))
            elif isinstance(ins, Report):
                if self.record:
                    self.reports.append(ins)
            elif isinstance(ins, Pause):
                self.finished += 1

    def discard(self, ins: Discard) -> None:
        """The run lost its race: a started one is abandoned at once (a unit checks
        after every batch), a queued one is dropped; either completes at once,
        freeing its worker."""
        key = (ins.worker, ins.model_id, ins.partition)
        queue = self.queues.get(ins.worker, deque())
        for i, task in enumerate(queue):
            if task[0] == "train" and (task[1].model_id, task[1].partition) == key[1:]:
                queue[i] = ("dropped", task[1], 0.0)
                return
        running = self.running.get(ins.worker)
        if running is not None and running[0] == "train" and (running[1].model_id, running[1].partition) == key[1:]:
            compute = running[2]
            done = min(compute, max(0.0, self.now - self.running_since[ins.worker][1]))
            self.busy -= compute - done
            self.wasted += done
            self.running[ins.worker] = ("dropped", running[1], 0.0)
            self.running_since[ins.worker] = (self.push(self.now, "task", ins.worker), self.now)
            return
        self.discarded.add(key)

    def answer(self, ins: AskProgress) -> None:
        """How far each asked-for unit has come, reported at the same virtual time
        (after the events already due then): the share of its compute done."""
        events = []
        for model_id, partition, w in ins.runs:
            task = self.running.get(w)
            if task is None or task[0] != "train" or (task[1].model_id, task[1].partition) != (model_id, partition):
                continue  # queued, ended or dropped: nothing to report
            seconds = self.now - self.running_since[w][1]
            if seconds >= 0:
                events.append(UnitProgress(model_id, partition, w, min(1.0, seconds / task[2]), seconds))
        if events:
            self.answers[self.push(self.now, "progress", "")] = events

    def push(self, when: float, kind: str, worker: str) -> int:
        self.seq += 1
        heapq.heappush(self.heap, (when, self.seq, kind, worker))
        return self.seq

    def submit(self, worker: str, task: tuple) -> None:
        self.queues[worker].append(task)
        if worker not in self.running:
            self.start_next(worker)

    def start_next(self, w: str) -> None:
        """Start the worker's next queued task: its finish time goes on the heap."""
        if not self.queues[w]:
            return
        kind, ins, seconds = task = self.queues[w].popleft()
        if kind == "dropped":  # a loser cancelled before it started: it ends at once
            self.running[w] = task
            self.running_since[w] = (self.push(self.now, "task", w), self.now)
            return
        if kind == "rank":
            self.running[w] = task
            self.running_since[w] = (-1, self.now)  # waits for the other ranks
            seconds.discard(w)
            if not seconds:
                self.launch_gang(ins)
            return
        compute = seconds * self.factor[w]
        if kind == "train":
            if self.unit_rate and self.rng.random() < self.unit_rate:
                compute *= self.unit_slowdown
            if ins.copy:
                self.copies += 1
            elif self.record:
                self.trains.append((self.now, ins))
        move = 0.0
        if kind != "place" and self.state_at.get(ins.model_id, w) != w:
            move = self.hop_cost[ins.model_id]
            self.hops += 1
        if kind != "place":
            self.busy += compute
            self.record_busy(self.now + move, compute)
        self.running[w] = (kind, ins, compute)
        end = self.push(self.now + move + (compute if kind != "place" else seconds), "task", w)
        self.running_since[w] = (end, self.now + move)

    def launch_gang(self, ins: TrainGang) -> None:
        """Every rank of the gang unit has started: the ranks train together, as long as
        the slowest rank's partition plus the all-reduces, from the state shipped to
        them (one hop, in parallel) if it was elsewhere."""
        assert self.gang is not None
        k, model = len(ins.workers), ins.model_id
        compute = max(self.costs[model] * self.factor[w] for w in ins.workers)
        if self.unit_rate and self.rng.random() < self.unit_rate:
            compute *= self.unit_slowdown
        compute += self.gang.overhead(k)
        move = 0.0
        if model in self.state_at:  # the ranks but one receive the state
            move = self.hop_cost[model]
            self.hops += 1
        if self.record:
            self.trains.append((self.now, ins))
        for w in ins.workers:
            self.busy += compute
            self.record_busy(self.now + move, compute)
            self.running[w] = ("rank", ins, compute)
            self.running_since[w] = (self.push(self.now + move + compute, "task", w), self.now + move)

    def record_busy(self, start: float, seconds: float) -> None:
        """A worker computes from ``start`` for ``seconds`` (a subclass keeps them)."""

    def complete(self, task: tuple, w: str) -> Event | None:
        kind, ins, compute = task
        if kind == "place":
            return PartitionPlaced(ins.partition, w)
        if kind == "rank":
            if w != ins.workers[0]:
                return None  # rank 0 reports the gang unit
            self.units += len(ins.workers)
            self.state_at[ins.model_id] = w
            return UnitDone(ins.model_id, ins.partitions[0], w)
        if kind == "dropped":
            return UnitDone(ins.model_id, ins.partition, w)
        if kind == "train":
            key = (w, ins.model_id, ins.partition)
            if key in self.discarded:  # it lost its race: its state is not the model's
                self.discarded.discard(key)
                self.wasted += compute
                return UnitDone(ins.model_id, ins.partition, w)
            self.units += 1
            self.copies_won += ins.copy
            self.state_at[ins.model_id] = w
            return UnitDone(ins.model_id, ins.partition, w)
        shard_key = (ins.model_id, ins.epoch)
        self.shards_left[shard_key] -= 1
        if self.shards_left[shard_key]:
            return None
        del self.shards_left[shard_key]
        return EvaluationDone(ins.model_id, ins.epoch)


def sweep(
    workers: Sequence[int] = (2, 8, 32, 128),
    ratios: Sequence[float] = (0.5, 1, 2, 4),
    spreads: Sequence[float] = (1, 2, 10),
    orders: Sequence[str] = ("fixed", "dynamic"),
    *,
    epochs: int = 5,
    seed: int = 0,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Simulate every (p, n = ratio * p, cost spread, order); one row dict per run.

    ``kwargs`` go to :func:`simulate` (``hop``, ``stragglers``, ...). Rows carry
    ``spread`` beside the :class:`SimulationResult` fields.
    """
    rows = []
    for p in workers:
        for ratio in ratios:
            n = max(1, int(round(ratio * p)))
            for spread in spreads:
                costs = spread_costs(n, spread, seed)
                for order in orders:
                    r = simulate(costs, p, epochs=epochs, order=order, seed=seed, **kwargs)
                    rows.append({"spread": spread, **r.row()})
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table: utilization and efficiency of fixed and dynamic side by side."""
    keyed: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        keyed.setdefault((row["workers"], row["models"], row["spread"]), {})[row["order"]] = row
    lines = [
        "| p | n | spread | util fixed | util dynamic | eff fixed | eff dynamic | decision µs mean / p99 (fixed) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (p, n, spread), by in keyed.items():
        f, d = by.get("fixed"), by.get("dynamic")
        cell = lambda r, k: f"{r[k]:.3f}" if r else "-"  # noqa: E731
        timing = f"{f['decision_mean_us']:.0f} / {f['decision_p99_us']:.0f}" if f else "-"
        lines.append(
            f"| {p} | {n} | {spread:g}x | {cell(f, 'utilization')} | {cell(d, 'utilization')} "
            f"| {cell(f, 'efficiency')} | {cell(d, 'efficiency')} | {timing} |"
        )
    return "\n".join(lines)


def _check_number(name: str, value: Any, *, least: float, strict: bool = False) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value > least if strict else value >= least)
    )
    if not ok:
        raise ValueError(f"{name} is {value!r}, but must be a finite number {'>' if strict else '>='} {least:g}")


def _per_model(name: str, value: Any, n: int | None, allow_empty: bool = False) -> list[float]:
    """One number per model: a sequence of length n (any length if n is None) or a scalar."""
    if n is not None and not isinstance(value, (list, tuple, np.ndarray)):
        _check_number(name, value, least=0.0)
        return [float(value)] * n
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(f"{name} is {type(value).__name__}, but must be a sequence of numbers")
    values = list(value)
    if n is None and not values and not allow_empty:
        raise ValueError(f"{name} is empty, but must name at least one model's cost")
    if n is not None and len(values) != n:
        raise ValueError(f"{name} has {len(values)} values, but must have one per model ({n})")
    for i, v in enumerate(values):
        _check_number(f"{name}[{i}]", float(v) if isinstance(v, np.floating) else v, least=0.0)
    return [float(v) for v in values]


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Simulate MOP visit orders (virtual time).")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 1, 2, 4])
    parser.add_argument("--spreads", type=float, nargs="+", default=[1, 2, 10])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(format_table(sweep(args.workers, args.ratios, args.spreads, epochs=args.epochs, seed=args.seed)))


if __name__ == "__main__":
    main()
