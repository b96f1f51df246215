"""Structured batches: a tensor, a tuple of tensors or a dict of name -> tensor.

A batch's ``x`` has one of these structures and its ``y`` too, or is None
(unlabeled data). Every *leaf* shares the first dimension (the rows), and a
batch takes the same rows of every leaf. Leaves keep their dtype from end to
end, with one documented exception: float64 becomes float32, the dtype torch
models are built in. Int64 ids stay int64; bool stays bool.

The structures are one level deep: a tuple or dict whose values are tensors.
Anything deeper, and leaves that are not numeric (object, str, structured,
datetime dtypes), are refused with an error naming the leaf.

Example:
    >>> import numpy as np
    >>> x = as_structure({"dense": np.zeros((4, 3)), "cat": np.arange(8).reshape(4, 2)}, "X")
    >>> {k: v.dtype for k, v in x.items()}
    {'dense': torch.float32, 'cat': torch.int64}
    >>> count_rows([("X", x), ("y", None)], "from_arrays")
    4
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

__all__ = [
    "Batch",
    "as_structure",
    "check_structure",
    "leaves",
    "map_structure",
    "count_rows",
    "take",
    "to_device",
    "concat",
    "call_model",
    "rows_of",
]

Batch = torch.Tensor | tuple | dict


def _is_array(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray)) or (
        hasattr(value, "__array__") and not isinstance(value, (tuple, dict))
    )


def check_structure(value: Any, name: str, *, optional: bool = False) -> None:
    """Raise TypeError unless ``value`` is an array, a tuple or a dict of arrays
    (or None when ``optional``), naming the part that breaks the rule."""
    if value is None:
        if optional:
            return
        raise TypeError(f"{name} is None, but must be an array, a tuple of arrays or a dict of arrays")
    if isinstance(value, (tuple, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        if not value:
            raise ValueError(f"{name} is an empty {type(value).__name__}; give at least one array")
        for key, leaf in items:
            if isinstance(value, dict) and not isinstance(key, str):
                raise TypeError(f"{name} has key {key!r}; the keys of a dict input must be str")
            if isinstance(leaf, (tuple, list, dict)):
                raise TypeError(
                    f"{_leaf_name(name, key)} is a {type(leaf).__name__}, but a batch is "
                    "one level deep: an array, a tuple of arrays or a dict of arrays"
                )
            if not _is_array(leaf):
                named = _leaf_name(name, key)
                raise TypeError(f"{named} is a {type(leaf).__name__}, but must be an array{_hint(leaf, named)}")
        return
    if isinstance(value, list):
        value = np.asarray(value)
    if not _is_array(value):
        raise TypeError(
            f"{name} is a {type(value).__name__}, but must be an array, a tuple of arrays or a dict of arrays"
        )


def _leaf_name(name: str, key: Any) -> str:
    return f"{name}[{key!r}]"


def leaves(value: Any, name: str) -> list[tuple[str, Any]]:
    """``(leaf name, leaf)`` pairs in a fixed order: ``X``, ``X[0]``, ``X['ids']``."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [(_leaf_name(name, k), v) for k, v in value.items()]
    if isinstance(value, tuple):
        return [(_leaf_name(name, i), v) for i, v in enumerate(value)]
    return [(name, value)]


def map_structure(fn: Callable[[Any], Any], value: Any) -> Any:
    """Apply ``fn`` to every leaf, keeping the structure (None stays None)."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: fn(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(fn(v) for v in value)
    return fn(value)


def _hint(value: Any, name: str) -> str:
    """What to do with text where labels (``y``) need numbers: class names."""
    text = isinstance(value, str) or (isinstance(value, np.ndarray) and value.dtype.kind in "USO")
    text = text and name.split()[-1].startswith("y")
    return (
        "; labels that are class names must become class indices, as torchvision's class_to_idx maps them"
        if (text)
        else ""
    )


def as_leaf(value: Any, name: str) -> torch.Tensor:
    """A CPU tensor for one leaf: numeric or bool dtypes only, float64 -> float32."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
    else:
        arr = np.asarray(value)
        if arr.dtype.kind not in "biufc":  # bool, int, uint, float, complex
            raise TypeError(f"{name} has dtype {arr.dtype}, but must be numeric (bool, int or float){_hint(arr, name)}")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("="))
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable:  # torch tensors are writable: a read-only buffer (Arrow) is copied
            arr = arr.copy()
        tensor = torch.from_numpy(arr)
    if tensor.dim() == 0:
        raise ValueError(f"{name} is a scalar, but must have one row per sample")
    # The one conversion: float64 becomes float32, the dtype torch models are built in.
    return tensor.float() if tensor.dtype == torch.float64 else tensor


def as_structure(value: Any, name: str, *, optional: bool = False) -> Batch | None:
    """Check ``value`` and convert every leaf with :func:`as_leaf` (None stays None when ``optional``)."""
    check_structure(value, name, optional=optional)
    if isinstance(value, list):
        value = np.asarray(value)
    if isinstance(value, dict):
        return {k: as_leaf(v, _leaf_name(name, k)) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(as_leaf(v, _leaf_name(name, i)) for i, v in enumerate(value))
    return None if value is None else as_leaf(value, name)


def _rows(leaf: Any) -> int:
    shape = getattr(leaf, "shape", None)
    if shape is None:
        shape = np.shape(leaf)
    if len(shape) == 0:
        raise ValueError("a scalar has no rows")
    return int(shape[0])


def count_rows(named: Iterable[tuple[str, Any]], where: str) -> int:
    """The rows every leaf of the named structures shares; raises naming two leaves that differ.

    >>> count_rows([("X", np.zeros(3)), ("y", np.zeros(2))], "from_arrays")
    Traceback (most recent call last):
    ValueError: from_arrays: X has 3 rows but y has 2; every leaf of X and y must have the same number of rows
    """
    first: tuple[str, int] | None = None
    for name, value in named:
        for leaf_name, leaf in leaves(value, name):
            try:
                n = _rows(leaf)
            except ValueError:
                raise ValueError(f"{where}: {leaf_name} is a scalar, but must have one row per sample") from None
            if first is None:
                first = (leaf_name, n)
            elif n != first[1]:
                raise ValueError(
                    f"{where}: {first[0]} has {first[1]} rows but {leaf_name} has {n}; "
                    "every leaf of X and y must have the same number of rows"
                )
    if first is None:
        raise ValueError(f"{where}: there is no data")
    return first[1]


def rows_of(value: Any) -> int:
    """The number of rows of a checked structure (its first leaf's)."""
    return _rows(leaves(value, "x")[0][1])


def take(value: Any, index: torch.Tensor) -> Any:
    """The rows ``index`` of every leaf (a copy)."""
    return map_structure(lambda t: t[index], value)


def to_device(value: Any, device: torch.device, non_blocking: bool = False) -> Any:
    if device.type == "cpu":
        return value
    return map_structure(lambda t: t.to(device, non_blocking=non_blocking), value)


def concat(parts: list[Any]) -> Any:
    """Concatenate structures of the same shape along the rows."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, dict):
        return {k: torch.cat([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple):
        return tuple(torch.cat([p[i] for p in parts]) for i in range(len(first)))
    return torch.cat(parts)


def call_model(model: Callable, x: Any) -> Any:
    """``model(x)`` for a tensor, ``model(*x)`` for a tuple, ``model(**x)`` for a dict."""
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, tuple):
        return model(*x)
    return model(x)
