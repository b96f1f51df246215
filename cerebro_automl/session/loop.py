"""The session's event loop: poll the executor, hand its events to the
scheduler, send the commands that follow to the executor and the notices to
their handler.

Every change of the engine goes through :meth:`EventLoop.handle` or
:meth:`EventLoop.step`, so the hooks deferred while an event is handled run once
the session is consistent again (the handler's ``settle``). An error that ends
the session (:class:`StalledError`, :class:`DataLoadError`) is kept and raised
by every later step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..checkpoint import CheckpointError, CheckpointWriter
from ..engine import Scheduler
from ..executors.base import Executor
from ..protocol import NOTICES, Discard, EvaluationDone, Event, Instruction, Notice, Report, Tick, Train
from .interrupts import deferred

__all__ = ["EventLoop", "NoticeHandler", "StalledError", "DataLoadError", "SchedulerLost"]

logger = logging.getLogger("cerebro_automl")


class StalledError(RuntimeError):
    """Models wait, but nothing has run for ``no_worker_timeout`` seconds (no worker
    is alive, say); the message names the cause."""


class DataLoadError(RuntimeError):
    """A partition kept failing to load, each retry included; the message names the
    partition and the last error."""


class SchedulerLost(RuntimeError):
    """The cluster's scheduler is gone; the message says which checkpoints exist and
    how to resume on a new cluster."""


class NoticeHandler(Protocol):
    """What the session does with the engine's notices."""

    def report(self, notice: Report, metrics: dict[str, float]) -> None:
        """An epoch is reported, with the metrics its evaluation returned."""

    def handle(self, notice: Notice) -> Exception | None:
        """Any other notice; return the error that ends the session, if it does."""

    def settle(self) -> None:
        """The notices of one event are handled: run what waited for that."""


class EventLoop:
    """Drives one session's engine and executor.

    Args:
        admits: whether the engine hears of an event (a worker the session refuses does not).
        bar: the progress bar; its count follows the scheduler's ``units_trained``.
        writer: the checkpoint writer, whose errors end the session.
        no_worker_timeout: seconds models may wait with nothing running (None: forever).
        lost_scheduler: an error from the cluster (an OSError, or a checkpoint that
            failed with one) -> the :class:`SchedulerLost` to raise instead when the
            cluster's scheduler is gone, else None.
        resume_advice: which checkpoints exist and how to resume from them, for a
            :class:`StalledError`.
    """

    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler,
        notices: NoticeHandler,
        *,
        admits: Callable[[Event], bool],
        bar: Any,
        writer: CheckpointWriter,
        no_worker_timeout: float | None,
        lost_scheduler: Callable[[BaseException], SchedulerLost | None] = lambda err: None,
        resume_advice: Callable[[], str] = lambda: "",
    ) -> None:
        self._executor, self._scheduler, self._notices = executor, scheduler, notices
        self._admits, self._bar, self._writer = admits, bar, writer
        self._no_worker_timeout = no_worker_timeout
        self._lost_scheduler, self._resume_advice = lost_scheduler, resume_advice
        self.metrics: dict[tuple[int, int, int | None], dict[str, float]] = {}  # an evaluation's, until reported
        self.failure: Exception | None = None  # raised by every later step
        self._idle_since: float | None = None  # since when models wait with nothing running

    def busy(self) -> bool:
        """True while a model trains or evaluates, or the executor has work in flight."""
        return self._scheduler.active() or self._executor.busy()

    def handle(self, event: Event) -> None:
        """Hand one event of the session's own (a model added, extended, stopped) to the engine."""
        with deferred():
            self.dispatch(self._scheduler.handle(event))

    def dispatch(self, instructions: list[Instruction]) -> None:
        """Send the commands to the executor and the notices to their handler, in order."""
        for ins in instructions:
            if isinstance(ins, Report):
                self._notices.report(ins, self.metrics.pop((ins.model_id, ins.epoch, ins.unit)))
            elif isinstance(ins, NOTICES):
                failure = self._notices.handle(ins)
                if failure is not None:
                    self.failure = failure
            else:
                self._executor.execute(ins)
                _log_straggler(ins)
        self._notices.settle()

    def step(self, poll_interval: float) -> None:
        """One poll of the executor, its events handed to the scheduler. With replicas
        the scheduler also reads the clock (worker paces, stragglers to copy), and the
        poll waits no longer than until the next unit becomes a straggler. A scheduler
        found gone ends the session with :class:`SchedulerLost`, not Dask's raw error."""
        try:
            with deferred():  # Ctrl-C lands between steps: no completion is lost
                self._step(poll_interval)
            self._writer.check()
        except (OSError, CheckpointError) as err:
            lost = self._lost_scheduler(err)
            if lost is None:
                raise
            logger.error("%s", lost)
            self.failure = lost
            raise lost from err

    def _step(self, poll_interval: float) -> None:
        if self._scheduler.replicas > 1:
            self.dispatch(self._scheduler.handle(Tick(time.monotonic())))
            wakeup = self._scheduler.next_wakeup()
            if wakeup is not None:
                poll_interval = max(0.001, min(poll_interval, wakeup - time.monotonic()))
        completions = self._executor.poll(poll_interval)
        self._watch_progress(bool(completions))
        for completion in completions:
            e = completion.event
            if not self._admits(e):
                continue
            # (An evaluation's metrics, kept until its report is made.)
            evaluated = _reported_as(e) if isinstance(e, EvaluationDone) else None
            if evaluated is not None and completion.metrics is not None:
                self.metrics[evaluated] = completion.metrics
            self.dispatch(self._scheduler.handle(e))
            trained = self._scheduler.units_trained
            if trained != self._bar.n:  # down after a rollback
                self._bar.update(trained - self._bar.n)
            if evaluated is not None and completion.metrics is not None:  # not reported (stale, or reported before)
                self.metrics.pop(evaluated, None)
            self.raise_failure()  # an Abort: the events after it are not handled

    def run_until(self, done: Callable[[], bool], deadline: float, poll_interval: float = 0.5) -> None:
        """Step until ``done()`` holds after a step, or the clock passes ``deadline``."""
        while time.monotonic() < deadline:
            self.raise_failure()
            self.step(poll_interval)
            if done():
                return

    def raise_failure(self) -> None:
        """Raise the error that ended the session, if any (the checkpoints queued so
        far are on disk first)."""
        if self.failure is not None:
            if not isinstance(self.failure, SchedulerLost):  # nothing more can be fetched then
                self._writer.flush()
            raise self.failure

    def _watch_progress(self, progressed: bool) -> None:
        """Raise StalledError once models have waited ``no_worker_timeout`` s with nothing running."""
        if progressed or self._executor.busy() or not self._scheduler.active():
            self._idle_since = None
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
            logger.warning(
                "models wait and nothing runs: %s", self._scheduler.waiting_for() or "nothing can be started"
            )
        elif self._no_worker_timeout is not None and now - self._idle_since > self._no_worker_timeout:
            cause = self._scheduler.waiting_for() or "nothing runs and nothing can be started"
            missing = self._executor.missing_workers()
            self._writer.flush()  # so that the advice lists the checkpoints queued so far
            self.failure = StalledError(
                f"no model could run for {now - self._idle_since:.0f} s (no_worker_timeout="
                f"{self._no_worker_timeout}): {cause}. Models wait: {self._scheduler.live_models()[:20]}"
                + (f". The cluster's worker jobs: {missing}" if missing else "")
                + (f". {advice}" if (advice := self._resume_advice()) else "")
            )
            self.raise_failure()


def _log_straggler(command: Any) -> None:
    if isinstance(command, Train) and command.copy:
        logger.info(
            "model %d's unit on partition %d straggles: a speculative copy runs on %s",
            command.model_id,
            command.partition,
            command.worker,
        )
    elif isinstance(command, Discard) and command.restart:
        logger.info(
            "model %d's unit on partition %d straggles on %s with no holder idle to race it: restarted",
            command.model_id,
            command.partition,
            command.worker,
        )


def _reported_as(e: EvaluationDone) -> tuple[int, int, int | None]:
    """The key of the :class:`Report` an evaluation makes: the epoch after ``e.epoch``
    with its unit, for one inside an epoch."""
    return (e.model_id, e.epoch + 1, e.unit) if e.unit else (e.model_id, e.epoch, None)
