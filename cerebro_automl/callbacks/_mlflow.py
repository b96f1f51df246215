"""MLflow tracking: one parent run per session (one search), one nested child run
per model with its config as params, per-epoch metrics and its status."""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from cerebro_automl.callbacks._base import Callback, flatten_config

if TYPE_CHECKING:
    from cerebro_automl.reports import EpochReport, ModelFailed, ModelPaused, SessionView

__all__ = ["MLflow"]

logger = logging.getLogger("cerebro_automl")

MAX_PARAM_LENGTH = 6000  # MLflow's limit for a param value (500 before MLflow 2.x)
MAX_TAG_LENGTH = 5000
CLOSE_TIMEOUT = 300.0  # seconds the session end waits for queued writes


def _mlflow():
    try:
        import mlflow.entities
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ImportError(
            "the MLflow callback needs mlflow: pip install 'cerebro-automl[mlflow]' "
            "(mlflow-skinny; the full 'mlflow' package adds the UI)"
        ) from None
    return mlflow.entities, MlflowClient


def _check_reachable(uri: str | None, timeout: float = 5.0) -> None:
    """Raise ConnectionError when an http(s) tracking server does not take a connection
    within ``timeout`` s: MLflow's client retries for minutes, which the session's end
    would wait for, before saying so. None: MLflow's own URI (``MLFLOW_TRACKING_URI``).
    A server behind an HTTP proxy is left to the client, which goes through it."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    if uri is None:
        import mlflow

        uri = mlflow.get_tracking_uri()
    parts = urlsplit(uri or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    if parts.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(parts.hostname):
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(f"the MLflow tracking server at {uri} cannot be reached: {err}") from None


def _key(name: str) -> str:
    """MLflow accepts letters, digits, ``_-. /:`` in keys; anything else becomes ``_``."""
    return re.sub(r"[^\w.\- /:]", "_", str(name))[:250] or "_"


class MLflow(Callback):
    """Log a session to MLflow: a parent run, and a nested child run per model.

    The parent run (named ``run_name``) holds the session's settings (seed,
    partitions, order, threads, workers). Each model's child run, named as the
    model (``model-<id>``, ``trial-<n>`` under Optuna), holds its config as params,
    every epoch's metrics with ``step=epoch``, and ends FINISHED (trained its
    budget), KILLED (stopped by the tuner, e.g. pruned) or FAILED (the error's
    first lines in the ``cerebro.error`` tag). The parent ends FINISHED, or FAILED
    when the code using the session raised.

    Every call to MLflow runs on one background thread, in order, so a slow
    tracking server (or a new sqlite store, which takes seconds to create) never
    holds up training; the session's end waits for them (up to 300 s). If one
    fails, the error is logged with its traceback and logging stops for that
    session; training goes on. An http(s) server that takes no connection within
    5 s fails the first call.

    Args:
        tracking_uri: e.g. ``"sqlite:///mlflow.db"`` or ``"http://host:5000"``;
            None: MLflow's default (``MLFLOW_TRACKING_URI``).
        experiment: the MLflow experiment's name, created when missing.
        run_name: the parent run's name (default: MLflow's generated name).
        tags: extra tags for the parent run.

    Example:
        >>> from cerebro_automl.callbacks import MLflow
        >>> # optimize(study, spec, data, space, n_trials=40, epochs=9, metric="val_accuracy",
        >>> #          session_callbacks=[MLflow("sqlite:///mlflow.db", experiment="mnist1d")])
        >>> # then: mlflow ui --backend-store-uri sqlite:///mlflow.db
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "cerebro_automl",
        *,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        if tracking_uri is not None and not isinstance(tracking_uri, str):
            raise TypeError(f"tracking_uri is {tracking_uri!r}, but must be a str or None")
        if not isinstance(experiment, str) or not experiment:
            raise ValueError(f"experiment is {experiment!r}, but must be a non-empty str")
        self._entities, self._Client = _mlflow()  # fail here, not later inside a hook
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.tags = dict(tags or {})
        self.parent_run_id: str | None = None
        self.run_ids: dict[int, str] = {}  # model id -> child run id (filled by the writer)
        self._client: Any = None
        self._writer: _Writer | None = None
        self._status: dict[int, str] = {}  # model id -> the status its run has or will have
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        return f"MLflow(tracking_uri={self.tracking_uri!r}, experiment={self.experiment!r})"

    # ----------------------------------------------------------------- hooks
    def on_session_start(self, view: SessionView) -> None:
        tags = {"cerebro.executor": view.executor_kind, **self.tags}
        settings = self._params(
            {
                "seed": view.seed,
                "num_partitions": view.num_partitions,
                "order": view.order,
                "threads": view.threads,
                "workers": view.num_workers,
            }
        )
        self.parent_run_id, self.run_ids, self._status, self._error = None, {}, {}, None

        def start() -> None:  # on the writer's thread: a new sqlite store takes seconds to create
            _check_reachable(self.tracking_uri)
            self._client = client = self._Client(self.tracking_uri)
            found = client.get_experiment_by_name(self.experiment)
            self._experiment_id = (
                found.experiment_id if found is not None else client.create_experiment(self.experiment)
            )
            parent = client.create_run(self._experiment_id, run_name=self.run_name, tags=tags)
            self.parent_run_id = parent.info.run_id
            client.log_batch(self.parent_run_id, params=settings)

        self._writer = _Writer()
        self._put(start)

    def on_model_added(self, view: SessionView, model_id: int) -> None:
        handle = view.model(model_id)
        tags = {
            "cerebro.model_id": str(model_id),
            "cerebro.seed": str(handle.seed),
            "cerebro.offset": str(handle.offset),
        }
        params = self._params(flatten_config(handle.config))
        self._status[model_id] = "RUNNING"

        def create() -> None:  # the parent's id exists once the writer has run start()
            run = self._client.create_run(
                self._experiment_id, run_name=handle.name, tags={"mlflow.parentRunId": self.parent_run_id, **tags}
            )
            self.run_ids[model_id] = run.info.run_id
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self._client.log_batch(run.info.run_id, params=params[i : i + 100])

        self._put(create)

    def on_epoch_end(self, view: SessionView, report: EpochReport) -> None:
        stamp = int(time.time() * 1000)
        metrics = [self._entities.Metric(_key(k), float(v), stamp, report.epoch) for k, v in report.metrics.items()]
        resumed = self._status.get(report.model_id) != "RUNNING"  # extended after a pause
        self._status[report.model_id] = "RUNNING"

        def log() -> None:
            run_id = self.run_ids[report.model_id]
            if resumed:
                self._client.update_run(run_id, status="RUNNING")
            self._client.log_batch(run_id, metrics=metrics)

        self._put(log)

    def on_model_paused(self, view: SessionView, report: ModelPaused) -> None:
        self._end(report.model_id, "FINISHED")

    def on_model_stopped(self, view: SessionView, model_id: int) -> None:
        self._end(model_id, "KILLED")

    def on_model_failed(self, view: SessionView, report: ModelFailed) -> None:
        error = report.error[:MAX_TAG_LENGTH]
        self._put(lambda: self._client.set_tag(self.run_ids[report.model_id], "cerebro.error", error))
        self._end(report.model_id, "FAILED")

    def on_exception(self, view: SessionView, error: BaseException) -> None:
        self._error = error

    def on_session_end(self, view: SessionView) -> None:
        for model_id, status in self._status.items():
            if status == "RUNNING":  # still training when the session closed
                self._end(model_id, "KILLED")
        status = "FINISHED" if self._error is None else "FAILED" if isinstance(self._error, Exception) else "KILLED"
        self._put(lambda: self._client.set_terminated(self.parent_run_id, status))
        if self._writer is not None:
            self._writer.close(CLOSE_TIMEOUT)
            self._writer = None

    # --------------------------------------------------------------- helpers
    def _end(self, model_id: int, status: str) -> None:
        self._status[model_id] = status
        self._put(lambda: self._client.set_terminated(self.run_ids[model_id], status))

    def _params(self, values: Mapping[str, Any]) -> list:
        return [self._entities.Param(_key(k), str(v)[:MAX_PARAM_LENGTH]) for k, v in values.items()]

    def _put(self, write: Callable[[], None]) -> None:
        if self._writer is not None:
            self._writer.put(write)


class _Writer:
    """One daemon thread that runs the MLflow writes in order. The first write
    that fails is logged with its traceback; later writes are dropped."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="cerebro-mlflow", daemon=True)
        self._thread.start()

    def put(self, write: Callable[[], None]) -> None:
        self._queue.put(write)

    def _run(self) -> None:
        while True:
            write = self._queue.get()
            if write is None:
                return
            if self._failed:
                continue
            try:
                write()
            except Exception:
                self._failed = True
                logger.error("MLflow logging failed and stops for this session; training goes on", exc_info=True)

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("MLflow writes still pending after %.0f s; the rest are dropped", timeout)
