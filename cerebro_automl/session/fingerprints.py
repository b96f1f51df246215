"""The fingerprint of the session's data, as checkpoints record it and a resume checks it.

Each partition's fingerprint (see :mod:`cerebro_automl.data.fingerprint`) is
taken by its worker when the partition loads; the session reads it from the
executor once per partition and keeps it. Checkpoints record what is known when
they are written (after an epoch every partition has loaded, so all of it, but
for a partition whose worker was lost meanwhile); a resume waits until every
partition has loaded, then compares.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from ..engine import Scheduler
from ..executors.base import Executor

__all__ = ["DataFingerprint"]


class DataFingerprint:
    """One fingerprint per partition, None while unknown.

    Args:
        run_until: ``(done, deadline)``: handle events until ``done()`` or the deadline.
        timeout: seconds :meth:`complete` waits for the partitions to load (None: forever).
    """

    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler,
        num_partitions: int,
        run_until: Callable[[Callable[[], bool], float], None],
        timeout: float | None,
    ) -> None:
        self._executor, self._scheduler, self._run_until = executor, scheduler, run_until
        self._timeout = math.inf if timeout is None else timeout
        self._known: list[dict | None] = [None] * num_partitions

    def known(self) -> list[dict | None]:
        """The fingerprints known now (asking the executor for those not yet known)."""
        missing = [p for p, fp in enumerate(self._known) if fp is None]
        if missing:
            for p, fp in self._executor.partition_fingerprints(missing).items():
                self._known[p] = fp
        return list(self._known)

    def complete(self) -> list[dict | None]:
        """The fingerprints, once every partition has loaded (handling events meanwhile,
        at most ``timeout`` s; a partition still unknown then stays None)."""
        if all(fp is not None for fp in self._known):
            return list(self._known)
        loaded = lambda: all(self._scheduler.holders(p) for p in range(len(self._known)))  # noqa: E731
        if not loaded():
            self._run_until(loaded, time.monotonic() + self._timeout)
        return self.known()
