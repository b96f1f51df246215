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
from collections.abc import Iterable
from typing import NamedTuple

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
    "Watched",
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
class Watched(NamedTuple):
    """A running unit that may become a straggler, with the clock it is judged by."""

    model: ModelRecord
    run: UnitRun
    started: float  # the clock when the run began executing
    now: float  # the engine's clock
    expected: float  # how long the model's units take on the run's worker


def watched_run(state: EngineState, worker: str) -> Watched | None:
    """The unit ``worker`` runs, if it may become a straggler: the running unit of a
    model with a median on that worker, not a copy or a discarded run, and without a
    copy racing it yet, on an engine with a clock."""
    run = state.runs.ahead.get(worker)
    now = state.now
    if (
        now is None
        or run is None
        or run.state is not RunState.RUNNING
        or run.started is None
        or run.ranks  # a gang unit: no single holder could run a copy of it
        or state.runs.copy_of(run.model_id) is not None
    ):
        return None
    expected = state.times.expected(run.model_id, worker)
    return None if expected is None else Watched(state.models[run.model_id], run, run.started, now, expected)


def straggler_due(state: EngineState, worker: str) -> float | None:
    """When the unit ``worker`` runs becomes a straggler: the clock time past which a
    copy may start (sooner when its progress projects it too slow). None: it may not
    become one (see :func:`watched_run`)."""
    watched = watched_run(state, worker)
    return None if watched is None else _straggler_due(watched)


def _straggler_due(watched: Watched) -> float:
    run, started = watched.run, watched.started
    late = late_after(watched.expected)
    due = started + late
    if run.progress is not None and run.progress[1] - started > late:
        due = min(due, run.progress[0])
    return due


def progress_due(state: EngineState, worker: str) -> float | None:
    """When to ask next how far the unit ``worker`` runs has come; None: not before
    it becomes a straggler anyway (or it may not become one)."""
    watched = watched_run(state, worker)
    return None if watched is None else _progress_due(watched)


def _progress_due(watched: Watched) -> float | None:
    run, started, expected = watched.run, watched.started, watched.expected
    due = (started if run.asked is None else run.asked) + max(PROGRESS_EVERY * expected, PROGRESS_INTERVAL)
    return due if due < started + late_after(expected) else None


def recheck_due(state: EngineState, worker: str) -> float | None:
    """When to look again at a straggler on ``worker`` that was left to run: the end
    its progress projects (past it, the unit has stalled since), or else the first
    time a holder's expected run fits in the time it has run. None: it is not a
    straggler (yet), or no holder will ever be quicker."""
    watched = watched_run(state, worker)
    if watched is None or _straggler_due(watched) > watched.now:
        return None
    m, run, now = watched.model, watched.run, watched.now
    if run.progress is not None and run.progress[1] > now:
        # (No rows done projects no end: an idle holder takes a copy when one frees up.)
        return run.progress[1] if math.isfinite(run.progress[1]) else None
    fits = [
        watched.started + expected
        for expected in _expected_on(state, m, state.placement.holders[run.partition] - {worker}).values()
    ]
    later = [t for t in fits if t > now]
    return min(later) if later else None


def _expected_on(state: EngineState, m: ModelRecord, workers: Iterable[str]) -> dict[str, float]:
    """How long ``m``'s unit is expected to take on each of ``workers`` that has an
    expectation (each has, once ``m`` has a median, as a watched run's model has)."""
    out = {}
    for w in workers:
        expected = state.times.expected(m.model_id, w)
        if expected is not None:
            out[w] = expected
    return out


# ------------------------------------------------------------------ acting
def ask_progress(state: EngineState) -> list[Instruction]:
    """An :class:`AskProgress` for the units whose progress is due, if any."""
    runs = []
    for w in sorted(state.workers):
        watched = watched_run(state, w)
        if watched is None:
            continue
        due, now = _progress_due(watched), watched.now
        if due is not None and due <= now and _straggler_due(watched) > now:
            watched.run.asked = now
            runs.append((watched.model.model_id, watched.run.partition, w))
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
        watched = watched_run(state, w)
        if watched is None:
            continue
        due, now, started = _straggler_due(watched), watched.now, watched.started
        if now >= due:
            overdue.append((-(now - started) / max(due - started, 1e-12), watched.model.ordinal, watched))
    out: list[Instruction] = []
    for _, _, watched in sorted(overdue, key=lambda t: t[:2]):
        out.extend(_act_on_straggler(state, watched, idle))
    return out


def _act_on_straggler(state: EngineState, watched: Watched, idle: set[str]) -> list[Instruction]:
    m, run, now = watched.model, watched.run, watched.now
    p = run.partition
    # The time the straggler still needs: projected from its progress (while that end
    # is still ahead: a unit past it stalled since), or else taken to be at least the
    # time it has already run.
    end = run.progress[1] if run.progress is not None and run.progress[1] > now else None
    projected = end is not None
    left = end - now if end is not None else now - watched.started
    expected = _expected_on(state, m, state.placement.holders[p])
    # (Compared as clock times, as recheck_due names them.)
    candidates = {
        w
        for w in state.placement.holders[p] & idle
        if (expected[w] < left if projected else watched.started + expected[w] <= now)
    }
    step = len(m.visited)
    if candidates:
        w = pick_holder(state, candidates, m)
        idle.discard(w)
        state.runs.new(m.model_id, p, w, RunState.COPY, now)
        state.copies_started += 1
        return [
            Train(m.model_id, p, w, m.epochs_done, step, step == state.num_partitions - 1, copy=True, budget=m.budget)
        ]
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
