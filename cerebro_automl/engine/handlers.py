"""What each event does to the engine's state: one function per event type of the
protocol, in :data:`HANDLERS`. Each returns the instructions that follow from the
event itself; ``Scheduler.handle`` then issues evaluations and assigns work."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..protocol import (
    BudgetExtended,
    Discard,
    Drop,
    EvaluationCancelled,
    EvaluationDone,
    GangWidth,
    Instruction,
    ModelsAdded,
    ModelStatus,
    ModelStopped,
    PartitionLost,
    PartitionPlaced,
    Pause,
    PlaceFailed,
    Report,
    Rollback,
    StatesLost,
    Tick,
    UnitCancelled,
    UnitDone,
    UnitFailed,
    UnitProgress,
    WorkerAdded,
    WorkerLost,
)
from .faults import fail, place_failed, replicate, retry, rollback
from .lifecycle import move
from .model import ModelRecord
from .runs import RunState, UnitRun
from .speculation import PROGRESS_EVERY, time_overtaken, time_unit, watched_run
from .state import EngineState

__all__ = ["HANDLERS"]

TRAINING, EVALUATING = ModelStatus.TRAINING, ModelStatus.EVALUATING


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


# ------------------------------------------------------------------ clock
def _on_tick(state: EngineState, e: Tick) -> list[Instruction]:
    if not _is_number(e.now) or e.now != e.now:
        raise ValueError(f"Tick.now is {e.now!r}, but must be a number of seconds")
    if state.now is None or e.now > state.now:  # a clock that steps back is not followed
        state.now = float(e.now)
    return []


def _on_unit_progress(state: EngineState, e: UnitProgress) -> list[Instruction]:
    for name in ("fraction", "seconds"):
        value = getattr(e, name)
        if not _is_number(value) or not value >= 0:
            raise ValueError(f"UnitProgress.{name} is {value!r}, but must be a number >= 0")
    if e.fraction > 1:
        raise ValueError(f"UnitProgress.fraction is {e.fraction!r}, but must be at most 1")
    watched = watched_run(state, e.worker)
    if watched is None or watched.run.key != (e.model_id, e.partition):
        return []  # a run that ended or was discarded meanwhile, a copy, a queued run
    if e.seconds < PROGRESS_EVERY * watched.expected:
        return []  # too soon to judge (the unit may have queued on its worker)
    left = e.seconds * (1 - e.fraction) / e.fraction if e.fraction > 0 else float("inf")
    watched.run.progress = (watched.now, watched.now + left)
    return []


# ---------------------------------------------------------- tuner's calls
def _on_models_added(state: EngineState, e: ModelsAdded) -> list[Instruction]:
    # Every model is checked before any is added, so a rejected event changes nothing.
    ids = [new.model_id for new in e.models]
    for i, new in enumerate(e.models):
        if new.model_id in state.models or new.model_id in ids[:i]:
            raise ValueError(f"model id {new.model_id} was already added")
        if not isinstance(new.epochs, int) or new.epochs < 1:
            raise ValueError(f"epochs is {new.epochs!r}, but must be an int >= 1")
        if not isinstance(new.start_epoch, int) or not 0 <= new.start_epoch <= new.epochs:
            raise ValueError(f"start_epoch is {new.start_epoch!r}, but must be an int in [0, epochs={new.epochs}]")
    out: list[Instruction] = []
    for new in e.models:
        ordinal = len(state.models)
        offset = ordinal if new.offset is None else new.offset
        m = state.models[new.model_id] = ModelRecord(
            new.model_id,
            ordinal,
            offset,
            new.epochs,
            epochs_done=new.start_epoch,
            epoch_start=new.start_epoch,
            reported=new.start_epoch,
            durable_epoch=new.start_epoch,
            durable=new.start_epoch > 0 or new.from_state,
        )
        out.extend(_place_resumed_state(state, m, new.state_worker))
        if new.start_epoch == new.epochs:  # its budget already trained (a resume): paused
            m.status, m.finished_at = ModelStatus.PAUSED, new.epochs
            out.append(Pause(m.model_id, new.epochs))
    return out


def _place_resumed_state(state: EngineState, m: ModelRecord, worker: str | None) -> list[Instruction]:
    """A model given a durable state: where that state is, or the driver's copy."""
    if worker is None or not m.durable:
        return []
    if worker in state.workers:
        m.state_worker = m.epoch_start_worker = worker
        return []
    # sent to a worker already gone (or not yet seen): use the driver's copy
    return [Rollback(m.model_id, m.epochs_done, durable=True)]


def _on_budget_extended(state: EngineState, e: BudgetExtended) -> list[Instruction]:
    m = state.model(e.model_id)
    if m.finished:
        raise ValueError(f"model {e.model_id} is {m.status.value} and cannot be extended")
    if not isinstance(e.epochs, int) or e.epochs < 1:
        raise ValueError(f"epochs is {e.epochs!r}, but must be an int >= 1")
    if e.resumed_epoch is not None:
        return _extend_resumed(state, m, e)
    m.budget += e.epochs
    if m.status is ModelStatus.PAUSED:
        return move(state, m, TRAINING)
    return []


def _extend_resumed(state: EngineState, m: ModelRecord, e: BudgetExtended) -> list[Instruction]:
    """Extended, and continued from a checkpoint after ``e.resumed_epoch`` epochs (a
    resume's: those epochs were trained and reported by the run before)."""
    epoch = e.resumed_epoch
    if m.status is not ModelStatus.PAUSED:
        raise ValueError(f"model {m.model_id} is {m.status.value}, but only a paused model continues from a checkpoint")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not m.epochs_done < epoch <= m.budget + e.epochs:
        raise ValueError(
            f"resumed_epoch is {epoch!r}, but must be an int in [{m.epochs_done + 1}, {m.budget + e.epochs}]"
        )
    m.budget += e.epochs
    m.epochs_done = m.epoch_start = m.reported = m.durable_epoch = epoch
    m.durable, m.visited, m.retries = True, [], []
    m.state_worker = m.epoch_start_worker = None
    m.epoch_start_lost = False
    out = _place_resumed_state(state, m, e.state_worker)
    if epoch < m.budget:
        return out + move(state, m, TRAINING)
    m.finished_at = m.budget
    return [*out, Pause(m.model_id, m.budget)]


def _on_model_stopped(state: EngineState, e: ModelStopped) -> list[Instruction]:
    m = state.model(e.model_id)
    return [] if m.finished else move(state, m, ModelStatus.STOPPED)


def _on_gang_width(state: EngineState, e: GangWidth) -> list[Instruction]:
    m = state.model(e.model_id)
    for name, least in (("epoch", 1), ("width", 1), ("lane", 0)):
        value = getattr(e, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"GangWidth.{name} is {value!r}, but must be an int >= {least}")
    if state.num_partitions % e.width:
        raise ValueError(
            f"GangWidth.width is {e.width}, but must divide the {state.num_partitions} partitions "
            "(an epoch is cut into gang units of that many)"
        )
    given = m.widths.get(e.epoch)
    if given is not None and given != (e.width, e.lane):
        raise ValueError(
            f"model {m.model_id}'s epoch {e.epoch} was given width {given[0]} on lane {given[1]}, and cannot "
            f"be given {e.width} on lane {e.lane}: an epoch keeps its gang units (a rollback trains it again alike)"
        )
    if not m.finished:
        m.widths[e.epoch] = (e.width, e.lane)
    return []


# ------------------------------------------------------------------- units
@dataclass(frozen=True)
class _Ended:
    """A run that ended and counted: ``was_copy`` if it was a speculative copy, and
    ``partner``, the other run of its race, if any."""

    run: UnitRun
    was_copy: bool
    partner: UnitRun | None


def _finish_run(state: EngineState, model_id: int, partition: int, worker: str) -> _Ended | None:
    """End the run a unit event names (a run queued behind it moves up); None if the
    event is stale or the run no longer counted (orphaned, discarded)."""
    runs = state.runs
    run = runs.match(worker, model_id, partition)
    if run is None:
        return None
    counted, was_copy = run.counts, run.state is RunState.COPY
    partner = (runs.unit_of(model_id) if was_copy else runs.copy_of(model_id)) if counted else None
    runs.move(run, RunState.ENDED, state.now)
    if not counted or state.models[model_id].status is not TRAINING:
        return None
    return _Ended(run, was_copy, partner)


def _on_unit_done(state: EngineState, e: UnitDone) -> list[Instruction]:
    ended = _finish_run(state, e.model_id, e.partition, e.worker)
    if ended is None:
        return []
    m = state.models[e.model_id]
    # The first run of the unit to finish is the model's; the other one loses.
    out: list[Instruction] = []
    loser = ended.partner
    if loser is not None:
        state.runs.move(loser, RunState.DISCARDED)  # its worker is busy until it ends
        out.append(Discard(m.model_id, e.partition, loser.worker))
        if ended.was_copy:
            time_overtaken(state, m, loser)
    trained = ended.run.partitions
    if len(trained) == 1:  # a gang unit's time says nothing of the model's units
        time_unit(state, m, e.worker, ended.run.started)
    m.retries.clear()
    m.visited.extend(trained)
    state.units_trained += len(trained)
    m.state_worker = e.worker
    if len(m.visited) < state.num_partitions and not _report_due(state, m):
        return out
    return out + move(state, m, EVALUATING)


def _report_due(state: EngineState, m: ModelRecord) -> bool:
    """With unit reports, whether the unit just trained inside an epoch is to be
    reported: not when a rollback trained it again (its report stands)."""
    return state.settings.unit_reports and (m.epochs_done + 1, len(m.visited)) > m.reported_unit


def _detach(state: EngineState, ended: _Ended) -> None:
    """The run ended without a result: a copy racing it becomes the model's unit."""
    if ended.partner is not None and not ended.was_copy:
        state.runs.move(ended.partner, RunState.RUNNING)


def _on_unit_failed(state: EngineState, e: UnitFailed) -> list[Instruction]:
    ended = _finish_run(state, e.model_id, e.partition, e.worker)
    if ended is None:
        return []
    # User code fails the same way on every worker: a copy racing it fails the model
    # too, so it is not waited for.
    _detach(state, ended)
    return fail(state, state.models[e.model_id], e.error)


def _on_unit_cancelled(state: EngineState, e: UnitCancelled) -> list[Instruction]:
    ended = _finish_run(state, e.model_id, e.partition, e.worker)
    if ended is None:
        return []
    _detach(state, ended)
    if ended.partner is not None:  # the other run of the race goes on
        return [Discard(e.model_id, e.partition, e.worker)]
    # The unit runs again from the state it started from (a lost state comes as StatesLost).
    return retry(state, state.models[e.model_id], f"its unit on {e.worker} was cancelled ({e.reason})")


# ------------------------------------------------------------- evaluation
def _evaluation_current(m: ModelRecord, epoch: int, unit: int) -> bool:
    return m.status is EVALUATING and (epoch, unit) == (m.epochs_done, len(m.visited)) and not m.eval_pending


def _on_evaluation_done(state: EngineState, e: EvaluationDone) -> list[Instruction]:
    m = state.model(e.model_id)
    if not _evaluation_current(m, e.epoch, e.unit):
        return []  # stale: the model was stopped, rolled back or re-evaluated
    if e.error is not None:
        return fail(state, m, e.error)
    m.retries.clear()
    if e.unit:
        return _unit_evaluated(state, m)
    out: list[Instruction] = []
    if e.epoch > m.reported:
        m.reported = e.epoch
        m.reported_orders[e.epoch] = m.last_order
        out.append(Report(m.model_id, e.epoch, m.last_order))
    return out + move(state, m, TRAINING if m.epochs_done < m.budget else ModelStatus.PAUSED)


def _unit_evaluated(state: EngineState, m: ModelRecord) -> list[Instruction]:
    """Reported inside its epoch, once (a rollback trains the epoch again in the order
    reported, to the same state); the epoch goes on."""
    point = (m.epochs_done + 1, len(m.visited))
    out: list[Instruction] = []
    if point > m.reported_unit:
        m.reported_unit = point
        m.reported_orders[point[0]] = tuple(m.visited)
        out.append(Report(m.model_id, point[0], tuple(m.visited), point[1]))
    return out + move(state, m, TRAINING)


def _on_evaluation_cancelled(state: EngineState, e: EvaluationCancelled) -> list[Instruction]:
    m = state.model(e.model_id)
    if not _evaluation_current(m, e.epoch, e.unit):
        return []  # stale, or already to be evaluated again
    failed = retry(state, m, f"its evaluation was cancelled ({e.reason})")
    if not failed:
        m.eval_pending = True
    return failed


def _on_states_lost(state: EngineState, e: StatesLost) -> list[Instruction]:
    m = state.model(e.model_id)
    if m.finished:
        return []
    if m.epoch_start in e.epochs and m.epoch_start > 0 and m.epoch_start_worker is not None:
        m.epoch_start_worker, m.epoch_start_lost = None, True
    return rollback(state, m) if e.newest else []


# ---------------------------------------------------- workers and partitions
def _on_worker_added(state: EngineState, e: WorkerAdded) -> list[Instruction]:
    if e.worker in state.workers:
        return []
    state.runs.add_worker(e.worker)
    out: list[Instruction] = []
    replicate(state, out)  # the newcomer takes units as soon as a copy has loaded
    return out


def _on_worker_lost(state: EngineState, e: WorkerLost) -> list[Instruction]:
    w = e.worker
    if w not in state.workers:
        return []
    # What the worker was running when it died is what most likely killed it
    # (memory): that work alone counts against its model's retries. Unknown: blame
    # the train unit sent there (not a discarded one).
    if e.executing is None:
        ahead = state.runs.ahead[w]
        culprit, loading = (ahead.model_id if ahead is not None and ahead.counts else None), None
    else:
        culprit, loading = e.executing.model_id, e.executing.partition
    lost, ranks = _end_runs_of(state, w)
    state.times.forget_worker(w)
    out: list[Instruction] = _lose_ranks(state, ranks)
    _, was_loading = state.placement.remove_worker(w, len(state.workers))
    if loading in was_loading:
        out.extend(
            place_failed(
                state,
                loading,
                f"on {w}: its worker died while loading it (out of memory? cache='disk' keeps a partition on the "
                "worker's disk, and more partitions make each smaller)",
            )
        )
    # Partitions it held are still served by their other holders; new copies load on
    # survivors meanwhile (a partition it alone held waits for its reload).
    replicate(state, out)
    for m in state.models.values():
        run = lost.get(m.model_id)
        if run is not None:
            out.extend(_lose_run(state, m, run))
        if m.epoch_start_worker == w:
            m.epoch_start_worker, m.epoch_start_lost = None, True
        if m.finished:
            continue
        if m.model_id == culprit:
            failed = retry(state, m, f"worker {w} died while running it")
            if failed:
                out.extend(failed)
                continue
        if m.state_worker == w:
            out.extend(rollback(state, m))
        elif m.status is EVALUATING and w in m.eval_workers:
            m.eval_pending = True  # a validation shard it used was lost: evaluate again
    return out


def _end_runs_of(state: EngineState, worker: str) -> tuple[dict[int, UnitRun], list[UnitRun]]:
    """Forget a dead worker's slots; end its runs that no longer counted, and return
    the others by model (their models learn of the loss in order), and the gang
    ranks it ran."""
    counting, ranks = {}, []
    for run in state.runs.remove_worker(worker):
        if run.counts:
            counting[run.model_id] = run
            continue
        if run.state is RunState.RANK:
            ranks.append(run)
        state.runs.move(run, RunState.ENDED)
    return counting, ranks


def _lose_ranks(state: EngineState, ranks: list[UnitRun]) -> list[Instruction]:
    """A gang unit that lost a rank ends: its rank 0 no longer counts (its workers stay
    busy until the executor reports its end), and its model trains the unit again,
    at the width the live workers allow."""
    out: list[Instruction] = []
    for rank in ranks:
        lead = next((r for r in state.runs.every_run() if rank in r.ranks), None)
        if lead is not None and lead.state is RunState.RUNNING:
            state.runs.move(lead, RunState.DISCARDED)
            out.append(Discard(lead.model_id, lead.partition, lead.worker, restart=True))
    return out


def _lose_run(state: EngineState, m: ModelRecord, run: UnitRun) -> list[Instruction]:
    """``m``'s run died with its worker: the other run of a race goes on as the unit;
    without one, the unit is retried from the state it started from."""
    runs = state.runs
    was_copy = run.state is RunState.COPY
    partner = runs.unit_of(m.model_id) if was_copy else runs.copy_of(m.model_id)
    runs.move(run, RunState.ENDED)
    if partner is None:  # a gang unit's other ranks are told to stop
        return [Discard(m.model_id, run.partition, run.worker)] if run.ranks else []
    if not was_copy:
        runs.move(partner, RunState.RUNNING)
    return [Discard(m.model_id, run.partition, run.worker)]


def _on_partition_placed(state: EngineState, e: PartitionPlaced) -> list[Instruction]:
    if e.worker not in state.workers:
        return []  # stale: the worker was lost meanwhile
    wanted, donor = state.placement.placed(e.partition, e.worker)
    if not wanted:
        return []
    state.place_failures.pop(e.partition, None)
    out: list[Instruction] = [] if donor is None else [Drop(e.partition, donor)]
    replicate(state, out)  # a background load ended: one that waited may start
    return out


def _on_place_failed(state: EngineState, e: PlaceFailed) -> list[Instruction]:
    if not state.placement.place_failed(e.partition, e.worker):
        return []  # stale: the worker was lost meanwhile, and the loss re-placed it
    out = place_failed(state, e.partition, f"on {e.worker}: {e.error}", e.lasting)
    if not out:
        replicate(state, out, avoid=frozenset({e.worker}))
    return out


def _on_partition_lost(state: EngineState, e: PartitionLost) -> list[Instruction]:
    p, w = e.partition, e.worker
    if w not in state.workers or not state.placement.lose_copy(p, w, len(state.workers)):
        return []  # stale: it moved or its worker was lost
    out: list[Instruction] = []
    replicate(state, out)
    for m in state.models.values():
        if m.status is EVALUATING and m.eval_workers[p : p + 1] == (w,):
            m.eval_pending = True  # its validation shard is gone: evaluate again
    return out


HANDLERS: dict[type, Callable[[EngineState, Any], list[Instruction]]] = {
    Tick: _on_tick,
    UnitProgress: _on_unit_progress,
    ModelsAdded: _on_models_added,
    BudgetExtended: _on_budget_extended,
    ModelStopped: _on_model_stopped,
    GangWidth: _on_gang_width,
    UnitDone: _on_unit_done,
    UnitFailed: _on_unit_failed,
    UnitCancelled: _on_unit_cancelled,
    EvaluationDone: _on_evaluation_done,
    EvaluationCancelled: _on_evaluation_cancelled,
    StatesLost: _on_states_lost,
    WorkerAdded: _on_worker_added,
    WorkerLost: _on_worker_lost,
    PartitionPlaced: _on_partition_placed,
    PlaceFailed: _on_place_failed,
    PartitionLost: _on_partition_lost,
}
