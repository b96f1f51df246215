"""What the session makes of the engine's notices: the reports a tuner reads,
the history's rows, the hooks' calls and the checkpoints' writes.

The hooks are deferred while one event's notices are handled and run by
:meth:`Outcomes.settle`, when the session is consistent again.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..callbacks import CallbackList
from ..checkpoint import CheckpointWriter, record_metrics, save_checkpoint
from ..engine import Scheduler
from ..executors.base import FETCH_TIMEOUT, Executor, StateUnavailable
from ..protocol import Abort, Checkpoint, Fail, Notice, Pause, Report
from ..reports import EpochReport, ModelFailed, ModelPaused, Outcome, SessionView, UnitReport
from ..retention import Retention
from .fusion import Fusion, MemberNotice
from .history import History, ModelInfo
from .loop import DataLoadError
from .replay import Replay, Replayed

__all__ = ["Outcomes"]

logger = logging.getLogger("cerebro_automl")


class Outcomes:
    """The session's handler of notices (see :class:`~.loop.NoticeHandler`).

    Args:
        run_keys: the columns every history row and checkpoint shares
            (``session_seed``, ``num_partitions``, ``threads``, ``deterministic``).
        devices: the devices the session's units run on, as the ``device`` column.
        describe_source: partition -> its source, for a :class:`DataLoadError`.
        started: the session's start on the ``time.monotonic`` clock.
        checkpoint_meta: what every checkpoint records of the run besides the model
            (the run's id, the data's fingerprint), asked at each checkpoint.
        retention: which checkpoints to keep (see :mod:`~cerebro_automl.retention`);
            None keeps them all. The writer removes the others after each write, and
            records each reported epoch's metrics in its checkpoint when a best is kept.
    """

    def __init__(
        self,
        history: History,
        callbacks: CallbackList,
        view: SessionView,
        *,
        executor: Executor,
        scheduler: Scheduler,
        bar: Any,
        writer: CheckpointWriter,
        checkpoint_dir: str | None,
        run_keys: Mapping[str, Any],
        devices: Callable[[], str],
        describe_source: Callable[[int], str],
        started: float,
        checkpoint_meta: Callable[[], dict[str, Any]] = dict,
        fusion: Fusion | None = None,
        retention: Retention | None = None,
        data_layouts: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._history, self._callbacks, self._view = history, callbacks, view
        self._executor, self._scheduler, self._bar, self._writer = executor, scheduler, bar, writer
        self._dir, self._run_keys, self._devices = checkpoint_dir, dict(run_keys), devices
        self._checkpoint_meta, self._retention = checkpoint_meta, retention
        self._warned_metric = False
        self._describe_source = describe_source
        self._data_layouts, self._told_layouts = data_layouts, False
        self._started = started  # the history's session_seconds count from it
        self.queue: deque[Outcome] = deque()  # for the tuner's next_reports
        self._fusion = fusion
        self._journal = Replay(checkpoint_dir) if checkpoint_dir is not None else None

    def take(self) -> list[Outcome]:
        """The outcomes not yet given to the tuner, oldest first."""
        batch = list(self.queue)
        self.queue.clear()
        return batch

    def report(self, notice: Report, metrics: dict[str, float]) -> None:
        """A report: an :class:`EpochReport` with its history row and ``on_epoch_end``,
        or one inside an epoch, a :class:`UnitReport` with ``on_unit_end``; and its
        line in the model's reports journal (:mod:`.replay`)."""
        if self._fusion is not None and self._fusion.owns(notice.model_id):
            self._members(self._fusion.members_of(notice, metrics, dict))
            return
        # The epoch's gang width (never with fused groups, whose members the engine does not know)
        gang = self._scheduler.settings.gang and notice.unit is None
        width = self._scheduler.gang_width(notice.model_id, notice.epoch) if gang else None
        if self._journal is not None:
            name = self._history.models[notice.model_id].name
            self._journal.record(name, notice.epoch, metrics, notice.order, notice.unit, width)
        self._report(notice, metrics, width)

    def replay(self, model_id: int, reports: Sequence[Replayed]) -> None:
        """Reports the run before made, of epochs a resume does not train again (with
        the widths they were trained at: the engine never trained them in this session)."""
        for r in reports:
            self._report(Report(model_id, r.epoch, r.order, r.unit), dict(r.metrics), r.gang)

    def _report(self, notice: Report, metrics: dict[str, float], width: int | None = None) -> None:
        info = self._history.models[notice.model_id]
        config = copy.deepcopy(info.config)
        if notice.unit is not None:
            units = self._scheduler.settings.num_partitions
            self._emit(UnitReport(notice.model_id, notice.epoch, notice.unit, units, metrics, config), "on_unit_end")
            logger.debug("model %d epoch %d unit %d: %s", notice.model_id, notice.epoch, notice.unit, metrics)
            return
        self._history.record_epoch(
            notice.model_id,
            notice.epoch,
            metrics,
            {"order": notice.order, **({"gang": width} if width else {}), **self.row_keys(info)},
        )
        self._emit(EpochReport(notice.model_id, notice.epoch, metrics, config), "on_epoch_end")
        logger.debug("model %d epoch %d: %s", notice.model_id, notice.epoch, metrics)
        if self._retention is not None:
            self._retain(info.name, notice.epoch, metrics)

    def _retain(self, name: str, epoch: int, metrics: Mapping[str, Any]) -> None:
        """Queue, for the checkpoint writer, the epoch's metrics for its checkpoint's
        record when retention keeps a best (the checkpoint is written before: the engine
        checkpoints an epoch before it evaluates it), then retention: the epoch is
        reported now, and may be the best."""
        assert self._retention is not None
        retention, directory, metric, values = self._retention, self._dir, self._retention.metric, dict(metrics)
        if metric is not None and metric not in values and not self._warned_metric:
            self._warned_metric = True
            logger.warning(
                "keep_best names %r, but %s's epoch %d reported %s: no epoch counts as best by it, "
                "and only the newest checkpoints are kept",
                metric,
                name,
                epoch,
                sorted(values),
            )

        def job() -> None:
            assert directory is not None
            if metric is not None:
                try:
                    record_metrics(directory, name, epoch, values)
                except (OSError, ValueError) as err:  # retention's bookkeeping: the checkpoint stands
                    logger.warning("metrics of %s after epoch %d not recorded in its checkpoint: %r", name, epoch, err)
                    return
            retention.prune(directory, name, epoch, reported=epoch)

        self._writer.submit(f"the retention of {name}'s checkpoints after epoch {epoch}", job)

    def handle(self, notice: Notice) -> Exception | None:
        """Pause, Fail, Checkpoint or Abort; an Abort returns the :class:`DataLoadError`."""
        fusion = self._fusion
        if isinstance(notice, (Pause, Fail, Checkpoint)) and fusion is not None and fusion.owns(notice.model_id):
            states = lambda: self._executor.fetch_state(notice.model_id)["members"]  # noqa: E731
            self._members(fusion.members_of(notice, None, states))
            return None
        if isinstance(notice, Pause):
            self._emit(ModelPaused(notice.model_id, notice.epochs), "on_model_paused")
            logger.debug("model %d paused after %d epochs", notice.model_id, notice.epochs)
        elif isinstance(notice, Fail):
            self._fail(notice)
        elif isinstance(notice, Checkpoint):
            self._checkpoint(notice.model_id, notice.epoch)
        elif isinstance(notice, Abort):
            error = DataLoadError(
                f"{notice.error}. Its source: {self._describe_source(notice.partition)}. "
                "Every model's checkpoints written so far are kept"
            )
            logger.error("%s", error)
            return error
        return None

    def _members(self, notices: list[MemberNotice]) -> None:
        """A group's notice as its members' (see :meth:`Fusion.members_of`)."""
        for m in notices:
            if isinstance(m.notice, Report):
                self.report(m.notice, m.metrics or {})
            elif isinstance(m.notice, Fail):
                self._fail(m.notice)
            elif isinstance(m.notice, Checkpoint):
                self._checkpoint(m.notice.model_id, m.notice.epoch, m.group)
            else:
                self.handle(m.notice)

    def settle(self) -> None:
        """Run the hooks deferred while the notices were handled."""
        self._callbacks.flush()

    def row_keys(self, info: ModelInfo) -> dict[str, Any]:
        """What a history row needs to replay its model, and when it was written."""
        keys = self._run_keys
        return {
            "config": info.config,
            "name": info.name,
            "seed": info.seed,
            "offset": info.offset,
            **info.lineage,
            "num_partitions": keys["num_partitions"],
            "threads": keys["threads"],
            "device": self._devices(),
            "deterministic": keys["deterministic"],
            **({"fuse": keys["fuse"]} if keys.get("fuse", 1) > 1 else {}),
            **({"cyclic": True} if keys.get("cyclic") else {}),
            "session_seed": keys["session_seed"],
            "session_seconds": time.monotonic() - self._started,
        }

    def _emit(self, outcome: Outcome, hook: str) -> None:
        self.queue.append(outcome)
        self._callbacks.defer(hook, self._view, outcome)

    def _fail(self, notice: Fail) -> None:
        if self._fusion is None or notice.model_id in self._scheduler.models:
            self._bar.total -= self._scheduler.remaining_units(notice.model_id)  # never trained
        info = self._history.models[notice.model_id]
        self._history.record_failure(notice.model_id, notice.error, self.row_keys(info))
        logger.warning(
            "model %d (%s) failed: %s; config %s", notice.model_id, info.name, notice.error.splitlines()[0], info.config
        )
        error = notice.error + self._layouts_differ()
        self._emit(ModelFailed(notice.model_id, error), "on_model_failed")

    def _layouts_differ(self) -> str:
        """When the partitions' data differ in layout (a loader's partitions of other
        widths or dtypes), which is the cause of a failure that names only shapes: said
        once in the log, and after each failure's traceback."""
        try:
            layouts = self._data_layouts()
        except Exception:  # a hint only: a fingerprint that cannot be read now adds none
            return ""
        if layouts is None:
            return ""
        text = f"the partitions hold data of different layouts, but every partition must have the same: {layouts}"
        if not self._told_layouts:
            self._told_layouts = True
            logger.warning(text)
        return "\n" + text

    def _checkpoint(self, model_id: int, epoch: int, group: int | None = None) -> None:
        """Queue the state after ``epoch`` for the background writer (picked now, on
        this thread; fetched and written there); a member's from its ``group``'s."""
        info = self._history.models[model_id]
        if group is None:
            fetch = self._executor.state_fetcher(model_id, epoch)
        else:
            fetch_group = self._executor.state_fetcher(group, epoch)
            fetch = lambda timeout: fetch_group(timeout)["members"][model_id]  # noqa: E731
        keys = self._run_keys
        meta = {
            "config": info.config,
            "seed": info.seed,
            "offset": info.offset,
            "session_seed": keys["session_seed"],
            "num_partitions": keys["num_partitions"],
            "threads": keys["threads"],
            **({"fuse": keys["fuse"]} if keys.get("fuse", 1) > 1 else {}),
            **({"cyclic": True} if keys.get("cyclic") else {}),
            **self._checkpoint_meta(),
        }
        directory, name, retention, reported = self._dir, info.name, self._retention, info.epochs
        if directory is None:
            raise ValueError(f"the engine asked to checkpoint {name}, but the session has no checkpoint_dir")

        def job() -> None:
            try:
                state = fetch(FETCH_TIMEOUT)
            except StateUnavailable as err:
                if not err.lost:
                    raise
                # The scheduler learns of the loss and trains that epoch again, which
                # checkpoints it again; a state lost after the model moved on is skipped.
                logger.warning("checkpoint of %s after epoch %d skipped: %s", name, epoch, err)
                return
            save_checkpoint(directory, name, epoch, state, meta)
            if retention is not None:
                retention.prune(directory, name, epoch, reported)

        self._writer.submit(f"{name} after epoch {epoch}", job)
