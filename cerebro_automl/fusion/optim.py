"""One optimizer for k members whose parameters are stacked along dim 0.

Each member keeps its own torch optimizer (SGD, Adam or AdamW, one param group)
with its own hyperparameters. :class:`FusedOptimizer` reads them into ``[k]``
tensors, steps every member at once with whole-tensor ops (the same arithmetic
as torch's single-tensor, ``foreach=False``, step), and writes the per-parameter
state back into the member optimizers in torch's own format, so that a member
can leave the group and continue with plain torch, or be checkpointed.

The per-member learning rates, momenta, betas, epsilons and weight decays may
all differ; the options that change the algorithm (Nesterov, decoupled weight
decay) must agree, and AMSGrad, maximize, capturable and differentiable are not
supported. ``foreach`` and ``fused`` are a member's choice of implementation,
not of arithmetic: they are accepted and ignored.

On the CPU a fused member's parameters and state are bitwise those of its own
torch optimizer with ``foreach=False``: every op is torch's, with the member's
hyperparameter as a broadcast tensor instead of a Python scalar, in the same
order. Other devices may round differently by an ulp (CUDA divides by a scalar
through its reciprocal and computes ``addcdiv`` as ``value * (t1 / t2)``), as
torch's own foreach and fused implementations do. Adam's step counts stay on the
CPU as torch keeps them; the work tensors of a step (three the size of the
largest stacked parameter) are kept between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from numbers import Real
from typing import Any

import torch

__all__ = ["Unfusable", "FusedOptimizer"]

# Exact types: a subclass may override step() with other arithmetic.
_KINDS: dict[type, str] = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}
_SGD_NUMBERS = ("lr", "momentum", "dampening", "weight_decay")
_ADAM_NUMBERS = ("lr", "beta1", "beta2", "eps", "weight_decay")
# Options that change the arithmetic and that this module does not implement.
_UNSUPPORTED = {"sgd": ("maximize", "differentiable"), "adam": ("amsgrad", "maximize", "capturable", "differentiable")}
_ADAM_STATE = {"step", "exp_avg", "exp_avg_sq"}
# The per-member values of Adam's arithmetic, besides the bias corrections.
_ADAM_STEP_VALUES = ("decay", "weight_decay", "one_minus_beta1", "one_minus_beta2", "beta2", "eps")

Members = Sequence[tuple[dict[str, torch.nn.Parameter], torch.optim.Optimizer]]


class Unfusable(Exception):
    """A reason the members cannot train fused (the message says which value and which rule)."""


# Elements of a stacked parameter that the CPU steps at a time: a piece's parameter,
# gradient, moments and work tensors (6 MB in float32) stay in the cache through the
# step's ten passes, where whole they would each go through memory (8 members of a
# ResNet-18: its AdamW step 276 -> 195 ms). A power of two: a piece starts where a
# vector of any width starts, so each element goes through the same kernel code.
_PIECE = 1 << 18


def _pieces(k: int, n: int, limit: int) -> list[tuple[slice, slice]]:
    """The (members, columns) of a ``[k, n]`` tensor in pieces of at most ``limit``
    elements: whole members' rows where one fits, else parts of one member's row.

    >>> _pieces(4, 3, 6)
    [(slice(0, 2, None), slice(None, None, None)), (slice(2, 4, None), slice(None, None, None))]
    >>> _pieces(2, 5, 4)[:2]
    [(slice(0, 1, None), slice(0, 4, None)), (slice(0, 1, None), slice(4, 8, None))]
    """
    if n <= limit:
        per = limit // n
        return [(slice(start, start + per), slice(None)) for start in range(0, k, per)]
    return [(slice(i, i + 1), slice(start, start + limit)) for i in range(k) for start in range(0, n, limit)]


def _three(work: torch.Tensor, shape: torch.Size) -> list[torch.Tensor]:
    """Three tensors of ``shape``, one after the other at the start of ``work``."""
    size = shape.numel()
    return [work[j * size : (j + 1) * size].view(shape) for j in range(3)]


def _rows(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[k]`` values viewed as ``[k, 1, 1, ...]`` to broadcast over a stacked tensor."""
    return values.view(values.shape[0], *([1] * (like.dim() - 1)))


# --- reading the members --------------------------------------------------------------------------


def _kind(members: Members) -> str:
    """The optimizer family every member uses, or Unfusable."""
    types = [type(opt) for _, opt in members]
    for i, t in enumerate(types):
        if t not in _KINDS:
            raise Unfusable(
                f"member {i}'s optimizer is {t.__module__}.{t.__qualname__}; "
                "a fused optimizer supports exactly torch.optim.SGD, Adam and AdamW"
            )
        if t is not types[0]:
            raise Unfusable(
                f"member 0's optimizer is {types[0].__name__} and member {i}'s is {t.__name__}; "
                "fused members must use one optimizer type"
            )
    return _KINDS[types[0]]


def _group(i: int, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The member optimizer's only param group."""
    if len(optimizer.param_groups) != 1:
        raise Unfusable(
            f"member {i}'s optimizer has {len(optimizer.param_groups)} param groups; "
            "a fused optimizer needs exactly one per member"
        )
    return optimizer.param_groups[0]


def _trainable_names(stacked: dict[str, torch.Tensor], members: Members) -> list[str]:
    """The names of the members' trainable parameters, in ``stacked``'s order, after
    checking that ``stacked`` and every member agree on names and shapes."""
    k = len(members)
    names = list(stacked)
    for i, (params, _) in enumerate(members):
        if set(params) != set(names):
            extra, missing = sorted(set(params) - set(names)), sorted(set(names) - set(params))
            raise Unfusable(
                f"member {i}'s parameters differ from the stacked ones (not stacked: {extra}, missing: {missing}); "
                "every member must have the stacked parameter names"
            )
        for name in names:
            want = (k, *params[name].shape)
            if tuple(stacked[name].shape) != want:
                raise Unfusable(
                    f"stacked {name!r} has shape {tuple(stacked[name].shape)}, member {i}'s gives {want}; "
                    "a stacked tensor is [k, *member shape]"
                )
    trainable = [n for n in names if members[0][0][n].requires_grad]
    for i, (params, _) in enumerate(members):
        mine = [n for n in names if params[n].requires_grad]
        if mine != trainable:
            raise Unfusable(
                f"member {i} trains {mine}, member 0 trains {trainable}; fused members train the same parameters"
            )
    for name in trainable:
        if not stacked[name].is_floating_point():
            raise Unfusable(f"stacked {name!r} is {stacked[name].dtype}; the fused optimizer steps real floats")
    devices = {stacked[n].device for n in trainable}
    if len(devices) > 1:
        raise Unfusable(f"the stacked parameters lie on {sorted(map(str, devices))}; they must share one device")
    return trainable


def _check_holds(i: int, group: dict[str, Any], params: dict[str, torch.nn.Parameter], names: list[str]) -> None:
    """The member optimizer holds exactly the member's trainable parameters, and maybe
    frozen ones (``AdamW(model.parameters())`` over a frozen base), which never get a
    gradient and which torch's step skips."""
    trainable = [p for p in group["params"] if p.requires_grad]
    held = {id(p) for p in trainable}
    own = {id(params[n]): n for n in names}
    missing = sorted(n for key, n in own.items() if key not in held)
    if missing or len(held) != len(own) or len(trainable) != len(held):
        raise Unfusable(
            f"member {i}'s optimizer holds {len(trainable)} trainable parameters, not exactly its "
            f"{len(own)} (missing: {missing}); it must hold exactly the member's trainable parameters"
        )


def _number(i: int, key: str, value: Any) -> float:
    """A hyperparameter as a Python float, or Unfusable for a tensor or a non-number."""
    if isinstance(value, torch.Tensor):
        raise Unfusable(
            f"member {i}'s {key} is a tensor ({value!r}); the fused optimizer reads hyperparameters as Python numbers"
        )
    if not isinstance(value, Real):
        raise Unfusable(f"member {i}'s {key} is {value!r}; a hyperparameter must be a real number")
    return float(value)


def _numbers(kind: str, groups: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each numeric hyperparameter, one value per member."""
    out: dict[str, list[float]] = {}
    for i, group in enumerate(groups):
        values = dict(group)
        if kind == "adam":
            betas = group["betas"]
            if isinstance(betas, torch.Tensor) or len(betas) != 2:
                raise Unfusable(f"member {i}'s betas is {betas!r}; it must be a pair of Python numbers")
            values["beta1"], values["beta2"] = betas
        for key in _SGD_NUMBERS if kind == "sgd" else _ADAM_NUMBERS:
            out.setdefault(key, []).append(_number(i, key, values[key]))
    return out


def _flag(kind: str, groups: list[dict[str, Any]], key: str, default: bool) -> bool:
    """An option that must agree between members."""
    values = [bool(g.get(key, default)) for g in groups]
    for i, value in enumerate(values):
        if value != values[0]:
            raise Unfusable(
                f"{key} differs between members (member 0: {values[0]}, member {i}: {value}); "
                f"fused {kind.upper()} members must agree on it"
            )
    return values[0]


def _check_unsupported(kind: str, groups: list[dict[str, Any]]) -> None:
    for i, group in enumerate(groups):
        for key in _UNSUPPORTED[kind]:
            if group.get(key, False):
                raise Unfusable(
                    f"member {i}'s {key}={group[key]!r} is not supported by the fused optimizer (it needs {key}=False)"
                )


def _check_nesterov(numbers: dict[str, list[float]]) -> None:
    """torch's own rule, checked again: the group may have changed since construction."""
    for i, (momentum, dampening) in enumerate(zip(numbers["momentum"], numbers["dampening"], strict=True)):
        if momentum <= 0 or dampening != 0:
            raise Unfusable(
                f"member {i} has nesterov=True with momentum={momentum} and dampening={dampening}; "
                "Nesterov momentum requires momentum > 0 and dampening = 0"
            )


def _state_tensor(i: int, name: str, key: str, value: Any, like: torch.Tensor) -> torch.Tensor:
    """A per-parameter state tensor, checked against the member's parameter."""
    if not isinstance(value, torch.Tensor) or value.shape != like.shape[1:]:
        shown = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise Unfusable(
            f"member {i}'s {key} for {name!r} is {shown}, not a tensor of the parameter's shape "
            f"{tuple(like.shape[1:])}; the fused optimizer cannot represent it"
        )
    return value


def _stacked_state(tensors: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """The members' state tensors for one parameter stacked like it, zeros for a member
    without one: one pass into a new tensor (zeros first, then each member's copy, were
    two, and a ResNet-18's moments at 8 members are 0.7 GB)."""
    if any(t is None for t in tensors):
        zero = torch.zeros(like.shape[1:], dtype=like.dtype, device=like.device)
        tensors = [zero if t is None else t for t in tensors]
    # .to: no copy where they match already
    return torch.stack([t.to(like.device, like.dtype) for t in tensors if t is not None])


def _step_value(i: int, name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise Unfusable(f"member {i}'s step for {name!r} has shape {tuple(value.shape)}; a step is one number")
        return float(value.item())
    return _number(i, f"step for {name!r}", value)


# --- the optimizer --------------------------------------------------------------------------------


class FusedOptimizer:
    """SGD, Adam or AdamW for k members at once, over parameters stacked along dim 0.

    Build it with :meth:`from_members`. ``step()`` updates the stacked leaves in
    place from their ``.grad``; ``write_back()`` puts the state into the member
    optimizers; ``set_lrs()`` re-reads the members' hyperparameters after a
    scheduler changed them; ``clip_grad_norms()`` clips each member's gradients.
    """

    def __init__(self, stacked: dict[str, torch.Tensor], members: Members, kind: str, names: list[str]) -> None:
        """Use :meth:`from_members`; this sets up empty state."""
        self._members = list(members)
        self._kind = kind
        self._names = names
        self._params = {n: stacked[n] for n in names}
        self._k = len(members)
        self._device = stacked[names[0]].device if names else torch.device("cpu")
        # SGD: momentum buffers; `started` is whether a member's buffer exists, as torch
        # creates it from the first step's gradient rather than from zeros.
        self._bufs: dict[str, torch.Tensor] = {}
        self._started: dict[str, torch.Tensor] = {}
        self._all_started: dict[str, bool] = {}
        # Adam: moments, and per-member step counts on the CPU as torch keeps them. Parameters
        # whose counts agree share one tensor, so the bias corrections are computed once.
        self._exp_avg: dict[str, torch.Tensor] = {}
        self._exp_avg_sq: dict[str, torch.Tensor] = {}
        self._steps: dict[str, torch.Tensor] = {}
        self._hp: dict[str, list[float]] = {}
        self._cpu: dict[str, torch.Tensor] = {}
        self._dev: dict[torch.dtype, dict[str, torch.Tensor]] = {}
        self._work: dict[torch.dtype, torch.Tensor] = {}
        self._views: dict[str, list[torch.Tensor]] = {}
        self._has_momentum = torch.zeros(self._k, dtype=torch.bool, device=self._device)
        self._nesterov = False
        self._decoupled = False
        self._any_weight_decay = False
        self._any_momentum = False
        self._all_momentum = False

    @classmethod
    def from_members(
        cls,
        stacked: dict[str, torch.Tensor],
        members: list[tuple[dict[str, torch.nn.Parameter], torch.optim.Optimizer]],
    ) -> FusedOptimizer:
        """stacked: name -> [k, ...] leaf. members[i] = (member i's name -> its own parameter, member i's optimizer).

        Reads each member optimizer's type, its param group's hyperparameters and
        its per-parameter state (keyed by the member's parameter objects) into
        stacked tensors. Raises :class:`Unfusable`, naming the value and the rule,
        where the members cannot step as one (see the module docstring).
        """
        if not members:
            raise Unfusable("no members; a fused optimizer needs at least one")
        kind = _kind(members)
        names = _trainable_names(stacked, members)
        for i, (params, optimizer) in enumerate(members):
            _check_holds(i, _group(i, optimizer), params, names)
        fused = cls(stacked, members, kind, names)
        fused._configure()
        if kind == "sgd":
            fused._read_sgd_state()
        else:
            fused._read_adam_state()
        return fused

    # --- hyperparameters

    def _configure(self) -> None:
        """Read and check the members' options and hyperparameters into [k] tensors."""
        groups = [_group(i, opt) for i, (_, opt) in enumerate(self._members)]
        _check_unsupported(self._kind, groups)
        numbers = _numbers(self._kind, groups)
        if self._kind == "sgd":
            self._nesterov = _flag("sgd", groups, "nesterov", False)
            if self._nesterov:
                _check_nesterov(numbers)
            numbers["damp"] = [1.0 - d for d in numbers["dampening"]]
            numbers["has_momentum"] = [float(m != 0) for m in numbers["momentum"]]
            numbers["neg_lr"] = [-lr for lr in numbers["lr"]]
        else:
            default = type(self._members[0][1]) is torch.optim.AdamW
            self._decoupled = _flag("adam", groups, "decoupled_weight_decay", default)
        self._hp = numbers
        self._any_weight_decay = any(v != 0 for v in numbers["weight_decay"])
        self._any_momentum = any(v != 0 for v in numbers.get("momentum", []))
        self._all_momentum = self._kind == "sgd" and all(v != 0 for v in numbers["momentum"])
        # float64 on the CPU: the same double arithmetic torch does on Python floats.
        self._cpu = {key: torch.tensor(values, dtype=torch.float64) for key, values in numbers.items()}
        if self._kind == "adam":
            self._cpu["one_minus_beta1"] = 1 - self._cpu["beta1"]
            self._cpu["one_minus_beta2"] = 1 - self._cpu["beta2"]
            self._cpu["decay"] = 1 - self._cpu["lr"] * self._cpu["weight_decay"]
        dtypes = {self._params[n].dtype for n in self._names}
        self._dev = {dtype: {key: self._to_device(v, dtype) for key, v in self._cpu.items()} for dtype in dtypes}
        if self._kind == "sgd":
            self._has_momentum = self._cpu["has_momentum"].to(self._device, torch.bool)

    def _to_device(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # Rounded on the CPU first: some devices have no float64.
        return values.to(dtype).to(self._device)

    def set_lrs(self) -> None:
        """Re-read every member's ``param_groups[0]['lr']`` (after an LR scheduler stepped
        the member optimizer), and with it the other hyperparameters, since a scheduler
        such as OneCycleLR also cycles the momentum or the betas."""
        self._configure()
        if self._kind == "sgd" and self._any_momentum and not self._bufs:
            # Momentum just turned on: the members' own buffers, which nothing touched since.
            self._read_sgd_state()

    # --- state in

    def _member_state(self, i: int, name: str) -> dict[str, Any]:
        params, optimizer = self._members[i]
        # .get: the optimizer's state is a defaultdict, a lookup would add an entry.
        return dict(optimizer.state.get(params[name], {}))

    @torch.no_grad()
    def _read_sgd_state(self) -> None:
        """Momentum buffers. A member whose buffer is absent has not stepped: its first step
        starts the buffer from the gradient, as torch does. A member with momentum 0 keeps
        the buffer it has untouched, as torch does, and resumes from it if momentum returns."""
        found = {name: [self._sgd_buffer(i, name) for i in range(self._k)] for name in self._names}
        if not self._any_momentum and all(b is None for bufs in found.values() for b in bufs):
            return  # plain SGD keeps no state
        for name, bufs in found.items():
            self._bufs[name] = _stacked_state(bufs, self._params[name])
            started = [buf is not None for buf in bufs]
            self._started[name] = torch.tensor(started, device=self._device)
            self._all_started[name] = all(started)

    def _sgd_buffer(self, i: int, name: str) -> torch.Tensor | None:
        state = self._member_state(i, name)
        unknown = sorted(set(state) - {"momentum_buffer"})
        if unknown:
            raise Unfusable(
                f"member {i}'s SGD state for {name!r} has keys {unknown}; SGD state holds only momentum_buffer"
            )
        buf = state.get("momentum_buffer")
        return None if buf is None else _state_tensor(i, name, "momentum_buffer", buf, self._params[name])

    @torch.no_grad()
    def _read_adam_state(self) -> None:
        """Moments and step counts; a member without state is at step 0 with zero moments,
        exactly torch's lazy initialisation."""
        counts: dict[tuple[float, ...], torch.Tensor] = {}
        for name in self._names:
            param = self._params[name]
            read = [self._read_adam_member(i, name) for i in range(self._k)]
            self._exp_avg[name] = _stacked_state([r[1] for r in read], param)
            self._exp_avg_sq[name] = _stacked_state([r[2] for r in read], param)
            key = tuple(r[0] for r in read)
            if key not in counts:
                counts[key] = torch.tensor(key, dtype=torch.float32)
            self._steps[name] = counts[key]

    def _read_adam_member(self, i: int, name: str) -> tuple[float, torch.Tensor | None, torch.Tensor | None]:
        """Member ``i``'s step count and moments for ``name`` (none before its first step)."""
        state = self._member_state(i, name)
        if not state:
            return 0.0, None, None
        if set(state) != _ADAM_STATE:
            raise Unfusable(
                f"member {i}'s Adam state for {name!r} has keys {sorted(state)}; the fused optimizer represents "
                f"exactly {sorted(_ADAM_STATE)} (or no state before the first step)"
            )
        param = self._params[name]
        return (
            _step_value(i, name, state["step"]),
            _state_tensor(i, name, "exp_avg", state["exp_avg"], param),
            _state_tensor(i, name, "exp_avg_sq", state["exp_avg_sq"], param),
        )

    # --- stepping

    def zero_grad(self) -> None:
        """Set the stacked grads to None."""
        for param in self._params.values():
            param.grad = None

    @torch.no_grad()
    def step(self, active: torch.Tensor | None = None) -> None:
        """One step of every member with its own hyperparameters, torch's single-tensor arithmetic.

        ``active``: bool ``[k]``; members False are left exactly unchanged (parameters
        and state), e.g. a member whose loss went NaN. A parameter whose stacked grad is
        None is skipped, as torch skips a parameter without a grad.
        """
        on_host = self._active_on_host(active)
        names = [n for n in self._names if self._params[n].grad is not None]
        if not names or (on_host is not None and not bool(on_host.any())):
            return
        # The inactive members' rows are saved and put back; one small copy to the host says which.
        frozen = None if on_host is None else (~on_host).nonzero().squeeze(1).to(self._device)
        mask = None if on_host is None else on_host.to(self._device)
        if self._kind == "sgd":
            for name in names:
                self._guarded(self._sgd_touches(name), frozen, partial(self._sgd_param, name, mask))
        else:
            corrections = self._advance_steps(names, on_host)
            for name in names:
                touched = [self._params[name], self._exp_avg[name], self._exp_avg_sq[name]]
                self._guarded(touched, frozen, partial(self._adam_param, name, corrections[name]))

    @torch.no_grad()
    def clip_grad_norms(self, max_norm: float) -> None:
        """Clip each member's gradients to a total 2-norm of ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` clips a model's: the norm of its parameters'
        norms, in the stacked parameters' order (the model's, which an optimizer built
        from ``model.parameters()`` shares; another order rounds otherwise), each from a
        member's own contiguous slice (the kernels of its own run), and its gradients
        scaled by ``min(max_norm / (norm + 1e-6), 1)``."""
        grads = [g for g in (self._params[n].grad for n in self._names) if g is not None]
        if not grads:
            return
        slices = [g[i] for i in range(self._k) for g in grads]
        norms = torch._foreach_norm(slices, 2) if len(slices) > 1 else [torch.linalg.vector_norm(slices[0], 2)]
        per = len(grads)
        totals = torch.stack([torch.linalg.vector_norm(torch.stack(norms[i * per : (i + 1) * per]), 2)
                              for i in range(self._k)])  # fmt: skip
        coefficients = torch.clamp(max_norm / (totals + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(_rows(coefficients.to(grad.dtype), grad))

    def _active_on_host(self, active: torch.Tensor | None) -> torch.Tensor | None:
        """``active`` on the CPU, or None where every member steps."""
        if active is None:
            return None
        if not isinstance(active, torch.Tensor) or active.dtype != torch.bool or tuple(active.shape) != (self._k,):
            shown = (active.dtype, tuple(active.shape)) if isinstance(active, torch.Tensor) else type(active)
            raise ValueError(f"active is {shown}; it must be a bool tensor of shape ({self._k},), one per member")
        on_host = active.to("cpu")
        return None if bool(on_host.all()) else on_host

    @staticmethod
    def _guarded(tensors: list[torch.Tensor], frozen: torch.Tensor | None, update: Callable[[], None]) -> None:
        """Run an in-place update; put the ``frozen`` members' rows back afterwards (their
        gradients may be NaN: they are computed with the others, then discarded)."""
        if frozen is None:
            update()
            return
        saved = [t.index_select(0, frozen) for t in tensors]
        update()
        for tensor, old in zip(tensors, saved, strict=True):
            tensor.index_copy_(0, frozen, old)

    def _scratch(self, name: str) -> list[torch.Tensor]:
        """Three work tensors shaped like a stacked parameter, views of one buffer per dtype
        kept between steps: temporaries the size of k parameters cost page faults on the
        CPU each time they are allocated, and the views themselves are cached."""
        views = self._views.get(name)
        if views is None:
            like = self._params[name]
            views = self._views[name] = _three(self._work_buffer(like.dtype), like.shape)
        return views

    def _work_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The buffer of the work tensors of ``dtype``: three times the largest parameter."""
        work = self._work.get(dtype)
        if work is None:
            largest = max(self._params[n].numel() for n in self._names if self._params[n].dtype == dtype)
            work = self._work[dtype] = torch.empty(3 * largest, dtype=dtype, device=self._device)
        return work

    def _sgd_touches(self, name: str) -> list[torch.Tensor]:
        return [self._params[name], *([self._bufs[name]] if name in self._bufs else [])]

    def _sgd_param(self, name: str, mask: torch.Tensor | None) -> None:
        """torch's ``_single_tensor_sgd`` for one stacked parameter. ``add(x, alpha=a)`` and
        ``addcmul(x, y, a)`` round alike (one fused multiply-add where the kernel has one)."""
        param = self._params[name]
        grad = param.grad
        assert grad is not None
        hp = self._dev[param.dtype]
        decayed, work1, work2 = self._scratch(name)
        if self._any_weight_decay:
            grad = torch.addcmul(grad, param, _rows(hp["weight_decay"], param), out=decayed)
        if self._any_momentum:
            grad = self._momentum(name, grad, mask, work1, work2)
        param.addcmul_(grad, _rows(hp["neg_lr"], param))

    def _momentum(
        self, name: str, grad: torch.Tensor, mask: torch.Tensor | None, work1: torch.Tensor, work2: torch.Tensor
    ) -> torch.Tensor:
        """Update the momentum buffer and return the direction; members with momentum 0
        step along the gradient and leave their buffer alone."""
        buf = self._bufs[name]
        hp = self._dev[buf.dtype]
        momentum = _rows(hp["momentum"], buf)
        if self._all_momentum and self._all_started[name]:
            buf.mul_(momentum).addcmul_(grad, _rows(hp["damp"], buf))
        else:
            started = self._started[name]
            torch.mul(buf, momentum, out=work1).addcmul_(grad, _rows(hp["damp"], buf))
            new = torch.where(_rows(started, buf), work1, grad, out=work2)
            if not self._all_momentum:
                new = torch.where(_rows(self._has_momentum, buf), work2, buf, out=work1)
            buf.copy_(new)
            started.logical_or_(self._has_momentum if mask is None else self._has_momentum & mask)
            self._all_started[name] = self._all_momentum and mask is None
        if self._nesterov:  # only with momentum > 0 for every member
            return torch.addcmul(grad, buf, momentum, out=work1)
        if self._all_momentum:
            return buf
        return torch.where(_rows(self._has_momentum, buf), buf, grad, out=work1)

    def _advance_steps(self, names: list[str], active: torch.Tensor | None) -> dict[str, dict[str, torch.Tensor]]:
        """Add one to the active members' step counts of the parameters that step, and
        return each such parameter's bias corrections on its device."""
        stepping = set(names)
        sharers: dict[int, list[str]] = {}
        for name in self._names:
            sharers.setdefault(id(self._steps[name]), []).append(name)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for users in sharers.values():
            moving = [n for n in users if n in stepping]
            if not moving:
                continue
            steps = self._steps[moving[0]]
            if len(moving) < len(users):  # the others keep their counts, as torch skips them
                steps = steps.clone()
                for name in moving:
                    self._steps[name] = steps
            steps += 1 if active is None else active.to(steps.dtype)
            per_dtype: dict[torch.dtype, dict[str, torch.Tensor]] = {}
            for name in moving:
                dtype = self._params[name].dtype
                if dtype not in per_dtype:
                    per_dtype[dtype] = self._corrections(steps, dtype)
                out[name] = per_dtype[dtype]
        return out

    def _corrections(self, steps: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """torch's Python-float bias corrections, in float64 on the CPU, then rounded."""
        count = steps.to(torch.float64)
        bias1 = 1 - self._cpu["beta1"] ** count
        bias2 = 1 - self._cpu["beta2"] ** count
        neg_step_size = -(self._cpu["lr"] / bias1)
        return {
            "neg_step_size": self._to_device(neg_step_size, dtype),
            "bias2_sqrt": self._to_device(bias2.sqrt(), dtype),
        }

    def _adam_param(self, name: str, corrections: dict[str, torch.Tensor]) -> None:
        """torch's ``_single_tensor_adam`` (amsgrad off) for one stacked parameter: on the
        CPU a large one piece by piece (see :func:`_pieces`), else whole."""
        param = self._params[name]
        grad = param.grad
        assert grad is not None
        hp = self._dev[param.dtype]
        values = {key: hp[key] for key in _ADAM_STEP_VALUES}
        values.update(corrections)
        tensors = [param, grad, self._exp_avg[name], self._exp_avg_sq[name]]
        if param.device.type != "cpu" or param.numel() <= _PIECE or not all(t.is_contiguous() for t in tensors):
            self._adam_update(tensors, self._scratch(name), {key: _rows(v, param) for key, v in values.items()})
            return
        members = [t.view(self._k, -1) for t in tensors]
        work = self._work_buffer(param.dtype)
        for rows, columns in _pieces(self._k, members[0].shape[1], _PIECE):
            piece = [t[rows, columns] for t in members]
            # The same few work tensors for every piece: they stay in the cache.
            scratch = _three(work, piece[0].shape)
            self._adam_update(piece, scratch, {key: v[rows].view(-1, 1) for key, v in values.items()})

    def _adam_update(
        self, tensors: list[torch.Tensor], scratch: list[torch.Tensor], hp: dict[str, torch.Tensor]
    ) -> None:
        """The step's arithmetic on (a piece of) a stacked parameter: ``tensors`` are the
        parameter, its gradient and its two moments; ``hp`` holds each member's values
        shaped to broadcast over them."""
        param, grad, exp_avg, exp_avg_sq = tensors
        decayed, scaled, denom = scratch
        if self._any_weight_decay:
            if self._decoupled:
                param.mul_(hp["decay"])
            else:
                grad = torch.addcmul(grad, param, hp["weight_decay"], out=decayed)
        exp_avg.lerp_(grad, hp["one_minus_beta1"])
        # torch: addcmul_(grad, grad, value=1 - beta2) multiplies ((1 - beta2) * grad) * grad.
        torch.mul(grad, hp["one_minus_beta2"], out=scaled)
        exp_avg_sq.mul_(hp["beta2"]).addcmul_(scaled, grad)
        torch.sqrt(exp_avg_sq, out=denom).div_(hp["bias2_sqrt"]).add_(hp["eps"])
        # torch's CPU addcdiv computes (value * t1) / t2, so the step size multiplies exp_avg first.
        param.addcdiv_(torch.mul(exp_avg, hp["neg_step_size"], out=scaled), denom)

    # --- state out

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy each member's slice of the per-parameter state into its own optimizer's
        ``.state`` (keyed by its own parameter objects), in torch's format, so that
        ``member_optimizer.state_dict()`` is what torch would save."""
        for name in self._names:
            if self._kind == "sgd":
                self._write_sgd(name)
            else:
                self._write_adam(name)

    def _write_sgd(self, name: str) -> None:
        if name not in self._bufs:
            return
        started = self._started[name].tolist()
        for i, (params, optimizer) in enumerate(self._members):
            # A member with momentum 0 has the buffer it came with, or none, as in torch.
            if started[i]:
                param = params[name]
                optimizer.state[param]["momentum_buffer"] = self._bufs[name][i].to(param.device, copy=True)

    def _write_adam(self, name: str) -> None:
        steps = self._steps[name].tolist()
        for i, (params, optimizer) in enumerate(self._members):
            param = params[name]
            if steps[i] == 0 and param not in optimizer.state:
                continue  # torch creates the state on the first step
            state = optimizer.state[param]
            state["step"] = _step_tensor(state.get("step"), steps[i], param, optimizer.param_groups[0])
            state["exp_avg"] = self._exp_avg[name][i].to(param.device, copy=True)
            state["exp_avg_sq"] = self._exp_avg_sq[name][i].to(param.device, copy=True)


def _step_tensor(old: Any, value: float, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """A step count where torch keeps it: where the member's step already was, else a
    float32 on the CPU (float64 under a float64 default dtype), or on the parameter's
    device for a fused optimizer."""
    if isinstance(old, torch.Tensor):
        return torch.tensor(value, dtype=old.dtype, device=old.device)
    if group.get("fused"):
        return torch.tensor(value, dtype=torch.float32, device=param.device)
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(value, dtype=dtype)
