"""A model and its optimizer rebuilt from a config and a state, and what a state
must look like to fit a config's model."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..meta_device import meta_build
from ..ties import tie, tied_names
from .seeding import canonical_config, seed_torch

if TYPE_CHECKING:
    from .contract import RunSpec

__all__ = [
    "build_model",
    "forget_off_state",
    "restore_optimizer",
    "check_optimizer_params",
    "weights_layout",
    "layout_mismatch",
    "module_structure",
    "check_structure",
    "recorded_structure",
    "structure_entry",
]


def build_model(spec: RunSpec, config: Mapping[str, Any], weights: dict | None, seed: int) -> torch.nn.Module:
    """Build ``model_fn(config)``; with ``weights``, load them.

    Initial weights come from ``seed``. Given weights, the model is built on
    the meta device (no initialisation cost) and the tensors are assigned. The
    buffers a state dict leaves out (non-persistent ones, as BERT's position ids)
    come from one normal build of the config and seed in this process, kept for
    the units after (see :func:`forget_off_state`). A ``model_fn`` that cannot
    run on the meta device (init code calling ``.item()``), a non-persistent
    buffer that views another tensor, or a module that keeps a tensor off its
    state dict falls back to a normal build.
    """
    if weights is not None:
        model = _assigned(spec, config, weights, seed)
        if model is not None:
            return model
    seed_torch(seed)
    model = spec.model_fn(config)
    if weights is not None:
        model.load_state_dict(weights)
    return model


def _assigned(spec: RunSpec, config: Mapping[str, Any], weights: dict, seed: int) -> torch.nn.Module | None:
    """The model built on the meta device, holding ``weights``; None where that cannot be."""
    try:
        model = meta_build(lambda: spec.model_fn(config))
        aliases = tied_names(model)
        off_state = _off_state_names(model)
        buffers = {} if not off_state else _off_state_buffers(spec, config, seed, off_state)
        if off_state is None or buffers is None:
            return None
        for name, buffer in buffers.items():  # before the weights, which a load hook may read them with
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = buffer.clone()
        model.load_state_dict(weights, assign=True)
        tie(model, aliases)  # assign and the buffers set give each name a tensor of its own
    except Exception:  # a real error shows again in the normal build
        return None
    return None if _holds_meta(model) else model


def _holds_meta(model: torch.nn.Module) -> bool:
    """Whether a tensor of ``model`` is still on the meta device: a parameter or buffer
    the weights did not give, or one a module keeps off its state dict as a plain
    attribute (a constant, a torchmetrics metric's states), alone or in a list or dict."""
    for module in model.modules():
        for value in vars(module).values():
            values = (
                value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            )
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in values):
                return True
    return False


def _off_state_names(model: torch.nn.Module) -> list[str] | None:
    """The names of the buffers ``model``'s state dict leaves out (its non-persistent
    ones), each tensor under its first name; None where one views another tensor (made
    from the weights, it must be made with them)."""
    names = []
    for name, buffer in model.named_buffers():
        owner, _, attr = name.rpartition(".")
        if attr in model.get_submodule(owner)._non_persistent_buffers_set:
            if buffer._base is not None:
                return None
            names.append(name)
    return names


#: how many models' off-state buffers a process keeps, and how many bytes of them at most
OFF_STATE_KEPT = 256
OFF_STATE_BYTES = 256 * 2**20

# Worker process: (id of the spec, config, seed) -> (the spec, the buffers a normal build
# of them has outside its state dict), least recently used first.
_OFF_STATE: OrderedDict[tuple[int, str, int], tuple[Any, dict[str, torch.Tensor]]] = OrderedDict()


def _off_state_buffers(
    spec: RunSpec, config: Mapping[str, Any], seed: int, names: list[str]
) -> dict[str, torch.Tensor] | None:
    """The buffers ``names`` of ``model_fn(config)`` built normally from ``seed`` (built
    once, then kept); None where the config has no canonical form or the build lacks one."""
    try:
        key = (id(spec), canonical_config(config), seed)
    except TypeError:
        return None
    found = _OFF_STATE.get(key)
    if found is None or found[0] is not spec:
        with torch.random.fork_rng(devices=[]):
            seed_torch(seed)
            built = dict(spec.model_fn(config).named_buffers())
        if not all(name in built for name in names):
            return None
        found = _OFF_STATE[key] = (spec, {name: built[name].detach().clone() for name in names})
        while len(_OFF_STATE) > OFF_STATE_KEPT or (len(_OFF_STATE) > 1 and _off_state_bytes() > OFF_STATE_BYTES):
            _OFF_STATE.popitem(last=False)
    _OFF_STATE.move_to_end(key)
    buffers = found[1]
    return buffers if all(name in buffers for name in names) else None


def _off_state_bytes() -> int:
    return sum(t.numel() * t.element_size() for _, buffers in _OFF_STATE.values() for t in buffers.values())


def forget_off_state(spec: Any = None) -> None:
    """Drop the off-state buffers this process keeps for ``spec`` (None: for every spec)."""
    for key in [k for k, (kept, _) in _OFF_STATE.items() if spec is None or kept is spec]:
        del _OFF_STATE[key]


def restore_optimizer(
    optimizer: torch.optim.Optimizer,
    schedulers: Sequence[Any],
    state: Mapping[str, Any],
    saved_schedulers: Sequence[Any],
    *,
    fresh_hyperparameters: bool = False,
) -> None:
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
    for scheduler, saved in zip(schedulers, saved_schedulers, strict=False):
        if saved is not None:
            scheduler.load_state_dict(saved)
    if fresh_hyperparameters:
        for group, values in zip(optimizer.param_groups, fresh, strict=True):
            group.update(values)
        for scheduler in schedulers:
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
            if hasattr(scheduler, "_last_lr"):
                scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def check_optimizer_params(
    model: torch.nn.Module,
    optimizer: Any,
    config: Mapping[str, Any],
    built_by: str = "optimizer_fn",
    how: str = "build it from the parameters it is given",
) -> None:
    """Raise ValueError unless ``optimizer`` holds every parameter of ``model`` with
    ``requires_grad`` (by identity), naming the config and those it lacks: an
    optimizer over other tensors trains nothing, and no loss would ever say so.

    >>> model = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> check_optimizer_params(model, optimizer, {"lr": 0.1})  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ValueError: optimizer_fn built, for config {'lr': 0.1}, an optimizer that holds 0 of the model's 2 trainable
    parameters (it lacks 'weight', 'bias'); it must hold every parameter with requires_grad=True (build it from
    the parameters it is given, and set requires_grad=False on those meant to stay frozen)
    """
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        raise TypeError(
            f"{built_by} returned {type(optimizer).__name__} for config {dict(config)}, but must return a "
            f"torch.optim.Optimizer ({how})"
        )
    held = {id(p) for group in groups for p in group["params"]}
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, p in trainable if id(p) not in held]
    if missing:
        shown = ", ".join(map(repr, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"{built_by} built, for config {dict(config)}, an optimizer that holds "
            f"{len(trainable) - len(missing)} of the model's {len(trainable)} trainable "
            f"parameters (it lacks {shown}); it must hold every parameter with "
            f"requires_grad=True ({how}, and set requires_grad=False on those meant "
            "to stay frozen)"
        )


def weights_layout(
    spec: RunSpec, config: Mapping[str, Any], *, hopping_only: bool = False
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``name -> (shape, dtype)`` of the model ``config`` builds: on the meta device
    (no memory, no compute), or a real build when the model cannot be built there.
    ``hopping_only``: without the frozen parameters (what a state with a base holds)."""
    try:
        model = meta_build(lambda: spec.model_fn(config))
    except Exception:
        with torch.random.fork_rng(devices=[]):
            model = spec.model_fn(config)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items() if not (hopping_only and k in frozen)}


def layout_mismatch(
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]], weights: Mapping[str, Any]
) -> str | None:
    """What differs between a model's layout and a state's weights (None: they fit).

    >>> layout_mismatch({"w": ((2, 3), torch.float32)}, {"w": torch.zeros(3, 2), "b": torch.zeros(2)})
    "unexpected keys ['b']; shapes differ: w (3, 2) in the state, (2, 3) in the model"
    """
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    shapes = [
        f"{k} {tuple(weights[k].shape)} in the state, {expected[k][0]} in the model"
        for k in expected
        if k in weights and tuple(weights[k].shape) != expected[k][0]
    ]
    parts = (
        ([f"missing keys {missing}"] if missing else [])
        + ([f"unexpected keys {unexpected}"] if unexpected else [])
        + ([f"shapes differ: {'; '.join(shapes)}"] if shapes else [])
    )
    return "; ".join(parts) or None


def module_structure(model: torch.nn.Module) -> list[str]:
    """The class of every submodule, in ``named_modules`` order: what a state records of
    the network its first build made, so that a later build can be compared with it. A
    lazy module counts as the class it becomes (``LazyLinear`` as ``Linear``)."""
    return [
        getattr(type(m), "cls_to_become", None).__qualname__  # type: ignore[union-attr]
        if getattr(type(m), "cls_to_become", None) is not None
        else type(m).__qualname__
        for _, m in model.named_modules(remove_duplicate=False)
    ]


def check_structure(recorded: Sequence[str], model: torch.nn.Module, config: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first module where ``model`` differs from the
    structure a state recorded (the same weights' shapes, another network: a
    ``model_fn`` that draws its architecture at random on each call).

    >>> check_structure(module_structure(torch.nn.ReLU()), torch.nn.GELU(), {"lr": 0.1})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: model_fn built another network ... module '' (the model) is GELU in this build, ReLU in the ...
    """
    now = module_structure(model)
    if list(recorded) == now:
        return
    names = [n for n, _ in model.named_modules(remove_duplicate=False)]
    at = next((i for i, (a, b) in enumerate(zip(recorded, now, strict=False)) if a != b), min(len(recorded), len(now)))
    if at < min(len(recorded), len(now)):
        where = repr(names[at]) + (" (the model)" if not names[at] else "")
        diff = f"module {where} is {now[at]} in this build, {recorded[at]} in the model's first build"
    else:
        diff = f"this build has {len(now)} modules, the model's first build {len(recorded)}"
    raise ValueError(
        f"model_fn built another network for the same config {dict(config)}: {diff}; model_fn must build "
        "the same network for a config (take any random choice from the config, or from a generator seeded by it)"
    )


def recorded_structure(state: Mapping[str, Any] | None, config: Mapping[str, Any]) -> list[str] | None:
    """The structure ``state`` recorded for ``config``'s network; None when it recorded
    none, or recorded another config's (a fork or warm start may change the network)."""
    saved = state.get("structure") if state is not None else None
    if not isinstance(saved, Mapping) or saved.get("config") != canonical_config(config):
        return None
    return list(saved["modules"])


def structure_entry(state: Mapping[str, Any] | None, config: Mapping[str, Any], model: torch.nn.Module) -> dict:
    """What the state after a unit records: the structure of the model's first build."""
    recorded = recorded_structure(state, config)
    return {"config": canonical_config(config), "modules": recorded or module_structure(model)}
