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
import os
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

from .data import Shard, TensorShard
from .data.structure import call_model, map_structure, to_device

__all__ = [
    "TrainingSpec", "EvalResult", "UnitError", "UnitTimeout", "UnitAbandoned", "abandon_when", "progress_to",
    "check_deadline",
    "NonFiniteLossError",
    "accuracy",
    "model_seed", "unit_seed", "canonical_config", "train_unit", "evaluate_unit",
    "epoch_metrics", "build_model", "batches", "unit_generators", "restore_optimizer",
    "weights_layout", "layout_mismatch", "to_host", "to_floats", "PRECISIONS", "pick_device",
    "describe_device", "deterministic_algorithms", "autocast", "grad_scaler", "shard_on_device",
    "losses_checked", "PhaseClock",
]

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
# cuBLAS needs a fixed workspace for bitwise-reproducible matrix products (PyTorch's
# reproducibility notes); read when a process first uses cuBLAS.
CUBLAS_WORKSPACE = ":4096:8"

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
        precision: ``"32"`` (float32), ``"bf16-mixed"`` or ``"16-mixed"``: the forward
            pass and loss under ``torch.autocast`` in bfloat16 or float16, as
            Lightning's ``Trainer(precision=...)``. With ``"16-mixed"`` a
            ``GradScaler`` scales the loss, and its state hops with the optimizer's.
        device_data_fraction: on a GPU, a worker copies a partition's in-memory
            shards to the device once when they take at most this fraction of the
            device's free memory (default 0.5), and slices batches there; otherwise
            batches are gathered in pinned host memory and copied while the GPU
            computes.

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
    precision: str = "32"
    device_data_fraction: float = 0.5

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
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision is {self.precision!r}, but must be one of {PRECISIONS}")
        fraction = self.device_data_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(f"device_data_fraction is {fraction!r}, but must be a number from 0 to 1")

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
        ``progress`` holds the epoch's sums so far (before this pass). A subclass
        that overrides it calls ``check_deadline(deadline, fraction)`` with 0.0
        before its first batch and the share of rows trained after each: past
        ``deadline`` (a ``time.perf_counter()`` value) it raises, and the fraction
        lets speculation spot a straggler early.
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


# .fn: the running unit's "is my result still wanted?" test; .progress: where it says how far it is
_unit_watch = threading.local()


@contextlib.contextmanager
def abandon_when(check: Callable[[], bool]) -> Iterator[None]:
    """Within the block, :func:`check_deadline` in this thread also raises
    :class:`UnitAbandoned` once ``check()`` is true (an executor's way to stop a
    unit whose result it has discarded, rather than let it run to its end)."""
    _unit_watch.fn = check
    try:
        yield
    finally:
        _unit_watch.fn = None


@contextlib.contextmanager
def progress_to(report: Callable[[float], None]) -> Iterator[None]:
    """Within the block, :func:`check_deadline` in this thread passes the unit's
    ``fraction`` done to ``report`` (an executor's way to see how far a unit has come;
    a unit reports 0.0 as its first batch begins)."""
    _unit_watch.progress = report
    try:
        yield
    finally:
        _unit_watch.progress = None


def check_deadline(deadline: float | None, fraction: float | None = None) -> None:
    """Raise :class:`UnitTimeout` once ``time.perf_counter()`` is past ``deadline``, and
    :class:`UnitAbandoned` once the executor no longer wants the unit's result.
    Units call it after every batch, with the ``fraction`` of their rows trained so
    far (and with 0.0 before the first): a single batch that never returns is not
    interrupted."""
    report = getattr(_unit_watch, "progress", None)
    if report is not None and fraction is not None:
        report(fraction)
    if deadline is not None and time.perf_counter() > deadline:
        raise UnitTimeout(f"the unit ran {time.perf_counter() - deadline:.1f} s past its unit_timeout "
                          "(checked after every batch)")
    check = getattr(_unit_watch, "fn", None)
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
    """The device a unit of ``spec`` runs on in this process: with ``"auto"`` or
    ``"cuda"``, the process's current GPU (a worker started with
    ``CUDA_VISIBLE_DEVICES`` set to one GPU sees it as ``cuda:0``)."""
    if spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def describe_device(spec: TrainingSpec) -> str:
    """What a unit of ``spec`` runs on here, as the history records it: ``"cpu"`` or
    ``"cuda:<GPU model>"`` (bits are reproducible on the same device type and GPU model).

    >>> describe_device(TrainingSpec(model_fn=len, optimizer_fn=len, device="cpu"))
    'cpu'
    """
    device = pick_device(spec)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return "cpu"


@contextlib.contextmanager
def deterministic_algorithms(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """On CUDA, run the block with deterministic kernels only (cuDNN's among them) and
    cuBLAS's fixed workspace, so that a unit's bits do not depend on the run; an
    operation without a deterministic kernel raises. Does nothing on the CPU, whose
    kernels are deterministic at a fixed thread count."""
    if device.type != "cuda":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.benchmark = before[1] and not enabled
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


def autocast(spec: TrainingSpec, device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for the spec's precision (a no-op context for ``"32"``)."""
    if spec.precision == "32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if spec.precision == "bf16-mixed" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def grad_scaler(spec: TrainingSpec, device: torch.device, state: "State | None") -> Any:
    """With ``"16-mixed"``, a ``GradScaler`` resumed from the state's (None otherwise)."""
    if spec.precision != "16-mixed":
        return None
    scaler = torch.amp.GradScaler(device.type)
    if state and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    return scaler


# Worker process: the GPU copy of each in-memory shard that fit, keyed by the shard's
# id (dropped with the shard, so an id is never reused while its entry lives).
_DEVICE_SHARDS: dict[tuple[int, str], TensorShard] = {}


def shard_on_device(shard: Shard, device: torch.device, fraction: float) -> Shard:
    """The shard batches come from: on a GPU, a copy of an in-memory shard made there
    once, when it takes at most ``fraction`` of the device's free memory; else ``shard``.

    Disk-cached and Dataset shards stay on the host: they exist because the data
    does not fit in memory."""
    if device.type != "cuda" or not isinstance(shard, TensorShard):
        return shard
    key = (id(shard), str(device))
    copy = _DEVICE_SHARDS.get(key)
    if copy is None:
        free, _ = torch.cuda.mem_get_info(device)
        if shard.nbytes > fraction * free:
            return shard
        copy = _DEVICE_SHARDS[key] = TensorShard(to_device(shard.x, device), to_device(shard.y, device))
        weakref.finalize(shard, _DEVICE_SHARDS.pop, key, None)
    return copy


def clone_tensors(value: Any) -> Any:
    """Deep-copy the tensors of a state: a unit never mutates its input, which
    Dask may still hold for evaluation, rollback or another consumer."""
    return _map_tensors(torch.Tensor.clone, value)


def to_host(value: Any) -> Any:
    """``value`` with its tensors on the CPU, in one wait: GPU tensors are copied into
    pinned host memory asynchronously and the stream is synchronized once at the end
    (``tensor.cpu()`` would wait for each)."""
    copies: list[torch.device] = []

    def move(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type != "cuda":
            return t.cpu()
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        out.copy_(t, non_blocking=True)
        copies.append(t.device)
        return out

    moved = _map_tensors(move, value)
    for device in set(copies):
        torch.cuda.current_stream(device).synchronize()
    return moved


def _map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(fn, v) for k, v in value.items()}  # plain dict: Dask sends it zero-copy
    if isinstance(value, (list, tuple)):
        mapped = [_map_tensors(fn, v) for v in value]
        return mapped if isinstance(value, list) else tuple(mapped)
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


def _batches(n: int, batch_size: int, generator: torch.Generator | None, device: torch.device):
    # The order is drawn on the CPU whatever the device, so shuffles match across devices.
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    if device.type != "cpu":
        order = order.to(device)
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
    ``eval_transform`` without.

    On a GPU, batches are sliced from the shard's device copy when it has one (see
    :func:`shard_on_device`); otherwise gathered on the host into pinned memory and
    copied asynchronously, so the copy of one batch overlaps the compute of the last.
    """
    source = shard_on_device(shard, device, spec.device_data_fraction)
    on_device = source is not shard
    for idx in _batches(len(source), batch_size, shuffle, device if on_device else torch.device("cpu")):
        x, y = source.batch(idx)
        if not on_device:
            if device.type == "cuda":
                x, y = _pinned(x), _pinned(y)
            x, y = to_device(x, device, non_blocking=True), to_device(y, device, non_blocking=True)
        x, y = spec.transform(x, y, augment)
        yield x, y, len(idx)


def _pinned(value: Any) -> Any:
    return map_structure(lambda t: t.pin_memory(), value)


def train_unit(spec: TrainingSpec, config: Mapping[str, Any], state: State | None,
               shard: Shard, *, seed: int, epoch: int,
               partition: int, step: int, epoch_end: bool, threads: int,
               unit_timeout: float | None = None, fresh_hyperparameters: bool = False,
               deterministic: bool = True) -> State:
    """Train one pass over ``shard``; return the new state.

    The state's ``progress`` sums the epoch's training loss, samples and unit
    seconds so far. An exception in user code, a non-finite loss or a pass
    longer than ``unit_timeout`` seconds (checked after every batch) raises
    :class:`UnitError`, which fails this model only. ``fresh_hyperparameters``:
    the state comes from another configuration (a fork, a warm start), whose
    optimizer hyperparameters must not override this config's (see
    :func:`restore_optimizer`). On CUDA the unit runs with deterministic kernels
    unless ``deterministic`` is False (see :func:`deterministic_algorithms`).

    The state's ``progress["phase_seconds"]`` sums, over the epoch's units, the
    seconds spent moving the state in (``transfer_in``), training (``compute``)
    and moving it out (``transfer_out``), as the device's clock measures them.
    """
    started = time.perf_counter()
    deadline = None if unit_timeout is None else started + unit_timeout
    progress = clone_tensors(state["progress"]) if state is not None and step > 0 else \
        {"loss_sum": 0.0, "samples": 0, "seconds": 0.0}
    device = pick_device(spec)
    # A copy to the GPU leaves the input untouched; on the CPU the model would train in it.
    private = clone_tensors(state) if state is not None and device.type == "cpu" else state
    try:
        torch.set_num_threads(threads)
        with deterministic_algorithms(device, deterministic):
            new_state = spec.train_pass(config, private, shard,
                                        seed=seed, epoch=epoch, partition=partition, step=step,
                                        epoch_end=epoch_end, progress=progress, deadline=deadline,
                                        fresh_hyperparameters=fresh_hyperparameters)
    except Exception as err:  # user code: fail this model only, keep the reason
        raise UnitError(_describe(err)) from None
    _check_finite(new_state["model"], epoch, partition)
    progress["loss_sum"] += new_state.pop("loss_sum")
    progress["samples"] += new_state["samples"]
    progress["seconds"] += time.perf_counter() - started
    phases = new_state.pop("phase_seconds", None)
    if phases:
        total = progress.setdefault("phase_seconds", {})
        for name, seconds in phases.items():
            total[name] = total.get(name, 0.0) + seconds
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


class PhaseClock:
    """Marks on the device's stream (CUDA events, which need no wait) or the host clock;
    read once the unit's work has finished."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self, names: tuple[str, ...]) -> dict[str, float]:
        """Seconds between consecutive marks, one per name."""
        pairs = zip(self.marks, self.marks[1:])
        if self.cuda:
            return {n: a.elapsed_time(b) / 1000 for n, (a, b) in zip(names, pairs)}
        return {n: b - a for n, (a, b) in zip(names, pairs)}


def losses_checked(losses: list[torch.Tensor], sizes: list[int], epoch: int, partition: int) -> float:
    """The pass's summed loss (each batch mean times its rows, added in batch order,
    as a per-batch ``float`` would), from losses read off the device together;
    raises :class:`NonFiniteLossError` naming the first non-finite one."""
    values = torch.stack([v.double() for v in losses]).tolist() if losses else []
    total, samples = 0.0, 0
    for value, n in zip(values, sizes):
        if not math.isfinite(value):
            raise NonFiniteLossError(f"loss is {value} at epoch {epoch}, partition {partition}, sample {samples}")
        total += value * n
        samples += n
    return total


def _train(spec, config, state, shard, seed, epoch, partition, epoch_end, deadline,
           fresh_hyperparameters=False):
    device = pick_device(spec)
    clock = PhaseClock(device)
    clock.mark()
    with torch.random.fork_rng(devices=[]):
        model = build_model(spec, config, state["model"] if state else None, seed).to(device)
        model.train()
        optimizer = spec.optimizer_fn(config, model.parameters())
        lr_scheduler = spec.scheduler_fn(config, optimizer) if spec.scheduler_fn else None
        if state:
            schedulers = [lr_scheduler] if lr_scheduler is not None else []
            restore_optimizer(optimizer, schedulers, state, [state.get("scheduler")],
                              fresh_hyperparameters=fresh_hyperparameters)
        scaler = grad_scaler(spec, device, state)
        clock.mark()
        useed = unit_seed(seed, epoch, partition)
        seed_torch(useed)  # dropout and other in-model randomness
        shuffle, augment = unit_generators(useed, device)
        batch_size = spec.resolve_batch_size(config)
        amp = autocast(spec, device)
        # The CPU reads each loss before its step, for free; on a GPU a read waits for the
        # device, so the losses stay there and are read together at the end.
        on_cpu = device.type == "cpu"
        losses, sizes, loss_sum, samples = [], [], 0.0, 0
        check_deadline(deadline, 0.0)  # the first batch begins: its progress is timed from here
        for xb, yb, n in batches(spec, shard, batch_size, device, shuffle, augment):
            optimizer.zero_grad(set_to_none=True)
            with amp:
                loss = spec.loss_fn(*spec.forward(model, xb, yb))
            if on_cpu:
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise NonFiniteLossError(
                        f"loss is {value} at epoch {epoch}, partition {partition}, sample {samples}")
                loss_sum += value * n
            else:
                losses.append(loss.detach())
            sizes.append(n)
            samples += n
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            check_deadline(deadline, samples / len(shard))
        if epoch_end and lr_scheduler is not None:
            lr_scheduler.step()
        clock.mark()
    new_state, stacked = to_host(({
        "model": dict(model.state_dict()),
        "optimizer": optimizer.state_dict(),
        "scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "samples": samples,
        "steps": (state.get("steps", 0) if state else 0) + len(sizes),
        **({"scaler": scaler.state_dict()} if scaler is not None else {}),
    }, torch.stack(losses) if losses else None))
    clock.mark()
    if not on_cpu and stacked is not None:
        loss_sum = losses_checked(list(stacked), sizes, epoch, partition)
    new_state["loss_sum"] = loss_sum
    new_state["phase_seconds"] = clock.seconds(("transfer_in", "compute", "transfer_out"))
    return new_state


def evaluate_unit(spec: TrainingSpec, config: Mapping[str, Any], state: State,
                  shard: Shard | None, *, seed: int,
                  threads: int, deterministic: bool = True) -> EvalResult:
    """Sum the loss and every metric over one validation shard (the state is not changed).

    Raises :class:`UnitError` when user code (the model, loss or a metric) fails.
    """
    started = time.perf_counter()
    try:
        torch.set_num_threads(threads)
        with deterministic_algorithms(pick_device(spec), deterministic):
            result = spec.evaluate_pass(config, state, shard, seed=seed)
    except Exception as err:
        raise UnitError(_describe(err)) from None
    return dataclasses.replace(result, seconds=time.perf_counter() - started, progress=state["progress"])


def _evaluate(spec, config, state, shard, seed) -> EvalResult:
    sums = {name: 0.0 for name in spec.metrics}
    if shard is None or len(shard) == 0:
        return EvalResult(0.0, sums, 0, 0.0, {})
    device = pick_device(spec)
    weights = clone_tensors(state["model"]) if device.type == "cpu" else state["model"]
    with torch.random.fork_rng(devices=[]):
        model = build_model(spec, config, weights, seed).to(device)
    model.eval()
    # Each batch's values stay on the device until the pass ends: one wait, not one per batch.
    values: list[list[Any]] = []
    sizes: list[int] = []
    with torch.no_grad():
        for xb, yb, n in batches(spec, shard, spec.eval_batch_size, device, None, None):
            with autocast(spec, device):
                out, targets = spec.forward(model, xb, yb)
                values.append([spec.loss_fn(out, targets), *(fn(out, targets) for fn in spec.metrics.values())])
            sizes.append(n)
    numbers = iter(to_floats([v for row in values for v in row]))
    loss_sum = 0.0
    for n in sizes:  # each sum in batch order, as per-batch reads would add them
        loss_sum += next(numbers) * n
        for name in spec.metrics:
            sums[name] += next(numbers) * n
    return EvalResult(loss_sum, sums, sum(sizes), 0.0, {})


def to_floats(values: list[Any]) -> list[float]:
    """Per-batch numbers (tensors on any device, or plain numbers) as floats, reading
    each device's tensors in one copy."""
    out: list[Any] = [None] * len(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
        else:
            out[i] = float(v)
    for indices in by_device.values():
        read = to_host(torch.stack([values[i].detach().reshape(()).double() for i in indices])).tolist()
        for i, value in zip(indices, read):
            out[i] = value
    return out


def _describe(err: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__, limit=-3))
    message = str(err)
    if isinstance(err, RuntimeError) and "does not have a deterministic implementation" in message:
        # torch's message names the operation; say the way out in our terms
        first = message.splitlines()[0].split(", but you set")[0]
        return (f"NondeterministicOperationError: {first}, and this session runs CUDA units with "
                "deterministic kernels only; pass deterministic=False to the Session to allow it "
                f"(results are then not bitwise reproducible; the history records it)\n{tb}")
    return f"{type(err).__name__}: {message}\n{tb}"
