"""Lifecycle callbacks: code that runs as a session's models train.

A :class:`Callback` has one no-op method per event (session start, model
added, epoch end, model paused, stopped or failed, an exception, session end);
override the ones you need. :class:`TensorBoard` and :class:`MLflow` write the
standard trackers' files and runs (extras ``tensorboard`` and ``mlflow``).

Give them to a Session as ``callbacks=[...]``, or to any tuner as
``session_callbacks=[...]``: the tuners' own ``callbacks=`` keeps the meaning
its library gives it (Optuna's ``callback(study, trial)``).

Example:
    >>> from cerebro_automl.callbacks import Callback, TensorBoard, MLflow
    >>> # with Session(spec, data, callbacks=[TensorBoard("runs/exp1")]) as s: ...
    >>> # optimize(study, spec, data, space, n_trials=20, epochs=9, metric="val_loss",
    >>> #          session_callbacks=[TensorBoard("runs/exp1"), MLflow("sqlite:///mlflow.db")])
"""

from cerebro_automl.callbacks._base import Callback, CallbackList, flatten_config
from cerebro_automl.callbacks._mlflow import MLflow
from cerebro_automl.callbacks._tensorboard import TensorBoard

__all__ = ["Callback", "CallbackList", "TensorBoard", "MLflow", "flatten_config"]
