"""The engine's invariants, checked after every event in the tests (as
dask.distributed's ``validate_state``): both state machines, the placement, the
timing and the indexes. Each check raises ``AssertionError`` naming what broke."""

from __future__ import annotations

from collections import Counter

from ..protocol import ModelStatus
from .model import ModelRecord
from .orders import FIXED_ORDERS
from .runs import RunState
from .state import EngineState

__all__ = ["validate"]

_AHEAD = (RunState.RUNNING, RunState.COPY, RunState.ORPHANED, RunState.DISCARDED, RunState.RANK)
_BEHIND = (RunState.QUEUED, RunState.ORPHANED)


def validate(state: EngineState) -> None:
    state.index.validate(state)
    state.times.validate()
    state.placement.validate(state.workers, complete=state.started and state.aborted is None)
    for p, failures in state.place_failures.items():
        if len(failures) > state.settings.max_place_retries and state.aborted is None:
            raise AssertionError(f"partition {p} failed {failures} without an Abort")
    _validate_slots(state)
    _validate_links(state)
    _validate_gangs(state)
    for m in state.models.values():
        _validate_runs_of(state, m)
        _validate_model(state, m)


def _validate_slots(state: EngineState) -> None:
    runs = state.runs
    for w, run in runs.ahead.items():
        if run is not None and (run.worker != w or run.state not in _AHEAD):
            raise AssertionError(f"worker {w} executes {run}")
    for w, run in runs.behind.items():
        if not state.settings.prefetch:
            raise AssertionError(f"worker {w} has {run} queued without prefetch")
        ahead = runs.ahead.get(w)
        if ahead is None:
            raise AssertionError(f"worker {w} has {run} queued behind no run")
        if run.worker != w or run.state not in _BEHIND:
            raise AssertionError(f"worker {w} has {run} queued")
        if ahead.model_id == run.model_id and run.state is RunState.QUEUED:
            raise AssertionError(f"worker {w} has {run} queued behind a run of its own model")


def _validate_links(state: EngineState) -> None:
    """Each model's unit and copy are the runs in the slots, and the orphans it waits
    for are counted right."""
    runs = state.runs
    in_slots = list(runs.every_run())
    counted = {(r.model_id, r.state is RunState.COPY): r for r in in_slots if r.counts}
    if len(counted) != sum(r.counts for r in in_slots):
        raise AssertionError(f"a model has two units or two copies in {in_slots}")
    for (model_id, is_copy), run in counted.items():
        linked = runs.copy_of(model_id) if is_copy else runs.unit_of(model_id)
        if linked is not run:
            raise AssertionError(f"model {model_id} links {linked}, but {run} runs for it")
    if len(runs._unit) + len(runs._copy) != len(counted):
        raise AssertionError(f"models link runs that are in no slot: {runs._unit} {runs._copy}")
    orphans = Counter(r.model_id for r in in_slots if r.state is RunState.ORPHANED)
    if dict(orphans) != runs._waited_for:
        raise AssertionError(f"models wait for orphans {runs._waited_for}, but {dict(orphans)} run")


def _validate_gangs(state: EngineState) -> None:
    """Each gang rank in a slot belongs to a gang unit in a slot, whose ranks train
    distinct partitions on distinct workers."""
    runs = list(state.runs.every_run())
    ranks = {id(r) for lead in runs for r in lead.ranks if r.state is RunState.RANK}
    for run in runs:
        if run.state is RunState.RANK and id(run) not in ranks:
            raise AssertionError(f"{run} is a gang rank of no gang unit in a slot")
        if not run.ranks:
            continue
        workers = [run.worker, *(r.worker for r in run.ranks)]
        if len(set(run.partitions)) != len(workers) or len(set(workers)) != len(workers):
            raise AssertionError(f"the gang unit {run} has ranks {run.ranks}")
        for r in run.ranks:
            if r.model_id != run.model_id or r.state not in (RunState.RANK, RunState.ENDED):
                raise AssertionError(f"the gang unit {run} has the rank {r}")
            if r.state is RunState.RANK and state.runs.ahead.get(r.worker) is not r:
                raise AssertionError(f"the gang rank {r} is not what its worker executes")


def _validate_runs_of(state: EngineState, m: ModelRecord) -> None:
    unit, copy = state.runs.unit_of(m.model_id), state.runs.copy_of(m.model_id)
    if unit is None and copy is None:
        return
    if m.status is not ModelStatus.TRAINING:
        raise AssertionError(f"model {m.model_id} is {m.status.value} but runs {unit} {copy}")
    if unit is None or (
        copy is not None
        and (unit.state is not RunState.RUNNING or copy.worker == unit.worker or copy.partition != unit.partition)
    ):
        raise AssertionError(f"model {m.model_id} races {copy} against {unit}")
    if state.runs.waits_for_orphan(m.model_id):
        raise AssertionError(f"model {m.model_id} runs {unit} and an orphaned unit")
    if not set(unit.partitions).isdisjoint(m.visited):
        raise AssertionError(f"model {m.model_id} runs partitions {unit.partitions} twice")


def _validate_model(state: EngineState, m: ModelRecord) -> None:
    P = state.num_partitions
    if len(set(m.visited)) != len(m.visited) or len(m.visited) >= P:
        raise AssertionError(f"model {m.model_id} visited {m.visited} this epoch")
    if m.epochs_done > m.budget:
        raise AssertionError(f"model {m.model_id} trained {m.epochs_done} > {m.budget} epochs")
    if len(m.retries) > state.settings.max_unit_retries and m.status is not ModelStatus.FAILED:
        raise AssertionError(f"model {m.model_id} is {m.status.value} after {m.retries}")
    if m.durable_epoch > m.epochs_done and not m.finished:
        raise AssertionError(
            f"model {m.model_id} trained {m.epochs_done} epochs, fewer than its durable {m.durable_epoch}"
        )
    if (
        state.order in FIXED_ORDERS
        and m.status is ModelStatus.TRAINING
        and tuple(m.visited) != state.model_order(m, m.epochs_done)[: len(m.visited)]
    ):
        raise AssertionError(f"model {m.model_id} left its Latin order: {m.visited}")
    if m.visited and (
        m.status is ModelStatus.PAUSED or (m.status is ModelStatus.EVALUATING and not state.settings.unit_reports)
    ):
        raise AssertionError(f"model {m.model_id} is {m.status.value} mid-epoch")
    if m.eval_pending and m.status is not ModelStatus.EVALUATING:
        raise AssertionError(f"model {m.model_id} is {m.status.value} with an evaluation wanted")
    if m.epoch_start_lost and m.epoch_start_worker is not None:
        raise AssertionError(f"model {m.model_id}'s epoch start is lost but held by {m.epoch_start_worker}")
    if m.status is ModelStatus.EVALUATING and not m.eval_pending and m.eval_workers:
        gone = sorted(set(m.eval_workers) - set(state.workers))
        if gone:
            raise AssertionError(f"model {m.model_id} is evaluated on lost workers {gone}")
