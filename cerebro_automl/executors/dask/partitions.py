"""The partitions loaded on the workers: each a future of PartitionData, pinned.

>>> placed = Partitions(client, in_flight, session, topic)  # doctest: +SKIP
>>> placed.place(Place(0, worker), data.sources[0])  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from ...protocol import PartitionLost, Place, PlaceFailed
from .failures import gone
from .inflight import InFlight
from .tasks import load, read_fingerprints
from .wire import unknown_keys

__all__ = ["Partitions", "SCATTER_TIMEOUT"]

SCATTER_TIMEOUT = 60  # seconds to send a shard or a resumed state to its worker

logger = logging.getLogger("cerebro_automl")


class Partitions:
    """``(partition, worker) -> future`` of each partition loaded, and their loading."""

    def __init__(self, client: Any, in_flight: InFlight, session: str, topic: str) -> None:
        self._client = client
        self._in_flight = in_flight
        self._session = session
        self._topic = topic
        self._futures: dict[tuple[int, str], Any] = {}

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return iter(list(self._futures))

    def __contains__(self, key: tuple[int, str]) -> bool:
        return key in self._futures

    def __getitem__(self, key: tuple[int, str]) -> Any:
        return self._futures[key]

    def place(self, ins: Place, source: Any) -> PlaceFailed | None:
        """Load partition ``ins.partition`` from ``source`` on ``ins.worker``; a
        PlaceFailed when its shard could not even be sent there."""
        if getattr(source, "in_memory", False):
            # The driver holds this shard: send it to its worker directly.
            try:
                [source] = self._client.scatter([source], workers=[ins.worker], hash=False, timeout=SCATTER_TIMEOUT)
            except Exception as err:  # the worker left, or the connection failed: say so
                logger.warning("sending partition %d to %s failed (%r)", ins.partition, ins.worker, err)
                return PlaceFailed(ins.partition, ins.worker, f"sending its shard failed: {type(err).__name__}: {err}")
        self._in_flight.submit(
            ins,
            ins.worker,
            load,
            source,
            self._session,
            *self._persisted_inputs(source),
            key=f"p{ins.partition}",
            topic=self._topic,
            partition=ins.partition,
            delay=_backoff(ins.attempt),
        )
        return None

    def placed(self, partition: int, worker: str, future: Any) -> None:
        """The load of ``partition`` on ``worker`` finished as ``future``."""
        self._futures[(partition, worker)] = future

    def drop(self, partition: int, worker: str) -> None:
        """Free the partition on ``worker`` (and its disk cache there)."""
        future = self._futures.pop((partition, worker), None)
        if future is not None:
            future.release()

    def forget_worker(self, worker: str) -> None:
        """The partitions on a lost worker went with it."""
        for key in [key for key in self._futures if key[1] == worker]:
            del self._futures[key]

    def lost(self) -> list[PartitionLost]:
        """PartitionLost for each partition whose future was cancelled or lost (forgotten)."""
        out = []
        for (p, w), future in sorted(self._futures.items()):
            if gone(future):
                del self._futures[(p, w)]
                out.append(PartitionLost(p, w))
        return out

    def fingerprints(self, wanted: set[int]) -> dict[int, dict]:
        """The fingerprints of the ``wanted`` partitions loaded now, read where they lie
        (one holder each), beside the running tasks; a worker that fails to answer
        (it is leaving) leaves its partitions out."""
        keys: dict[str, int] = {}
        holders: set[str] = set()
        for (p, w), future in sorted(self._futures.items()):
            if p in wanted and p not in keys.values():
                keys[future.key] = p
                holders.add(w)
        if not keys:
            return {}
        try:
            answers = self._client.run(read_fingerprints, list(keys), workers=sorted(holders), on_error="return")
        except Exception as err:  # the cluster is going away: none known now
            logger.debug("reading the partitions' fingerprints failed: %r", err)
            return {}
        found = {k: fp for answer in answers.values() if isinstance(answer, dict) for k, fp in answer.items()}
        return {keys[k]: fp for k, fp in found.items() if k in keys}

    def futures(self) -> list[Any]:
        return list(self._futures.values())

    def clear(self) -> None:
        self._futures.clear()

    def _persisted_inputs(self, source: Any) -> list:
        """Futures for the persisted blocks a dask source reads; they must live on
        this client's scheduler (a collection persisted on another cluster cannot)."""
        keys = source.external_keys() if hasattr(source, "external_keys") else []
        if not keys:
            return []
        from distributed import Future

        # Known to the scheduler in any state: a collection persisted a moment ago may
        # still be computing (who_has would not list it yet).
        missing = self._client.run_on_scheduler(unknown_keys, keys)
        if missing:
            raise ValueError(
                f"the data reads {len(missing)} persisted blocks (e.g. {missing[0]!r}) that the scheduler "
                f"at {self._client.scheduler.address} does not hold: the dask collection was persisted "
                "on another cluster. Persist it with this session's client, or pass it unpersisted"
            )
        return [Future(k, self._client) for k in keys]


def _backoff(attempt: int) -> float:
    """Seconds a load waits after ``attempt`` failed loads in a row: 0, 1, 2, 4, ... 30."""
    return 0.0 if attempt <= 0 else min(2.0 ** (attempt - 1), 30.0)
