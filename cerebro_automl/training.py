"""TrainingSpec and the unit functions that run on the workers.

A *unit* trains one model for one pass over one partition's train shard. It
rebuilds the model from its config, loads the state it was handed, trains, and
returns the new state (a plain dict of tensors, which Dask moves zero-copy)
with the unit's metrics. Everything a unit computes depends only on the
config, the state, the shard and a seed derived from (model seed, epoch,
partition), so the order in which units run never changes their results.

Example:
    >>> import torch
    >>> spec = TrainingSpec(
    ...     model_fn=lambda c: torch.nn.Linear(4, 2),
    ...     optimizer_fn=lambda c, params: torch.optim.SGD(params, lr=c["lr"]),
    ...     loss_fn=torch.nn.functional.cross_entropy,
    ...     metrics={"accuracy": accuracy},
    ...     batch_size=32,
    ... )
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

from .shards import Shard
from .structure import call_model, to_device

__all__ = [
    "TrainingSpec", "EvalResult", "UnitError", "UnitTimeout", "UnitAbandoned", "abandon_when", "check_deadline",
    "NonFiniteLossError",
    "accuracy",
    "model_seed", "unit_seed", "canonical_config", "train_unit", "evaluate_unit",
    "epoch_metrics", "build_model", "batches", "unit_generators", "restore_optimizer",
    "weights_layout", "layout_mismatch", "to_cpu",
]

State = dict  # {"model": {name: tensor}, "optimizer": ..., "scheduler": ..., "samples", "steps", "progress"}


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Fraction of rows whose arg-max equals the target class (a batch mean)."""
    return (outputs.argmax(dim=-1) == targets).float().mean()


@dataclass(frozen=True)
class TrainingSpec:
    """What to train, in plain PyTorch.

    Args:
        model_fn: ``config -> nn.Module``.
        optimizer_fn: ``(config, parameters) -> torch.optim.Optimizer``.
        loss_fn: ``(outputs, targets) -> scalar tensor``, a mean over the batch.
        metrics: named ``(outputs, targets) -> scalar tensor`` batch means,
            reported on the validation set as ``val_<name>``.
        batch_size: an int, or the name of a config key holding one.
        scheduler_fn: optional ``(config, optimizer) -> LRScheduler``, stepped
            once per epoch.
        eval_batch_size: batch size for validation (default 1024).
        device: ``"auto"`` (CUDA when the worker has a GPU), ``"cpu"`` or ``"cuda"``.
        forward_fn: optional ``(model, x, y) -> (outputs, targets)``, for models that
            are not called as ``model(x)`` (tensor), ``model(*x)`` (tuple) or
            ``model(**x)`` (dict), or whose targets are not ``y`` (an autoencoder
            returns ``(model(x), x)``).
        train_transform: optional ``(x, y, generator) -> (x, y)``, run on every
            training batch on the unit's device (augmentation); ``generator`` is a
            ``torch.Generator`` on that device seeded from the unit's seed, so
            augmented runs stay bitwise reproducible.
        eval_transform: optional ``(x, y) -> (x, y)``, run on every validation batch.

    ``loss_fn(outputs, targets)`` and each metric receive the targets as they are:
    a tensor, a tuple or dict of tensors, or None for unlabeled data.
    """

    model_fn: Callable[[Mapping[str, Any]], torch.nn.Module]
    optimizer_fn: Callable[[Mapping[str, Any], Any], torch.optim.Optimizer]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.nn.functional.cross_entropy
    metrics: Mapping[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    batch_size: int | str = 32
    scheduler_fn: Callable[[Mapping[str, Any], torch.optim.Optimizer], Any] | None = None
    eval_batch_size: int = 1024
    device: str = "auto"
    forward_fn: Callable[[torch.nn.Module, Any, Any], tuple[Any, Any]] | None = None
    train_transform: Callable[[Any, Any, torch.Generator], tuple[Any, Any]] | None = None
    eval_transform: Callable[[Any, Any], tuple[Any, Any]] | None = None

    def __post_init__(self) -> None:
        for name in ("model_fn", "optimizer_fn", "loss_fn"):
            if not callable(getattr(self, name)):
                raise TypeError(f"{name} is {getattr(self, name)!r}, but must be callable")
        for name in ("forward_fn", "train_transform", "eval_transform"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"{name} is {getattr(self, name)!r}, but must be callable or None")
        if self.scheduler_fn is not None and not callable(self.scheduler_fn):
            raise TypeError(f"scheduler_fn is {self.scheduler_fn!r}, but must be callable or None")
        if not isinstance(self.metrics, Mapping):
            raise TypeError(f"metrics is {self.metrics!r}, but must be a dict of name -> callable")
        for name, fn in self.metrics.items():
            if not isinstance(name, str) or not callable(fn):
                raise TypeError(f"metrics[{name!r}] is {fn!r}, but must be callable with a str name")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, (int, str)):
            raise TypeError(f"batch_size is {self.batch_size!r}, but must be a positive int or a config key")
        if isinstance(self.batch_size, int) and self.batch_size < 1:
            raise ValueError(f"batch_size is {self.batch_size}, but must be a positive int")
        if not isinstance(self.eval_batch_size, int) or self.eval_batch_size < 1:
            raise ValueError(f"eval_batch_size is {self.eval_batch_size!r}, but must be a positive int")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device is {self.device!r}, but must be 'auto', 'cpu' or 'cuda'")

    def forward(self, model: torch.nn.Module, x: Any, y: Any) -> tuple[Any, Any]:
        """``(outputs, targets)`` of one batch: ``forward_fn``, or the model called on ``x``."""
        if self.forward_fn is None:
            return call_model(model, x), y
        out = self.forward_fn(model, x, y)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"forward_fn returned {type(out).__name__}, but must return (outputs, targets)")
        return out

    def transform(self, x: Any, y: Any, generator: torch.Generator | None) -> tuple[Any, Any]:
        """A batch after ``train_transform`` (with a generator) or ``eval_transform`` (without)."""
        fn, args = ((self.train_transform, (generator,)) if generator is not None
                    else (self.eval_transform, ()))
        if fn is None:
            return x, y
        out = fn(x, y, *args)
        if not (isinstance(out, tuple) and len(out) == 2):
            name = "train_transform" if generator is not None else "eval_transform"
            raise TypeError(f"{name} returned {type(out).__name__}, but must return (x, y)")
        return out

    @property
    def metric_names(self) -> list[str]:
        """The history columns an epoch produces."""
        return ["train_loss", "val_loss"] + [f"val_{name}" for name in self.metrics]

    # The two passes a unit runs. Subclasses (the Lightning adapter) drive other
    # model code through the same units, seeds and states.
    def train_pass(self, config: Mapping[str, Any], state: State | None,
                   shard: Shard, *, seed: int, epoch: int, partition: int,
                   step: int, epoch_end: bool, progress: dict[str, Any],
                   deadline: float | None = None, fresh_hyperparameters: bool = False) -> State:
        """One pass over ``shard`` from ``state`` (a private copy); returns the new
        state with ``loss_sum``, the summed training loss of the pass.
        ``progress`` holds the epoch's sums so far (before this pass); past
        ``deadline`` (a ``time.perf_counter()`` value) :func:`check_deadline` raises.
        ``fresh_hyperparameters``: see :func:`restore_optimizer`."""
        return _train(self, config, state, shard, seed, epoch, partition, epoch_end, deadline,
                      fresh_hyperparameters)

    def evaluate_pass(self, config: Mapping[str, Any], state: State,
                      shard: Shard | None, *, seed: int) -> EvalResult:
        """Sums over one validation shard (``seconds`` and ``progress`` are filled in by the unit)."""
        return _evaluate(self, config, state, shard, seed)

    def resolve_batch_size(self, config: Mapping[str, Any]) -> int:
        """The batch size for ``config``; raises naming the value when it is not a positive int."""
        value, source = self.batch_size, "batch_size"
        if isinstance(value, str):
            if value not in config:
                raise ValueError(f"batch_size names config key {value!r}, which config {dict(config)} lacks")
            value, source = config[value], f"config[{value!r}] (the batch size)"
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{source} is {value!r}, but must be a positive int")
        return value

    def validate_config(self, config: Mapping[str, Any]) -> None:
        """Build the model and optimizer on the meta device (no memory, no compute)
        so that a config missing a key fails before any training starts."""
        self.resolve_batch_size(config)
        try:
            with torch.device("meta"):
                model = self.model_fn(config)
                if not isinstance(model, torch.nn.Module):
                    raise _NotAModule(type(model).__name__)
                optimizer = self.optimizer_fn(config, model.parameters())
                if self.scheduler_fn is not None:
                    self.scheduler_fn(config, optimizer)
        except _NotAModule as err:
            raise TypeError(f"model_fn returned {err}, but must return a torch.nn.Module") from None
        except KeyError as err:
            raise ValueError(f"config {dict(config)} lacks key {err.args[0]!r}, "
                             "which model_fn, optimizer_fn or scheduler_fn reads") from None
        except Exception:
            # Some code cannot run on the meta device (data-dependent init, say);
            # a real error surfaces in the model's first unit and fails that model only.
            return


class _NotAModule(Exception):
    """model_fn returned something other than a torch.nn.Module (its type name)."""


# ------------------------------------------------------------------- seeding
def canonical_config(config: Mapping[str, Any]) -> str:
    """The config as canonical JSON; raises TypeError naming a key whose value is not JSON."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config is {config!r}, but must be a dict")
    for key in config:
        if not isinstance(key, str):
            raise TypeError(f"config key {key!r} is a {type(key).__name__}, but keys must be str")
    try:
        return json.dumps(config, sort_keys=True, allow_nan=False, default=_json_default)
    except (TypeError, ValueError) as err:
        raise TypeError(f"config {config!r} is not JSON-serialisable: {err}") from None


def _json_default(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy and torch scalars
    if callable(item) and getattr(value, "ndim", 1) == 0:
        return item()
    raise TypeError(f"value {value!r} of type {type(value).__name__} is not a number, str, bool, None, list or dict")


def _hash_seed(*parts: Any) -> int:
    digest = hashlib.sha256(json.dumps(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def model_seed(session_seed: int, config: Mapping[str, Any]) -> int:
    """A model's seed: from the session seed and the canonical form of its config."""
    return _hash_seed("model", session_seed, canonical_config(config))


def unit_seed(seed: int, epoch: int, partition: int) -> int:
    """The seed of one unit (shuffling, dropout): from (model seed, epoch, partition)."""
    return _hash_seed("unit", seed, epoch, partition)


# ---------------------------------------------------------------------- units
class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


class UnitTimeout(RuntimeError):
    """A train unit ran past the session's ``unit_timeout``."""


class UnitAbandoned(RuntimeError):
    """The unit's result is no longer wanted (its model stopped or rolled back, or a
    speculative copy of it finished first): it stopped after a batch."""


_abandon_check = threading.local()  # .fn: the running unit's "is my result still wanted?" test


@contextlib.contextmanager
def abandon_when(check: Callable[[], bool]) -> Iterator[None]:
    """Within the block, :func:`check_deadline` in this thread also raises
    :class:`UnitAbandoned` once ``check()`` is true (an executor's way to stop a
    unit whose result it has discarded, rather than let it run to its end)."""
    _abandon_check.fn = check
    try:
        yield
    finally:
        _abandon_check.fn = None


def check_deadline(deadline: float | None) -> None:
    """Raise :class:`UnitTimeout` once ``time.perf_counter()`` is past ``deadline``, and
    :class:`UnitAbandoned` once the executor no longer wants the unit's result.
    Units call it after every batch: a single batch that never returns is not interrupted."""
    if deadline is not None and time.perf_counter() > deadline:
        raise UnitTimeout(f"the unit ran {time.perf_counter() - deadline:.1f} s past its unit_timeout "
                          "(checked after every batch)")
    check = getattr(_abandon_check, "fn", None)
    if check is not None and check():
        raise UnitAbandoned("the unit's result is no longer wanted; it stopped after a batch")


class UnitError(RuntimeError):
    """User code failed inside a unit; the message holds the error and its traceback.

    Raised on the worker, it fails only the model whose unit raised it.
    """


@dataclass(frozen=True)
class EvalResult:
    """One validation shard's sums, plus the training progress of the epoch
    (carried in the state, so the driver never fetches a state for metrics).
    The driver adds shards up in partition order."""
    loss_sum: float | None  # None: the spec computes no loss of its own (Lightning logs it)
    metric_sums: dict[str, float]
    samples: int
    seconds: float
    progress: dict[str, Any]
    logged: dict[str, list[float]] = field(default_factory=dict)  # name -> [weighted sum, weight]


def epoch_metrics(results: "list[EvalResult]") -> dict[str, float]:
    """Combine per-shard results (in partition order) into the epoch's metrics.

    >>> r = EvalResult(2.0, {"accuracy": 1.0}, 4, 0.1, {"loss_sum": 3.0, "samples": 6, "seconds": 1.0})
    >>> epoch_metrics([r, r])["val_loss"]
    0.5
    """
    progress = results[0].progress
    out = {"train_loss": progress["loss_sum"] / max(progress["samples"], 1),
           "train_seconds": progress["seconds"]}
    out.update(logged_means([progress.get("logged", {})]))
    samples = sum(r.samples for r in results)
    if samples:
        if results[0].loss_sum is not None:
            out["val_loss"] = sum(r.loss_sum for r in results) / samples
        for name in results[0].metric_sums:
            out[f"val_{name}"] = sum(r.metric_sums[name] for r in results) / samples
        out.update(logged_means([r.logged for r in results]))
    out["val_seconds"] = sum(r.seconds for r in results)
    return out


def logged_means(parts: "list[dict[str, list[float]]]") -> dict[str, float]:
    """Combine ``name -> [weighted sum, weight]`` pieces into weighted means, names in first-seen order.

    >>> logged_means([{"acc": [3.0, 4]}, {"acc": [1.0, 4]}])
    {'acc': 0.5}
    """
    total: dict[str, list[float]] = {}
    for part in parts:
        for name, (value, weight) in part.items():
            acc = total.setdefault(name, [0.0, 0.0])
            acc[0] += value
            acc[1] += weight
    return {name: value / weight for name, (value, weight) in total.items() if weight}


def seed_torch(seed: int) -> None:
    """Seed torch's global RNGs, the CPU's and CUDA's, as ``torch.manual_seed`` does.

    ``torch.manual_seed`` also queues a seed for each accelerator not yet in use
    (XPU, MPS), recording a stack trace every time: 0.6 ms per call on our 2-core
    machine (2.6 µs for the CPU seed alone), more under a worker's deeper stack,
    paid by every unit.
    """
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def pick_device(spec: TrainingSpec) -> torch.device:
    if spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def clone_tensors(value: Any) -> Any:
    """Deep-copy the tensors of a state: a unit never mutates its input, which
    Dask may still hold for evaluation, rollback or another consumer."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: clone_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone_tensors(v) for v in value]
    return value


def to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}  # plain dict: Dask sends it zero-copy
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    return value


def weights_layout(spec: TrainingSpec, config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``name -> (shape, dtype)`` of the model ``config`` builds: on the meta device
    (no memory, no compute), or a real build when the model cannot be built there."""
    try:
        with torch.device("meta"):
            model = spec.model_fn(config)
    except Exception:
        with torch.random.fork_rng(devices=[]):
            model = spec.model_fn(config)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def layout_mismatch(expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                    weights: Mapping[str, Any]) -> str | None:
    """What differs between a model's layout and a state's weights (None: they fit).

    >>> layout_mismatch({"w": ((2, 3), torch.float32)}, {"w": torch.zeros(3, 2), "b": torch.zeros(2)})
    "unexpected keys ['b']; shapes differ: w (3, 2) in the state, (2, 3) in the model"
    """
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    shapes = [f"{k} {tuple(weights[k].shape)} in the state, {expected[k][0]} in the model"
              for k in expected if k in weights and tuple(weights[k].shape) != expected[k][0]]
    parts = ([f"missing keys {missing}"] if missing else []) + \
        ([f"unexpected keys {unexpected}"] if unexpected else []) + \
        ([f"shapes differ: {'; '.join(shapes)}"] if shapes else [])
    return "; ".join(parts) or None


def build_model(spec: TrainingSpec, config: Mapping[str, Any], weights: dict | None,
                seed: int) -> torch.nn.Module:
    """Build ``model_fn(config)``; with ``weights``, load them.

    Initial weights come from ``seed``. Given weights, the model is built on
    the meta device (no initialisation cost) and the tensors are assigned; a
    ``model_fn`` that cannot run there (init code calling ``.item()``, as timm's
    drop-path schedules do) or a module that keeps something off its state dict
    falls back to a normal build.
    """
    if weights is not None:
        try:
            with torch.device("meta"):
                model = spec.model_fn(config)
            model.load_state_dict(weights, assign=True)
        except Exception:  # a real error shows again in the normal build below
            model = None
        if model is not None and not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            return model
    seed_torch(seed)
    model = spec.model_fn(config)
    if weights is not None:
        model.load_state_dict(weights)
    return model


def _batches(n: int, batch_size: int, generator: torch.Generator | None):
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]


def unit_generators(useed: int, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    """The unit's shuffling generator (CPU) and its augmentation generator (on ``device``),
    both from the unit seed."""
    shuffle = torch.Generator().manual_seed(useed)
    augment = torch.Generator(device=device).manual_seed(_hash_seed("transform", useed))
    return shuffle, augment


def batches(spec: TrainingSpec, shard: Shard, batch_size: int, device: torch.device,
            shuffle: torch.Generator | None, augment: torch.Generator | None):
    """``(x, y, rows)`` for each batch of a pass over ``shard``, on ``device``, transformed:
    shuffled and through ``train_transform`` with generators, in order and through
    ``eval_transform`` without."""
    for idx in _batches(len(shard), batch_size, shuffle):
        x, y = shard.batch(idx)
        x, y = to_device(x, device, non_blocking=True), to_device(y, device, non_blocking=True)
        x, y = spec.transform(x, y, augment)
        yield x, y, len(idx)


def train_unit(spec: TrainingSpec, config: Mapping[str, Any], state: State | None,
               shard: Shard, *, seed: int, epoch: int,
               partition: int, step: int, epoch_end: bool, threads: int,
               unit_timeout: float | None = None, fresh_hyperparameters: bool = False) -> State:
    """Train one pass over ``shard``; return the new state.

    The state's ``progress`` sums the epoch's training loss, samples and unit
    seconds so far. An exception in user code, a non-finite loss or a pass
    longer than ``unit_timeout`` seconds (checked after every batch) raises
    :class:`UnitError`, which fails this model only. ``fresh_hyperparameters``:
    the state comes from another configuration (a fork, a warm start), whose
    optimizer hyperparameters must not override this config's (see
    :func:`restore_optimizer`).
    """
    started = time.perf_counter()
    deadline = None if unit_timeout is None else started + unit_timeout
    progress = clone_tensors(state["progress"]) if state is not None and step > 0 else \
        {"loss_sum": 0.0, "samples": 0, "seconds": 0.0}
    try:
        torch.set_num_threads(threads)
        new_state = spec.train_pass(config, clone_tensors(state) if state is not None else None, shard,
                                    seed=seed, epoch=epoch, partition=partition, step=step,
                                    epoch_end=epoch_end, progress=progress, deadline=deadline,
                                    fresh_hyperparameters=fresh_hyperparameters)
    except Exception as err:  # user code: fail this model only, keep the reason
        raise UnitError(_describe(err)) from None
    _check_finite(new_state["model"], epoch, partition)
    progress["loss_sum"] += new_state.pop("loss_sum")
    progress["samples"] += new_state["samples"]
    progress["seconds"] += time.perf_counter() - started
    new_state["progress"] = progress
    return new_state


def _check_finite(weights: Mapping[str, Any], epoch: int, partition: int) -> None:
    """Raise UnitError when a weight is NaN or infinite: the loss is checked before
    each optimizer step, so the last step of a pass could write them unseen."""
    for name, tensor in weights.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and \
                not bool(torch.isfinite(tensor).all()):
            raise UnitError(f"NonFiniteWeightsError: weight {name!r} is not finite after the pass "
                            f"over partition {partition} in epoch {epoch} (the optimizer step after "
                            "the last finite loss wrote NaN or infinity)")


def restore_optimizer(optimizer: torch.optim.Optimizer, schedulers: list, state: Mapping[str, Any],
                      saved_schedulers: list, *, fresh_hyperparameters: bool = False) -> None:
    """Load a state's optimizer and LR-scheduler states (those it has) into ones just
    built from the config.

    ``optimizer.load_state_dict`` also restores the saved ``param_groups``
    hyperparameters (the learning rate among them). Where the state comes from
    another configuration (``fresh_hyperparameters``: a fork, a warm start), the
    values the config set stay in force: the per-parameter state (momentum, Adam's
    moments, step counts) and the schedulers' progress are the state's, every
    group hyperparameter and the schedulers' base learning rates are the config's.
    """
    fresh = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    if state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    for scheduler, saved in zip(schedulers, saved_schedulers):
        if saved is not None:
            scheduler.load_state_dict(saved)
    if fresh_hyperparameters:
        for group, values in zip(optimizer.param_groups, fresh):
            group.update(values)
        for scheduler in schedulers:
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
            if hasattr(scheduler, "_last_lr"):
                scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _train(spec, config, state, shard, seed, epoch, partition, epoch_end, deadline,
           fresh_hyperparameters=False):
    device = pick_device(spec)
    with torch.random.fork_rng(devices=[]):
        model = build_model(spec, config, state["model"] if state else None, seed).to(device)
        model.train()
        optimizer = spec.optimizer_fn(config, model.parameters())
        lr_scheduler = spec.scheduler_fn(config, optimizer) if spec.scheduler_fn else None
        if state:
            schedulers = [lr_scheduler] if lr_scheduler is not None else []
            restore_optimizer(optimizer, schedulers, state, [state.get("scheduler")],
                              fresh_hyperparameters=fresh_hyperparameters)
        useed = unit_seed(seed, epoch, partition)
        seed_torch(useed)  # dropout and other in-model randomness
        shuffle, augment = unit_generators(useed, device)
        batch_size = spec.resolve_batch_size(config)
        loss_sum, samples = 0.0, 0
        for xb, yb, n in batches(spec, shard, batch_size, device, shuffle, augment):
            optimizer.zero_grad(set_to_none=True)
            loss = spec.loss_fn(*spec.forward(model, xb, yb))
            value = float(loss.detach())
            if not math.isfinite(value):
                raise NonFiniteLossError(
                    f"loss is {value} at epoch {epoch}, partition {partition}, sample {samples}")
            loss.backward()
            optimizer.step()
            loss_sum += value * n
            samples += n
            check_deadline(deadline)
        if epoch_end and lr_scheduler is not None:
            lr_scheduler.step()
    return {
        "model": to_cpu(dict(model.state_dict())),
        "optimizer": to_cpu(optimizer.state_dict()),
        "scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "samples": samples,
        "steps": (state.get("steps", 0) if state else 0) + math.ceil(samples / batch_size),
        "loss_sum": loss_sum,
    }


def evaluate_unit(spec: TrainingSpec, config: Mapping[str, Any], state: State,
                  shard: Shard | None, *, seed: int,
                  threads: int) -> EvalResult:
    """Sum the loss and every metric over one validation shard (the state is not changed).

    Raises :class:`UnitError` when user code (the model, loss or a metric) fails.
    """
    started = time.perf_counter()
    try:
        torch.set_num_threads(threads)
        result = spec.evaluate_pass(config, state, shard, seed=seed)
    except Exception as err:
        raise UnitError(_describe(err)) from None
    return dataclasses.replace(result, seconds=time.perf_counter() - started, progress=state["progress"])


def _evaluate(spec, config, state, shard, seed) -> EvalResult:
    sums = {name: 0.0 for name in spec.metrics}
    if shard is None or len(shard) == 0:
        return EvalResult(0.0, sums, 0, 0.0, {})
    device = pick_device(spec)
    with torch.random.fork_rng(devices=[]):
        model = build_model(spec, config, clone_tensors(state["model"]), seed).to(device)
    model.eval()
    loss_sum, samples = 0.0, 0
    with torch.no_grad():
        for xb, yb, n in batches(spec, shard, spec.eval_batch_size, device, None, None):
            out, targets = spec.forward(model, xb, yb)
            loss_sum += float(spec.loss_fn(out, targets)) * n
            for name, fn in spec.metrics.items():
                sums[name] += float(fn(out, targets)) * n
            samples += n
    return EvalResult(loss_sum, sums, samples, 0.0, {})


def _describe(err: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__, limit=-3))
    return f"{type(err).__name__}: {err}\n{tb}"
