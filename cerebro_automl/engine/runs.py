"""Unit runs: each run of a model's unit on a worker is one :class:`UnitRun`
record, and its :class:`RunState` changes only through :data:`RUN_TRANSITIONS`,
whose entries do the transition's work on the registry (:class:`Runs`).

A worker has two slots: the run it executes (``ahead``) and, with prefetch, one
run sent behind it (``behind``) that starts when the one ahead ends, so that it
need not wait for the driver's round trip. A model has at most one unit run (its
*unit*: ``RUNNING``, or ``QUEUED`` behind another model's run) and, racing it, at
most one speculative ``COPY``. A run whose result no longer counts stays in its
slot until it ends, since its worker is busy until then: ``ORPHANED`` when its
model was stopped, failed or rolled back (the model waits for that run to end
before it trains again, so that it never runs two units at once), ``DISCARDED``
when it lost a race or was restarted (the model does not wait).

A gang unit (a model trained data-parallel over k partitions at once) is one run
per rank: rank 0's is the model's unit (it carries the gang's partitions and its
other ranks), and each other rank's is a ``RANK`` run that only keeps its worker
busy. The ranks end with rank 0's run, whatever ends it.

The states and the moves between them::

    (new) -> QUEUED | RUNNING | COPY
    QUEUED -> RUNNING                 the run ahead of it ended
    COPY -> RUNNING                   the run it raced ended without counting
    (new) -> RANK                     another rank of a gang unit
    QUEUED | RUNNING | COPY -> ORPHANED
    RUNNING | COPY -> DISCARDED       lost its race, or restarted
    any -> ENDED                      finished, or its worker died
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum

__all__ = ["RunState", "UnitRun", "Runs", "RUN_TRANSITIONS", "RunTransitionError"]


class RunState(str, Enum):
    QUEUED = "queued"  # the model's unit, sent behind the run its worker executes
    RUNNING = "running"  # the model's unit, executing
    COPY = "copy"  # a speculative copy racing the model's running unit
    ORPHANED = "orphaned"  # no longer counts; its model waits for its end
    DISCARDED = "discarded"  # no longer counts (a lost race, a restart); its model does not wait
    ENDED = "ended"  # finished, or its worker died: out of every slot
    RANK = "rank"  # a gang unit's rank other than 0: its worker is busy until rank 0's run ends


@dataclass(eq=False)
class UnitRun:
    """One run of ``model_id``'s unit on ``partition`` on ``worker``."""

    model_id: int
    partition: int
    worker: str
    state: RunState
    started: float | None = None  # clock when it began executing (None: queued, or no clock)
    asked: float | None = None  # clock of the last AskProgress for it
    # (clock of its latest UnitProgress, the clock at which that projects it to end)
    progress: tuple[float, float] | None = None
    ranks: tuple[UnitRun, ...] = ()  # a gang unit's rank 0: the runs of its other ranks

    @property
    def partitions(self) -> tuple[int, ...]:
        """The partitions it trains: its own, then its other ranks' (a gang unit)."""
        return (self.partition, *(r.partition for r in self.ranks))

    @property
    def key(self) -> tuple[int, int]:
        return self.model_id, self.partition

    @property
    def counts(self) -> bool:
        """Its result is the model's if it finishes first."""
        return self.state in (RunState.QUEUED, RunState.RUNNING, RunState.COPY)


class RunTransitionError(AssertionError):
    """A run state change that :data:`RUN_TRANSITIONS` does not list (a bug)."""


class Runs:
    """The registry of unit runs: the workers' slots and each model's unit and copy.
    Its keys are the live workers (``ahead[w]`` is None while ``w`` is idle)."""

    def __init__(self) -> None:
        self.ahead: dict[str, UnitRun | None] = {}
        self.behind: dict[str, UnitRun] = {}
        self._unit: dict[int, UnitRun] = {}  # model -> its RUNNING or QUEUED run
        self._copy: dict[int, UnitRun] = {}  # model -> the COPY racing its unit
        self._waited_for: dict[int, int] = {}  # model -> how many ORPHANED runs it waits for

    # ------------------------------------------------------------ queries
    def unit_of(self, model_id: int) -> UnitRun | None:
        return self._unit.get(model_id)

    def copy_of(self, model_id: int) -> UnitRun | None:
        return self._copy.get(model_id)

    def waits_for_orphan(self, model_id: int) -> bool:
        return model_id in self._waited_for

    def idle(self) -> set[str]:
        return {w for w, run in self.ahead.items() if run is None}

    def open_slots(self) -> set[str]:
        """Busy workers with nothing queued behind their run."""
        return {w for w, run in self.ahead.items() if run is not None and w not in self.behind}

    def busy(self) -> bool:
        return any(run is not None for run in self.ahead.values())

    def every_run(self) -> Iterator[UnitRun]:
        for slots in (self.ahead.values(), self.behind.values()):
            yield from (run for run in slots if run is not None)

    def match(self, worker: str, model_id: int, partition: int) -> UnitRun | None:
        """The run of ``(model_id, partition)`` in a slot of ``worker``; the one behind
        first (it may run before the one ahead, which may still wait for its input)."""
        for run in (self.behind.get(worker), self.ahead.get(worker)):
            if run is not None and run.key == (model_id, partition):
                return run
        return None

    # ------------------------------------------------------------ changes
    def add_worker(self, worker: str) -> None:
        self.ahead[worker] = None

    def new(self, model_id: int, partition: int, worker: str, state: RunState, now: float | None) -> UnitRun:
        run = UnitRun(model_id, partition, worker, RunState.ENDED)
        _transition(self, run, None, state, now)
        return run

    def move(self, run: UnitRun, state: RunState, now: float | None = None) -> None:
        _transition(self, run, run.state, state, now)

    def remove_worker(self, worker: str) -> list[UnitRun]:
        """Forget a dead worker; return its runs (still in their states, for the caller
        to end one by one)."""
        runs = [run for run in (self.ahead.pop(worker, None), self.behind.pop(worker, None)) if run is not None]
        return runs


# ------------------------------------------------------------- transitions
def _start(runs: Runs, run: UnitRun, now: float | None) -> None:
    runs.ahead[run.worker] = run
    run.started = now
    runs._unit[run.model_id] = run


def _queue(runs: Runs, run: UnitRun, now: float | None) -> None:
    runs.behind[run.worker] = run
    runs._unit[run.model_id] = run


def _copy(runs: Runs, run: UnitRun, now: float | None) -> None:
    runs.ahead[run.worker] = run
    run.started = now
    runs._copy[run.model_id] = run


def _begin(runs: Runs, run: UnitRun, now: float | None) -> None:
    run.started = now  # moved ahead when the run before it ended (see _end)


def _promote(runs: Runs, run: UnitRun, now: float | None) -> None:
    del runs._copy[run.model_id]
    runs._unit[run.model_id] = run


def _unlink(runs: Runs, run: UnitRun) -> None:
    """``run`` is no longer its model's unit or copy."""
    if runs._unit.get(run.model_id) is run:
        del runs._unit[run.model_id]
    elif runs._copy.get(run.model_id) is run:
        del runs._copy[run.model_id]


def _orphan(runs: Runs, run: UnitRun, now: float | None) -> None:
    _unlink(runs, run)
    runs._waited_for[run.model_id] = runs._waited_for.get(run.model_id, 0) + 1


def _discard(runs: Runs, run: UnitRun, now: float | None) -> None:
    _unlink(runs, run)


def _rank(runs: Runs, run: UnitRun, now: float | None) -> None:
    runs.ahead[run.worker] = run
    run.started = now


def _end(runs: Runs, run: UnitRun, now: float | None) -> None:
    """Out of its slot (a run behind moves up and begins) and out of its model's; a
    gang unit's other ranks end with it."""
    for rank in run.ranks:
        if rank.state is RunState.RANK:
            runs.move(rank, RunState.ENDED, now)
    if runs.behind.get(run.worker) is run:
        del runs.behind[run.worker]
    elif runs.ahead.get(run.worker) is run:
        nxt = runs.behind.pop(run.worker, None)
        runs.ahead[run.worker] = nxt
        if nxt is not None and nxt.state is RunState.QUEUED:
            runs.move(nxt, RunState.RUNNING, now)
    _unlink(runs, run)


def _end_orphan(runs: Runs, run: UnitRun, now: float | None) -> None:
    left = runs._waited_for[run.model_id] - 1
    if left:
        runs._waited_for[run.model_id] = left
    else:
        del runs._waited_for[run.model_id]
    _end(runs, run, now)


_Work = Callable[[Runs, UnitRun, "float | None"], None]
# One letter per state keeps the table below a table.
Q, R, C, O, D, E, K = (  # noqa: E741
    RunState.QUEUED,
    RunState.RUNNING,
    RunState.COPY,
    RunState.ORPHANED,
    RunState.DISCARDED,
    RunState.ENDED,
    RunState.RANK,
)

# (from, to) -> the work of that change; None is a run not yet sent.
RUN_TRANSITIONS: dict[tuple[RunState | None, RunState], _Work] = {
    (None, Q): _queue,
    (None, R): _start,
    (None, C): _copy,
    (None, K): _rank,
    (Q, R): _begin,
    (C, R): _promote,
    (Q, O): _orphan,
    (R, O): _orphan,
    (C, O): _orphan,
    (R, D): _discard,
    (C, D): _discard,
    (Q, E): _end,
    (R, E): _end,
    (C, E): _end,
    (D, E): _end,
    (O, E): _end_orphan,
    (K, E): _end,
}


def _transition(runs: Runs, run: UnitRun, start: RunState | None, finish: RunState, now: float | None) -> None:
    work = RUN_TRANSITIONS.get((start, finish))
    if work is None:
        raise RunTransitionError(
            f"the run of model {run.model_id} on partition {run.partition} on {run.worker} "
            f"cannot go from {'new' if start is None else start.value} to {finish.value}"
        )
    run.state = finish
    work(runs, run, now)
