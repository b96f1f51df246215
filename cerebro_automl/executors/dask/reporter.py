"""Polling: what Dask did with the tasks in flight, reported as events.

The executor's books (:class:`.InFlight`, :class:`.StateVersions`,
:class:`.Partitions`, :class:`.Evaluations`, :class:`.WorkerWatch`) are shared
with :class:`Reporter`, which reads Dask's facts (futures that finished, failed or
were cancelled, workers that came or went, data that was lost), updates the books
and returns the events, turned from those facts by :mod:`.failures`.

The order of the events is part of the protocol the engine relies on: completions
in submission order; a worker loss before the cancellations it explains; the data
lost before the work cancelled with it; evaluations read at the poll after the one
that saw them finish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ...data import DataError
from ...protocol import Evaluate, Event, PartitionPlaced, Place, Train, UnitDone, WorkerAdded, WorkerLost
from ..base import Completion, idle_wait
from . import failures
from .evaluations import Evaluations
from .failures import Origin, Task
from .gang import GangRanks
from .inflight import InFlight
from .partitions import Partitions
from .progress import ProgressAsks
from .states import StateVersions
from .watch import WorkerWatch

__all__ = ["Reporter", "PROGRESS_POLL", "WORKER_CHECK_INTERVAL", "QUIET_CHECK_INTERVAL"]

PROGRESS_POLL = 0.005  # seconds a poll waits at most while an answer is due (it is reported then)
WORKER_CHECK_INTERVAL = 1.0  # seconds between checks for workers that joined or left while busy
QUIET_CHECK_INTERVAL = 0.25  # ... and at least between those of polls that found nothing finished

logger = logging.getLogger("cerebro_automl")


class Reporter:
    """Turns what happened on the cluster into events, keeping the books in step.

    ``ready``: events found outside a poll (work that could not be sent), reported by
    the next one."""

    def __init__(
        self,
        client: Any,
        workers: Callable[[], list[str]],
        in_flight: InFlight,
        states: StateVersions,
        partitions: Partitions,
        evaluations: Evaluations,
        watch: WorkerWatch,
        progress: ProgressAsks,
        gangs: GangRanks | None = None,
    ) -> None:
        self._client = client
        self._workers = workers
        self._pending = in_flight
        self.states = states
        self._partitions = partitions
        self._evaluations = evaluations
        self._watch = watch
        self._progress = progress
        self._gangs = gangs
        self.ready: list[Completion] = []
        self._next_worker_check = self._next_quiet_check = 0.0
        self._idle_delay = 0.01  # poll's sleep when nothing is in flight

    def busy(self) -> bool:
        """Whether work is in flight, or events wait to be reported."""
        return bool(self._pending) or bool(self.ready) or bool(self._evaluations)

    def poll(self, timeout: float) -> list[Completion]:
        """What happened within ``timeout`` seconds (see :meth:`Executor.poll`)."""
        self._pending.cancel_again()
        units = [t.command for _, t in self._pending.items() if isinstance(t.command, Train)]
        self.states.forget_priors({ins.model_id for ins in units})
        out, self.ready = self.ready, []
        out.extend(self._progress.answers())
        out.extend(self._read_evaluations())
        if out:
            return out
        if not self._pending:
            # Nothing to wait on (every worker gone, say): sleep, backing off, rather
            # than return at once to a caller that would call again at once.
            self._idle_delay = idle_wait(self._idle_delay, timeout)
            return self.check_workers() or self._audit("the partition's future was cancelled")
        self._idle_delay = 0.01
        if self._progress:  # answered within milliseconds, usually: report it then
            timeout = min(timeout, PROGRESS_POLL)
        done = self._pending.wait(timeout)
        cancelled = [f for f in done if f.cancelled()]
        if cancelled:
            # A worker loss explains most cancellations (Dask cancels tasks whose inputs
            # died with a worker): report it first, so that the engine rolls back;
            # the cancelled futures are handled at the next poll, known to be stale.
            lost = self.check_workers()
            if lost:
                return lost
            out.extend(self._recover(cancelled))
        # A cancelled evaluation shard drops its siblings: they are no longer pending.
        finished = sorted(
            (f for f in done if f in self._pending and not f.cancelled()), key=lambda f: self._pending[f].sequence
        )
        for future in finished:
            task = self._pending.pop(future)
            if task is not None:  # a worker loss seen meanwhile may have dropped it
                out.extend(self._complete(future, task))
        out.extend(self._progress.answers())
        if not out:
            out.extend(self._read_evaluations())
        if not out:  # nothing finished in time: has a worker come or gone, or data gone?
            if time.monotonic() >= self._next_quiet_check:  # polls can be short (speculation wake-ups)
                self._next_quiet_check = time.monotonic() + QUIET_CHECK_INTERVAL
                out.extend(self.check_workers() or self._audit("the partition's future was cancelled"))
        elif time.monotonic() >= self._next_worker_check:  # a busy cluster grows and shrinks too
            out.extend(self.check_workers() or self._audit("its only copy was on a lost worker"))
        return out

    def _read_evaluations(self) -> list[Completion]:
        """At the start of the poll after the one that saw evaluations finish (whose
        completions have sent the workers new units meanwhile), or at its end."""
        return self._evaluations.read(self._client, self.check_workers)

    def _complete(self, future: Any, task: Task) -> list[Completion]:
        ins = task.command
        if future.status == "finished":
            if isinstance(ins, Place):
                self._partitions.placed(ins.partition, ins.worker, future)
                return [Completion(PartitionPlaced(ins.partition, ins.worker))]
            if isinstance(ins, Train):
                self.states.settle(future)
                return [Completion(UnitDone(ins.model_id, ins.partition, ins.worker))]
            self._evaluations.shard_done(ins)
            return []
        if future.status != "error":
            return []
        error = future.exception()
        if self._gangs:
            error = self._gangs.cause(future, error)
        origin = failures.error_origin(error, task.worker is None or task.worker in self._workers())
        if origin is Origin.LOST_WORKER:
            self._undo_unit(future, task)
            if self._gangs:  # a gang unit's rank 0: its other ranks go with it
                self._gangs.stop([future])
            return self.check_workers()
        text = failures.text_of(error)
        if self._gangs:  # a gang unit's rank 0 ended: its other ranks go with it
            self._gangs.stop([future])
        if origin is Origin.KILLED:
            lost = self.check_workers()
            if lost and (task.worker is None or task.worker not in self._workers()):
                return lost
            # Its own worker lives (a gang unit's rank 0, whose peer was lost): it ends too.
            self._undo_unit(future, task)
            return [*lost, Completion(failures.killed(task, text, self.states.settle(future)))]
        else:
            if isinstance(ins, Place):
                logger.warning("loading partition %d on %s failed: %s", ins.partition, ins.worker, text)
            event = failures.failed(task, text, self.states.settle(future), isinstance(error, DataError))
        if isinstance(ins, Evaluate):
            self._evaluations.drop(ins.model_id)  # its other shards no longer count
        return [Completion(event)]

    def _recover(self, cancelled: list) -> list[Completion]:
        """Completions for futures cancelled while their workers live: our own
        cancellations of discarded units free their workers; any other (a client that
        reconnected loses every future; a user may cancel one) is reported, after the
        partitions and states it took with it."""
        out: list[Completion] = []
        foreign: list[tuple[Any, Task]] = []
        for future in sorted(cancelled, key=lambda f: self._pending[f].sequence):
            task = self._pending[future]
            if isinstance(task.command, Train) and self.states.is_discarded(future):
                self._pending.pop(future)
                self.states.settle(future)
                out.append(Completion(failures.discarded_done(task.command)))
            else:
                foreign.append((future, task))
        if not foreign:
            return out
        reason = failures.cancel_reason(foreign[0][0])
        logger.warning(
            "%d futures were cancelled although their workers live (%s); the lost work runs again", len(foreign), reason
        )
        out.extend(self._audit(reason))
        for future, task in foreign:
            if self._pending.pop(future) is None:  # a shard of an evaluation dropped just now
                continue
            self._undo_unit(future, task)
            if isinstance(task.command, Evaluate):
                self._evaluations.drop(task.command.model_id)
            out.append(Completion(failures.cancelled(task, reason)))
        return out

    def _undo_unit(self, future: Any, task: Task) -> None:
        """Forget a unit's output: it runs again from the state it started from."""
        if isinstance(task.command, Train):
            self.states.undo_unit(task.command.model_id, future, task.prior)

    def _audit(self, reason: str) -> list[Completion]:
        """PartitionLost and StatesLost for the data we hold whose futures were cancelled
        or lost, checked at every quiet poll and every second while busy: a client
        reconnect cancels them all, a state Dask cancels on its own (one it cannot
        recompute) comes with no change in the set of workers, and a state whose only
        copy was on a lost worker other than the one that computed it is lost without
        the engine knowing (Dask would recompute it on the dead worker: never).
        Each lost state is reported once."""
        in_flight = {
            t.command.model_id: (f, t.prior)
            for f, t in self._pending.items()
            if isinstance(t.command, Train) and not self.states.is_discarded(f)
        }
        lost: list[Event] = [*self._partitions.lost(), *self.states.lost(in_flight)]
        out = [Completion(e) for e in lost]
        if out:
            logger.warning(
                "data the models need was lost (%s): %s",
                reason,
                ", ".join(repr(c.event) for c in out[:5]) + (" ..." if len(out) > 5 else ""),
            )
        return out

    def check_workers(self) -> list[Completion]:
        """WorkerLost for each known worker gone (see :meth:`lose`), WorkerAdded for each new one."""
        self._next_worker_check = time.monotonic() + WORKER_CHECK_INTERVAL
        gone, joined = self._watch.changes(self._workers())
        out = [c for w in gone for c in self.lose(w)]
        for w in joined:
            self._watch.join(w)
            out.append(Completion(WorkerAdded(w)))
        return out

    def lose(self, worker: str) -> list[Completion]:
        """Forget everything pinned to a lost worker; the engine re-places and rolls back."""
        executing = self._watch.running_on(worker)
        logger.warning(
            "worker %s was lost%s",
            worker,
            ""
            if executing is None
            else f" while it ran {'model' if executing.model_id is not None else 'partition'} "
            f"{executing.model_id if executing.model_id is not None else executing.partition}",
        )
        self._watch.lose(worker)
        # An evaluation with a shard on the lost worker would wait for it forever;
        # the engine evaluates again every model evaluating when a worker is lost.
        for model_id in self._evaluations.using(worker):
            self._evaluations.drop(model_id)
        for future, task in self._pending.items():
            if task.worker == worker:
                self._pending.pop(future)
                self.states.settle(future)
                self._pending.cancel(future)
                self._undo_unit(future, task)
                if self._gangs:  # a gang unit's rank 0: stop its other ranks
                    self._gangs.stop([future])
        self._partitions.forget_worker(worker)
        return [Completion(WorkerLost(worker, executing))]
