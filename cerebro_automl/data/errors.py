"""The error of data that breaks a rule of ours, found where a partition loads."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """The data breaks a rule (a null, a NaN in validation rows, chunks that do not
    match, a loader's result of the wrong form): found where a partition loads, it is
    the same on every worker and every try, so the load is not tried again."""
