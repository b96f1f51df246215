import os
import tempfile

import optuna

from tiny import data, spec

os.chdir(tempfile.mkdtemp())
study = optuna.create_study(direction="maximize")
space = lambda t: {"lr": t.suggest_float("lr", 1e-3, 1e-2, log=True), "width": 32}
sent = []
send_message = sent.append
# --8<-- [start:log]
import cerebro_automl.log as cl
cl.set_verbosity(cl.WARNING)     # failures and cluster warnings only; cl.DEBUG: every epoch
cl.disable_default_handler()     # no stderr handler of ours at all
# --8<-- [end:log]
# --8<-- [start:callback]
from cerebro_automl.adapters.search import grid_search
from cerebro_automl.callbacks import Callback

class Notify(Callback):
    def on_model_failed(self, view, report):
        send_message(f"{view.model(report.model_id).name} failed: {report.error.splitlines()[0]}")

result = grid_search(spec, data, {"lr": [1e-3, "oops"], "width": [8]}, epochs=1,
                     session_callbacks=[Notify()], executor="local")
# --8<-- [end:callback]
assert len(sent) == 1 and "failed" in sent[0]
# --8<-- [start:tensorboard]
from cerebro_automl.adapters.optuna import optimize
from cerebro_automl.callbacks import TensorBoard
optimize(study, spec, data, space, n_trials=2, epochs=2, metric="val_accuracy",
         session_callbacks=[TensorBoard("runs/mnist1d")], executor="local")
# tensorboard --logdir runs
# --8<-- [end:tensorboard]
# --8<-- [start:mlflow]
from cerebro_automl.callbacks import MLflow
optimize(study, spec, data, space, n_trials=4, epochs=2, metric="val_accuracy",
         session_callbacks=[MLflow("sqlite:///mlflow.db", experiment="mnist1d")], executor="local")
# mlflow ui --backend-store-uri sqlite:///mlflow.db
# --8<-- [end:mlflow]
# --8<-- [start:curves]
from cerebro_automl.results import plot_learning_curves
plot_learning_curves(result.history, "val_accuracy", mode="max", top=6, path="curves.png")
# --8<-- [end:curves]
assert os.path.exists("curves.png") and os.path.isdir("runs/mnist1d")
