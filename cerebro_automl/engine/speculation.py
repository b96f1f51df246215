"""Stragglers: what runs teach the clock, when a running unit is late, when to ask
how far it has come, and what to do about it (a speculative copy, or a restart).

With ``speculate=True`` the engine acts on a unit running well past what its
model's units take on that worker (``SPECULATE_AFTER`` times, and at least
``SPECULATE_MIN_LATE`` seconds past it): it starts a copy on an idle holder, and
the first run to finish is the model's (a ``Discard`` names the other). It need not
wait that long to know: it asks the executor how far a unit has come
(``AskProgress``) every ``PROGRESS_EVERY`` of the unit's expected time, and a unit
whose ``UnitProgress`` projects it past that point is a straggler from then on (a
unit of a second or more running 4x slow shows it a quarter of the way in). With no
holder idle to race it, the unit is restarted once: its run is discarded and the
unit goes to the first holder that frees up, its own worker included. Waiting for a
holder to race it would cost that holder a whole unit on top of the straggler's
time; a restart costs only the time already run.
"""

from __future__ import annotations

import math

from ..protocol import AskProgress, Discard, Instruction, Train
from .model import ModelRecord
from .runs import RunState, UnitRun
from .state import EngineState

__all__ = [
    "SPECULATE_AFTER",
    "SPECULATE_MIN_LATE",
    "SLOW_PACE",
    "PROGRESS_EVERY",
    "PROGRESS_INTERVAL",
    "late_after",
    "time_unit",
    "time_overtaken",
    "watched_run",
    "straggler_due",
    "progress_due",
    "recheck_due",
    "ask_progress",
    "speculate",
    "pick_holder",
]

# A unit is a straggler once it has run SPECULATE_AFTER times what its model's
# units take on its worker (the model's running median, times the worker's pace)...
SPECULATE_AFTER = 1.5
# ... and at least this many seconds past it: units of a few tens of milliseconds
# run 1.5x late from timing noise alone (a busy host, the driver's poll), and a
# restart then throws away work to gain at most that much (Spark's
# spark.speculation.minTaskRuntime guards the same).
SPECULATE_MIN_LATE = 0.5
# An idle holder more than SLOW_PACE times slower than the fastest idle one is
# passed over while a faster one is idle.
SLOW_PACE = 1.25
# The progress of a unit that may straggle is asked for every PROGRESS_EVERY of its
# expected time, but no more often than every PROGRESS_INTERVAL seconds (an answer
# costs the executor a round trip to the workers), and judged once the unit has
# trained that long on its worker.
PROGRESS_EVERY = 0.25
PROGRESS_INTERVAL = 0.2


def late_after(expected: float) -> float:
    """How long a unit expected to take ``expected`` seconds runs before it is a straggler."""
    return max(SPECULATE_AFTER * expected, expected + SPECULATE_MIN_LATE)


# ------------------------------------------------------------------ timing
def time_unit(state: EngineState, m: ModelRecord, worker: str, started: float | None) -> None:
    """Learn from a unit of ``m`` that finished on ``worker``."""
    if state.now is not None and started is not None and state.now > started:
        state.times.learn(m.model_id, worker, state.now - started)


def time_overtaken(state: EngineState, m: ModelRecord, run: UnitRun) -> None:
    """Learn from ``run``, a unit of ``m`` that lost its race to a copy or was
    restarted: it takes at least as long as it ran, or as its progress projects."""
    if state.now is not None and run.started is not None:
        seconds = state.now - run.started
        if run.progress is not None and math.isfinite(run.progress[1]):  # (no rows done: no end)
            seconds = max(seconds, run.progress[1] - run.started)
        state.times.overtaken(m.model_id, run.worker, seconds)


# --------------------------------------------------------------- lateness
def watched_run(state: EngineState, worker: str) -> tuple[ModelRecord, UnitRun, float] | None:
    """The model, run and expected duration of the unit ``worker`` runs, if it may
    become a straggler: the running unit of a model with a median on that worker, not
    a copy or a discarded run, and without a copy racing it yet."""
    run = state.runs.ahead.get(worker)
    if (
        run is None
        or run.state is not RunState.RUNNING
        or run.started is None
        or state.runs.copy_of(run.model_id) is not None
    ):
        return None
    expected = state.times.expected(run.model_id, worker)
    return None if expected is None else (state.models[run.model_id], run, expected)


def straggler_due(state: EngineState, worker: str) -> float | None:
    """When the unit ``worker`` runs becomes a straggler: the clock time past which a
    copy may start (sooner when its progress projects it too slow). None: it may not
    become one (see :func:`watched_run`)."""
    watched = watched_run(state, worker)
    if watched is None:
        return None
    _, run, expected = watched
    late = late_after(expected)
    due = run.started + late
    if run.progress is not None and run.progress[1] - run.started > late:
        due = min(due, run.progress[0])
    return due


def progress_due(state: EngineState, worker: str) -> float | None:
    """When to ask next how far the unit ``worker`` runs has come; None: not before
    it becomes a straggler anyway (or it may not become one)."""
    watched = watched_run(state, worker)
    if watched is None:
        return None
    _, run, expected = watched
    due = (run.started if run.asked is None else run.asked) + max(PROGRESS_EVERY * expected, PROGRESS_INTERVAL)
    return due if due < run.started + late_after(expected) else None


def recheck_due(state: EngineState, worker: str) -> float | None:
    """When to look again at a straggler on ``worker`` that was left to run: the end
    its progress projects (past it, the unit has stalled since), or else the first
    time a holder's expected run fits in the time it has run. None: it is not a
    straggler (yet), or no holder will ever be quicker."""
    due = straggler_due(state, worker)
    if due is None or due > state.now:
        return None
    m, run, _ = watched_run(state, worker)
    if run.progress is not None and run.progress[1] > state.now:
        # (No rows done projects no end: an idle holder takes a copy when one frees up.)
        return run.progress[1] if math.isfinite(run.progress[1]) else None
    fits = [
        run.started + expected
        for h in state.placement.holders[run.partition]
        if h != worker
        for expected in (state.times.expected(m.model_id, h),)
        if expected is not None
    ]
    later = [t for t in fits if t > state.now]
    return min(later) if later else None


# ------------------------------------------------------------------ acting
def ask_progress(state: EngineState) -> list[Instruction]:
    """An :class:`AskProgress` for the units whose progress is due, if any."""
    runs = []
    for w in sorted(state.workers):
        due = progress_due(state, w)
        if due is not None and due <= state.now and straggler_due(state, w) > state.now:
            m, run, _ = watched_run(state, w)
            run.asked = state.now
            runs.append((m.model_id, run.partition, w))
    return [AskProgress(tuple(runs))] if runs else []


def speculate(state: EngineState, idle: set[str]) -> list[Instruction]:
    """Act on the straggling units, the most overdue first: a copy on an idle holder
    expected to run the unit in less time than the straggler still needs (as its
    progress projects; without progress, the time it has already run, so a slower
    worker qualifies as a stall goes on); with none, a restart, once per unit and
    only if a rerun is expected to be quicker (a unit that is slow on every run, such
    as a heavier partition, runs on)."""
    overdue = []
    for w in sorted(state.workers):
        due = straggler_due(state, w)
        if due is not None and state.now >= due:
            run = state.runs.ahead[w]
            overdue.append(
                (-(state.now - run.started) / max(due - run.started, 1e-12), state.models[run.model_id].ordinal, run)
            )
    out: list[Instruction] = []
    for _, _, run in sorted(overdue, key=lambda t: t[:2]):
        out.extend(_act_on_straggler(state, state.models[run.model_id], run, idle))
    return out


def _act_on_straggler(state: EngineState, m: ModelRecord, run: UnitRun, idle: set[str]) -> list[Instruction]:
    p, now = run.partition, state.now
    # The time the straggler still needs: projected from its progress (while that end
    # is still ahead: a unit past it stalled since), or else taken to be at least the
    # time it has already run.
    projected = run.progress is not None and run.progress[1] > now
    left = run.progress[1] - now if projected else now - run.started
    expected = {w: state.times.expected(m.model_id, w) for w in state.placement.holders[p]}
    # (Compared as clock times, as recheck_due names them.)
    candidates = {
        w
        for w in state.placement.holders[p] & idle
        if (expected[w] < left if projected else run.started + expected[w] <= now)
    }
    step = len(m.visited)
    if candidates:
        w = pick_holder(state, candidates, m)
        idle.discard(w)
        state.runs.new(m.model_id, p, w, RunState.COPY, now)
        state.copies_started += 1
        return [Train(m.model_id, p, w, m.epochs_done, step, step == state.num_partitions - 1, copy=True)]
    if m.restarted != (m.epochs_done, step) and (not projected or left > min(expected.values())):
        time_overtaken(state, m, run)
        state.runs.move(run, RunState.DISCARDED)  # its worker is busy until the run ends
        m.restarted = (m.epochs_done, step)
        state.restarts += 1
        return [Discard(m.model_id, p, run.worker, restart=True)]
    return []


def pick_holder(state: EngineState, candidates: set[str], m: ModelRecord) -> str:
    """Of the idle holders, one not known to be slow, then the one holding the
    model's state (no hop), then the fastest, then by name."""
    if len(candidates) == 1:
        return next(iter(candidates))
    paces = {w: state.pace(w) for w in candidates}
    fastest = min(paces.values())
    return min(candidates, key=lambda w: (paces[w] > SLOW_PACE * fastest, w != m.state_worker, paces[w], w))
