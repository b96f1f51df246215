"""Decoding a Dataset's items in threads, a few batches ahead of training, with the
bytes of decoding them one by one.

A :class:`~cerebro_automl.data.shards.DatasetShard` with ``decode_threads=n >= 1``
reads its batches through :func:`read_ahead`: a pool of ``n`` threads decodes the
items of the next :data:`BATCHES_AHEAD` batches while the training thread computes
on the current one. Threads, not processes: a Dask worker process is daemonic and
cannot start children, and PIL releases the GIL while it decodes. Each batch is
collated from its items in the batch's order, so the bytes do not depend on ``n``.

The pool lives for one pass (one iterator): it is shut down, its threads joined,
when the pass ends, fails, or is closed; an exception raised while decoding an item
is raised again, as it is, from the batch that holds the item.

An item that draws from a global random number generator (``torch.rand``,
``numpy.random``, ``random``) would break that promise: the generator is shared by
the process, so threads would draw in an order that depends on timing, and would
also move the training thread's generator (dropout). Seeding it per item does not
help, for the same reason. :func:`draws_global_rng` detects such an item (the first
one of a shard, read twice), and the shard then decodes in the training thread, as
with ``decode_threads=0``, and says so in the log.

Example:
    >>> batches = read_ahead(lambda i: i * i, [[0, 1], [2, 3], [4]], lambda items: items, threads=2)
    >>> list(batches)
    [[0, 1], [4, 9], [16]]
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = ["BATCHES_AHEAD", "THREAD_NAME", "read_ahead", "draws_global_rng"]

T = TypeVar("T")

#: Batches decoded ahead of the one the training thread is on: one keeps the threads
#: busy while the batch trains, the second absorbs a slow batch.
BATCHES_AHEAD = 2
#: The decode threads' name prefix (as ``threading.enumerate()`` shows them).
THREAD_NAME = "cerebro-decode"


def read_ahead(
    read_item: Callable[[int], Any],
    row_batches: Iterable[Sequence[int]],
    collate: Callable[[list], T],
    threads: int,
    ahead: int = BATCHES_AHEAD,
) -> Generator[T, None, None]:
    """``collate([read_item(r) for r in rows])`` for each ``rows`` of ``row_batches``,
    in order, the items read by ``threads`` threads up to ``ahead`` batches early."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix=THREAD_NAME)
    pending: deque[list[Future[list]]] = deque()
    try:
        for rows in row_batches:
            pending.append(_submit(pool, read_item, rows, threads))
            if len(pending) > ahead:
                yield collate(_gather(pending.popleft()))
        while pending:
            yield collate(_gather(pending.popleft()))
    finally:
        # Reached at the end, on an error, and when the consumer closes the iterator:
        # queued reads are dropped and the running ones waited for, so no thread outlives
        # the pass.
        pool.shutdown(wait=True, cancel_futures=True)


def _submit(pool: ThreadPoolExecutor, read_item: Callable[[int], Any], rows: Sequence[int], threads: int) -> list:
    """A batch's reads, in runs of consecutive rows: two per thread, so that a thread
    slowed by another process does not hold the batch up for long."""
    size = max(1, -(-len(rows) // (2 * threads)))
    return [pool.submit(_read_run, read_item, rows[i : i + size]) for i in range(0, len(rows), size)]


def _read_run(read_item: Callable[[int], Any], rows: Sequence[int]) -> list:
    return [read_item(r) for r in rows]


def _gather(futures: list[Future[list]]) -> list:
    """The batch's items in its order; a read's exception is raised here, unchanged."""
    return [item for future in futures for item in future.result()]


def draws_global_rng(read: Callable[[], Any]) -> bool:
    """Whether ``read()`` draws from torch's CPU or numpy's global random number
    generator, or gives what Python's ``random`` decides. Their states are put back
    afterwards, so the call changes no later draw.

    Python's generator is judged by the result, read under two seeds: Dask's own
    threads draw from it at any time, so a moved state says nothing of ``read``.

    >>> draws_global_rng(lambda: torch.rand(1)), draws_global_rng(lambda: torch.ones(1))
    (True, False)
    """
    before = _global_states()
    try:
        random.seed(_PROBE_SEEDS[0])
        first = read()
        moved = _global_states()
        random.seed(_PROBE_SEEDS[1])
        second = read()
    finally:
        torch.set_rng_state(before[0])
        np.random.set_state(before[1])
        random.setstate(before[2])
    same_torch, same_numpy = torch.equal(before[0], moved[0]), _same_numpy_state(before[1], moved[1])
    return not (same_torch and same_numpy and _same_item(first, second))


_PROBE_SEEDS = (0x5EED, 0x5EED + 1)


def _same_item(a: Any, b: Any) -> bool:
    """Whether two reads of an item gave the same values (tensors, arrays, images,
    and tuples, lists and dicts of them)."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(map(_same_item, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_item(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    try:
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    except (TypeError, ValueError):
        return bool(a == b)


def _global_states() -> tuple[torch.Tensor, Any, Any]:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _same_numpy_state(a: Any, b: Any) -> bool:
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b, strict=True))
