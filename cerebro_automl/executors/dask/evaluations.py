"""Evaluations in flight: one task per validation shard, read together once all finish.

The driver gathers the shards' results in one request and combines them into the
epoch's metrics (:func:`~cerebro_automl.training.epoch_metrics`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

from ...protocol import Evaluate, EvaluationCancelled, EvaluationDone
from ...training import epoch_metrics
from ..base import FETCH_TIMEOUT, Completion
from .failures import TIMEOUTS, gone
from .inflight import InFlight

__all__ = ["Evaluations", "GATHER_TRY"]

GATHER_TRY = 2.0  # seconds of the first try to read evaluation results (then 4, 8, ...)


class Evaluations:
    """Each model's evaluation in flight: its shard futures and the workers they use."""

    def __init__(self, in_flight: InFlight) -> None:
        self._in_flight = in_flight
        self.shards: dict[int, list] = {}  # model -> its evaluation futures
        self._workers: dict[int, set[str]] = {}  # model -> the workers its evaluation uses
        self._finished: list[tuple[Evaluate, list]] = []  # every shard finished, results not yet read

    def __bool__(self) -> bool:
        """Whether results wait to be read."""
        return bool(self._finished)

    def start(self, model_id: int, shards: list, workers: set[str]) -> None:
        self.shards[model_id] = shards
        self._workers[model_id] = workers

    def drop(self, model_id: int) -> None:
        """Forget the model's evaluation, and cancel its shards."""
        self._workers.pop(model_id, None)
        for future in self.shards.pop(model_id, []):
            self._in_flight.pop(future)
            self._in_flight.cancel(future)

    def using(self, worker: str) -> list[int]:
        """The models whose evaluation has a shard on ``worker``."""
        return [m for m, used in self._workers.items() if worker in used]

    def shard_done(self, ins: Evaluate) -> None:
        """A shard of ``ins`` finished: once all have, they are no longer in flight and
        their results wait to be read."""
        shards = self.shards.get(ins.model_id, [])
        if shards and all(s.status == "finished" for s in shards):
            self._finished.append((ins, shards))
            for shard in shards:
                self._in_flight.pop(shard)

    def read(self, client: Any, check_workers: Callable[[], list[Completion]]) -> list[Completion]:
        """EvaluationDone, with its metrics, for every evaluation whose shards all
        finished; a worker loss seen meanwhile (``check_workers``) is reported instead,
        and ends the read."""
        finished = [
            (ins, shards) for ins, shards in self._finished if self.shards.get(ins.model_id) is shards
        ]  # not dropped since
        self._finished = []
        out: list[Completion] = []
        for ins, shards in [(i, s) for i, s in finished if any(map(gone, s))]:  # Dask would wait for it
            finished.remove((ins, shards))
            self.drop(ins.model_id)
            out.append(Completion(EvaluationCancelled(ins.model_id, ins.epoch, "its result was lost", ins.unit)))
        if not finished:
            return out
        results, error, lost = _gather([s for _, shards in finished for s in shards], client, check_workers)
        if lost:
            return lost
        for ins, shards in finished:
            self.shards.pop(ins.model_id)
            self._workers.pop(ins.model_id, None)
            for shard in shards:  # the metrics are here: free the keys now, not at GC
                shard.release()
            if results is None:
                out.append(Completion(EvaluationCancelled(ins.model_id, ins.epoch, error, ins.unit)))
                continue
            done = EvaluationDone(ins.model_id, ins.epoch, unit=ins.unit)
            out.append(Completion(done, epoch_metrics(results[: len(shards)])))
            results = results[len(shards) :]
        return out

    def clear(self) -> list:
        """Forget every evaluation; returns their shard futures (to release)."""
        futures = [f for shards in self.shards.values() for f in shards]
        self.shards.clear()
        self._workers.clear()
        return futures


def _gather(
    futures: list, client: Any, check_workers: Callable[[], list[Completion]]
) -> tuple[list | None, str, list[Completion]]:
    """``(results, "", [])``, ``(None, why not, [])``, or ``(None, "", the worker loss seen)``.

    One gather, waited for in short tries, each twice as long: a result whose worker
    died meanwhile is rescheduled by Dask onto that worker (the task is pinned to
    it), and the gather would wait for it until FETCH_TIMEOUT; between tries, a lost
    worker ends the wait. The gather is left to end on its own (once its futures
    are released): cancelling it orphans Dask's own waits, which then print "Task
    exception was never retrieved ... AllExit"."""
    give_up, attempt = time.monotonic() + FETCH_TIMEOUT, GATHER_TRY
    reading = asyncio.run_coroutine_threadsafe(_gathered(client, futures), client.loop.asyncio_loop)
    while True:
        try:
            return reading.result(timeout=max(0.0, min(attempt, give_up - time.monotonic()))), "", []
        except (CancelledError, *TIMEOUTS) as err:  # a result died between "finished" and now
            lost = check_workers()
            if lost:
                return None, "", lost
            if isinstance(err, CancelledError) or time.monotonic() >= give_up:
                return None, f"its result could not be read: {type(err).__name__}", []
            attempt *= 2


async def _gathered(client: Any, futures: list) -> list:
    """Runs on the client's event loop."""
    return await client.gather(futures, asynchronous=True)
