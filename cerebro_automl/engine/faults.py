"""Faults: retries of lost work, failures, rollbacks to a state still held, and
partitions that fail to load (placed again, or the session aborts)."""

from __future__ import annotations

from ..protocol import Abort, Instruction, ModelStatus, Place, Rollback
from .lifecycle import move, orphan_unit
from .model import ModelRecord
from .state import EngineState

__all__ = ["retry", "fail", "rollback", "place_failed", "replicate"]


def retry(state: EngineState, m: ModelRecord, cause: str) -> list[Instruction]:
    """Count one lost or cancelled run of ``m``'s work; past ``max_unit_retries``, fail it."""
    m.retries.append(cause)
    n = len(m.retries)
    limit = state.settings.max_unit_retries
    if n <= limit:
        return []
    if all("died while running it" in c for c in m.retries):
        why = (
            f"its worker died each of the {n} times in a row it ran this model's work "
            "(a worker killed for passing its memory limit, say, by a model too large "
            "for it)"
        )
    else:
        why = f"its work was lost {n} times in a row"
    return fail(state, m, f"WorkerDied: {why}; max_unit_retries={limit}. In order: " + "; ".join(m.retries))


def fail(state: EngineState, m: ModelRecord, error: str) -> list[Instruction]:
    return move(state, m, ModelStatus.FAILED, error=error)


def rollback(state: EngineState, m: ModelRecord) -> list[Instruction]:
    """The model's newest state is lost: go back to the newest state still held.

    While evaluating or paused, ``epoch_start`` still names the start of the epoch
    just trained, so that epoch is trained again too."""
    orphan_unit(state, m)
    if m.epoch_start_lost:
        # Replay from the newest copy no worker can lose: the state the driver keeps
        # of a model resumed from a checkpoint, or the initial weights.
        target, holder = m.durable_epoch, None
    else:
        target, holder = m.epoch_start, m.epoch_start_worker
    state.units_trained -= (m.epochs_done - target) * state.num_partitions + len(m.visited)
    m.epochs_done = target
    m.visited = []
    m.state_worker = holder
    move(state, m, ModelStatus.TRAINING)  # begins the epoch from ``holder``'s state
    return [Rollback(m.model_id, target, durable=holder is None and m.durable)]


def place_failed(state: EngineState, p: int, reason: str, lasting: bool = False) -> list[Instruction]:
    """Count a failed load of ``p``; past ``max_place_retries``, or at once when the
    failure is ``lasting`` (the data breaks a rule), Abort."""
    failures = state.place_failures.setdefault(p, [])
    failures.append(reason)
    if lasting:
        state.aborted = f"partition {p} failed to load, and would on every try: {reason}"
        return [Abort(p, state.aborted)]
    limit = state.settings.max_place_retries
    if len(failures) <= limit:
        return []
    state.aborted = f"partition {p} failed to load {len(failures)} times in a row; the last time {reason}"
    return [Abort(p, state.aborted)]


def replicate(state: EngineState, out: list[Instruction], avoid: frozenset[str] = frozenset()) -> None:
    """Place new copies of the partitions short of their replicas (the fewest holders
    first), then move copies from the most loaded workers onto the least loaded (a
    worker that joined), so that memory and units stay even. Called after every
    event that changes the copies: a worker that joined while the copies it should
    take were still loading gets them once they are held."""
    if state.aborted is not None or not state.workers:
        return
    placement = state.placement
    for p, w in placement.replicate(state.workers, avoid) + placement.balance(state.workers):
        out.append(Place(p, w, len(state.place_failures.get(p, ()))))
