"""The Dask futures of the tasks in flight: submitting, cancelling, stopping them.

>>> in_flight = InFlight(client, session="1a2b3c4d")  # doctest: +SKIP
>>> future = in_flight.submit(ins, worker, train_task, *args, key="m0-e0-p1")  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from ...protocol import Train
from .failures import TIMEOUTS, Task, TaskCommand, kind_of
from .wire import RUNNER, is_future, portable

__all__ = ["InFlight", "release", "RECANCEL_AFTER"]

RECANCEL_AFTER = 1.0  # seconds after a cancel to send it once more (see InFlight.cancel)

logger = logging.getLogger("cerebro_automl")


class InFlight:
    """Each future of ours still running, and the :class:`Task` it is (by future)."""

    def __init__(self, client: Any, session: str) -> None:
        self._client = client
        self._session = session
        self._tasks: dict[Any, Task] = {}
        self._counter = itertools.count()
        self._cancelled: list[tuple[float, Any]] = []  # (when to cancel again, future)

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def __contains__(self, future: Any) -> bool:
        return future in self._tasks

    def __iter__(self) -> Iterator[Any]:
        return iter(self._tasks)

    def items(self) -> list[tuple[Any, Task]]:
        """``(future, task)`` of each, in submission order."""
        return list(self._tasks.items())

    def get(self, future: Any) -> Task | None:
        return self._tasks.get(future)

    def __getitem__(self, future: Any) -> Task:
        """The task of ``future``, which is in flight (KeyError if not)."""
        return self._tasks[future]

    def pop(self, future: Any) -> Task | None:
        """Forget ``future`` (it finished, or no longer counts); its task, if it was here."""
        return self._tasks.pop(future, None)

    def submit(
        self,
        ins: TaskCommand,
        worker: str | None,
        fn: Callable,
        *args: Any,
        key: str,
        prior: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Submit ``fn(*args, **kwargs)``, the task carrying out ``ins``, pinned to
        ``worker`` (None: any); its future."""
        pin = dict(workers=[worker], allow_other_workers=False) if worker else {}
        task_key = f"cerebro-{kind_of(ins)}-{key}-{self._session}-{next(self._counter)}"
        future = self._client.submit(RUNNER, *portable(fn, args, kwargs), key=task_key, pure=False, **pin)
        self._tasks[future] = Task(ins, worker, next(self._counter), prior)
        return future

    def submit_untracked(self, worker: str, fn: Callable, *args: Any, key: str) -> Any:
        """Submit ``fn(*args)`` pinned to ``worker`` as :meth:`submit` does, but keep no
        books of it: a gang unit's rank other than 0, whose rank 0 stands for the unit."""
        task_key = f"cerebro-train-{key}-{self._session}-{next(self._counter)}"
        pin = dict(workers=[worker], allow_other_workers=False)
        return self._client.submit(RUNNER, *portable(fn, args, {}), key=task_key, pure=False, **pin)

    def cancel(self, future: Any) -> None:
        """Cancel a future, and again a moment later: the scheduler builds a submitted
        task off its event loop, so a cancel that overtakes it finds no task and is
        dropped, and the task then runs and stays wanted by this client for good."""
        future.cancel()
        self._cancelled.append((time.monotonic() + RECANCEL_AFTER, future))

    def cancel_again(self, everything: bool = False) -> None:
        """Send the cancels that are due (``everything``: all, now)."""
        now = time.monotonic()
        due = [f for when, f in self._cancelled if everything or when <= now]
        if not due:
            return
        self._cancelled = [(when, f) for when, f in self._cancelled if not (everything or when <= now)]
        try:
            self._client.cancel(due)
        except Exception as err:  # a cluster going away: nothing left to cancel
            logger.debug("cancelling %d futures again failed: %r", len(due), err)

    def units_of(self, model_id: int) -> list[Any]:
        """The futures of the model's units in flight."""
        return [f for f, t in self._tasks.items() if isinstance(t.command, Train) and t.command.model_id == model_id]

    def stop(self, units: list[Any]) -> None:
        """Cancel ``units``. One already running stops after its batch: Dask cannot
        interrupt a task, but our units check after every batch whether it is
        cancelled on their worker, so that worker frees up at once."""
        for future in units:
            self.cancel(future)

    def wait(self, timeout: float) -> set:
        """The futures that finished (or were cancelled) within ``timeout`` seconds;
        returns at the first."""
        from distributed import wait
        from distributed.client import FuturesCancelledError

        try:
            done, _ = wait(list(self._tasks), timeout=timeout, return_when="FIRST_COMPLETED")
        except TIMEOUTS:  # distributed raises rather than returning nothing
            return set()
        except FuturesCancelledError:
            return {f for f in self._tasks if f.cancelled()}
        return done

    def held(self) -> list[Any]:
        """The futures, and the states their units started from (to release them)."""
        return [*self._tasks, *(t.prior for t in self._tasks.values())]

    def clear(self) -> None:
        self._tasks.clear()


def release(held: list[Any]) -> None:
    """Release our references to the futures among ``held``, at once: dropping the
    futures alone leaves the ones caught in reference cycles until the garbage
    collector runs."""
    for future in [f for f in held if is_future(f)]:
        try:
            future.release()  # our reference only; idempotent
        except Exception as err:  # a cluster going away: nothing left to release
            logger.debug("releasing %s failed: %r", future.key, err)
