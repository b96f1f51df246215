"""The MOP scheduler: a pure state machine (no Dask, no torch, no I/O).

It holds which worker holds each partition, which worker runs which unit and
where every model stands in its epoch. It changes only in :meth:`Scheduler.handle`,
which takes one event and returns the instructions that follow from it, in the
style of dask.distributed's ``worker_state_machine``. Executors (local, Dask)
and the simulator run this same code.

Visit orders (DESIGN.md, "Visit order and reproducibility"):

* ``"fixed"`` (Latin order): in epoch ``e`` the model with offset ``k`` visits
  partition ``sigma_e[(k + j) % P]`` at step ``j``; ``sigma_e`` is one permutation
  per epoch shared by all models, drawn from the session seed. What a model
  computes depends only on the seed, its config and its offset.
* ``"dynamic"``: a model takes any unvisited partition on an idle worker
  (Cerebro's randomized scheduler). The realized order is reported.

A model's epoch ends with an evaluation; the model trains on only after it
(so a tuner can prune on the report before any more compute is spent). Its
status moves along :data:`TRANSITIONS` only (training -> evaluating -> training
or paused, stopped or failed from any of those; a rollback returns it to
training); any other change raises :class:`TransitionError`. Events are
dispatched by type (``Scheduler._HANDLERS``); the events and instructions
themselves, the protocol with the executors, live in
:mod:`cerebro_automl.protocol`.

Replicas (``replicas=r``): each partition is held by r workers (placement in
:mod:`cerebro_automl.placement`), and a unit may run on any idle holder of its
partition. Which worker runs a unit never changes what it computes, so with
fixed order the weights are those of r = 1. A lost worker's partitions are
still served by their other holders while a new copy loads elsewhere; a
worker that joins receives copies and takes units once one has loaded.

Timing arrives as :class:`Tick` events (the executor's clock). From it the
scheduler learns each model's unit time and each worker's pace (how much
slower than its models' median it runs; :mod:`cerebro_automl.timing`), prefers
fast holders, and with
``speculate=True`` acts on a unit running well past what its model's units
take on that worker (``SPECULATE_AFTER`` times, and at least
``SPECULATE_MIN_LATE`` seconds past it): it starts a copy on an idle
holder, and the first run to finish is the model's (:class:`Discard` names the
other). It need not wait that long to know: it asks the executor how far a unit
has come (:class:`AskProgress`) every ``PROGRESS_EVERY`` of the unit's expected
time, and a unit whose :class:`UnitProgress` projects it past that point is a
straggler from then on (a unit of a second or more running 4x slow shows it a
quarter of the way in). With no holder idle to race it, the unit is restarted
once: its run is discarded and the unit goes to the first holder that frees up,
its own worker included. Waiting for a holder to race it would cost that holder
a whole unit on top of the straggler's time; a restart costs only the time
already run.

Prefetch (``prefetch=True``): a busy worker is also sent the unit it runs next
(``reserved``), chosen as for an idle worker, so that it starts when the one
ahead ends rather than after the executor's round trip through the driver. The
worker may run the two in either order (the one ahead may still wait for its
input state), so either may end first. A model never has a unit reserved behind
one of its own, and a discarded reserved unit keeps its slot until it ends.

Example:
    >>> s = Scheduler(num_partitions=2, workers=["a", "b"], seed=0)
    >>> [type(i).__name__ for i in s.start()]
    ['Place', 'Place']
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from .placement import Placement
from .timing import UnitTimes
from .protocol import (
    Event, Instruction, ModelStatus,
    ModelsAdded, BudgetExtended, ModelStopped, UnitDone, UnitFailed, EvaluationDone, WorkerAdded,
    Tick, UnitProgress, AskProgress, WorkerLost, PartitionPlaced, PlaceFailed,
    PartitionLost, UnitCancelled, EvaluationCancelled, StatesLost, Place, Train, Evaluate, Drop, Discard, Checkpoint, Report,
    Pause, Fail, Rollback, Release, Abort)

__all__ = [
    "ORDERS", "Scheduler", "latin_order",
    "SPECULATE_AFTER", "SPECULATE_MIN_LATE", "PROGRESS_EVERY", "PROGRESS_INTERVAL", "TRANSITIONS", "TransitionError",
]

ORDERS = ("fixed", "dynamic")

# Speculation and pace (learnt by timing.UnitTimes). A unit is a straggler once it
# has run SPECULATE_AFTER times what its model's units take on its worker (the
# model's running median, times the worker's pace). An idle holder more than
# SLOW_PACE times slower than the fastest idle one is passed over while a faster
# one is idle.
# The progress of a unit that may straggle is asked for every PROGRESS_EVERY of its
# expected time, but no more often than every PROGRESS_INTERVAL seconds (an answer
# costs the executor a round trip to the workers), and judged once the unit has
# trained that long on its worker.
SPECULATE_AFTER = 1.5
# ... and at least this many seconds past it: units of a few tens of milliseconds
# run 1.5x late from timing noise alone (a busy host, the driver's poll), and a
# restart then throws away work to gain at most that much (Spark's
# spark.speculation.minTaskRuntime guards the same).
SPECULATE_MIN_LATE = 0.5
SLOW_PACE = 1.25
# A slow idle holder's unit is left to a busy holder only if that one is expected to
# free up and finish it in under this share of the slow one's time: leaving a worker
# idle costs its capacity, so the gain must be clear (the simulator: 0.5 helps a
# 4-10x slow worker and changes nothing else; 1.0 cost a 2-4x slow one).
HAND_OFF = 0.5
PROGRESS_EVERY = 0.25
PROGRESS_INTERVAL = 0.2


def _late_after(expected: float) -> float:
    """How long a unit expected to take ``expected`` seconds runs before it is a straggler."""
    return max(SPECULATE_AFTER * expected, expected + SPECULATE_MIN_LATE)


def latin_order(seed: int, epoch: int, offset: int, num_partitions: int) -> tuple[int, ...]:
    """The partitions a model with ``offset`` visits in ``epoch``, in order (fixed order).

    >>> latin_order(0, 0, 0, 3) == tuple(latin_order(0, 0, 1, 3)[-1:] + latin_order(0, 0, 1, 3)[:-1])
    True
    """
    return _rotate(_sigma(seed, epoch, num_partitions), offset)


def _sigma(seed: int, epoch: int, num_partitions: int) -> tuple[int, ...]:
    """The epoch's permutation of the partitions, shared by all models."""
    return tuple(int(p) for p in np.random.default_rng([seed, epoch]).permutation(num_partitions))


def _rotate(sigma: tuple[int, ...], offset: int) -> tuple[int, ...]:
    """``sigma[(offset + j) % P]`` for j = 0 .. P-1."""
    k = offset % len(sigma)
    return sigma[k:] + sigma[:k]


# ------------------------------------------------------------------------ state
@dataclass
class _Run:
    """A model's unit in flight on ``worker``, and the speculative copy racing it, if any."""
    partition: int
    worker: str
    started: float | None = None        # clock when it started (None: no clock)
    copy_worker: str | None = None      # a copy of the unit runs there
    copy_started: float | None = None   # ... since then
    asked: float | None = None          # clock of the last AskProgress for it
    # (clock of its latest UnitProgress, the clock at which that projects it to end)
    progress: tuple[float, float] | None = None

    def workers(self) -> set[str]:
        return {self.worker} if self.copy_worker is None else {self.worker, self.copy_worker}


@dataclass
class _Model:
    model_id: int
    ordinal: int
    offset: int
    budget: int
    status: ModelStatus = ModelStatus.TRAINING
    epochs_done: int = 0
    visited: list[int] = field(default_factory=list)  # this epoch, in order
    running: _Run | None = None            # its unit in flight
    eval_workers: tuple[str, ...] = ()     # the workers of its latest Evaluate, by partition
    state_worker: str | None = None        # holds the newest state; None: initial
    epoch_start_worker: str | None = None  # holds the state this epoch started from
    epoch_start_lost: bool = False         # ... which died with its worker: replay further back
    epoch_start: int = 0                   # epochs done when this epoch started
    last_order: tuple[int, ...] = ()
    reported: int = 0                      # highest epoch reported
    finished_at: int = 0                   # budget at the last Pause
    eval_pending: bool = False             # Evaluate wanted but not yet issued
    reported_orders: dict[int, tuple[int, ...]] = field(default_factory=dict)  # epoch -> order
    durable_epoch: int = 0                 # the driver keeps the state after these epochs
    durable: bool = False                  # ... it keeps one (else: replay from the seed)
    retries: list[str] = field(default_factory=list)  # why its work was lost, in a row
    restarted: tuple[int, int] | None = None  # (epoch, step) of its unit last restarted


TRAINING, EVALUATING, PAUSED = ModelStatus.TRAINING, ModelStatus.EVALUATING, ModelStatus.PAUSED
STOPPED, FAILED = ModelStatus.STOPPED, ModelStatus.FAILED

# The model lifecycle. Every status change goes through Scheduler._move, which
# refuses a pair not listed here; the value says when the change happens.
# STOPPED and FAILED are final.
TRANSITIONS: dict[tuple[ModelStatus, ModelStatus], str] = {
    (TRAINING, EVALUATING): "the epoch's last unit finished",
    (EVALUATING, TRAINING): "evaluated with budget left, or rolled back",
    (EVALUATING, PAUSED): "evaluated with its budget spent",
    (PAUSED, TRAINING): "its budget was extended, or it was rolled back",
    (TRAINING, TRAINING): "rolled back to an earlier state",
    **{(s, STOPPED): "its tuner stopped it" for s in (TRAINING, EVALUATING, PAUSED)},
    **{(s, FAILED): "its code failed, or its work was lost too often in a row"
       for s in (TRAINING, EVALUATING, PAUSED)},
}


class TransitionError(AssertionError):
    """The scheduler tried a status change that :data:`TRANSITIONS` does not list (a bug)."""


class Scheduler:
    """MOP decisions for one session. See the module docstring.

    Args:
        num_partitions: P, the number of data partitions.
        workers: the workers at start; with one replica, partition i goes to
            ``sorted(workers)[i % W]``.
        seed: the session seed (it draws the Latin-order permutations).
        order: ``"fixed"`` or ``"dynamic"``.
        checkpoint: emit a ``Checkpoint`` at every epoch end.
        max_unit_retries: how many times in a row a model's work (a unit or an
            evaluation) may be lost with its worker, or cancelled, and run again;
            past it the model fails with the reasons. A model whose units kill
            their worker (memory) thus fails alone instead of killing worker after
            worker. A completed unit or evaluation resets the count.
        max_place_retries: how many times in a row a partition may fail to load
            and be placed again; past it the scheduler emits ``Abort``.
        replicas: how many workers hold each partition (fewer while fewer live).
        speculate: start a copy of a straggling unit on another holder of its
            partition, or restart it when none is idle (needs ``replicas >= 2``
            and :class:`Tick` events).
        prefetch: send each busy worker its next unit too (see the module docstring).
    """

    def __init__(self, num_partitions: int, workers: list[str] | tuple[str, ...] = (),
                 *, seed: int = 0, order: str = "fixed", checkpoint: bool = False,
                 max_unit_retries: int = 3, max_place_retries: int = 3,
                 replicas: int = 1, speculate: bool = False, prefetch: bool = False) -> None:
        if not isinstance(num_partitions, int) or num_partitions < 1:
            raise ValueError(f"num_partitions is {num_partitions!r}, but must be an int >= 1")
        if order not in ORDERS:
            raise ValueError(f"order is {order!r}, but must be one of {ORDERS}")
        for name, value in (("max_unit_retries", max_unit_retries),
                            ("max_place_retries", max_place_retries)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} is {value!r}, but must be an int >= 0")
        for name, flag in (("speculate", speculate), ("prefetch", prefetch)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} is {flag!r}, but must be True or False")
        self.placement = Placement(num_partitions, replicas)  # checks replicas
        if speculate and replicas < 2:
            raise ValueError(f"speculate is True with replicas={replicas}, but a speculative copy "
                             "runs on another holder of the partition: it needs replicas >= 2")
        self.num_partitions = num_partitions
        self.seed = seed
        self.order = order
        self.checkpoint = checkpoint
        self.max_unit_retries = max_unit_retries
        self.max_place_retries = max_place_retries
        self.replicas = replicas
        self.speculate = speculate
        self.prefetch = prefetch
        # With prefetch: worker -> (model, partition) of the unit sent to it behind the
        # one in self.workers. The worker may run the two in either order (the one ahead
        # may still wait for its input state), so either may end first.
        self.reserved: dict[str, tuple[int, int]] = {}
        self.orphan_reserved: set[str] = set()  # workers whose reserved unit is discarded
        self.place_failures: dict[int, list[str]] = {}  # partition -> why its loads failed, in a row
        self.aborted: str | None = None  # the error of the Abort emitted, if any
        self.models: dict[int, _Model] = {}
        self.workers: dict[str, tuple[int, int] | None] = {}  # worker -> (model, partition)
        # Workers running a unit whose result is discarded: an orphan's model (rolled
        # back, stopped) waits for it to end; a race loser's model does not.
        self.orphan_workers: set[str] = set()
        self.loser_workers: set[str] = set()
        self.now: float | None = None  # the latest Tick; None: no clock, no timing
        self.copies_started = 0        # speculative copies of straggling units, so far
        self.restarts = 0              # straggling units restarted (no holder idle to race them)
        # Units the models' current states hold, trained since they were added: the
        # progress bar's count (a race's loser, a discarded run and the units a
        # rollback throws away are not in it).
        self.units_trained = 0
        self.times = UnitTimes()       # models' unit durations and workers' paces
        self._initial_workers = sorted(set(workers))
        self._started = False
        self._orders: dict[tuple[int, int], tuple[int, ...]] = {}  # (offset, epoch) cache
        self._sigmas: dict[int, tuple[int, ...]] = {}  # epoch -> its permutation
        # Indexes over the models, so that an event neither scans nor sorts every model
        # (p=128, n=512: 150-270 us per event before, 20-60 us with them). They are
        # refreshed after every event for the models it touched (all of them after a
        # WorkerLost); validate() checks them against a scan.
        self._ready_queue: list[tuple[int, int, int]] = []  # (-remaining units, ordinal, id): TRAINING
        self._ready_entries: dict[int, tuple[int, int, int]] = {}  # id -> its entry in _ready_queue
        self._live: set[int] = set()          # TRAINING or EVALUATING
        self._eval_pending: set[int] = set()  # eval_pending is set

    # ------------------------------------------------------------------ API
    def start(self) -> list[Instruction]:
        """Place every partition's replicas on the initial workers (see placement)."""
        if self._started:
            raise RuntimeError("Scheduler.start() was already called")
        self._started = True
        out: list[Instruction] = []
        for w in self._initial_workers:
            self.workers[w] = None
        self._replicate(out)
        return out

    def handle(self, event: Event) -> list[Instruction]:
        """Apply one event; return the instructions that follow from it."""
        handler = self._HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"event {event!r} is not a scheduler event")
        if self.aborted is not None:
            raise RuntimeError(f"the scheduler stopped after an Abort: {self.aborted}")
        try:
            out: list[Instruction] = handler(self, event)
        finally:
            self._reindex(event)
        out.extend(self._issue_evaluations())
        out.extend(self._assign())
        return out

    def model_order(self, model: _Model, epoch: int) -> tuple[int, ...]:
        key = (model.offset, epoch)
        if key not in self._orders:
            if epoch not in self._sigmas:
                self._sigmas[epoch] = _sigma(self.seed, epoch, self.num_partitions)
            self._orders[key] = _rotate(self._sigmas[epoch], model.offset)
        return self._orders[key]

    def remaining_units(self, model_id: int) -> int:
        m = self.models[model_id]
        return (m.budget - m.epochs_done) * self.num_partitions - len(m.visited)

    def active(self) -> bool:
        """True while any model trains or evaluates, or any unit is in flight."""
        return bool(self._live) or any(self.workers.values())

    def waiting_for(self) -> str | None:
        """Why models wait although nothing may be running, or None: no worker is
        alive, or partitions have no live worker to load them."""
        if not self.active():
            return None
        if not self.workers:
            return "no worker is alive"
        unplaced = self.placement.unserved()
        if unplaced:
            return f"partitions {unplaced} have no live worker"
        return None

    def holders(self, partition: int) -> list[str]:
        """The live workers holding ``partition``, sorted."""
        return sorted(self.placement.holders[partition])

    def pace(self, worker: str) -> float:
        """How many times its models' median unit time ``worker`` takes (1.0 until
        it has ``MIN_TIMINGS`` timed units)."""
        return self.times.pace(worker)

    def next_wakeup(self) -> float | None:
        """The clock time at which a running unit becomes a straggler (a Tick then may
        start its copy), its progress is due to be asked for, or a straggler left to
        run is due to be looked at again; None: none of these. An executor that waits
        for completions waits no longer than this."""
        if not self.speculate or self.now is None:
            return None
        times = [due for w in self.workers
                 for due in (self._straggler_due(w), self._progress_due(w), self._recheck_due(w))
                 if due is not None and due > self.now]
        return min(times) if times else None

    # --------------------------------------------------------------- events
    def _on_tick(self, e: Tick) -> list[Instruction]:
        if isinstance(e.now, bool) or not isinstance(e.now, (int, float)) or e.now != e.now:
            raise ValueError(f"Tick.now is {e.now!r}, but must be a number of seconds")
        if self.now is None or e.now > self.now:  # a clock that steps back is not followed
            self.now = float(e.now)
        return []

    def _on_unit_progress(self, e: UnitProgress) -> list[Instruction]:
        for name in ("fraction", "seconds"):
            value = getattr(e, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"UnitProgress.{name} is {value!r}, but must be a number >= 0")
        if e.fraction > 1:
            raise ValueError(f"UnitProgress.fraction is {e.fraction!r}, but must be at most 1")
        watched = self._watched_run(e.worker) if self.now is not None else None
        if watched is None or (watched[0].model_id, watched[1].partition) != (e.model_id, e.partition):
            return []  # a run that ended or was discarded meanwhile, a copy, a reserved run
        _, run, expected = watched
        if e.seconds < PROGRESS_EVERY * expected:
            return []  # too soon to judge (the unit may have queued on its worker)
        left = e.seconds * (1 - e.fraction) / e.fraction if e.fraction > 0 else float("inf")
        run.progress = (self.now, self.now + left)
        return []

    def _on_models_added(self, e: ModelsAdded) -> list[Instruction]:
        # Every model is checked before any is added, so a rejected event changes nothing.
        ids = [new.model_id for new in e.models]
        for i, new in enumerate(e.models):
            if new.model_id in self.models or new.model_id in ids[:i]:
                raise ValueError(f"model id {new.model_id} was already added")
            if not isinstance(new.epochs, int) or new.epochs < 1:
                raise ValueError(f"epochs is {new.epochs!r}, but must be an int >= 1")
            if not isinstance(new.start_epoch, int) or not 0 <= new.start_epoch < new.epochs:
                raise ValueError(f"start_epoch is {new.start_epoch!r}, but must be an int in "
                                 f"[0, epochs={new.epochs})")
        out: list[Instruction] = []
        for new in e.models:
            ordinal = len(self.models)
            offset = ordinal if new.offset is None else new.offset
            m = self.models[new.model_id] = _Model(new.model_id, ordinal, offset, new.epochs,
                                                   epochs_done=new.start_epoch,
                                                   epoch_start=new.start_epoch,
                                                   reported=new.start_epoch,
                                                   durable_epoch=new.start_epoch,
                                                   durable=new.start_epoch > 0 or new.from_state)
            if new.state_worker is not None and m.durable:
                if new.state_worker in self.workers:
                    m.state_worker = m.epoch_start_worker = new.state_worker
                else:  # sent to a worker already gone (or not yet seen): use the driver's copy
                    out.append(Rollback(m.model_id, new.start_epoch, durable=True))
        return out

    def _on_budget_extended(self, e: BudgetExtended) -> list[Instruction]:
        m = self._model(e.model_id)
        if m.status in (ModelStatus.STOPPED, ModelStatus.FAILED):
            raise ValueError(f"model {e.model_id} is {m.status.value} and cannot be extended")
        if not isinstance(e.epochs, int) or e.epochs < 1:
            raise ValueError(f"epochs is {e.epochs!r}, but must be an int >= 1")
        m.budget += e.epochs
        if m.status is ModelStatus.PAUSED:
            self._move(m, ModelStatus.TRAINING)
            self._begin_epoch(m)
        return []

    def _on_model_stopped(self, e: ModelStopped) -> list[Instruction]:
        m = self._model(e.model_id)
        if m.status in (ModelStatus.STOPPED, ModelStatus.FAILED):
            return []
        self._move(m, ModelStatus.STOPPED)
        m.eval_pending = False
        self._orphan_running_unit(m)
        return [Release(m.model_id)]

    def _on_unit_done(self, e: UnitDone) -> list[Instruction]:
        m = self._finish_unit(e.model_id, e.partition, e.worker)
        if m is None or m.status is not ModelStatus.TRAINING:
            return []
        # The first run of the unit to finish is the model's; the other one loses.
        out: list[Instruction] = []
        run, m.running = m.running, None
        other = run.copy_worker if e.worker == run.worker else run.worker
        started = run.started if e.worker == run.worker else run.copy_started
        if run.copy_worker is not None:
            self.loser_workers.add(other)
            out.append(Discard(m.model_id, e.partition, other))
            if other == run.worker:
                self._time_overtaken(m, run)
        self._time_unit(m, e.worker, started)
        m.retries.clear()
        m.visited.append(e.partition)
        self.units_trained += 1
        m.state_worker = e.worker
        if len(m.visited) < self.num_partitions:
            return out
        m.epochs_done += 1
        m.last_order = tuple(m.visited)
        m.visited = []
        self._move(m, ModelStatus.EVALUATING)
        m.eval_pending = True
        if self.checkpoint:
            out.append(Checkpoint(m.model_id, m.epochs_done))
        return out

    def _on_unit_failed(self, e: UnitFailed) -> list[Instruction]:
        m = self._finish_unit(e.model_id, e.partition, e.worker)
        if m is None or m.status is not ModelStatus.TRAINING:
            return []
        # User code fails the same way on every worker: a copy racing it fails the
        # model too, so it is not waited for.
        self._detach(m, e.worker)
        return self._fail(m, e.error)

    def _on_evaluation_done(self, e: EvaluationDone) -> list[Instruction]:
        m = self._model(e.model_id)
        if m.status is not ModelStatus.EVALUATING or e.epoch != m.epochs_done or m.eval_pending:
            return []  # stale: the model was stopped, rolled back or re-evaluated
        if e.error is not None:
            return self._fail(m, e.error)
        m.retries.clear()
        out: list[Instruction] = []
        if e.epoch > m.reported:
            m.reported = e.epoch
            m.reported_orders[e.epoch] = m.last_order
            out.append(Report(m.model_id, e.epoch, m.last_order))
        if m.epochs_done < m.budget:
            self._move(m, ModelStatus.TRAINING)
            self._begin_epoch(m)
        else:
            self._move(m, ModelStatus.PAUSED)
            if m.budget > m.finished_at:
                m.finished_at = m.budget
                out.append(Pause(m.model_id, m.budget))
        return out

    def _on_worker_added(self, e: WorkerAdded) -> list[Instruction]:
        if e.worker in self.workers:
            return []
        self.workers[e.worker] = None
        out: list[Instruction] = []
        self._replicate(out)  # the newcomer takes units as soon as a copy has loaded
        return out

    def _on_worker_lost(self, e: WorkerLost) -> list[Instruction]:
        w = e.worker
        if w not in self.workers:
            return []
        # What the worker was running when it died is what most likely killed it
        # (memory): that work alone counts against its model's retries. Unknown:
        # blame the train unit sent there (not a discarded one).
        if e.executing is None:
            unit = self.workers[w]
            discarded = w in self.orphan_workers or w in self.loser_workers
            culprit, loading = (unit[0] if unit is not None and not discarded else None), None
        else:
            culprit, loading = e.executing.model_id, e.executing.partition
        del self.workers[w]
        self.reserved.pop(w, None)
        self.orphan_reserved.discard(w)
        self.orphan_workers.discard(w)
        self.loser_workers.discard(w)
        self.times.forget_worker(w)
        out: list[Instruction] = []
        _, was_loading = self.placement.remove_worker(w, len(self.workers))
        if loading in was_loading:
            out.extend(self._place_failed(loading, f"on {w}: its worker died while loading it "
                                                   "(out of memory?)"))
        # Partitions it held are still served by their other holders; new copies load
        # on survivors meanwhile (a partition it alone held waits for its reload).
        self._replicate(out)
        for m in self.models.values():
            if m.running is not None and w in m.running.workers():
                if m.running.copy_worker is not None:  # the other run of the race goes on
                    self._detach(m, w)
                    out.append(Discard(m.model_id, m.running.partition, w))
                else:
                    m.running = None  # retried from the state it started from
            if m.epoch_start_worker == w:
                m.epoch_start_worker, m.epoch_start_lost = None, True
            if m.status in (ModelStatus.STOPPED, ModelStatus.FAILED):
                continue
            if m.model_id == culprit:
                failed = self._retry(m, f"worker {w} died while running it")
                if failed:
                    out.extend(failed)
                    continue
            if m.state_worker == w:
                out.extend(self._rollback(m))
            elif m.status is ModelStatus.EVALUATING and w in m.eval_workers:
                m.eval_pending = True  # a validation shard it used was lost: evaluate again
        return out

    def _on_partition_placed(self, e: PartitionPlaced) -> list[Instruction]:
        if e.worker not in self.workers:
            return []  # stale: the worker was lost meanwhile
        wanted, donor = self.placement.placed(e.partition, e.worker)
        if not wanted:
            return []
        self.place_failures.pop(e.partition, None)
        out: list[Instruction] = [] if donor is None else [Drop(e.partition, donor)]
        self._replicate(out)  # a background load ended: one that waited may start
        return out

    def _on_place_failed(self, e: PlaceFailed) -> list[Instruction]:
        if not self.placement.place_failed(e.partition, e.worker):
            return []  # stale: the worker was lost meanwhile, and the loss re-placed it
        out = self._place_failed(e.partition, f"on {e.worker}: {e.error}")
        if not out:
            self._replicate(out, avoid=frozenset({e.worker}))
        return out

    def _on_partition_lost(self, e: PartitionLost) -> list[Instruction]:
        p, w = e.partition, e.worker
        if w not in self.workers or not self.placement.lose_copy(p, w, len(self.workers)):
            return []  # stale: it moved or its worker was lost
        out: list[Instruction] = []
        self._replicate(out)
        for m in self.models.values():
            if m.status is ModelStatus.EVALUATING and m.eval_workers[p:p + 1] == (w,):
                m.eval_pending = True  # its validation shard is gone: evaluate again
        return out

    def _on_unit_cancelled(self, e: UnitCancelled) -> list[Instruction]:
        m = self._finish_unit(e.model_id, e.partition, e.worker)
        if m is None or m.status is not ModelStatus.TRAINING:
            return []
        if m.running.copy_worker is not None:  # the other run of the race goes on
            self._detach(m, e.worker)
            return [Discard(m.model_id, e.partition, e.worker)]
        self._detach(m, e.worker)
        # The unit runs again from the state it started from (a lost state comes as StatesLost).
        return self._retry(m, f"its unit on {e.worker} was cancelled ({e.reason})")

    def _on_evaluation_cancelled(self, e: EvaluationCancelled) -> list[Instruction]:
        m = self._model(e.model_id)
        if m.status is not ModelStatus.EVALUATING or e.epoch != m.epochs_done or m.eval_pending:
            return []  # stale, or already to be evaluated again
        failed = self._retry(m, f"its evaluation was cancelled ({e.reason})")
        if not failed:
            m.eval_pending = True
        return failed

    def _on_states_lost(self, e: StatesLost) -> list[Instruction]:
        m = self._model(e.model_id)
        if m.status in (ModelStatus.STOPPED, ModelStatus.FAILED):
            return []
        if m.epoch_start in e.epochs and m.epoch_start > 0 and m.epoch_start_worker is not None:
            m.epoch_start_worker, m.epoch_start_lost = None, True
        return self._rollback(m) if e.newest else []

    # Dispatch by event type; every event of the protocol has its handler.
    _HANDLERS: dict[type, Callable[["Scheduler", Any], list[Instruction]]] = {
        Tick: _on_tick, ModelsAdded: _on_models_added, BudgetExtended: _on_budget_extended,
        ModelStopped: _on_model_stopped, UnitDone: _on_unit_done, UnitFailed: _on_unit_failed,
        EvaluationDone: _on_evaluation_done, WorkerAdded: _on_worker_added,
        WorkerLost: _on_worker_lost, PartitionPlaced: _on_partition_placed,
        PlaceFailed: _on_place_failed, PartitionLost: _on_partition_lost,
        UnitCancelled: _on_unit_cancelled, EvaluationCancelled: _on_evaluation_cancelled,
        StatesLost: _on_states_lost, UnitProgress: _on_unit_progress,
    }

    # -------------------------------------------------------------- helpers
    def _move(self, m: _Model, status: ModelStatus) -> None:
        """Change ``m``'s status along one of the :data:`TRANSITIONS`."""
        if (m.status, status) not in TRANSITIONS:
            raise TransitionError(f"model {m.model_id} cannot go from {m.status.value} to "
                                  f"{status.value}: not one of the scheduler's TRANSITIONS")
        m.status = status

    def _model(self, model_id: int) -> _Model:
        if model_id not in self.models:
            raise ValueError(f"model id {model_id!r} is unknown")
        return self.models[model_id]

    def _begin_epoch(self, m: _Model) -> None:
        m.epoch_start_worker, m.epoch_start_lost = m.state_worker, False
        m.epoch_start = m.epochs_done

    def _orphan_running_unit(self, m: _Model) -> None:
        """The runs in flight keep their workers busy, but their results will be discarded."""
        run = m.running
        if run is not None and self.reserved.get(run.worker) == (m.model_id, run.partition):
            self.orphan_reserved.add(run.worker)  # it may already run: its slot waits for its end
        elif run is not None:
            self.orphan_workers |= run.workers()
        m.running = None

    def _detach(self, m: _Model, worker: str) -> None:
        """The run of ``m``'s unit on ``worker`` ended without counting; a copy racing
        it, if any, becomes the unit."""
        run = m.running
        if run is None:
            return
        if worker == run.copy_worker:
            run.copy_worker, run.copy_started = None, None
        elif worker == run.worker:
            m.running = None if run.copy_worker is None else _Run(run.partition, run.copy_worker,
                                                                 run.copy_started)

    def _finish_unit(self, model_id: int, partition: int, worker: str) -> _Model | None:
        """Free the worker's slot of a finished run (a reserved unit behind the one that
        ended moves up); None if the event is stale or the run was discarded (an
        orphan, a race loser)."""
        if self.reserved.get(worker) == (model_id, partition):  # it ran before the one ahead
            del self.reserved[worker]
            if worker in self.orphan_reserved:
                self.orphan_reserved.discard(worker)
                return None
            return self.models[model_id]
        if self.workers.get(worker) != (model_id, partition):
            return None
        discarded = worker in self.orphan_workers or worker in self.loser_workers
        self.orphan_workers.discard(worker)
        self.loser_workers.discard(worker)
        self.workers[worker] = self.reserved.pop(worker, None)
        if worker in self.orphan_reserved:
            self.orphan_reserved.discard(worker)
            self.orphan_workers.add(worker)
        elif self.workers[worker] is not None:  # the reserved unit starts now
            self.models[self.workers[worker][0]].running.started = self.now
        return None if discarded else self.models[model_id]

    def _replicate(self, out: list[Instruction], avoid: frozenset[str] = frozenset()) -> None:
        """Place new copies of the partitions short of their replicas (the fewest
        holders first), then move copies from the most loaded workers onto the least
        loaded (a worker that joined), so that memory and units stay even. Called
        after every event that changes the copies: a worker that joined while the
        copies it should take were still loading gets them once they are held."""
        if self.aborted is not None or not self.workers:
            return
        for p, w in self.placement.replicate(self.workers, avoid) + self.placement.balance(self.workers):
            out.append(Place(p, w, len(self.place_failures.get(p, ()))))

    def _place_failed(self, p: int, reason: str) -> list[Instruction]:
        """Count a failed load of ``p``; past ``max_place_retries``, Abort."""
        failures = self.place_failures.setdefault(p, [])
        failures.append(reason)
        if len(failures) <= self.max_place_retries:
            return []
        self.aborted = (f"partition {p} failed to load {len(failures)} times in a row "
                        f"(max_place_retries={self.max_place_retries}); the last time {reason}")
        return [Abort(p, self.aborted)]

    def _retry(self, m: _Model, cause: str) -> list[Instruction]:
        """Count one lost or cancelled run of ``m``'s work; past ``max_unit_retries``, fail it."""
        m.retries.append(cause)
        n = len(m.retries)
        if n <= self.max_unit_retries:
            return []
        if all("died while running it" in c for c in m.retries):
            why = (f"its worker died each of the {n} times in a row it ran this model's work "
                   "(a worker killed for passing its memory limit, say, by a model too large "
                   "for it)")
        else:
            why = f"its work was lost {n} times in a row"
        return self._fail(m, f"WorkerDied: {why}; max_unit_retries={self.max_unit_retries}. "
                             f"In order: " + "; ".join(m.retries))

    def _fail(self, m: _Model, error: str) -> list[Instruction]:
        self._move(m, ModelStatus.FAILED)
        m.eval_pending = False
        self._orphan_running_unit(m)
        return [Fail(m.model_id, error), Release(m.model_id)]

    def _rollback(self, m: _Model) -> list[Instruction]:
        """The model's newest state is lost: go back to the newest state still held."""
        # While evaluating or paused, epoch_start still names the start of the epoch
        # just trained, so that epoch is retrained too.
        self._orphan_running_unit(m)
        if m.epoch_start_lost:
            # Replay from the newest copy no worker can lose: the state the driver
            # keeps of a model resumed from a checkpoint, or the initial weights.
            target, holder = m.durable_epoch, None
        else:
            target, holder = m.epoch_start, m.epoch_start_worker
        self.units_trained -= (m.epochs_done - target) * self.num_partitions + len(m.visited)
        m.epochs_done = target
        m.visited = []
        m.state_worker = holder
        m.epoch_start_worker, m.epoch_start_lost = holder, False
        m.epoch_start = target
        m.eval_pending = False
        self._move(m, ModelStatus.TRAINING)
        return [Rollback(m.model_id, target, durable=holder is None and m.durable)]

    # ---------------------------------------------------------------- timing
    def _time_unit(self, m: _Model, worker: str, started: float | None) -> None:
        """Learn from a unit of ``m`` that finished on ``worker``."""
        if self.now is not None and started is not None and self.now > started:
            self.times.learn(m.model_id, worker, self.now - started)

    def _time_overtaken(self, m: _Model, run: _Run) -> None:
        """Learn from ``run``, a unit of ``m`` that lost its race to a copy or was
        restarted: it takes at least as long as it ran, or as its progress projects."""
        if self.now is not None and run.started is not None:
            seconds = self.now - run.started
            if run.progress is not None and math.isfinite(run.progress[1]):  # (no rows done: no end)
                seconds = max(seconds, run.progress[1] - run.started)
            self.times.overtaken(m.model_id, run.worker, seconds)

    def _watched_run(self, worker: str) -> tuple[_Model, _Run, float] | None:
        """The model, run and expected duration of the unit ``worker`` runs, if it may
        become a straggler: a timed unit of a model with a median, not a copy or a
        discarded run, and without a copy racing it yet."""
        unit = self.workers.get(worker)
        if unit is None or worker in self.orphan_workers or worker in self.loser_workers:
            return None
        m = self.models[unit[0]]
        run = m.running
        if run is None or (run.partition, run.worker) != (unit[1], worker) or run.copy_worker is not None \
                or run.started is None:
            return None
        expected = self.times.expected(m.model_id, worker)
        return None if expected is None else (m, run, expected)

    def _straggler_due(self, worker: str) -> float | None:
        """When the unit ``worker`` runs becomes a straggler: the clock time past which
        a copy may start (sooner when its progress projects it too slow). None: it
        may not become one (see ``_watched_run``)."""
        watched = self._watched_run(worker)
        if watched is None:
            return None
        _, run, expected = watched
        late = _late_after(expected)
        due = run.started + late
        if run.progress is not None and run.progress[1] - run.started > late:
            due = min(due, run.progress[0])
        return due

    def _progress_due(self, worker: str) -> float | None:
        """When to ask next how far the unit ``worker`` runs has come; None: not before
        it becomes a straggler anyway (or it may not become one)."""
        watched = self._watched_run(worker)
        if watched is None:
            return None
        _, run, expected = watched
        due = (run.started if run.asked is None else run.asked) + \
            max(PROGRESS_EVERY * expected, PROGRESS_INTERVAL)
        return due if due < run.started + _late_after(expected) else None

    def _recheck_due(self, worker: str) -> float | None:
        """When to look again at a straggler on ``worker`` that was left to run: the end
        its progress projects (past it, the unit has stalled since), or else the first
        time a holder's expected run fits in the time it has run. None: it is not a
        straggler (yet), or no holder will ever be quicker."""
        due = self._straggler_due(worker)
        if due is None or due > self.now:
            return None
        m, run, _ = self._watched_run(worker)
        if run.progress is not None and run.progress[1] > self.now:
            # (No rows done projects no end: an idle holder takes a copy when one frees up.)
            return run.progress[1] if math.isfinite(run.progress[1]) else None
        fits = [run.started + expected for h in self.placement.holders[run.partition] if h != worker
                for expected in (self.times.expected(m.model_id, h),) if expected is not None]
        later = [t for t in fits if t > self.now]
        return min(later) if later else None

    def _ask_progress(self) -> list[Instruction]:
        """An :class:`AskProgress` for the units whose progress is due, if any."""
        runs = []
        for w in sorted(self.workers):
            due = self._progress_due(w)
            if due is not None and due <= self.now and self._straggler_due(w) > self.now:
                m, run, _ = self._watched_run(w)
                run.asked = self.now
                runs.append((m.model_id, run.partition, w))
        return [AskProgress(tuple(runs))] if runs else []

    def _speculate(self, idle: set[str]) -> list[Instruction]:
        """Act on the straggling units, the most overdue first: a copy on an idle holder
        expected to run the unit in less time than the straggler still needs (as its
        progress projects; without progress, the time it has already run, so a slower
        worker qualifies as a stall goes on); with none, a restart, once per unit and
        only if a rerun is expected to be quicker (a unit that is slow on every run,
        such as a heavier partition, runs on)."""
        overdue = []
        for w in sorted(self.workers):
            due = self._straggler_due(w)
            if due is not None and self.now >= due:
                m = self.models[self.workers[w][0]]
                started = m.running.started
                overdue.append((-(self.now - started) / max(due - started, 1e-12), m.ordinal, m))
        out: list[Instruction] = []
        for _, _, m in sorted(overdue, key=lambda t: t[:2]):
            run = m.running
            p = run.partition
            # The time the straggler still needs: projected from its progress (while that
            # end is still ahead: a unit past it stalled since), or else taken to be at
            # least the time it has already run.
            projected = run.progress is not None and run.progress[1] > self.now
            left = run.progress[1] - self.now if projected else self.now - run.started
            expected = {w: self.times.expected(m.model_id, w) for w in self.placement.holders[p]}
            # (Compared as clock times, as _recheck_due names them.)
            candidates = {w for w in self.placement.holders[p] & idle
                          if (expected[w] < left if projected else run.started + expected[w] <= self.now)}
            step = len(m.visited)
            if candidates:
                w = self._pick_holder(candidates, m)
                idle.discard(w)
                self.workers[w] = (m.model_id, p)
                run.copy_worker, run.copy_started = w, self.now
                self.copies_started += 1
                out.append(Train(m.model_id, p, w, m.epochs_done, step, step == self.num_partitions - 1,
                                 copy=True))
            elif m.restarted != (m.epochs_done, step) and \
                    (not projected or left > min(expected.values())):  # a rerun is quicker
                straggler = run.worker
                self._time_overtaken(m, run)
                self.loser_workers.add(straggler)  # busy until its discarded run ends
                m.running = None
                m.restarted = (m.epochs_done, step)
                self.restarts += 1
                out.append(Discard(m.model_id, p, straggler, restart=True))
        return out

    def _pick_holder(self, candidates: set[str], m: _Model) -> str:
        """Of the idle holders, one not known to be slow, then the one holding the
        model's state (no hop), then the fastest, then by name."""
        if len(candidates) == 1:
            return next(iter(candidates))
        paces = {w: self.pace(w) for w in candidates}
        fastest = min(paces.values())
        return min(candidates, key=lambda w: (paces[w] > SLOW_PACE * fastest, w != m.state_worker,
                                              paces[w], w))

    def _sooner_elsewhere(self, m: _Model, p: int, w: str) -> bool:
        """``w`` is measured slow, and a busy holder of ``p`` is expected to free up
        and run ``m``'s unit to its end in under HAND_OFF of the time ``w`` would
        take: leave the unit to it (a later event or Tick looks again)."""
        holders = self.placement.holders[p]
        if self.now is None or self.pace(w) <= SLOW_PACE * min(map(self.pace, holders)):
            return False
        here = self.times.expected(m.model_id, w)
        if here is None:
            return False
        for h in holders:
            unit = self.workers.get(h)
            if unit is None or h in self.reserved or h in self.orphan_workers or h in self.loser_workers:
                continue  # idle, or what it runs ends at an unknown time
            run = self.models[unit[0]].running
            if run is None or h not in run.workers():
                continue
            started = run.started if h == run.worker else run.copy_started
            ahead, there = self.times.expected(unit[0], h), self.times.expected(m.model_id, h)
            if started is None or ahead is None or there is None:
                continue
            # Overdue by t: assume t more. A hung unit thus stops holding the unit back
            # once it is overdue by HAND_OFF * here - there.
            rest = max(started + ahead - self.now, self.now - started - ahead)
            if rest + there < HAND_OFF * here:
                return True
        return False

    # ----------------------------------------------------------- assignment
    def _reindex(self, event: Event) -> None:
        """Bring the indexes up to date with the models ``event`` may have changed:
        the one it names, the ones it adds, or all of them (a lost worker)."""
        if isinstance(event, ModelsAdded):
            ids = [new.model_id for new in event.models]
        elif isinstance(event, (WorkerLost, PartitionLost)):
            ids = list(self.models)
        else:
            model_id = getattr(event, "model_id", None)
            ids = [] if model_id is None else [model_id]
        for model_id in ids:
            m = self.models.get(model_id)
            if m is not None:
                self._reindex_model(m)

    def _reindex_model(self, m: _Model) -> None:
        old = self._ready_entries.pop(m.model_id, None)
        if old is not None:
            del self._ready_queue[bisect_left(self._ready_queue, old)]
        if m.status is ModelStatus.TRAINING:
            entry = (-self.remaining_units(m.model_id), m.ordinal, m.model_id)
            self._ready_entries[m.model_id] = entry
            insort(self._ready_queue, entry)
        if m.status in (ModelStatus.TRAINING, ModelStatus.EVALUATING):
            self._live.add(m.model_id)
        else:
            self._live.discard(m.model_id)
        if m.eval_pending:
            self._eval_pending.add(m.model_id)
        else:
            self._eval_pending.discard(m.model_id)

    def _issue_evaluations(self) -> list[Instruction]:
        if not self._eval_pending or not all(self.placement.holders):
            return []  # nothing to evaluate, or a validation shard has no worker yet
        out: list[Instruction] = []
        for model_id in sorted(self._eval_pending, key=lambda i: self.models[i].ordinal):
            m = self.models[model_id]
            m.eval_pending = False
            m.eval_workers = self._evaluation_workers(m)
            out.append(Evaluate(m.model_id, m.epochs_done, m.eval_workers))
        self._eval_pending.clear()
        return out

    def _evaluation_workers(self, m: _Model) -> tuple[str, ...]:
        """A holder per validation shard, among those not known to be slow: the one
        holding the model's state (no hop), else an idle one, else in turn by the
        models' ordinals, so that evaluations spread over the replicas."""
        chosen = []
        for p in range(self.num_partitions):
            holders = sorted(self.placement.holders[p])
            paces = [self.pace(w) for w in holders]
            fast = [w for w, pace in zip(holders, paces) if pace <= SLOW_PACE * min(paces)]
            idle = [w for w in fast if self.workers.get(w) is None]
            if m.state_worker in fast:
                chosen.append(m.state_worker)
            else:
                pool = idle or fast
                chosen.append(pool[(m.ordinal + p) % len(pool)])
        return tuple(chosen)

    def _next_partitions(self, m: _Model, idle_partitions: list[int]) -> Iterable[int]:
        """The partitions ``m`` may train on next, in the order to try them.

        With dynamic order these are its unvisited partitions; only those on an
        idle holder matter, so they come from ``idle_partitions`` (ascending),
        lazily: the caller takes the first that still has an idle holder.
        """
        if self.order == "fixed":
            return [self.model_order(m, m.epochs_done)[len(m.visited)]]
        # An epoch replayed after a rollback follows the order it was reported with,
        # so that Report.order keeps describing the model's state.
        replay = m.reported_orders.get(m.epochs_done + 1)
        if replay is not None:
            return [replay[len(m.visited)]]
        seen = set(m.visited) if len(idle_partitions) > 8 else m.visited  # a set pays off
        return (p for p in idle_partitions if p not in seen)

    def _assign(self) -> list[Instruction]:
        """Greedy: give idle holders to ready models, most remaining work first; then,
        with ``speculate``, act on stragglers (copies on the holders still idle); then,
        with ``prefetch``, send each busy worker its next unit."""
        # A rolled-back model whose orphaned unit still runs waits for it to end, so
        # that a model never runs two units at once (a speculative copy aside).
        orphaned = {self.workers[w][0] for w in self.orphan_workers} | \
            {self.reserved[w][0] for w in self.orphan_reserved}
        idle = {w for w, unit in self.workers.items() if unit is None}
        out = self._fill(idle, orphaned, reserve=False) if idle else []
        if self.speculate and self.now is not None:
            out.extend(self._speculate(idle))
            out.extend(self._ask_progress())
        if self.prefetch:
            open_slots = {w for w, unit in self.workers.items() if unit is not None and w not in self.reserved}
            if open_slots:
                out.extend(self._fill(open_slots, orphaned, reserve=True))
        return out

    def _fill(self, slots: set[str], orphaned: set[int], reserve: bool) -> list[Instruction]:
        """Give the ``slots`` (workers) to ready models whose next partition they hold,
        most remaining work first. ``reserve``: the workers are busy, and the unit
        runs after the one they run (it starts without waiting for the driver)."""
        holders = self.placement.holders
        slot_partitions = ([p for p in range(self.num_partitions) if not holders[p].isdisjoint(slots)]
                           if self.order == "dynamic" else [])
        out: list[Instruction] = []
        for _, _, model_id in self._ready_queue:  # TRAINING models, most remaining work first
            m = self.models[model_id]
            if m.running is not None or model_id in orphaned:
                continue
            for p in self._next_partitions(m, slot_partitions):
                candidates = holders[p] & slots
                if reserve:  # not behind a run of its own (a restarted straggler's, say)
                    candidates = {w for w in candidates if self.workers[w][0] != model_id}
                if candidates:
                    w = self._pick_holder(candidates, m)
                    if not reserve and self._sooner_elsewhere(m, p, w):
                        continue
                    slots.discard(w)
                    if reserve:
                        self.reserved[w] = (m.model_id, p)
                        m.running = _Run(p, w)
                    else:
                        self.workers[w] = (m.model_id, p)
                        m.running = _Run(p, w, self.now)
                    step = len(m.visited)
                    out.append(Train(m.model_id, p, w, m.epochs_done, step,
                                     step == self.num_partitions - 1))
                    break
            if not slots:
                break
        return out

    # ----------------------------------------------------------- invariants
    def validate(self) -> None:
        """Check the invariants; raise ``AssertionError`` naming the broken one."""
        P = self.num_partitions
        self._validate_indexes()
        self.times.validate()
        self.placement.validate(self.workers, complete=self._started and self.aborted is None)
        for p in range(P):
            if len(self.place_failures.get(p, ())) > self.max_place_retries and self.aborted is None:
                raise AssertionError(f"partition {p} failed {self.place_failures[p]} without an Abort")
        if self.orphan_workers & self.loser_workers:
            both = sorted(self.orphan_workers & self.loser_workers)
            raise AssertionError(f"workers {both} run both an orphaned unit and a losing run")
        for w in self.orphan_workers | self.loser_workers:
            if self.workers.get(w) is None:
                raise AssertionError(f"worker {w} runs a discarded unit, but runs nothing")
        runs: dict[int, set[str]] = {}  # model -> the workers running its unit for it
        for w, unit in self.workers.items():
            if unit is None:
                continue
            mid, p = unit
            m = self.models.get(mid)
            if m is None:
                raise AssertionError(f"worker {w} runs a unit of unknown model {mid}")
            if w in self.orphan_workers or w in self.loser_workers:
                continue
            runs.setdefault(mid, set()).add(w)
            if m.running is None or m.running.partition != p or w not in m.running.workers():
                raise AssertionError(f"worker {w} runs ({mid}, {p}) but the model says {m.running}")
        if self.reserved and not self.prefetch:
            raise AssertionError(f"units {self.reserved} are reserved without prefetch")
        if not self.orphan_reserved <= set(self.reserved):
            raise AssertionError(f"workers {sorted(self.orphan_reserved)} have discarded reserved units, "
                                 f"but reserve {self.reserved}")
        for w, (mid, p) in self.reserved.items():
            if self.workers.get(w) is None:
                raise AssertionError(f"worker {w} has ({mid}, {p}) reserved behind no unit")
            if w in self.orphan_reserved:
                continue
            runs.setdefault(mid, set()).add(w)
            m = self.models[mid]
            if m.running != _Run(p, w):
                raise AssertionError(f"worker {w} has ({mid}, {p}) reserved, but the model says {m.running}")
        orphaned = {self.workers[w][0] for w in self.orphan_workers} | \
            {self.reserved[w][0] for w in self.orphan_reserved}
        for m in self.models.values():
            # A model runs at most one unit at a time, a speculative copy of it aside.
            expected = set() if m.running is None else m.running.workers()
            if runs.get(m.model_id, set()) != expected:
                raise AssertionError(f"model {m.model_id} runs on {sorted(runs.get(m.model_id, ()))}, "
                                     f"but says {m.running}")
            if m.running is not None and m.running.copy_worker == m.running.worker:
                raise AssertionError(f"model {m.model_id} races a copy on its own worker: {m.running}")
            if m.running is not None and m.status is not ModelStatus.TRAINING:
                raise AssertionError(f"model {m.model_id} is {m.status.value} but runs {m.running}")
            if len(set(m.visited)) != len(m.visited) or len(m.visited) >= P:
                raise AssertionError(f"model {m.model_id} visited {m.visited} this epoch")
            if m.running is not None and m.model_id in orphaned:
                raise AssertionError(f"model {m.model_id} runs {m.running} and an orphaned unit")
            if m.running is not None and m.running.partition in m.visited:
                raise AssertionError(f"model {m.model_id} runs partition {m.running.partition} twice")
            if m.epochs_done > m.budget:
                raise AssertionError(f"model {m.model_id} trained {m.epochs_done} > {m.budget} epochs")
            if len(m.retries) > self.max_unit_retries and m.status is not ModelStatus.FAILED:
                raise AssertionError(f"model {m.model_id} is {m.status.value} after {m.retries}")
            if m.durable_epoch > m.epochs_done and m.status not in (ModelStatus.STOPPED, ModelStatus.FAILED):
                raise AssertionError(f"model {m.model_id} trained {m.epochs_done} epochs, fewer "
                                     f"than its durable {m.durable_epoch}")
            if self.order == "fixed" and m.status is ModelStatus.TRAINING:
                expected_order = self.model_order(m, m.epochs_done)[:len(m.visited)]
                if tuple(m.visited) != expected_order:
                    raise AssertionError(f"model {m.model_id} left its Latin order: {m.visited}")
            if m.status is not ModelStatus.TRAINING and m.visited and \
                    m.status not in (ModelStatus.STOPPED, ModelStatus.FAILED):
                raise AssertionError(f"model {m.model_id} is {m.status.value} mid-epoch")
            if m.epoch_start_lost and m.epoch_start_worker is not None:
                raise AssertionError(f"model {m.model_id}'s epoch start is lost but held by "
                                     f"{m.epoch_start_worker}")
            if m.status is ModelStatus.EVALUATING and not m.eval_pending and m.eval_workers:
                gone = sorted(set(m.eval_workers) - set(self.workers))
                if gone:
                    raise AssertionError(f"model {m.model_id} is evaluated on lost workers {gone}")

    def _validate_indexes(self) -> None:
        """The indexes agree with a scan of the models."""
        training = sorted((-self.remaining_units(i), m.ordinal, i) for i, m in self.models.items()
                          if m.status is ModelStatus.TRAINING)
        if self._ready_queue != training or sorted(self._ready_entries.values()) != training:
            raise AssertionError(f"the ready queue {self._ready_queue} differs from the models {training}")
        live = {i for i, m in self.models.items()
                if m.status in (ModelStatus.TRAINING, ModelStatus.EVALUATING)}
        if self._live != live:
            raise AssertionError(f"live models {sorted(self._live)} differ from the models {sorted(live)}")
        pending = {i for i, m in self.models.items() if m.eval_pending}
        if self._eval_pending != pending:
            raise AssertionError(f"models waiting to evaluate {sorted(self._eval_pending)} differ "
                                 f"from the models {sorted(pending)}")

    # ----- queries for the session
    def status(self, model_id: int) -> ModelStatus:
        """The status of model ``model_id``; ValueError naming the id if it is unknown.

        >>> s = Scheduler(num_partitions=1, workers=["a"])
        >>> s.status(7)
        Traceback (most recent call last):
        ValueError: model id 7 is unknown to the scheduler
        """
        m = self.models.get(model_id)
        if m is None:
            raise ValueError(f"model id {model_id!r} is unknown to the scheduler")
        return m.status

    def statuses(self) -> dict[int, ModelStatus]:
        """Every model's status, by id, in the order the models were added."""
        return {i: m.status for i, m in self.models.items()}

    def live_models(self) -> list[int]:
        """The sorted ids of the models that train or evaluate."""
        return sorted(self._live)
