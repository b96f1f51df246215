"""A model state's tensors between devices: private copies for a unit, one wait
to bring a GPU state (or a pass's numbers) to the host.

A state is a plain dict, which Dask moves zero-copy::

    {"model": {name: tensor}, "optimizer": ..., "scheduler": ..., "samples": int,
     "steps": int, "progress": {...}}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["State", "clone_tensors", "to_host", "to_floats"]

State = dict  # {"model": {name: tensor}, "optimizer": ..., "scheduler": ..., "samples", "steps", "progress"}


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


def to_floats(values: list[Any]) -> list[float]:
    """Per-batch numbers (tensors on any device, or plain numbers) as floats, reading
    each device's tensors in one copy.

    >>> to_floats([torch.tensor(0.5), 2])
    [0.5, 2.0]
    """
    out: list[Any] = [None] * len(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
        else:
            out[i] = float(v)
    for indices in by_device.values():
        read = to_host(torch.stack([values[i].detach().reshape(()).double() for i in indices])).tolist()
        for i, value in zip(indices, read, strict=True):
            out[i] = value
    return out


def _map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(fn, v) for k, v in value.items()}  # plain dict: Dask sends it zero-copy
    if isinstance(value, (list, tuple)):
        mapped = [_map_tensors(fn, v) for v in value]
        return mapped if isinstance(value, list) else tuple(mapped)
    return value
