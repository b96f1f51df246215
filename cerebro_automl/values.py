"""Small value helpers shared by the session, the results and the tuners."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["rank_key", "plain"]


def rank_key(value: float | None, mode: str) -> float:
    """A sort key, smaller is better, for a metric to ``mode`` ("min" or "max");
    None and NaN (a failed or diverged model) rank last.

    >>> sorted([0.5, float("nan"), 0.9], key=lambda v: rank_key(v, "max"))
    [0.9, 0.5, nan]
    """
    if value is None or math.isnan(value):
        return math.inf
    return value if mode == "min" else -value


def plain(value: Any) -> Any:
    """numpy scalars become Python numbers, through dicts, lists and tuples, so
    that configs stay JSON.

    >>> import numpy as np
    >>> plain({"lr": np.float64(0.1), "widths": (np.int64(8),)})
    {'lr': 0.1, 'widths': [8]}
    """
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return item()
    return value
