"""A model's lifecycle: :data:`TRANSITIONS`, the table of the status
changes it may make, each mapped to the function that does that change's work and
returns what follows from it (dask.distributed's ``_TRANSITIONS_TABLE`` style).

::

    TRAINING -> EVALUATING     its epoch's last unit finished (with unit reports: any unit)
    EVALUATING -> TRAINING     evaluated with budget left (or inside the epoch), or rolled back
    EVALUATING -> PAUSED       evaluated with its budget spent
    PAUSED -> TRAINING         its budget was extended, or it was rolled back
    TRAINING -> TRAINING       rolled back to an earlier state
    any live -> STOPPED        its tuner stopped it
    any live -> FAILED         its code failed, or its work was lost too often in a row

EVALUATING has two phases: the evaluation is *wanted* (``eval_pending``: the epoch
was just trained, or a validation shard it used was lost) until every validation
shard has a holder and the engine issues an ``Evaluate``; then it is *issued*.
STOPPED and FAILED are final. Every change goes through :func:`move`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..protocol import Checkpoint, Fail, Instruction, ModelStatus, Pause, Release
from .model import ModelRecord
from .runs import RunState
from .state import EngineState

__all__ = ["TRANSITIONS", "TransitionError", "move", "orphan_unit"]


class TransitionError(AssertionError):
    """The engine tried a status change that :data:`TRANSITIONS` does not list (a bug)."""


def orphan_unit(state: EngineState, m: ModelRecord) -> None:
    """The model's runs in flight keep their workers busy, but their results will be
    discarded; the model trains again only once they end."""
    runs = state.runs
    for run in (runs.unit_of(m.model_id), runs.copy_of(m.model_id)):
        if run is not None:
            runs.move(run, RunState.ORPHANED)


def _unit_trained(state: EngineState, m: ModelRecord, **_: Any) -> list[Instruction]:
    if m.visited and len(m.visited) < state.num_partitions:  # a report inside the epoch
        m.eval_pending = True
        return []
    return _epoch_trained(state, m)


def _epoch_trained(state: EngineState, m: ModelRecord) -> list[Instruction]:
    m.epochs_done += 1
    m.last_order = tuple(m.visited)
    m.visited = []
    m.eval_pending = True
    return [Checkpoint(m.model_id, m.epochs_done)] if state.checkpoint else []


def _begin_epoch(state: EngineState, m: ModelRecord, **_: Any) -> list[Instruction]:
    m.epoch_start_worker, m.epoch_start_lost = m.state_worker, False
    m.epoch_start = m.epochs_done
    m.eval_pending = False
    return []


def _evaluated(state: EngineState, m: ModelRecord, **_: Any) -> list[Instruction]:
    if m.visited:  # evaluated inside its epoch: the epoch goes on
        m.eval_pending = False
        return []
    return _begin_epoch(state, m)


def _pause(state: EngineState, m: ModelRecord, **_: Any) -> list[Instruction]:
    if m.budget <= m.finished_at:
        return []  # paused at this budget before (rolled back since)
    m.finished_at = m.budget
    return [Pause(m.model_id, m.budget)]


def _stop(state: EngineState, m: ModelRecord, **_: Any) -> list[Instruction]:
    m.eval_pending = False
    orphan_unit(state, m)
    return [Release(m.model_id)]


def _fail(state: EngineState, m: ModelRecord, *, error: str, **_: Any) -> list[Instruction]:
    m.eval_pending = False
    orphan_unit(state, m)
    return [Fail(m.model_id, error), Release(m.model_id)]


_Work = Callable[..., "list[Instruction]"]
TRAINING, EVALUATING, PAUSED = ModelStatus.TRAINING, ModelStatus.EVALUATING, ModelStatus.PAUSED
STOPPED, FAILED = ModelStatus.STOPPED, ModelStatus.FAILED
_LIVE = (TRAINING, EVALUATING, PAUSED)

TRANSITIONS: dict[tuple[ModelStatus, ModelStatus], _Work] = {
    (TRAINING, EVALUATING): _unit_trained,
    (EVALUATING, TRAINING): _evaluated,
    (EVALUATING, PAUSED): _pause,
    (PAUSED, TRAINING): _begin_epoch,
    (TRAINING, TRAINING): _begin_epoch,
    **{(s, STOPPED): _stop for s in _LIVE},
    **{(s, FAILED): _fail for s in _LIVE},
}


def move(state: EngineState, m: ModelRecord, status: ModelStatus, **info: Any) -> list[Instruction]:
    """Change ``m``'s status along one of the :data:`TRANSITIONS` and do its work."""
    work = TRANSITIONS.get((m.status, status))
    if work is None:
        raise TransitionError(
            f"model {m.model_id} cannot go from {m.status.value} to {status.value}: not one of the engine's TRANSITIONS"
        )
    m.status = status
    return work(state, m, **info)
