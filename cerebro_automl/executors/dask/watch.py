"""Which workers the executor has seen, lost and seen again; what a lost one ran."""

from __future__ import annotations

import logging
from typing import Any

from ...protocol import Executing

__all__ = ["WorkerWatch"]

logger = logging.getLogger("cerebro_automl")


class WorkerWatch:
    """The workers known to the executor, and those seen lost and not seen again.

    The tasks announce what runs on their worker in the Dask scheduler's event log
    under ``topic``; :meth:`running_on` reads it when a worker is lost."""

    def __init__(self, client: Any, topic: str, workers: list[str]) -> None:
        self._client = client
        self.topic = topic
        self.known: set[str] = set(workers)
        self.lost: set[str] = set()

    def live(self) -> list[str]:
        """The workers known and not seen lost, sorted."""
        return sorted(self.known - self.lost)

    def changes(self, now: list[str]) -> tuple[list[str], list[str]]:
        """``(gone, joined)``: the known workers missing from ``now``, and the workers of
        ``now`` not known, each sorted."""
        current = set(now)
        return sorted(self.known - current), sorted(current - self.known)

    def lose(self, worker: str) -> None:
        self.known.discard(worker)
        self.lost.add(worker)

    def join(self, worker: str) -> None:
        self.known.add(worker)
        self.lost.discard(worker)

    def running_on(self, worker: str) -> Executing | None:
        """What ``worker`` ran when it was last heard of (None: nothing, or unknown).

        Read, not subscribed to: the scheduler pushes a topic's events to its
        subscribers, and one arriving in the 2 ms batch of a reconnecting client's
        stream-start breaks distributed's reconnect (``assert len(msg) == 1`` in
        ``Client._ensure_connected``), which a test that drops the connection hit."""
        try:
            events = self._client.get_events(self.topic)
        except Exception as err:  # a client or scheduler going away: unknown
            logger.debug("reading the announcements of %s failed: %r", worker, err)
            return None
        for _, msg in reversed(events):
            if msg.get("worker") == worker:
                return Executing(msg["model"], msg["partition"]) if msg["running"] else None
        return None
