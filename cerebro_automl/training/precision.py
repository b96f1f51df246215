"""Mixed precision, as Lightning's ``Trainer(precision=...)``: ``torch.autocast``
around the forward pass and the loss, and a ``GradScaler`` for ``"16-mixed"``
whose state hops with the optimizer's."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .contract import RunSpec

__all__ = ["PRECISIONS", "autocast", "grad_scaler"]

PRECISIONS = ("32", "bf16-mixed", "16-mixed")


def autocast(spec: RunSpec, device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for the spec's precision (a no-op context for ``"32"``)."""
    if spec.precision == "32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if spec.precision == "bf16-mixed" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def grad_scaler(spec: RunSpec, device: torch.device, state: Mapping[str, Any] | None) -> Any:
    """With ``"16-mixed"``, a ``GradScaler`` resumed from the state's (None otherwise)."""
    if spec.precision != "16-mixed":
        return None
    scaler = torch.amp.GradScaler(device.type)
    if state and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    return scaler
