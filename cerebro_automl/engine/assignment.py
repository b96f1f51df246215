"""Assignment: which ready model trains next on which idle holder of its next
partition, and which holders evaluate a model's epoch.

Greedy: idle holders go to ready models, most remaining work first. With
``prefetch``, a busy worker is also sent the unit it runs next (queued behind the
one it runs), chosen as for an idle worker, so that it starts when the one ahead
ends rather than after the executor's round trip through the driver. A model never
has a unit queued behind one of its own, and a model whose orphaned run still runs
waits for it to end (it never runs two units at once, a speculative copy aside).

Gang units (see ``gangs``) take all their workers at once: a gang whose workers
are not all idle holds the idle ones, and prefetch leaves its busy ones alone.

Hand-off: a unit whose only idle holder is measured slow waits for a busy fast
holder expected to free up and finish it in under ``HAND_OFF`` of the slow one's
time (leaving a worker idle costs its capacity, so the gain must be clear: in the
simulator 0.5 helps a 4-10x slow worker and changes nothing else; 1.0 cost a 2-4x
slow one).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..protocol import Evaluate, Instruction, Train, TrainGang
from .gangs import Gang, pick_gang, width_of
from .model import ModelRecord
from .orders import FIXED_ORDERS
from .runs import Runs, RunState
from .speculation import SLOW_PACE, ask_progress, pick_holder, speculate
from .state import EngineState

__all__ = ["HAND_OFF", "assign", "issue_evaluations", "evaluation_workers", "state_home"]

HAND_OFF = 0.5


def assign(state: EngineState) -> list[Instruction]:
    """Give idle holders to ready models; then, with ``speculate``, act on stragglers
    (copies on the holders still idle); then, with ``prefetch``, queue each busy
    worker's next unit."""
    idle = state.runs.idle()
    settings = state.settings
    state.held = set()
    out = _fill(state, idle, reserve=False) if idle or settings.gang else []
    if settings.speculate and state.now is not None:
        out.extend(speculate(state, idle))
        out.extend(ask_progress(state))
    if settings.prefetch:
        open_slots = state.runs.open_slots() - state.held
        if open_slots:
            out.extend(_fill(state, open_slots, reserve=True))
    return out


def _fill(state: EngineState, slots: set[str], reserve: bool) -> list[Instruction]:
    """Give the ``slots`` (workers) to ready models whose next partition they hold,
    most remaining work first. ``reserve``: the workers are busy, and the unit is
    queued behind the one they run."""
    holders = state.placement.holders
    runs = state.runs
    dynamic = state.order not in FIXED_ORDERS
    slot_partitions = [p for p in range(state.num_partitions) if not holders[p].isdisjoint(slots)] if dynamic else []
    out: list[Instruction] = []
    for _, _, model_id in state.index.ready:  # TRAINING models, most remaining work first
        if runs.unit_of(model_id) is not None or runs.waits_for_orphan(model_id):
            continue
        m = state.models[model_id]
        width = width_of(state, m)
        if width is None:
            continue  # its epoch waits for its width
        gang = pick_gang(state, m, width, slots) if width > 1 else None
        if gang is not None:
            if not reserve:  # a gang unit is never queued behind another run
                out.extend(_start_gang(state, m, gang, slots))
            continue
        for p in _next_partitions(state, m, slot_partitions):
            candidates = holders[p] & slots
            if reserve:  # not behind a run of its own (a restarted straggler's, say)
                candidates = {w for w in candidates if _runs_other_model(runs, w, model_id)}
            if not candidates:
                continue
            w = pick_holder(state, candidates, m)
            if not reserve and _sooner_elsewhere(state, m, p, w):
                continue
            slots.discard(w)
            runs.new(model_id, p, w, RunState.QUEUED if reserve else RunState.RUNNING, state.now)
            step = len(m.visited)
            out.append(Train(model_id, p, w, m.epochs_done, step, step == state.num_partitions - 1, budget=m.budget))
            break
        if not slots:
            break
    return out


def _start_gang(state: EngineState, m: ModelRecord, gang: Gang, slots: set[str]) -> list[Instruction]:
    """Start ``m``'s gang unit if all its workers are free; else hold the free ones
    for it (and keep prefetch off the busy ones) until they are."""
    slots.difference_update(gang.workers)
    if not gang.startable:
        state.held.update(w for w in gang.workers if w)
        return []
    runs, now = state.runs, state.now
    lead = runs.new(m.model_id, gang.partitions[0], gang.workers[0], RunState.RUNNING, now)
    lead.ranks = tuple(
        runs.new(m.model_id, p, w, RunState.RANK, now)
        for p, w in zip(gang.partitions[1:], gang.workers[1:], strict=True)
    )
    step = len(m.visited)
    end = step + len(gang.partitions) == state.num_partitions
    return [TrainGang(m.model_id, gang.partitions, gang.workers, m.epochs_done, step, end, budget=m.budget)]


def _runs_other_model(runs: Runs, worker: str, model_id: int) -> bool:
    """``worker`` executes a run of a model other than ``model_id`` (an open slot's
    worker is busy, so it executes one)."""
    ahead = runs.ahead[worker]
    return ahead is not None and ahead.model_id != model_id


def _next_partitions(state: EngineState, m: ModelRecord, idle_partitions: list[int]) -> Iterable[int]:
    """The partitions ``m`` may train on next, in the order to try them.

    With dynamic order these are its unvisited partitions; only those on an idle
    holder matter, so they come from ``idle_partitions`` (ascending), lazily: the
    caller takes the first that still has an idle holder.
    """
    if state.order in FIXED_ORDERS:
        return [state.model_order(m, m.epochs_done)[len(m.visited)]]
    # An epoch replayed after a rollback follows the order it was reported with (up to
    # its last report inside the epoch, with unit reports), so that Report.order keeps
    # describing the model's state.
    replay = m.reported_orders.get(m.epochs_done + 1, ())
    if len(m.visited) < len(replay):
        return [replay[len(m.visited)]]
    seen = set(m.visited) if len(idle_partitions) > 8 else m.visited  # a set pays off
    return (p for p in idle_partitions if p not in seen)


def _sooner_elsewhere(state: EngineState, m: ModelRecord, p: int, w: str) -> bool:
    """``w`` is measured slow, and a busy holder of ``p`` is expected to free up and
    run ``m``'s unit to its end in under HAND_OFF of the time ``w`` would take:
    leave the unit to it (a later event or Tick looks again)."""
    holders = state.placement.holders[p]
    now = state.now
    if now is None or state.pace(w) <= SLOW_PACE * min(map(state.pace, holders)):
        return False
    here = state.times.expected(m.model_id, w)
    if here is None:
        return False
    for h in holders:
        run = state.runs.ahead.get(h)
        if run is None or h in state.runs.behind or not run.counts:
            continue  # idle, or what it runs ends at an unknown time
        ahead, there = state.times.expected(run.model_id, h), state.times.expected(m.model_id, h)
        if run.started is None or ahead is None or there is None:
            continue
        # Overdue by t: assume t more. A hung unit thus stops holding the unit back
        # once it is overdue by HAND_OFF * here - there.
        rest = max(run.started + ahead - now, now - run.started - ahead)
        if rest + there < HAND_OFF * here:
            return True
    return False


# ------------------------------------------------------------- evaluations
def issue_evaluations(state: EngineState) -> list[Instruction]:
    """An Evaluate for every model whose evaluation is wanted, once every validation
    shard has a holder."""
    pending = state.index.eval_pending
    if not pending or not all(state.placement.holders):
        return []
    out: list[Instruction] = []
    for model_id in sorted(pending, key=lambda i: state.models[i].ordinal):
        m = state.models[model_id]
        m.eval_pending = False
        m.eval_workers = evaluation_workers(state, m)
        out.append(Evaluate(m.model_id, m.epochs_done, m.eval_workers, len(m.visited)))
    pending.clear()
    return out


def evaluation_workers(state: EngineState, m: ModelRecord) -> tuple[str, ...]:
    """A holder per validation shard, among those not known to be slow: the one
    holding the model's state (no hop), else an idle one, else in turn by the
    models' ordinals, so that evaluations spread over the replicas. Without validation
    data, one worker: the one holding the state, whose training figures are read."""
    if state.settings.has_validation is False:
        if m.state_worker in state.workers:
            return (m.state_worker,)
        return (sorted(state.placement.holders[0])[0],)
    chosen = []
    for p in range(state.num_partitions):
        holders = sorted(state.placement.holders[p])
        paces = [state.pace(w) for w in holders]
        fast = [w for w, pace in zip(holders, paces, strict=True) if pace <= SLOW_PACE * min(paces)]
        idle = [w for w in fast if state.runs.ahead.get(w) is None]
        if m.state_worker in fast:
            chosen.append(m.state_worker)
        else:
            pool = idle or fast
            chosen.append(pool[(m.ordinal + p) % len(pool)])
    return tuple(chosen)


def state_home(state: EngineState, model_id: int) -> str | None:
    """The worker to send a model's given state to (a checkpoint it resumes, a warm
    start, a fork whose parent's state the driver holds) before its first unit: the
    models take the live workers in turn, so that many resumed states spread."""
    live = sorted(state.workers)
    return live[model_id % len(live)] if live else None
