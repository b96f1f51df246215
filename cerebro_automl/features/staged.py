"""The staged pass: one forward of the frozen backbone yields every requested layer.

Forward hooks on the named submodules capture their outputs; once all are captured
the pass stops, so the layers above the deepest one never run.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 2))
    >>> out = staged_outputs(net, torch.ones(5, 3), {"a": "0", "b": "1"})
    >>> sorted(out), tuple(out["a"].shape)
    (['a', 'b'], (5, 4))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..data.structure import call_model, map_structure

__all__ = ["staged_outputs", "prepare"]


class _AllCaptured(Exception):
    """Every requested layer has its output: the rest of the backbone need not run."""


def staged_outputs(backbone: torch.nn.Module, x: Any, layers: Mapping[str, str]) -> dict[str, Any]:
    """The output of each submodule ``layers`` names (feature name -> path) for input
    ``x``, from one forward pass that stops after the last of them. Each output is
    copied as it is captured: a later in-place operation (``ReLU(inplace=True)``)
    must not change it. A submodule called twice gives its first output."""
    by_path: dict[str, Any] = {}
    paths = set(layers.values())

    def capture(path: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if path not in by_path:
                by_path[path] = map_structure(_copy, _plain(output, path))
                if len(by_path) == len(paths):
                    raise _AllCaptured

        return hook

    handles = [backbone.get_submodule(path).register_forward_hook(capture(path)) for path in paths]
    try:
        call_model(backbone, x)
    except _AllCaptured:
        pass
    finally:
        for handle in handles:
            handle.remove()
    missing = sorted(paths - set(by_path))
    if missing:
        raise ValueError(
            f"the backbone's forward pass never called submodules {missing}, so their outputs "
            "cannot be features; name submodules that its forward runs"
        )
    return {name: by_path[path] for name, path in layers.items()}


def prepare(value: Any, pool: str | None, dtype: torch.dtype | None) -> Any:
    """A captured output as it is kept: pooled over its spatial dimensions, in the
    storage dtype, on the CPU.

    >>> prepare(torch.ones(2, 3, 4, 4), "avg", torch.float16).shape
    torch.Size([2, 3])
    """

    def leaf(t: torch.Tensor) -> torch.Tensor:
        if pool is not None and t.dim() > 2:
            flat = t.flatten(2)
            t = flat.mean(dim=-1) if pool == "avg" else flat.amax(dim=-1)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t.cpu()

    return map_structure(leaf, value)


def _plain(output: Any, path: str) -> Any:
    """A submodule's output as a batch structure: a tensor, a tuple or a dict of tensors."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and all(isinstance(t, torch.Tensor) for t in output):
        return tuple(output)
    if isinstance(output, Mapping) and output and all(isinstance(t, torch.Tensor) for t in output.values()):
        return {str(k): v for k, v in output.items()}
    raise TypeError(
        f"submodule {path!r} returned {type(output).__name__}, but a feature must be a tensor, "
        "a tuple of tensors or a dict of tensors"
    )


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()
