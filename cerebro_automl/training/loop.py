"""THE training loop of a unit, and the validation pass: every spec trains through
them, filling in hooks.

A pass rebuilds the model from its config and state, restores the optimizer and
LR schedulers, seeds the unit, runs the batches, steps the schedulers, and
returns the new state. What differs between a plain :class:`TrainingSpec` and
the Lightning adapter (how the optimizer is built, how a batch's loss is
computed, what runs around the optimizer step) is a :class:`TrainHooks` the spec
makes for each pass; errors, seeds, the state's form and the phases' clock are
the loop's, so they are the same on every path.

A batch, in order (the optional hooks a spec leaves as None cost nothing)::

    batch_start -> [zero_grad] -> step_loss (under autocast) -> loss check
    -> before_zero_grad -> [zero_grad] -> before_backward -> backward
    -> after_backward -> unscale (16-mixed) -> clip -> before_optimizer_step -> step
    -> after_optimizer_step -> "step" schedulers -> batch_end -> deadline check

``zero_grad`` runs once: first (``zero_grad_first``, plain PyTorch's order, which
frees the old gradients before the forward pass) or after the loss
(Lightning's order).

With ``accumulate_grad_batches=k`` the gradients of k batches add up (each loss
divided by k) before one optimizer step, and ``zero_grad`` runs before the first
of them; a pass that ends within a group steps on what it has, since gradients do
not hop between units. ``gradient_clip_val`` clips the gradients' total norm
before every optimizer step (after unscaling, under ``"16-mixed"``).

A gang unit's ranks (:mod:`.gang`) train through this same loop: under
:func:`synced_passes`, a :class:`PassSync` sets the rank's batch size and the
gang's step count, pads the rank's batches with empty ones once its rows run out,
and sums the ranks' gradients before each optimizer step.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .base import checkout_model, hopping_weights
from .batches import batches
from .devices import PHASES, PhaseClock, pick_device
from .errors import NonFiniteLossError
from .metrics import EvalResult
from .precision import autocast, grad_scaler
from .restore import check_optimizer_params, restore_optimizer, structure_entry
from .schedulers import (
    SchedulerConfig,
    UnitProgress,
    keep_initial_lr,
    mark_initial_lr,
    saved_scheduler_states,
    scheduler_state,
    step_schedulers,
)
from .seeding import item_seed, seed_torch, unit_generators, unit_seed
from .stepping import Stepping
from .transfer import State, clone_tensors, to_host
from .watch import check_deadline

if TYPE_CHECKING:
    from ..data import Shard
    from .contract import RunSpec

__all__ = [
    "TrainHooks",
    "EvalHooks",
    "PassLoss",
    "PassSync",
    "synced_passes",
    "train_pass",
    "evaluate_pass",
    "losses_checked",
]

_NOTHING: Mapping[str, Any] = MappingProxyType({})


class TrainHooks:
    """What one training pass asks of the model code; a spec makes one per pass.

    A subclass defines :meth:`configure` and :meth:`step_loss`, and, as methods,
    those of the optional hooks (None here) it needs; a spec returns it from
    ``train_hooks``::

        class ClippedHooks(TrainHooks):
            def configure(self, model):
                return torch.optim.SGD(model.parameters(), lr=0.1), []

            def step_loss(self, model, batch, batch_idx):
                x, y = batch
                return torch.nn.functional.cross_entropy(model(x), y)

            def before_optimizer_step(self, optimizer):  # an optional hook
                torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], 1.0)
    """

    #: zero the gradients before the forward pass rather than between the loss and backward
    zero_grad_first: bool = True
    #: ``batch_idx`` of the pass's first batch (Lightning counts batches across a model-epoch)
    first_batch: int = 0
    #: entries the new state carries besides the loop's own
    extra_state: Mapping[str, Any] = _NOTHING
    #: the values "step" schedulers may monitor, read after each optimizer step
    step_values: Mapping[str, Any] = _NOTHING
    #: what builds the optimizer, and how it reaches every trainable parameter: the
    #: error for an optimizer that lacks some names them
    optimizer_built_by: tuple[str, str] = ("optimizer_fn", "build it from the parameters it is given")

    epoch_start: Callable[[], None] | None = None
    """In the first unit of a model-epoch, after seeding, before the first batch."""
    batch_start: Callable[[Any, Any, int, int], Any] | None = None
    """``(x, y, rows, batch_idx) -> batch`` handed to :meth:`step_loss`; without it, ``(x, y)``."""
    before_zero_grad: Callable[[torch.optim.Optimizer], None] | None = None
    before_backward: Callable[[torch.Tensor], None] | None = None
    after_backward: Callable[[], None] | None = None
    before_optimizer_step: Callable[[torch.optim.Optimizer], None] | None = None
    after_optimizer_step: Callable[[int], None] | None = None
    """``(batch_idx)``, before the "step" schedulers step."""
    batch_end: Callable[[Any, int], None] | None = None
    """``(batch, batch_idx)``, after every batch, skipped or not."""
    pass_end: Callable[[int], None] | None = None
    """``(batches)``: the number of batches the pass ran."""
    epoch_end: Callable[[PassLoss], Mapping[str, Any]] | None = None
    """In the last unit of a model-epoch: returns the values "epoch" schedulers may monitor."""

    def attached(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """A context around the optimizer's set-up, the batches and the epoch's end."""
        return contextlib.nullcontext()

    def configure(self, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, list[SchedulerConfig]]:
        """The optimizer of ``model`` and its LR schedulers, built from the config."""
        raise NotImplementedError

    def step_loss(self, model: torch.nn.Module, batch: Any, batch_idx: int) -> torch.Tensor | None:
        """The batch's loss, a scalar tensor (a batch mean); None skips the optimizer step."""
        raise NotImplementedError


class PassSync(Protocol):
    """How the ranks of a gang unit (:mod:`.gang`) keep their passes in step: each
    trains its own shard, with its share of the batch, for the gang's number of steps
    (past its own rows, with empty batches: ``rows`` 0), and their gradients are
    summed before every optimizer step."""

    batch_size: int  # this rank's rows a batch
    steps: int  # the batches every rank runs (the most any rank's rows make)

    def spanning(self, progress: UnitProgress | None) -> UnitProgress | None:
        """Where the pass stands in the schedule's span, over the gang's partitions."""

    def padded(self, source: Iterable[tuple[Any, Any, int]]) -> Iterator[tuple[Any, Any, int]]:
        """``source``'s batches, then empty ones ``(None, None, 0)`` up to ``steps``."""

    def reduce(self, model: torch.nn.Module) -> None:
        """Replace each gradient with the gang's, weighted by the ranks' rows."""

    def finish(self, state: State) -> None:
        """Make the pass's loss, samples and steps the gang's."""


# .sync: the PassSync of the gang this thread's passes train in (see synced_passes)
_gang = threading.local()


@contextlib.contextmanager
def synced_passes(sync: PassSync) -> Iterator[None]:
    """Within the block, this thread's training passes are ranks of a gang unit, kept
    in step by ``sync``."""
    _gang.sync = sync
    try:
        yield
    finally:
        _gang.sync = None


class EvalHooks:
    """What one validation pass asks of the model code; a spec makes one per pass."""

    def attached(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """A context around the batches."""
        return contextlib.nullcontext()

    def step(self, model: torch.nn.Module, x: Any, y: Any, rows: int, batch_idx: int) -> None:
        """One batch, under ``torch.no_grad()`` and autocast."""
        raise NotImplementedError

    def result(self) -> EvalResult:
        """The shard's sums, once every batch ran."""
        raise NotImplementedError

    def empty(self) -> EvalResult:
        """The result of a shard without rows."""
        raise NotImplementedError


class PassLoss:
    """The summed training loss of a pass: read as the batches run on the CPU, read
    together at the end on a GPU (a read waits for the device)."""

    def __init__(self, epoch: int, partition: int) -> None:
        self.epoch, self.partition = epoch, partition
        self.sum, self.samples = 0.0, 0
        self.sizes: list[int] = []
        self.pending: list[torch.Tensor] = []

    def total(self) -> tuple[float, int]:
        """``(summed loss, rows)``, reading the losses still on the device; raises
        :class:`NonFiniteLossError` naming the first non-finite one."""
        if self.pending:
            self.read(self.pending)
        return self.sum, self.samples

    def read(self, losses: Iterable[torch.Tensor]) -> None:
        """Take the device's losses (here or on the host) as read."""
        self.sum, self.pending = losses_checked(list(losses), self.sizes, self.epoch, self.partition), []


def losses_checked(losses: list[torch.Tensor], sizes: list[int], epoch: int, partition: int) -> float:
    """The pass's summed loss (each batch mean times its rows, added in batch order,
    as a per-batch ``float`` would), from losses read off the device together;
    raises :class:`NonFiniteLossError` naming the first non-finite one."""
    values = torch.stack([v.double() for v in losses]).tolist() if losses else []
    total, samples = 0.0, 0
    for value, n in zip(values, sizes, strict=True):
        if not math.isfinite(value):
            raise NonFiniteLossError(loss_message(value, epoch, partition, samples))
        total += value * n
        samples += n
    return total


def loss_message(value: float, epoch: int, partition: int, samples: int) -> str:
    """Where a loss turned ``value`` (NaN or infinite), epochs counted from 1 as reports
    count them, and what causes one."""
    return (
        f"loss is {value} at epoch {epoch + 1}, partition {partition}, sample {samples} (NaN or infinity in "
        "the inputs or labels, or a learning rate too large)"
    )


def train_pass(
    spec: RunSpec,
    hooks: TrainHooks,
    config: Mapping[str, Any],
    state: State | None,
    shard: Shard,
    *,
    seed: int,
    epoch: int,
    partition: int,
    step: int,
    epoch_end: bool,
    deadline: float | None = None,
    fresh_hyperparameters: bool = False,
    progress: UnitProgress | None = None,
) -> State:
    """One pass over ``shard`` from ``state`` (a private copy); returns the new state
    with ``loss_sum`` (the pass's summed training loss) and ``phase_seconds``.

    ``deadline``: see :func:`check_deadline`. ``fresh_hyperparameters``: see
    :func:`restore_optimizer`. ``progress``: where the unit stands in the span of
    the spec's ``lr_schedule``, which sets the learning rate of every step.
    """
    device = pick_device(spec)
    clock = PhaseClock(device)
    clock.mark()
    sync: PassSync | None = getattr(_gang, "sync", None)  # None: a plain unit
    if sync is not None:
        progress = sync.spanning(progress)
    with torch.random.fork_rng(devices=[]):
        model, base = checkout_model(spec, config, state, seed, device, fresh_hyperparameters=fresh_hyperparameters)
        model.train()
        with hooks.attached(model):
            optimizer, schedulers = hooks.configure(model)
            check_optimizer_params(model, optimizer, config, *hooks.optimizer_built_by)
            # Before the restore: a state's own initial_lr wins; after, a state saved without one gets the config's.
            initial = mark_initial_lr(optimizer) if progress is not None else None
            if state:
                restore_optimizer(
                    optimizer,
                    [c.scheduler for c in schedulers],
                    state,
                    saved_scheduler_states(state.get("scheduler")),
                    fresh_hyperparameters=fresh_hyperparameters,
                )
            if initial is not None:
                keep_initial_lr(optimizer, initial)
            scaler = grad_scaler(spec, device, state)
            clock.mark()
            useed = unit_seed(seed, epoch, partition)
            seed_torch(useed)  # dropout and other in-model randomness
            shuffle, augment = unit_generators(useed, device)
            if step == 0 and hooks.epoch_start is not None:
                hooks.epoch_start()
            loss = PassLoss(epoch, partition)
            batch_size = spec.resolve_batch_size(config) if sync is None else sync.batch_size
            stepping = Stepping(spec.accumulate_grad_batches, spec.gradient_clip_val, spec.lr_schedule, progress)
            stepping.batches = -(-len(shard) // batch_size) if sync is None else sync.steps
            # Closed here, not when an error's traceback lets go of it: the shard may decode in threads.
            items = item_seed(seed, epoch)  # a file source's random_transform, per item
            with contextlib.closing(batches(spec, shard, batch_size, device, shuffle, augment, items)) as source:
                count = _run_batches(
                    hooks,
                    model,
                    optimizer,
                    scaler,
                    schedulers,
                    loss,
                    source if sync is None else sync.padded(source),
                    autocast(spec, device),
                    device.type == "cpu",
                    len(shard),
                    deadline,
                    stepping,
                    sync,
                )
            if hooks.pass_end is not None:
                hooks.pass_end(count)
            if epoch_end:
                values = hooks.epoch_end(loss) if hooks.epoch_end is not None else _NOTHING
                step_schedulers(schedulers, "epoch", epoch + 1, values)
            clock.mark()
    new_state, stacked = to_host(
        (
            {
                "model": hopping_weights(model, base, copy=device.type == "cpu"),
                **({"base": base.as_dict()} if base is not None else {}),
                "structure": structure_entry(state, config, model),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler_state(schedulers),
                "samples": loss.samples,
                "steps": (state.get("steps", 0) if state else 0) + len(loss.sizes),
                **hooks.extra_state,
                **({"scaler": scaler.state_dict()} if scaler is not None else {}),
            },
            torch.stack(loss.pending) if loss.pending else None,
        )
    )
    clock.mark()
    if stacked is not None:
        loss.read(stacked)
    new_state["loss_sum"] = loss.sum
    if sync is not None:
        sync.finish(new_state)
    new_state["phase_seconds"] = clock.seconds(PHASES)
    return new_state


def _run_batches(
    hooks: TrainHooks,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    schedulers: list[SchedulerConfig],
    tally: PassLoss,
    source: Iterable[tuple[Any, Any, int]],
    amp: contextlib.AbstractContextManager[Any],
    on_cpu: bool,
    rows_total: int,
    deadline: float | None,
    stepping: Stepping | None = None,
    sync: PassSync | None = None,
) -> int:
    """Train on every batch of ``source``; returns how many ran. The CPU reads each
    loss before its step, for free; on a GPU the losses stay on the device
    (``tally.pending``)."""
    stepping = stepping or Stepping()
    step_loss, batch_start, batch_end = hooks.step_loss, hooks.batch_start, hooks.batch_end
    before_zero_grad, before_backward = hooks.before_zero_grad, hooks.before_backward
    after_backward, before_step = hooks.after_backward, hooks.before_optimizer_step
    after_step, zero_first, first = hooks.after_optimizer_step, hooks.zero_grad_first, hooks.first_batch
    by_step = [c for c in schedulers if c.interval == "step"]
    epoch, partition, sizes, pending = tally.epoch, tally.partition, tally.sizes, tally.pending
    total, samples, rows, count = 0.0, 0, 0, 0
    scale = stepping.accumulate

    def optimizer_step(batch_idx: int) -> None:
        if sync is not None:  # as DDP: the gang's gradients, before unscaling, clipping and the hooks
            sync.reduce(model)
        stepping.set_lr(optimizer, batch_idx - first)
        if scaler is not None:
            scaler.unscale_(optimizer)  # the hook sees true gradients, as in Lightning
        stepping.clip_gradients(optimizer)
        if before_step is not None:
            before_step(optimizer)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        if after_step is not None:
            after_step(batch_idx)
        if by_step:
            step_schedulers(by_step, "step", batch_idx + 1, hooks.step_values)

    check_deadline(deadline, 0.0)  # the first batch begins: its progress is timed from here
    batch_idx = first - 1
    for x, y, n in source:
        batch_idx = first + count
        count += 1
        if n == 0:  # a gang's rank past its rows: it steps with the others, on their gradients
            if stepping.step_now():
                optimizer_step(batch_idx)
            check_deadline(deadline, 1.0)
            continue
        batch = (x, y) if batch_start is None else batch_start(x, y, n, batch_idx)
        if zero_first and stepping.starts_group():
            optimizer.zero_grad(set_to_none=True)
        with amp:
            loss = step_loss(model, batch, batch_idx)
        if loss is not None:
            if on_cpu:
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise NonFiniteLossError(loss_message(value, epoch, partition, samples))
                total += value * n
            else:
                pending.append(loss.detach())
            sizes.append(n)
            samples += n
            if not zero_first and stepping.starts_group():
                if before_zero_grad is not None:
                    before_zero_grad(optimizer)
                optimizer.zero_grad(set_to_none=True)
            if before_backward is not None:
                before_backward(loss)
            if scale > 1:
                loss = loss / scale
            (loss if scaler is None else scaler.scale(loss)).backward()
            if after_backward is not None:
                after_backward()
            if stepping.step_now():
                optimizer_step(batch_idx)
        if batch_end is not None:
            batch_end(batch, batch_idx)
        rows += n
        check_deadline(deadline, rows / rows_total)
    if stepping.take_remainder():  # the pass ended within a group: its gradients do not hop
        optimizer_step(batch_idx)
    tally.sum, tally.samples = total, samples
    return count


def evaluate_pass(
    spec: RunSpec, hooks: EvalHooks, config: Mapping[str, Any], state: State, shard: Shard | None, *, seed: int
) -> EvalResult:
    """One validation pass over ``shard`` (the state is not changed); ``seconds`` and
    ``progress`` of the result are filled in by the unit."""
    if shard is None or len(shard) == 0:
        return hooks.empty()
    device = pick_device(spec)
    # A copy on the CPU: the state's tensors are shared with the next unit and the other
    # shards' evaluations, and a module may write its buffers in validation.
    weights = clone_tensors(state["model"]) if device.type == "cpu" and "base" not in state else state["model"]
    with torch.random.fork_rng(devices=[]):
        model, _ = checkout_model(spec, config, {**state, "model": weights}, seed, device)
    model.eval()
    amp, step = autocast(spec, device), hooks.step
    with hooks.attached(model), torch.no_grad():
        for batch_idx, (x, y, n) in enumerate(batches(spec, shard, spec.eval_batch_size, device, None, None)):
            with amp:
                step(model, x, y, n, batch_idx)
    return hooks.result()
