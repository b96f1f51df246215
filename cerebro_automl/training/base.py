"""The frozen base: what does not train stays on the worker; only what trains hops.

A model whose ``model_fn`` freezes parameters (``requires_grad_(False)``, a peft
LoRA wrapper, a timm backbone with its head left trainable) has a *base*: its
frozen parameters. A unit then moves, and a checkpoint holds, only the tensors
that can change: the trainable parameters and the buffers (BatchNorm's running
statistics change in training), with the optimizer's state of those alone.

On a worker, the module ``model_fn(config)`` built is kept between units
(:class:`_Models`, per process and device), so ``from_pretrained`` runs once per
worker and configuration, not once per unit. The frozen tensors of every kept
module are held once per worker and device, by content (:class:`_Tensors`):
k LoRA configurations of one checkpoint share one copy of it.

Each frozen tensor gets a digest where it is built; the state records them
(:class:`BaseRecord`), and a worker whose base differs from the one a model
trained with (another file on another node, say) fails that model, naming the
worker and the tensor. A model that was never given a state, a fork or a warm
start builds afresh; a base is keyed by what it holds, so configurations whose
frozen weights differ on purpose (a config picks the checkpoint) work alike.

The state of a model with a base::

    {"model": {trainable and buffer names: tensor}, "base": {"digest": ..., ...}, ...}
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .restore import build_model, check_structure, forget_off_state, recorded_structure
from .seeding import canonical_config

if TYPE_CHECKING:
    from .contract import RunSpec

__all__ = [
    "BaseMismatchError",
    "BaseRecord",
    "frozen_names",
    "base_record",
    "check_base",
    "checkout_model",
    "hopping_weights",
    "whole_model",
    "clear_models",
    "kept_models",
    "set_worker_name",
]

# A worker keeps at most this many built modules (each holds its trainable tensors and
# the module objects; the frozen tensors are shared), and drops the least recently used.
MAX_MODELS = 256


class BaseMismatchError(RuntimeError):
    """The frozen base a worker built is not the one a model trained with."""


@dataclass(frozen=True)
class BaseRecord:
    """The frozen tensors of a model, by digest: what its state says about its base.

    ``digests`` holds 8 bytes per frozen tensor, in the order of ``frozen_names``;
    ``digest`` is the digest of them all; ``built_on`` names the worker process that
    digested them first.
    """

    digest: str
    digests: bytes
    tensors: int
    nbytes: int
    built_on: str

    def as_dict(self) -> dict[str, Any]:
        """The record as the state carries it (plain values: Dask and ``torch.save`` move them)."""
        return {
            "digest": self.digest,
            "digests": self.digests,
            "tensors": self.tensors,
            "bytes": self.nbytes,
            "built_on": self.built_on,
        }

    @classmethod
    def of(cls, value: Mapping[str, Any]) -> BaseRecord:
        return cls(value["digest"], value["digests"], value["tensors"], value["bytes"], value["built_on"])


# Worker process: the name its executor gives it (a Dask worker's address), for errors.
_WORKER_NAME: list[str] = []


def set_worker_name(name: str) -> None:
    """Name this worker process in the base's errors (the Dask executor gives its address)."""
    _WORKER_NAME[:] = [name]


def where() -> str:
    """This worker process, as errors name it."""
    process = f"{socket.gethostname()} (pid {os.getpid()})"
    return f"worker {_WORKER_NAME[0]} on {process}" if _WORKER_NAME else process


def frozen_names(model: torch.nn.Module) -> list[str]:
    """The state-dict names of ``model``'s frozen parameters (``requires_grad`` False), sorted.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> _ = model[0].requires_grad_(False)
    >>> frozen_names(model)
    ['0.bias', '0.weight']
    """
    return sorted(name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad)


def _tensor_digest(tensor: torch.Tensor) -> bytes:
    """8 bytes of BLAKE2b over the tensor's dtype, shape and bytes."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


def base_record(model: torch.nn.Module, names: list[str] | None = None) -> BaseRecord:
    """The :class:`BaseRecord` of ``model``'s frozen parameters (``names``: :func:`frozen_names`)."""
    names = frozen_names(model) if names is None else names
    params = dict(model.named_parameters(remove_duplicate=False))
    digests = b"".join(_tensor_digest(params[n]) for n in names)
    total = hashlib.blake2b(digest_size=8)
    for name in names:
        total.update(name.encode() + b"\0")
    total.update(digests)
    nbytes = sum(params[n].numel() * params[n].element_size() for n in set(names))
    return BaseRecord(total.hexdigest(), digests, len(names), nbytes, where())


def check_base(expected: BaseRecord, found: BaseRecord, names: list[str], whose: str) -> None:
    """Raise :class:`BaseMismatchError` when ``found`` (built here, frozen ``names``) is
    not ``expected`` (the state's), naming the first tensor that differs."""
    if expected.digest == found.digest:
        return
    if expected.tensors != found.tensors:
        what = f"has {found.tensors} frozen tensors, where the one the model trained with has {expected.tensors}"
    else:
        first = next(
            (
                i
                for i in range(found.tensors)
                if found.digests[8 * i : 8 * i + 8] != expected.digests[8 * i : 8 * i + 8]
            ),
            None,
        )
        tensor = names[first] if first is not None else "(the frozen parameters' names)"
        what = f"differs in tensor {tensor!r} from the one the model trained with"
    raise BaseMismatchError(
        f"the frozen base that {found.built_on} built for {whose} {what} (built on "
        f"{expected.built_on}): every worker must build the same frozen "
        "weights (the same checkpoint files, the same seeded build); a configuration that picks "
        "other weights is another model"
    )


@dataclass
class _Entry:
    """A module kept on a worker, with what its units need to know of it."""

    module: torch.nn.Module
    record: BaseRecord
    frozen: list[str]
    hopping: list[str]
    shared: list[tuple]


class _Tensors:
    """The frozen tensors of every kept module, once per content and device."""

    def __init__(self) -> None:
        self._held: dict[tuple, list[Any]] = {}  # key -> [Parameter, users]

    def share(self, model: torch.nn.Module, names: list[str], record: BaseRecord, device: torch.device) -> list[tuple]:
        """Point ``model``'s frozen parameters at the held copies (on ``device``); returns their keys."""
        keys: list[tuple] = []
        by_id: dict[int, torch.nn.Parameter] = {}
        for i, name in enumerate(names):
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            param = module._parameters[attr]
            if param is None:
                continue
            if id(param) in by_id:  # a tied name: the same parameter again
                module._parameters[attr] = by_id[id(param)]
                continue
            key = (record.digests[8 * i : 8 * i + 8], param.dtype, tuple(param.shape), device)
            if key not in self._held:
                data = param.detach().to(device)
                self._held[key] = [torch.nn.Parameter(data, requires_grad=False), 0]
            held = self._held[key]
            held[1] += 1
            keys.append(key)
            by_id[id(param)] = held[0]
            module._parameters[attr] = held[0]
        return keys

    def release(self, keys: list[tuple]) -> None:
        for key in keys:
            held = self._held[key]
            held[1] -= 1
            if held[1] == 0:
                del self._held[key]

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p, _ in self._held.values())


class _Models:
    """The modules a worker process keeps between units, least recently used first."""

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.tensors = _Tensors()
        self.builds = 0  # model_fn calls, for tests and benchmarks

    def get(self, key: tuple) -> _Entry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def keep(self, key: tuple, model: torch.nn.Module, device: torch.device) -> _Entry:
        """Keep ``model`` (built on the CPU, frozen parameters still its own) under ``key``."""
        frozen = frozen_names(model)
        record = base_record(model, frozen)
        shared = self.tensors.share(model, frozen, record, device)
        model.to(device)
        frozen_set = set(frozen)
        hopping = [k for k in model.state_dict() if k not in frozen_set]
        old = self.entries.pop(key, None)
        if old is not None:
            self.tensors.release(old.shared)
        entry = self.entries[key] = _Entry(model, record, frozen, hopping, shared)
        while len(self.entries) > MAX_MODELS:
            _, dropped = self.entries.popitem(last=False)
            self.tensors.release(dropped.shared)
        return entry


# Worker process: kept modules, per spec (the Dask executor unpickles a spec once per worker).
_BY_SPEC: OrderedDict[int, tuple[Any, _Models]] = OrderedDict()


def _models(spec: RunSpec) -> _Models:
    found = _BY_SPEC.get(id(spec))
    if found is not None and found[0] is spec:
        _BY_SPEC.move_to_end(id(spec))
        return found[1]
    models = _Models()
    _BY_SPEC[id(spec)] = (spec, models)
    while len(_BY_SPEC) > 4:  # the specs of a few sessions at most
        _BY_SPEC.popitem(last=False)
    return models


def clear_models(spec: RunSpec | None = None) -> None:
    """Drop the modules this process keeps for ``spec`` (None: for every spec), the
    memory of their bases with them, and the buffers kept to build its models."""
    forget_off_state(spec)
    if spec is None:
        _BY_SPEC.clear()
    elif id(spec) in _BY_SPEC and _BY_SPEC[id(spec)][0] is spec:
        del _BY_SPEC[id(spec)]


def kept_models(spec: RunSpec) -> tuple[int, int, int]:
    """``(modules kept, model_fn builds, bytes of frozen tensors held)`` in this process for ``spec``."""
    models = _models(spec)
    return len(models.entries), models.builds, models.tensors.nbytes()


def has_base(model: torch.nn.Module) -> bool:
    """Whether ``model`` has frozen parameters."""
    return any(not p.requires_grad for p in model.parameters())


def checkout_model(
    spec: RunSpec,
    config: Mapping[str, Any],
    state: Mapping[str, Any] | None,
    seed: int,
    device: torch.device,
    *,
    fresh_hyperparameters: bool = False,
) -> tuple[torch.nn.Module, BaseRecord | None]:
    """The module a unit trains or evaluates, on ``device``, holding the state's weights,
    and its base (None: the model has no frozen parameters, and the whole state hops).

    A state with a base, of this configuration, takes the module this worker keeps for
    it (built once, its frozen tensors shared) and checks the base's digest. Any other
    (no state, a state of another configuration, a state without a base) builds
    afresh; a model with frozen parameters is then kept for the units after it.
    The module must have the structure the state recorded of the model's first build
    (:func:`~.restore.check_structure`).
    """
    model, record = _checkout(spec, config, state, seed, device, fresh_hyperparameters)
    recorded = recorded_structure(state, config)
    if recorded is not None:
        check_structure(recorded, model, config)
    return model, record


def _checkout(
    spec: RunSpec,
    config: Mapping[str, Any],
    state: Mapping[str, Any] | None,
    seed: int,
    device: torch.device,
    fresh_hyperparameters: bool,
) -> tuple[torch.nn.Module, BaseRecord | None]:
    weights = state["model"] if state is not None else None
    saved = state.get("base") if state is not None else None
    if not spec.frozen_base and saved is None:
        return build_model(spec, config, weights, seed).to(device), None
    models = _models(spec)
    if saved is not None and not fresh_hyperparameters:
        key = (canonical_config(config), seed, str(device))
        entry = models.get(key)
        if entry is None:
            models.builds += 1
            entry = models.keep(key, build_model(spec, config, None, seed), device)
        check_base(BaseRecord.of(saved), entry.record, entry.frozen, f"config {dict(config)}")
        _load(entry.module, weights or {}, entry.hopping, config)
        return entry.module, entry.record
    if saved is not None:  # a fork or a warm start from a state with a base: build, then load
        model = build_model(spec, config, None, seed)
        _load(model, weights or {}, list(model.state_dict()), config)
    else:
        model = build_model(spec, config, weights, seed)
    models.builds += 1
    if not has_base(model):  # kept by no key: a config of any values (an infinite rate) builds
        return model.to(device), None
    entry = models.keep((canonical_config(config), seed, str(device)), model, device)
    return entry.module, entry.record


def _load(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], allowed: list[str], config: Any) -> None:
    """Copy ``weights`` into ``model``'s tensors of the same names (all in ``allowed``)."""
    own = model.state_dict(keep_vars=True)
    allowed_set = set(allowed)
    unexpected = sorted(k for k in weights if k not in allowed_set)
    if unexpected:
        shown = ", ".join(map(repr, unexpected[:5])) + (
            f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        )
        raise ValueError(
            f"the state holds {shown}, which the model of config {dict(config)} has not as trainable "
            "parameters or buffers: a state fits the model that trained it"
        )
    with torch.no_grad():
        for name, tensor in weights.items():
            target = own[name]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"the state's {name!r} has shape {tuple(tensor.shape)}, but the model of config "
                    f"{dict(config)} has {tuple(target.shape)}"
                )
            target.copy_(tensor)


def hopping_weights(model: torch.nn.Module, base: BaseRecord | None, *, copy: bool) -> dict[str, torch.Tensor]:
    """What hops of ``model``'s weights: its whole state dict, or without a base's frozen
    tensors. ``copy``: the tensors are copied (the module lives on for the next unit)."""
    weights = model.state_dict()
    if base is not None:
        frozen = set(frozen_names(model))
        weights = {k: (v.detach().clone() if copy else v) for k, v in weights.items() if k not in frozen}
    return dict(weights)


def whole_model(spec: RunSpec, config: Mapping[str, Any], state: Mapping[str, Any], seed: int) -> torch.nn.Module:
    """``model_fn(config)`` with a state's weights: a state with a base gets the frozen
    tensors from a build here, checked against the state's digests."""
    saved = state.get("base")
    if saved is None:
        return build_model(spec, config, state["model"], seed)
    model = build_model(spec, config, None, seed)
    frozen = frozen_names(model)
    check_base(BaseRecord.of(saved), base_record(model, frozen), frozen, f"config {dict(config)}")
    hopping = [k for k in model.state_dict() if k not in set(frozen)]
    _load(model, state["model"], hopping, config)
    return model
