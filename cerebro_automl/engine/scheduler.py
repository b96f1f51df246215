"""The MOP scheduler: a pure state machine (no Dask, no torch, no I/O).

It holds which worker holds each partition, which worker runs which unit and where
every model stands in its epoch. It changes only in :meth:`Scheduler.handle`, which
takes one event and returns the commands (for the executor) and notices (for the
session) that follow from it, in the style of dask.distributed's
``worker_state_machine``. Executors (local, Dask) and the simulator run this same
code. Where each decision lives:

=========================  ==================================================
``orders``                 the visit order of a model's epoch (Latin or dynamic)
``model``, ``lifecycle``   a model's record; its status transitions table
``runs``                   unit runs and their transitions table, the slots
``assignment``             which ready model trains where; evaluation holders
``gangs``                  gang units: their width, and their partitions and workers
``speculation``            stragglers: timing, progress asks, copies, restarts
``faults``                 retries, failures, rollbacks, failed loads, Abort
``placement``              which workers hold each partition's copies
``timing``                 unit times and worker paces learnt from the clock
``handlers``               what each event does
``validate``               the invariants, checked after every event in tests
=========================  ==================================================

A model's epoch ends with an evaluation; the model trains on only after it (so a
tuner can prune on the report before any more compute is spent).

Replicas (``replicas=r``): each partition is held by r workers, and a unit may run
on any idle holder of its partition. Which worker runs a unit never changes what it
computes, so with fixed (or cyclic) order the weights are those of r = 1. A lost worker's
partitions are still served by their other holders while a new copy loads
elsewhere; a worker that joins receives copies and takes units once one has loaded.

Example:
    >>> s = Scheduler(num_partitions=2, workers=["a", "b"], seed=0)
    >>> [type(i).__name__ for i in s.start()]
    ['Place', 'Place']
"""

from __future__ import annotations

from ..protocol import Event, Instruction, ModelsAdded, ModelStatus, PartitionLost, WorkerLost
from .assignment import assign, issue_evaluations, state_home
from .faults import replicate
from .gangs import widths_wanted
from .handlers import HANDLERS
from .model import ModelRecord
from .placement import Placement
from .runs import UnitRun
from .speculation import progress_due, recheck_due, straggler_due
from .state import EngineState, Settings
from .timing import UnitTimes
from .validate import validate

__all__ = ["Scheduler"]


class Scheduler:
    """MOP decisions for one session. See the module docstring.

    Args:
        num_partitions: P, the number of data partitions.
        workers: the workers at start; with one replica, partition i goes to
            ``sorted(workers)[i % W]``.
        seed: the session seed (it draws the Latin-order permutations).
        order: ``"fixed"``, ``"cyclic"`` or ``"dynamic"`` (see ``orders``).
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
            and ``Tick`` events).
        prefetch: send each busy worker its next unit too (see ``assignment``).
        has_validation: False when the data has no validation rows: an ``Evaluate``
            then names one worker, the one holding the model's state, where the
            epoch's training figures are read; None: unknown before the data loads
            (every shard is evaluated).
        unit_reports: evaluate and report a model after every unit, not only after
            its epoch's last: it waits, evaluating, before its next unit, so that its
            tuner may stop it inside an epoch.
        gang: train survivors in gang units (see ``gangs``): each epoch of a model
            waits for its width, a ``GangWidth`` event, before it starts.
    """

    def __init__(
        self,
        num_partitions: int,
        workers: list[str] | tuple[str, ...] = (),
        *,
        seed: int = 0,
        order: str = "fixed",
        checkpoint: bool = False,
        max_unit_retries: int = 3,
        max_place_retries: int = 3,
        replicas: int = 1,
        speculate: bool = False,
        prefetch: bool = False,
        has_validation: bool | None = None,
        unit_reports: bool = False,
        gang: bool = False,
    ) -> None:
        settings = Settings(
            num_partitions,
            seed,
            order,
            checkpoint,
            max_unit_retries,
            max_place_retries,
            replicas,
            speculate,
            prefetch,
            has_validation,
            unit_reports,
            gang,
        )
        settings.check()
        self._state = EngineState(settings, list(workers))

    # ------------------------------------------------------------ changes
    def start(self) -> list[Instruction]:
        """Place every partition's replicas on the initial workers (see placement)."""
        state = self._state
        if state.started:
            raise RuntimeError("Scheduler.start() was already called")
        state.started = True
        for w in state.initial_workers:
            state.runs.add_worker(w)
        out: list[Instruction] = []
        replicate(state, out)
        return out

    def handle(self, event: Event) -> list[Instruction]:
        """Apply one event; return the commands and notices that follow from it, in
        the order they must be acted on."""
        state = self._state
        handler = HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"event {event!r} is not a scheduler event")
        if state.aborted is not None:
            raise RuntimeError(f"the scheduler stopped after an Abort: {state.aborted}")
        try:
            out = handler(state, event)
        finally:
            self._reindex(event)
        out.extend(issue_evaluations(state))
        out.extend(assign(state))
        return out

    def _reindex(self, event: Event) -> None:
        """Refresh the indexes for the models ``event`` may have changed: the one it
        names, the ones it adds, or all of them (a lost worker or partition)."""
        state = self._state
        if isinstance(event, ModelsAdded):
            ids = [new.model_id for new in event.models]
        elif isinstance(event, (WorkerLost, PartitionLost)):
            ids = list(state.models)
        else:
            model_id = getattr(event, "model_id", None)
            ids = [] if model_id is None else [model_id]
        for model_id in ids:
            m = state.models.get(model_id)
            if m is not None:
                state.index.refresh(m, state.remaining_units(m))

    def validate(self) -> None:
        """Check the invariants; raise ``AssertionError`` naming the broken one."""
        validate(self._state)

    # ------------------------------------------------------------ settings
    @property
    def settings(self) -> Settings:
        return self._state.settings

    @property
    def num_partitions(self) -> int:
        return self._state.num_partitions

    @property
    def replicas(self) -> int:
        return self._state.settings.replicas

    @property
    def speculate(self) -> bool:
        return self._state.settings.speculate

    @property
    def prefetch(self) -> bool:
        return self._state.settings.prefetch

    # ------------------------------------------------------------- queries
    @property
    def models(self) -> dict[int, ModelRecord]:
        """The models' records, by id, in the order they were added (read them only)."""
        return self._state.models

    @property
    def placement(self) -> Placement:
        return self._state.placement

    @property
    def times(self) -> UnitTimes:
        return self._state.times

    @property
    def now(self) -> float | None:
        return self._state.now

    @property
    def units_trained(self) -> int:
        """Units the models' current states hold (the progress bar's count)."""
        return self._state.units_trained

    @property
    def copies_started(self) -> int:
        return self._state.copies_started

    @property
    def restarts(self) -> int:
        return self._state.restarts

    @property
    def place_failures(self) -> dict[int, list[str]]:
        return self._state.place_failures

    def workers(self) -> list[str]:
        """The live workers, in the order they were seen."""
        return list(self._state.workers)

    def run_on(self, worker: str) -> UnitRun | None:
        """The run ``worker`` executes, if any."""
        return self._state.runs.ahead.get(worker)

    def queued_on(self, worker: str) -> UnitRun | None:
        """The run queued behind the one ``worker`` executes (prefetch), if any."""
        return self._state.runs.behind.get(worker)

    def unit_of(self, model_id: int) -> UnitRun | None:
        """The model's unit run in flight (running or queued), if any."""
        return self._state.runs.unit_of(model_id)

    def state_home(self, model_id: int) -> str | None:
        """The worker an executor sends the given state of model ``model_id`` (resumed,
        warm-started, or forked from a state the driver holds) to, before the engine
        learns of the model; None: no worker is alive."""
        return state_home(self._state, model_id)

    def status(self, model_id: int) -> ModelStatus:
        """The model's status (``ValueError`` naming an unknown id)."""
        return self._state.model(model_id).status

    def statuses(self) -> dict[int, ModelStatus]:
        """Every model's status, in the order they were added."""
        return {i: m.status for i, m in self._state.models.items()}

    def live_models(self) -> list[int]:
        """The ids of the models training or evaluating, sorted."""
        return sorted(self._state.index.live)

    def gang_width(self, model_id: int, epoch: int) -> int | None:
        """The width decided for the model's ``epoch`` (1-based), which its units train at
        where ``width`` distinct workers hold its next partitions (else one partition at a
        time); None without gang units (or for an epoch never given one, a resume's
        replayed epochs)."""
        given = self._state.model(model_id).widths.get(epoch)
        return None if given is None else given[0]

    def widths_wanted(self) -> list[tuple[int, int]]:
        """``(model, epoch)`` of each training model whose next epoch waits for its
        gang width (none without gang units)."""
        state = self._state
        if not state.settings.gang:
            return []
        out: list[tuple[int, int]] = []
        for model_id in sorted(state.index.live):
            m = state.models[model_id]
            if m.status is ModelStatus.TRAINING:
                out.extend((model_id, epoch) for epoch in widths_wanted(m))
        return out

    def remaining_units(self, model_id: int) -> int:
        return self._state.remaining_units(self._state.model(model_id))

    def active(self) -> bool:
        """True while any model trains or evaluates, or any unit is in flight."""
        return bool(self._state.index.live) or self._state.runs.busy()

    def waiting_for(self) -> str | None:
        """Why models wait although nothing may be running, or None: no worker is
        alive, or partitions have no live worker to load them."""
        if not self.active():
            return None
        if not self._state.workers:
            return "no worker is alive"
        unplaced = self._state.placement.unserved()
        if unplaced:
            return f"partitions {unplaced} have no live worker"
        return None

    def holders(self, partition: int) -> list[str]:
        """The live workers holding ``partition``, sorted."""
        return sorted(self._state.placement.holders[partition])

    def pace(self, worker: str) -> float:
        """How many times its models' median unit time ``worker`` takes (1.0 until it
        has ``MIN_TIMINGS`` timed units)."""
        return self._state.pace(worker)

    def next_wakeup(self) -> float | None:
        """The clock time at which a running unit becomes a straggler (a Tick then may
        start its copy), its progress is due to be asked for, or a straggler left to
        run is due to be looked at again; None: none of these. An executor that waits
        for completions waits no longer than this."""
        state = self._state
        if not state.settings.speculate or state.now is None:
            return None
        times = [
            due
            for w in state.workers
            for due in (straggler_due(state, w), progress_due(state, w), recheck_due(state, w))
            if due is not None and due > state.now
        ]
        return min(times) if times else None
