"""TensorBoard event files: one run folder per model, scalars per epoch, the
config as hparams, so that TensorBoard's HParams tab compares the search."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from cerebro_automl.callbacks._base import Callback, flatten_config

if TYPE_CHECKING:
    from cerebro_automl.reports import EpochReport, ModelFailed, ModelPaused, SessionView

__all__ = ["TensorBoard"]

FLUSH_SECONDS = 5  # a run's new scalars reach its file (and TensorBoard) this often, at most


def _writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(
            "the TensorBoard callback needs tensorboard: pip install 'cerebro-automl[tensorboard]'"
        ) from None
    return SummaryWriter


class TensorBoard(Callback):
    """Write TensorBoard event files: ``log_dir/<model name>/`` per model.

    Each model's run gets, at every epoch (the step), one scalar per metric the
    epoch reported (``train_loss``, ``val_loss``, ``val_<metric>``, and the names
    a LightningModule gives ``self.log``), and its config as hparams. TensorBoard's
    HParams tab then lists every model with its config and the last value of
    each metric; a failed model is marked FAILURE there. Files are written on
    TensorBoard's own writer threads, flushed every 5 s and when a model pauses,
    stops or fails; a file stays open only while its model trains. Model names are
    ``model-<id>`` (``trial-<n>`` under Optuna): give each search its own ``log_dir``.

    Example:
        >>> from cerebro_automl.callbacks import TensorBoard
        >>> # grid_search(spec, data, space, epochs=5, session_callbacks=[TensorBoard("runs/grid")])
        >>> # then: tensorboard --logdir runs
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        if not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(f"log_dir is {log_dir!r}, but must be a path")
        self._SummaryWriter = _writer_class()  # fail here, not later inside a hook
        self.log_dir = os.fspath(log_dir)
        self._writers: dict[int, Any] = {}  # model id -> SummaryWriter, while it trains

    def __repr__(self) -> str:
        return f"TensorBoard(log_dir={self.log_dir!r})"

    def run_dir(self, view: SessionView, model_id: int) -> str:
        """The folder of one model's events."""
        return os.path.join(self.log_dir, view.model(model_id).name)

    def _writer(self, view: SessionView, model_id: int):
        if model_id not in self._writers:  # reopened after a pause: a new file in the same run
            self._writers[model_id] = self._SummaryWriter(self.run_dir(view, model_id), flush_secs=FLUSH_SECONDS)
        return self._writers[model_id]

    def on_model_added(self, view: SessionView, model_id: int) -> None:
        handle = view.model(model_id)
        writer = self._writer(view, model_id)
        writer.file_writer.add_summary(_session_start(flatten_config(handle.config), handle.name))
        writer.flush()

    def on_epoch_end(self, view: SessionView, report: EpochReport) -> None:
        writer = self._writer(view, report.model_id)
        for name, value in report.metrics.items():  # queued: the writer's thread writes them
            writer.add_scalar(name, value, global_step=report.epoch)

    def on_model_paused(self, view: SessionView, report: ModelPaused) -> None:
        self._end(report.model_id, "STATUS_SUCCESS")

    def on_model_stopped(self, view: SessionView, model_id: int) -> None:
        self._end(model_id, "STATUS_SUCCESS")  # pruned: a result, not an error

    def on_model_failed(self, view: SessionView, report: ModelFailed) -> None:
        self._writer(view, report.model_id)
        self._end(report.model_id, "STATUS_FAILURE")

    def on_session_end(self, view: SessionView) -> None:
        for model_id in list(self._writers):
            self._writers.pop(model_id).close()

    def _end(self, model_id: int, status: str) -> None:
        """Record the status and close the file: open files stay one per training model."""
        writer = self._writers.pop(model_id, None)
        if writer is not None:
            writer.file_writer.add_summary(_session_end(status))
            writer.close()


def _plugin_summary(tag: str, data: Any):
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams.metadata import PLUGIN_NAME

    meta = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=data.SerializeToString())
    )
    return Summary(value=[Summary.Value(tag=tag, metadata=meta)])


def _session_start(hparams: dict[str, bool | int | float | str], group: str):
    """The HParams plugin's session-start record. No experiment record is written:
    the plugin then builds one from every run's hparams and scalar tags, so runs
    with different config keys all show, and each metric's value is its last."""
    from tensorboard.plugins.hparams.metadata import PLUGIN_DATA_VERSION, SESSION_START_INFO_TAG
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionStartInfo

    info = SessionStartInfo(group_name=group, start_time_secs=time.time())
    for key, value in hparams.items():
        if isinstance(value, bool):  # before int: a bool is an int
            info.hparams[key].bool_value = value
        elif isinstance(value, (int, float)):
            info.hparams[key].number_value = value
        else:
            info.hparams[key].string_value = str(value)
    data = HParamsPluginData(session_start_info=info, version=PLUGIN_DATA_VERSION)
    return _plugin_summary(SESSION_START_INFO_TAG, data)


def _session_end(status: str):
    from tensorboard.plugins.hparams.api_pb2 import Status
    from tensorboard.plugins.hparams.metadata import PLUGIN_DATA_VERSION, SESSION_END_INFO_TAG
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionEndInfo

    info = SessionEndInfo(status=Status.Value(status), end_time_secs=time.time())
    data = HParamsPluginData(session_end_info=info, version=PLUGIN_DATA_VERSION)
    return _plugin_summary(SESSION_END_INFO_TAG, data)
