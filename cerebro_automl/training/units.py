"""The units a worker runs: train one model for one pass over one partition's
train shard, or evaluate it on one validation shard.

A unit rebuilds the model from its config, loads the state it was handed,
trains, and returns the new state (a plain dict of tensors, which Dask moves
zero-copy) with the unit's metrics. Everything a unit computes depends only on
the config, the state, the shard and a seed derived from (model seed, epoch,
partition), so the order in which units run never changes their results.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ..features import feature_shard
from ..fusion import group_members, is_group
from .devices import add_phase_seconds, deterministic_algorithms, pick_device
from .errors import UnitAbandoned, UnitError, describe_failure
from .groups import evaluate_group, train_group
from .loop import evaluate_pass, train_pass
from .metrics import EvalResult
from .schedulers import unit_progress
from .transfer import State, clone_tensors

if TYPE_CHECKING:
    from ..data import Shard
    from .spec import TrainingSpec

__all__ = ["train_unit", "evaluate_unit"]


def train_unit(
    spec: TrainingSpec,
    config: Mapping[str, Any],
    state: State | None,
    shard: Shard,
    *,
    seed: int,
    epoch: int,
    partition: int,
    step: int,
    epoch_end: bool,
    threads: int,
    unit_timeout: float | None = None,
    fresh_hyperparameters: bool = False,
    deterministic: bool = True,
    budget: int | None = None,
    partitions: int | None = None,
) -> State:
    """Train one pass over ``shard``; return the new state.

    The state's ``progress`` sums the epoch's training loss, samples and unit
    seconds so far. An exception in user code, a non-finite loss or a pass
    longer than ``unit_timeout`` seconds (checked after every batch) raises
    :class:`UnitError`, which fails this model only. ``fresh_hyperparameters``:
    the state comes from another configuration (a fork, a warm start), whose
    optimizer hyperparameters must not override this config's (see
    :func:`restore_optimizer`). On CUDA the unit runs with deterministic kernels
    unless ``deterministic`` is False (see :func:`deterministic_algorithms`).
    ``budget`` (the model's epochs) and ``partitions`` place the unit in its
    model's budget, for the spec's ``lr_schedule``.

    A fusion group's config (see :mod:`cerebro_automl.fusion`) trains its members
    together (:func:`~cerebro_automl.training.groups.train_group`).

    The state's ``progress["phase_seconds"]`` sums, over the epoch's units, the
    seconds spent moving the state in (``transfer_in``), training (``compute``)
    and moving it out (``transfer_out``), as the device's clock measures them.
    """
    started = time.perf_counter()
    if is_group(config):
        return _train_group_unit(
            spec,
            config,
            state,
            shard,
            epoch,
            partition,
            step,
            epoch_end,
            threads,
            unit_timeout,
            fresh_hyperparameters,
            deterministic,
            budget,
            partitions,
        )
    progress: dict[str, Any] = (
        clone_tensors(state["progress"])
        if state is not None and step > 0
        else {"loss_sum": 0.0, "samples": 0, "seconds": 0.0}
    )
    device = pick_device(spec)
    # A copy to the GPU leaves the input untouched; on the CPU the model would train in it.
    private = clone_tensors(state) if state is not None and device.type == "cpu" else state
    with _user_code(threads, device, deterministic):
        shard, deadline = _unit_shard(spec, shard, config, device, started, unit_timeout)
        hooks = spec.train_hooks(config, state=private, progress=progress, epoch=epoch, step=step)
        new_state = train_pass(
            spec,
            hooks,
            config,
            private,
            shard,
            seed=seed,
            epoch=epoch,
            partition=partition,
            step=step,
            epoch_end=epoch_end,
            deadline=deadline,
            fresh_hyperparameters=fresh_hyperparameters,
            progress=unit_progress(spec.lr_schedule, config, epoch, step, budget, partitions),
        )
    _check_finite(new_state["model"], epoch, partition)
    progress["loss_sum"] += new_state.pop("loss_sum")
    progress["samples"] += new_state["samples"]
    progress["seconds"] += time.perf_counter() - started
    add_phase_seconds(progress, new_state.pop("phase_seconds", None))
    new_state["progress"] = progress
    return new_state


def _train_group_unit(
    spec: TrainingSpec,
    config: Mapping[str, Any],
    state: State | None,
    shard: Shard,
    epoch: int,
    partition: int,
    step: int,
    epoch_end: bool,
    threads: int,
    unit_timeout: float | None,
    fresh_hyperparameters: bool,
    deterministic: bool,
    budget: int | None,
    partitions: int | None,
) -> State:
    """A fusion group's unit: an error no member owns (the features' pass, say) fails the
    group; ``unit_timeout`` counts once per member."""
    device = pick_device(spec)
    with _user_code(threads, device, deterministic):
        members = group_members(config)
        # unit_timeout is a model's: a group's unit trains all of its members.
        timeout = None if unit_timeout is None else unit_timeout * len(members)
        shard, deadline = _unit_shard(spec, shard, members[0].config, device, time.perf_counter(), timeout)
        return train_group(
            spec,
            config,
            state,
            shard,
            device=device,
            epoch=epoch,
            partition=partition,
            step=step,
            epoch_end=epoch_end,
            deadline=deadline,
            fresh_hyperparameters=fresh_hyperparameters,
            budget=budget,
            partitions=partitions,
        )


@contextmanager
def _user_code(threads: int, device: torch.device, deterministic: bool) -> Iterator[None]:
    """A unit's torch threads and kernels; an exception inside (user code) becomes a
    :class:`UnitError` with its reason, which fails this model (or group) only."""
    try:
        torch.set_num_threads(threads)
        with deterministic_algorithms(device, deterministic):
            yield
    except UnitAbandoned:  # its task was cancelled on the worker: no fault of the model's code
        raise
    except Exception as err:
        raise UnitError(describe_failure(err)) from None


def _unit_shard(
    spec: TrainingSpec,
    shard: Shard,
    features_config: Mapping[str, Any],
    device: torch.device,
    started: float,
    timeout: float | None,
) -> tuple[Shard, float | None]:
    """The shard a unit trains on (the spec's frozen features of it, if any) and the
    unit's deadline: ``timeout`` seconds after ``started``, or after the features'
    one-time pass, which is not the models' training."""
    if spec.features is not None:
        shard = feature_shard(spec.features, shard, features_config, device)
        started = time.perf_counter()
    return shard, None if timeout is None else started + timeout


def _check_finite(weights: Mapping[str, Any], epoch: int, partition: int) -> None:
    """Raise UnitError when a weight is NaN or infinite: the loss is checked before
    each optimizer step, so the last step of a pass could write them unseen."""
    for name, tensor in weights.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise UnitError(
                f"NonFiniteWeightsError: weight {name!r} is not finite after the pass "
                f"over partition {partition} in epoch {epoch + 1} (the optimizer step after "
                "the last finite loss wrote NaN or infinity)"
            )


def evaluate_unit(
    spec: TrainingSpec,
    config: Mapping[str, Any],
    state: State,
    shard: Shard | None,
    *,
    seed: int,
    threads: int,
    deterministic: bool = True,
) -> EvalResult:
    """Sum the loss and every metric over one validation shard (the state is not changed).

    Raises :class:`UnitError` when user code (the model, loss or a metric) fails.
    """
    started = time.perf_counter()
    try:
        torch.set_num_threads(threads)
        device = pick_device(spec)
        with deterministic_algorithms(device, deterministic):
            features_of = group_members(config)[0].config if is_group(config) else config
            if spec.features is not None and shard is not None and len(shard) > 0:
                shard = feature_shard(spec.features, shard, features_of, device)
            if is_group(config):
                return evaluate_group(spec, config, state, shard)
            result = evaluate_pass(spec, spec.eval_hooks(config, state), config, state, shard, seed=seed)
    except Exception as err:
        # Training went through: the validation data (a label past the training ones,
        # another shape) is the likely cause, so the reason names it.
        first, *rest = describe_failure(err).split("\n", 1)
        raise UnitError("\n".join([f"{first} [in the validation pass, over the validation data]", *rest])) from None
    return dataclasses.replace(result, seconds=time.perf_counter() - started, progress=state["progress"])
