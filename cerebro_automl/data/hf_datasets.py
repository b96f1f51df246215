"""A HuggingFace ``datasets.Dataset`` as in-memory arrays: each numeric column a leaf
of ``X`` (a dict, as ``model(**x)`` takes it), the label column ``y``.

Tokenized text is fixed-length columns of ids (``tokenizer(..., padding="max_length",
truncation=True)``); a column whose rows differ in length is refused naming it,
since the rows of a batch must stack. Text and other non-numeric columns are left
out unless named in ``columns``, which then fails naming them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["is_hf_dataset", "hf_arrays"]

logger = logging.getLogger("cerebro_automl")


def is_hf_dataset(value: Any) -> bool:
    """Whether ``value`` is a ``datasets.Dataset`` (or a ``DatasetDict``), found by its
    class so that ``datasets`` need not be installed."""
    return any(
        c.__module__.startswith("datasets.") and c.__name__ in ("Dataset", "DatasetDict") for c in type(value).__mro__
    )


def hf_arrays(
    dataset: Any, label: str | None, columns: Sequence[str] | None, name: str = "dataset"
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """``(X, y)`` of ``dataset``: ``X`` maps each input column to its numpy array."""
    if type(dataset).__name__ == "DatasetDict":
        raise TypeError(
            f"{name} is a DatasetDict with splits {sorted(dataset)}, but must be one Dataset: "
            f"pass {name}['train'] (and the validation split as valid=...)"
        )
    available = list(dataset.column_names)
    if label is not None and label not in available:
        raise ValueError(f"label is {label!r}, but {name} has columns {available}")
    if columns is not None:
        missing = [c for c in columns if c not in available]
        if missing:
            raise ValueError(f"columns names {missing}, which {name} lacks (it has {available})")
    table = dataset.with_format("numpy")[:]
    wanted = list(columns) if columns is not None else [c for c in available if c != label]
    X: dict[str, np.ndarray] = {}
    left_out = []
    for column in wanted:
        values = table[column]
        if values.dtype == object:
            raise ValueError(
                f"{name} column {column!r} holds rows of different lengths, but the rows of a batch must "
                "stack: tokenize with padding='max_length' and truncation=True (or pad the column)"
            )
        if values.dtype.kind not in "biuf":
            if columns is not None:
                raise ValueError(f"{name} column {column!r} is {values.dtype}, but an input column must be numeric")
            left_out.append(column)
            continue
        X[column] = values
    if not X:
        raise ValueError(f"{name} has no numeric input column (columns: {available}); tokenize it first")
    if left_out:
        logger.info("%s: columns %s are not numeric and are left out of the inputs", name, left_out)
    return X, (table[label] if label is not None else None)
