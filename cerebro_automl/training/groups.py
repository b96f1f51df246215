"""A fusion group's units: its members train one pass over a partition together,
as one batched model (see :mod:`cerebro_automl.fusion`), and are evaluated together
too, each with its own sums.

A group's state is its members' states, each the plain state an unfused model
would have, under their model ids::

    {"members": {model_id: state}, "failed": {model_id: reason}, "unfused": reason | None}

so a member leaves the group (stopped, extended alone, forked, checkpointed) with
nothing converted. The group shuffles its data and seeds its in-model randomness
from the group's seed; each member's initial weights come from its own model seed.

When the members cannot train as one (a module ``vmap`` cannot batch, a
data-dependent branch, an optimizer the fused step lacks, a spec with hooks of
its own), the unit trains them one after the other through the one loop instead,
with the same data order, and the state records why (``unfused``): later units
of the group do not try again. A member whose loss or weights turn non-finite, or
whose code raises, fails alone.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..fusion import FusedOptimizer, Member, StackedModels, Unfusable, group_members, group_seed
from .base import BaseRecord, checkout_model, frozen_names
from .batches import batches
from .devices import PHASES, PhaseClock, add_phase_seconds, pick_device
from .errors import UnitAbandoned, UnitTimeout, describe_failure
from .group_steps import GroupStepping
from .loop import evaluate_pass, loss_message, train_pass
from .metrics import EvalResult
from .plain import PlainEvalHooks, PlainTrainHooks, call_loss
from .precision import autocast
from .restore import build_model, check_optimizer_params, restore_optimizer
from .schedulers import (
    SchedulerConfig,
    UnitProgress,
    keep_initial_lr,
    mark_initial_lr,
    saved_scheduler_states,
    scheduler_state,
    step_schedulers,
    unit_progress,
)
from .seeding import item_seed, seed_torch, unit_generators, unit_seed
from .transfer import State, clone_tensors, to_host
from .watch import check_deadline

if TYPE_CHECKING:
    from ..data import Shard
    from .spec import TrainingSpec

__all__ = ["train_group", "evaluate_group", "group_figures"]

# Raised by the deadline and by an abandoned unit: the unit stops, fused or not.
_STOPS = (UnitTimeout, UnitAbandoned)


@dataclasses.dataclass
class _Trained:
    """What one member's pass produced: its new state (less ``progress``) and loss sum."""

    state: State
    loss_sum: float


@dataclasses.dataclass(frozen=True)
class _GroupPass:
    """One unit of a group: what its fused pass and its one-by-one pass both need."""

    spec: TrainingSpec
    members: list[Member]
    starts: Mapping[int, State | None]  # each member's state before the unit (None: fresh)
    shard: Shard
    device: torch.device
    seed: int  # the group's: its data order and in-model randomness
    epoch: int
    partition: int
    step: int
    epoch_end: bool
    deadline: float | None
    fresh_hyperparameters: bool
    progress: Mapping[int, UnitProgress | None]  # each member's place in its lr_schedule's span


def train_group(
    spec: TrainingSpec,
    config: Mapping[str, Any],
    state: State | None,
    shard: Shard,
    *,
    device: torch.device,
    epoch: int,
    partition: int,
    step: int,
    epoch_end: bool,
    deadline: float | None,
    fresh_hyperparameters: bool,
    budget: int | None = None,
    partitions: int | None = None,
) -> State:
    """One pass of the group over ``shard``; returns the group's new state (on the host).
    ``budget`` (the group's epochs) and ``partitions`` place the unit in each member's
    budget, for the spec's ``lr_schedule``."""
    started = time.perf_counter()
    # The input may still be evaluated, or rolled back to, so the unit must not change it.
    # The fused pass only reads its tensors (it stacks copies), and the one-by-one pass
    # clones a member's state before training it, so the members' states are not cloned
    # here: a ResNet-18 group's clone was a gigabyte copied per unit.
    prior: dict[int, State] = {} if not state else _containers_copied(state["members"])
    failed: dict[int, str] = dict(state.get("failed", {})) if state else {}
    unfused: str | None = state.get("unfused") if state else None
    # A member absent from a group's state left it (stopped) after this unit was sent.
    members = [m for m in group_members(config) if m.model_id not in failed and (state is None or m.model_id in prior)]
    starts = {m.model_id: prior.get(m.model_id) for m in members}
    places = {m.model_id: unit_progress(spec.lr_schedule, m.config, epoch, step, budget, partitions) for m in members}
    unit = _GroupPass(
        spec,
        members,
        starts,
        shard,
        device,
        group_seed(config),
        epoch,
        partition,
        step,
        epoch_end,
        deadline,
        fresh_hyperparameters,
        places,
    )
    trained: dict[int, _Trained] = {}
    if unfused is None:
        try:
            trained = _fused_pass(unit, failed)
        except _STOPS:
            raise
        except Exception as err:  # the members train one by one instead; say why once
            unfused, trained = _fusion_failure(err), {}
    if unfused is not None and members and not trained:
        newly = len(failed)
        trained = _one_by_one(unit, failed)
        if len(failed) > newly and unfused.startswith("ran fused"):
            unfused = None  # a member's own error broke the fused pass; the rest may fuse again
    seconds = time.perf_counter() - started
    out: dict[int, State] = {}
    for m in members:
        if m.model_id in failed or m.model_id not in trained:
            continue
        done = trained[m.model_id]
        progress = _progress(starts[m.model_id], step)
        progress["loss_sum"] += done.loss_sum
        progress["samples"] += done.state["samples"]
        progress["seconds"] += seconds
        add_phase_seconds(progress, done.state.pop("phase_seconds", None))
        done.state["progress"] = progress
        out[m.model_id] = done.state
    return {"members": out, "failed": failed, "unfused": unfused}


def _containers_copied(value: Any) -> Any:
    """``value`` with its dicts, lists and tuples copied and its tensors shared: an
    optimizer or scheduler that loads a state may keep (and change) its containers."""
    if isinstance(value, dict):
        return {key: _containers_copied(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        copied = [_containers_copied(v) for v in value]
        return copied if isinstance(value, list) else tuple(copied)
    return value


def _progress(state: State | None, step: int) -> dict[str, Any]:
    """The epoch's sums so far: the member state's, or new at a model-epoch's first unit."""
    if state is not None and step > 0 and "progress" in state:
        return clone_tensors(state["progress"])
    return {"loss_sum": 0.0, "samples": 0, "seconds": 0.0}


def _fusion_failure(err: BaseException) -> str:
    if isinstance(err, Unfusable):
        return str(err)
    return f"ran fused, but {describe_failure(err).splitlines()[0]}"


def _member_model(spec: TrainingSpec, member: Member, state: State | None, device: torch.device) -> torch.nn.Module:
    """The member's model with its weights: its state's, or new from its own seed."""
    return build_model(spec, member.config, state["model"] if state else None, member.seed).to(device)


def _checked_out(
    spec: TrainingSpec, member: Member, state: State | None, device: torch.device, fresh_hyperparameters: bool = False
) -> tuple[torch.nn.Module, BaseRecord | None]:
    """The member's model as its own unit would check it out: with a frozen base, the
    module this worker keeps for it, whose frozen tensors the worker holds once for
    every member of one checkpoint (so the group stacks them once: :class:`StackedModels`)."""
    return checkout_model(spec, member.config, state, member.seed, device, fresh_hyperparameters=fresh_hyperparameters)


def _fused_pass(unit: _GroupPass, failed: dict[int, str]) -> dict[int, _Trained]:
    """Every member in one batched model; members failing are added to ``failed``."""
    spec, members, starts, device = unit.spec, unit.members, unit.starts, unit.device
    epoch, step = unit.epoch, unit.step
    clock = PhaseClock(device)
    clock.mark()
    if spec.precision == "16-mixed":
        raise Unfusable(
            "precision='16-mixed' scales each model's loss on its own; fused training takes '32' or 'bf16-mixed'"
        )
    with torch.random.fork_rng(devices=[]):
        models, optimizers, schedulers, bases = [], [], [], []
        for m in members:
            hooks = spec.train_hooks(m.config, state=starts[m.model_id], progress={}, epoch=epoch, step=step)
            if type(hooks) is not PlainTrainHooks:
                raise Unfusable(
                    f"the spec trains through {type(hooks).__name__}; fused training takes a plain "
                    "TrainingSpec's optimizer_fn, scheduler_fn and loss_fn"
                )
            model, base = _checked_out(spec, m, starts[m.model_id], device, unit.fresh_hyperparameters)
            bases.append(base)
            model.train()
            optimizer, scheds = hooks.configure(model)
            check_optimizer_params(model, optimizer, m.config)
            # As the one loop does (train_pass): before the restore, and after.
            initial = mark_initial_lr(optimizer) if unit.progress[m.model_id] is not None else None
            start = starts[m.model_id]
            if start:
                restore_optimizer(
                    optimizer,
                    [c.scheduler for c in scheds],
                    start,
                    saved_scheduler_states(start.get("scheduler")),
                    fresh_hyperparameters=unit.fresh_hyperparameters,
                )
            if initial is not None:
                keep_initial_lr(optimizer, initial)
            models.append(model)
            optimizers.append(optimizer)
            schedulers.append(scheds)
        if len({id(model) for model in models}) < len(models):
            raise Unfusable(
                "two members have one config and seed, so the worker keeps one module for both (their frozen base's "
                "module), which cannot hold both members' weights at once"
            )
        stacked = StackedModels(models)
        trainable = stacked.trainable()
        fused = FusedOptimizer.from_members(
            trainable,
            [
                ({n: p for n, p in model.named_parameters() if p.requires_grad}, opt)
                for model, opt in zip(models, optimizers, strict=True)
            ],
        )
        steps = GroupStepping(
            fused,
            optimizers,
            schedulers,
            batches=-(-len(unit.shard) // spec.resolve_batch_size(members[0].config)),
            accumulate=spec.accumulate_grad_batches,
            clip=spec.gradient_clip_val,
            schedule=spec.lr_schedule,
            progress=[unit.progress[m.model_id] for m in members],
        )
        useed = unit_seed(unit.seed, epoch, unit.partition)
        seed_torch(useed)
        shuffle, augment = unit_generators(useed, device)
        clock.mark()
        losses, sizes, count = _fused_batches(unit, stacked, steps, shuffle, augment, failed)
        if unit.epoch_end:
            for optimizer, scheds in zip(optimizers, schedulers, strict=True):
                if count:  # the fused step stepped it (torch's scheduler warns of one never stepped)
                    optimizer.__dict__["_opt_called"] = True
                step_schedulers(scheds, "epoch", epoch + 1, {})
    clock.mark()
    fused.write_back()
    trained = _member_states(
        stacked, models, bases, optimizers, schedulers, members, starts, losses, sizes, count, failed,
        at=(epoch, unit.partition),
    )  # fmt: skip
    clock.mark()
    phases = clock.seconds(PHASES)  # the group's, as each member's time is the group's
    for done in trained.values():
        done.state["phase_seconds"] = dict(phases)
    return trained


def _fused_batches(
    unit: _GroupPass,
    stacked: StackedModels,
    steps: GroupStepping,
    shuffle: torch.Generator,
    augment: torch.Generator,
    failed: dict[int, str],
) -> tuple[list[torch.Tensor], list[int], int]:
    """Train every member on each batch, stepping as ``steps`` says; returns each batch's
    ``[k]`` losses, its rows and the batch count. On the CPU a member whose loss is not
    finite stops stepping (and is added to ``failed``) at once; on a GPU the losses are
    read at the end."""
    spec, members, shard, device, deadline = unit.spec, unit.members, unit.shard, unit.device, unit.deadline
    epoch, partition = unit.epoch, unit.partition
    forward, loss_fn = spec.forward, spec.loss_fn

    default_loss = loss_fn is torch.nn.functional.cross_entropy

    def member_loss(model: torch.nn.Module, x: Any, y: Any) -> Any:
        out, targets = forward(model, x, y)
        if default_loss and isinstance(out, torch.Tensor) and isinstance(targets, torch.Tensor):
            return out, targets  # one cross-entropy for every member, below
        return call_loss(loss_fn, out, targets, x)

    def member_losses(x: Any, y: Any) -> torch.Tensor:
        """Each member's loss on the batch, ``[k]``."""
        out = stacked.batched_forward(x) if spec.forward_fn is None else None
        if out is None:
            found = stacked.call(member_loss, x, y)
            return cross_entropy_per_member(*found) if isinstance(found, tuple) else found
        if default_loss and isinstance(y, torch.Tensor):
            return cross_entropy_per_member(out, y.expand(stacked.k, *y.shape))
        return torch.func.vmap(lambda member_out: call_loss(loss_fn, member_out, y, x), randomness="same")(out)

    on_cpu = device.type == "cpu"
    active = torch.ones(stacked.k, dtype=torch.bool, device=device)
    amp = autocast(spec, device)
    losses: list[torch.Tensor] = []
    sizes: list[int] = []
    rows, rows_total, count = 0, len(shard), 0
    all_active = True
    check_deadline(deadline, 0.0)
    batch_size, items = spec.resolve_batch_size(members[0].config), item_seed(unit.seed, epoch)
    for x, y, n in batches(spec, shard, batch_size, device, shuffle, augment, items):
        count += 1
        steps.zero_grad()
        with amp:
            batch_losses = member_losses(x, y)
        if batch_losses.shape != (stacked.k,):
            raise Unfusable(f"loss_fn returned shape {tuple(batch_losses.shape[1:])} per member, not a scalar")
        if on_cpu:
            _stop_non_finite(batch_losses.detach(), active, members, failed, epoch, partition, rows)
            if not bool(active.any()):
                break
        losses.append(batch_losses.detach())
        sizes.append(n)
        if all_active and on_cpu and not bool(active.all()):
            all_active = False
        if steps.accumulate > 1:
            batch_losses = batch_losses / steps.accumulate
        if all_active:  # the common case: no mask to apply, nothing to guard
            batch_losses.sum().backward()
        else:
            torch.where(active, batch_losses, torch.zeros((), device=device)).sum().backward()
        if steps.step_now():
            steps.step(count - 1, None if all_active else active)
        rows += n
        check_deadline(deadline, rows / rows_total)
    if steps.take_remainder() and bool(active.any()):  # the pass ended within a step's batches
        steps.step(count - 1, None if all_active else active)
    return losses, sizes, count


def cross_entropy_per_member(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(outputs[i], targets[i])`` (its defaults: the mean, ignore_index
    -100) for every member i, ``[k]``: one call over all members' rows, where under
    ``vmap`` torch would decompose it op by op in Python.

    >>> out, y = torch.randn(3, 5, 4), torch.randint(0, 4, (3, 5))
    >>> per_member = cross_entropy_per_member(out, y)
    >>> torch.allclose(per_member, torch.stack([torch.nn.functional.cross_entropy(o, t) for o, t in zip(out, y)]))
    True
    """
    if outputs.dim() < 3:  # not [k, rows, classes, ...]
        return torch.func.vmap(torch.nn.functional.cross_entropy)(outputs, targets)
    k = outputs.shape[0]
    if outputs.dim() == 3 and not targets.is_floating_point():
        # The classes in dim 1 of [k, classes, rows]: log_softmax then runs along the rows,
        # where on [k * rows, classes] it runs one short row at a time (15x slower for 10 classes).
        rows = torch.nn.functional.cross_entropy(outputs.transpose(1, 2), targets, reduction="none")
    else:
        rows = torch.nn.functional.cross_entropy(outputs.flatten(0, 1), targets.flatten(0, 1), reduction="none")
    rows = rows.view(k, -1)
    if targets.is_floating_point():  # class probabilities: the mean over every element
        return rows.mean(1)
    return rows.sum(1) / (targets != -100).view(k, -1).sum(1)  # ignored targets do not count


def _stop_non_finite(
    values: torch.Tensor,
    active: torch.Tensor,
    members: list[Member],
    failed: dict[int, str],
    epoch: int,
    partition: int,
    rows: int,
) -> None:
    for i, value in enumerate(values.tolist()):
        if bool(active[i]) and not math.isfinite(value):
            active[i] = False
            failed[members[i].model_id] = f"NonFiniteLossError: {loss_message(value, epoch, partition, rows)}"


def _member_states(
    stacked: StackedModels,
    models: list[torch.nn.Module],
    bases: list[BaseRecord | None],
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[list[SchedulerConfig]],
    members: list[Member],
    starts: Mapping[int, State | None],
    losses: list[torch.Tensor],
    sizes: list[int],
    count: int,
    failed: dict[int, str],
    at: tuple[int, int],
) -> dict[int, _Trained]:
    """Each member's state as its own pass would leave it, on the host: with a frozen
    base, what hops (the trainable weights and the buffers) and the base's record.
    ``at``: the pass's epoch (from 0) and partition, for a failure's message."""
    table = torch.stack(losses).double() if losses else None
    table, states = to_host(
        (
            table,
            [
                {
                    "model": stacked.member_weights(i, _hopping(model, base)),
                    **({"base": base.as_dict()} if base is not None else {}),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler_state(scheds),
                }
                for i, (model, base, optimizer, scheds) in enumerate(
                    zip(models, bases, optimizers, schedulers, strict=True)
                )
            ],
        )
    )
    finite = _finite_members(stacked)
    out: dict[int, _Trained] = {}
    for i, m in enumerate(members):
        if m.model_id in failed:
            continue
        column = table[:, i].tolist() if table is not None else []
        total, samples = 0.0, 0
        for value, n in zip(column, sizes, strict=True):
            if not math.isfinite(value):
                failed[m.model_id] = f"NonFiniteLossError: {loss_message(value, at[0], at[1], samples)}"
                break
            total += value * n
            samples += n
        if m.model_id in failed or (not finite[i] and _non_finite_weights(m, states[i]["model"], failed, at)):
            continue
        start = starts[m.model_id]
        states[i]["samples"] = samples
        states[i]["steps"] = (start.get("steps", 0) if start else 0) + count
        out[m.model_id] = _Trained(states[i], total)
    return out


def _hopping(model: torch.nn.Module, base: BaseRecord | None) -> list[str]:
    """The state-dict names of what hops of ``model``: all, or all but its base's frozen tensors."""
    frozen = set(frozen_names(model)) if base is not None else set()
    return [name for name in model.state_dict() if name not in frozen]


@torch.no_grad()
def _finite_members(stacked: StackedModels) -> list[bool]:
    """Whether each member's weights are surely all finite, from one sum per member and
    stacked tensor: a NaN or an infinity makes the sum one too, so a finite sum needs no
    look at each weight (``isfinite`` over 8 ResNet-18s' weights took 0.17 s a unit). A
    sum that is not finite may also come from finite weights too large to add up: such a
    member's weights are looked at one by one."""
    sums = [t.reshape(stacked.k, -1).sum(1) for t in (*stacked.params.values(), *stacked.buffers.values())
            if t.is_floating_point() and t.numel()]  # fmt: skip
    if not sums:
        return [True] * stacked.k
    return torch.isfinite(torch.stack([s.float() for s in sums])).all(0).tolist()


def _non_finite_weights(
    member: Member, weights: Mapping[str, torch.Tensor], failed: dict[int, str], at: tuple[int, int]
) -> bool:
    for name, tensor in weights.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            failed[member.model_id] = (
                f"NonFiniteWeightsError: weight {name!r} is not finite after the pass over partition {at[1]} in "
                f"epoch {at[0] + 1} (the optimizer "
                "step after the last finite loss wrote NaN or infinity)"
            )
            return True
    return False


def _one_by_one(unit: _GroupPass, failed: dict[int, str]) -> dict[int, _Trained]:
    """Each member through the one loop in turn, with the group's data order."""
    spec, starts, device, epoch, step = unit.spec, unit.starts, unit.device, unit.epoch, unit.step
    out: dict[int, _Trained] = {}
    for m in unit.members:
        start = starts[m.model_id]
        try:
            if start is None:  # its own initial weights, then the group's seed for the pass
                with torch.random.fork_rng(devices=[]):
                    start = {"model": dict(_member_model(spec, m, None, torch.device("cpu")).state_dict())}
            private = clone_tensors(start) if device.type == "cpu" else start  # a fused try may have begun
            hooks = spec.train_hooks(
                m.config, state=private, progress=_progress(starts[m.model_id], step), epoch=epoch, step=step
            )
            new = train_pass(
                spec,
                hooks,
                m.config,
                private,
                unit.shard,
                seed=unit.seed,
                epoch=epoch,
                partition=unit.partition,
                step=step,
                epoch_end=unit.epoch_end,
                deadline=unit.deadline,
                fresh_hyperparameters=unit.fresh_hyperparameters,
                progress=unit.progress[m.model_id],
            )
        except _STOPS:
            raise
        except Exception as err:  # this member's code: it fails alone
            failed[m.model_id] = describe_failure(err)
            continue
        if _non_finite_weights(m, new["model"], failed, (epoch, unit.partition)):
            continue
        out[m.model_id] = _Trained(new, new.pop("loss_sum"))  # its own pass's phase_seconds stay
    return out


def evaluate_group(spec: TrainingSpec, config: Mapping[str, Any], state: State, shard: Shard | None) -> EvalResult:
    """Every member evaluated on ``shard``: on a GPU in one batched pass where the group
    trains fused, else each on its own; a member whose code raises fails alone.

    On the CPU each member's own pass is the faster: without a backward, oneDNN's
    convolutions beat the products that training fuses, and the members' outputs need
    no stacking (``python benchmarks/compare_fused_unit.py --arch cnn --eval`` under the
    workers' allocator thresholds: 0.39-0.40 s against 0.65-0.73 s for 8 members on
    10,000 rows; the MLP's, 0.063 s against 0.078 s)."""
    started = time.perf_counter()
    failed = dict(state.get("failed", {}))
    members = [m for m in group_members(config) if m.model_id in state["members"] and m.model_id not in failed]
    results: dict[int, EvalResult] = {}
    batched = state.get("unfused") is None and pick_device(spec).type != "cpu"
    if batched and shard is not None and len(shard) > 0 and len(members) > 1:
        try:
            results = _fused_evaluation(spec, members, state["members"], shard)
        except _STOPS:
            raise
        except Exception:  # evaluated one by one below, where a member's own error fails it alone
            results = {}
    if not results:
        for m in members:
            member_started = time.perf_counter()
            member_state = state["members"][m.model_id]
            try:
                result = evaluate_pass(
                    spec, spec.eval_hooks(m.config, member_state), m.config, member_state, shard, seed=m.seed
                )
            except _STOPS:
                raise
            except Exception as err:
                failed[m.model_id] = describe_failure(err)
                continue
            results[m.model_id] = dataclasses.replace(
                result, seconds=time.perf_counter() - member_started, progress=member_state["progress"]
            )
    return _group_result(results, failed, state, time.perf_counter() - started)


def _fused_evaluation(
    spec: TrainingSpec, members: list[Member], states: Mapping[int, State], shard: Shard
) -> dict[int, EvalResult]:
    """The plain validation pass (``loss_fn`` and ``metrics``, each batch mean times its
    rows, summed in batch order) for every member in one batched model."""
    if type(spec.eval_hooks(members[0].config, states[members[0].model_id])) is not PlainEvalHooks:
        raise Unfusable("the spec evaluates through hooks of its own")
    started = time.perf_counter()
    device = pick_device(spec)
    with torch.random.fork_rng(devices=[]):
        models = [_checked_out(spec, m, states[m.model_id], device)[0].eval() for m in members]
    stacked = StackedModels(models)
    forward, loss_fn, metrics = spec.forward, spec.loss_fn, list(spec.metrics.values())

    def scores(out: Any, targets: Any, x: Any) -> torch.Tensor:
        found = [call_loss(loss_fn, out, targets, x), *(fn(out, targets) for fn in metrics)]
        return torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()) for v in found])

    def values(model: torch.nn.Module, x: Any, y: Any) -> torch.Tensor:
        return scores(*forward(model, x, y), x)

    def member_values(x: Any, y: Any) -> torch.Tensor:
        """Each member's loss and metrics on the batch, ``[k, 1 + metrics]``."""
        out = stacked.batched_forward(x) if spec.forward_fn is None else None
        if out is None:
            return stacked.call(values, x, y)
        return torch.func.vmap(lambda member_out: scores(member_out, y, x))(out)

    per_batch, sizes = [], []
    amp = autocast(spec, device)
    # k members' activations at once: batches 1/k the size keep the memory of one model's pass.
    batch_size = max(1, -(-spec.eval_batch_size // len(members)))
    with torch.no_grad():
        for x, y, n in batches(spec, shard, batch_size, device, None, None):
            with amp:
                per_batch.append(member_values(x, y))
            sizes.append(n)
    table = to_host(torch.stack(per_batch)).tolist()  # [batches][k][1 + metrics]
    seconds = (time.perf_counter() - started) / len(members)
    out = {}
    for i, m in enumerate(members):
        sums = [0.0] * (1 + len(metrics))
        for row, n in zip(table, sizes, strict=True):  # in batch order, as the plain pass adds them
            for j, value in enumerate(row[i]):
                sums[j] += value * n
        out[m.model_id] = EvalResult(
            sums[0], dict(zip(spec.metrics, sums[1:], strict=True)), sum(sizes), seconds, states[m.model_id]["progress"]
        )
    return out


def group_figures(state: State) -> EvalResult:
    """An evaluation of a group without validation data: each member's training figures."""
    results = {mid: EvalResult(None, {}, 0, 0.0, s["progress"]) for mid, s in state["members"].items()}
    return _group_result(results, dict(state.get("failed", {})), state, 0.0)


def _group_result(results: dict[int, EvalResult], failed: dict[int, str], state: State, seconds: float) -> EvalResult:
    return EvalResult(None, {}, 0, seconds, {"unfused": state.get("unfused")}, members=results, failed=failed)
