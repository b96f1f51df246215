"""Asking the workers how far their running units have come (for ``AskProgress``).

One round trip to all the workers asked, which the driver does not wait for: the
answers become :class:`~cerebro_automl.protocol.UnitProgress` events at the first
poll after they arrive. A unit not yet started, or a worker that does not answer
within :data:`PROGRESS_TIMEOUT`, is not reported: the engine falls back on the clock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any

from ...protocol import UnitProgress
from ..base import Completion
from .tasks import units_progress

__all__ = ["ProgressAsks", "PROGRESS_TIMEOUT", "Asked"]

PROGRESS_TIMEOUT = 1.0  # seconds the workers have to answer an AskProgress

logger = logging.getLogger("cerebro_automl")

Asked = dict[str, dict[str, tuple[int, int]]]  # worker -> unit key -> (model, partition)


class ProgressAsks:
    """The questions about units' progress sent and not yet answered."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._asks: list[tuple[concurrent.futures.Future, Asked]] = []

    def __bool__(self) -> bool:
        return bool(self._asks)

    def ask(self, asked: Asked) -> None:
        """Ask each worker of ``asked`` about its units (a no-op for none)."""
        if not asked:
            return
        keys = [key for units in asked.values() for key in units]
        client = self._client
        # Client.run with a time limit (what Client.run does, which takes none)
        answer = asyncio.wait_for(
            client._run(units_progress, keys, workers=list(asked), on_error="return"), PROGRESS_TIMEOUT
        )
        self._asks.append((asyncio.run_coroutine_threadsafe(answer, client.loop.asyncio_loop), asked))

    def answers(self) -> list[Completion]:
        """UnitProgress for every answer that has arrived."""
        out: list[Completion] = []
        done = [a.done() for a, _ in self._asks]  # once: an answer may arrive meanwhile
        arrived = [ask for ask, d in zip(self._asks, done, strict=True) if d]
        self._asks = [ask for ask, d in zip(self._asks, done, strict=True) if not d]
        for answer, asked in arrived:
            try:
                answers = answer.result()
            except Exception as err:  # slow or leaving workers: no answer this time
                logger.debug("asking %s for their units' progress failed: %r", sorted(asked), err)
                continue
            for worker, found in answers.items():
                if not isinstance(found, dict) or worker not in asked:
                    continue  # the worker's error, returned
                for key, (fraction, seconds) in found.items():
                    model_id, partition = asked[worker][key]
                    out.append(Completion(UnitProgress(model_id, partition, worker, fraction, seconds)))
        return out

    def cancel(self) -> None:
        """Drop the questions unanswered (not left pending on a loop that may close)."""
        for ask, _ in self._asks:
            ask.cancel()
        self._asks.clear()
