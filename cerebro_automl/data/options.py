"""The options every source takes, and the checks every constructor shares.

Each ``PartitionedDataset.from_*`` constructor checks its arguments on the
driver, before any worker loads anything, so bad input fails at once with an
error naming the value and the rule.

Example:
    >>> check_options(None, 0.2, 0, "disk", None)
    LoadOptions(valid_fraction=0.2, shuffle_seed=0, cache='disk', cache_dir=None, shuffle=True, decode_threads=0)
    >>> check_partitions(5, 4)
    Traceback (most recent call last):
    ValueError: num_partitions is 5, but must be <= the 4 training rows
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from .assign import row_ranges
from .partition import CACHES, held_out_rows

# More decode threads than this is a typo, not a machine (threads past the cores only contend).
MAX_DECODE_THREADS = 256

__all__ = [
    "LoadOptions",
    "MAX_DECODE_THREADS",
    "check_options",
    "check_decode_threads",
    "check_partitions",
    "check_held_out",
    "check_picklable",
]


@dataclass(frozen=True)
class LoadOptions:
    """How every partition of a dataset is split and kept (see :mod:`cerebro_automl.data`).

    ``shuffle``: rows go to partitions by a seeded permutation (the default), or in
    their given order (False). ``shuffle_seed``: that permutation's seed; None takes
    the session's seed when the session resolves the dataset (:meth:`seeded`).
    ``decode_threads``: threads that decode a file source's items, a few batches
    ahead of training (0: one by one, in the training thread; see
    :mod:`~cerebro_automl.data.decode`).
    """

    valid_fraction: float | None = None
    shuffle_seed: int | None = None
    cache: str | None = "memory"
    cache_dir: str | None = None
    shuffle: bool = True
    decode_threads: int = 0

    @property
    def seed(self) -> int | None:
        """The seed of the rows' permutation; None: the rows keep their given order.

        >>> LoadOptions(shuffle_seed=3).seed, LoadOptions(shuffle=False).seed
        (3, None)
        """
        return self.shuffle_seed if self.shuffle else None

    def seeded(self, session_seed: int) -> LoadOptions:
        """These options with ``session_seed`` as the permutation's seed where the user gave none.

        >>> LoadOptions().seeded(7).seed, LoadOptions(shuffle_seed=3).seeded(7).seed
        (7, 3)
        """
        if self.shuffle and self.shuffle_seed is None:
            return replace(self, shuffle_seed=session_seed)
        return self


def check_options(
    valid: Any,
    valid_fraction: Any,
    shuffle_seed: Any,
    cache: Any,
    cache_dir: Any,
    caches: tuple = CACHES,
    shuffle: Any = True,
    decode_threads: Any = 0,
) -> LoadOptions:
    """The checked :class:`LoadOptions`; ``valid`` is the constructor's explicit
    validation data (or None), which excludes ``valid_fraction``.

    >>> check_options(None, None, 3, "memory", None, shuffle=False)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ValueError: shuffle_seed is 3, but shuffle is False: the rows keep their given order, so there is no
    permutation to seed (drop shuffle_seed, or shuffle=True)
    """
    if valid is not None and valid_fraction is not None:
        raise ValueError("give valid or valid_fraction, not both")
    if valid_fraction is not None and (
        isinstance(valid_fraction, bool)
        or not isinstance(valid_fraction, (int, float))
        or not 0.0 < valid_fraction < 1.0
    ):
        raise ValueError(f"valid_fraction is {valid_fraction!r}, but must be in (0, 1)")
    if shuffle_seed is not None and (
        isinstance(shuffle_seed, bool) or not isinstance(shuffle_seed, int) or shuffle_seed < 0
    ):
        raise ValueError(f"shuffle_seed is {shuffle_seed!r}, but must be None or an int >= 0")
    if not isinstance(shuffle, bool):
        raise TypeError(f"shuffle is {shuffle!r}, but must be True (a seeded permutation) or False (the given order)")
    if not shuffle and shuffle_seed is not None:
        raise ValueError(
            f"shuffle_seed is {shuffle_seed}, but shuffle is False: the rows keep their given order, so "
            "there is no permutation to seed (drop shuffle_seed, or shuffle=True)"
        )
    if cache not in caches:
        raise ValueError(f"cache is {cache!r}, but must be one of {caches}")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir is {cache_dir!r}, but must be a folder path or None")
    check_decode_threads(decode_threads)
    folder = os.fspath(cache_dir) if cache_dir is not None else None
    return LoadOptions(valid_fraction, shuffle_seed, cache, folder, shuffle, decode_threads)


def check_decode_threads(decode_threads: Any) -> None:
    """``decode_threads`` is an int in ``[0, MAX_DECODE_THREADS]``, or an error names it.

    >>> check_decode_threads(-1)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ValueError: decode_threads is -1, but must be an int in [0, 256] (0 decodes each batch in the training
    thread; n >= 1 decodes in n threads, a few batches ahead)
    """
    rule = (
        f"must be an int in [0, {MAX_DECODE_THREADS}] (0 decodes each batch in the training thread; "
        "n >= 1 decodes in n threads, a few batches ahead)"
    )
    if isinstance(decode_threads, bool) or not isinstance(decode_threads, int):
        raise TypeError(f"decode_threads is {decode_threads!r}, but {rule}")
    if not 0 <= decode_threads <= MAX_DECODE_THREADS:
        raise ValueError(f"decode_threads is {decode_threads}, but {rule}")


def check_partitions(num_partitions: Any, rows: int | None) -> None:
    """``num_partitions`` is None or an int in ``[1, rows]`` (``rows`` None: not known here)."""
    if num_partitions is None:
        return
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int):
        raise TypeError(f"num_partitions is {num_partitions!r}, but must be an int")
    if num_partitions < 1:
        raise ValueError(f"num_partitions is {num_partitions}, but must be >= 1")
    if rows is not None and num_partitions > rows:
        raise ValueError(f"num_partitions is {num_partitions}, but must be <= the {rows} training rows")


def check_held_out(valid_fraction: float | None, rows: int | None, parts: int) -> None:
    """Every one of ``parts`` partitions of ``rows`` rows (as :func:`row_ranges` cuts
    them) holds out at least one validation row and keeps one training row, or a
    DataError (a ValueError) names the value, the rows and the rule (``rows`` None: not known here;
    each partition is checked as it loads).

    >>> check_held_out(0.0001, 600, 4)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    cerebro_automl.data.errors.DataError: valid_fraction is 0.0001, but a partition of 150 rows (600 rows in
    4 partitions) holds out round(150 x 0.0001) = 0 of its 150 rows; each partition holds out that fraction of
    its own rows, rounded, and must keep at least one validation row and one training row
    """
    if not valid_fraction or rows is None:
        return
    for size in sorted({stop - start for start, stop in row_ranges(rows, parts)}):
        held_out_rows(size, valid_fraction, f"a partition of {size} rows ({rows} rows in {parts} partitions)")


def check_picklable(value: Any, name: str) -> None:
    """``value`` (a function the workers call) survives cloudpickle, or a TypeError names it."""
    import cloudpickle

    try:
        cloudpickle.dumps(value)
    except Exception as err:
        raise TypeError(
            f"{name} cannot be pickled for the Dask workers ({err}); define it so that "
            "cloudpickle can send it (no open files, locks or live connections)"
        ) from None
