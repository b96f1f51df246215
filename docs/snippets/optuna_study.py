import os
import tempfile

from tiny import data, spec

os.chdir(tempfile.mkdtemp())
# --8<-- [start:optuna]
import optuna
from cerebro_automl.adapters.optuna import optimize

def space(trial):                                   # define-by-run, as with study.optimize
    return {"lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
            "width": trial.suggest_int("width", 16, 128, log=True)}

study = optuna.create_study(direction="maximize", storage="sqlite:///mnist1d.db",
                            study_name="mnist1d", load_if_exists=True,
                            pruner=optuna.pruners.HyperbandPruner(min_resource=1, max_resource=3))
result = optimize(study, spec, data, space, n_trials=4, epochs=3, metric="val_accuracy",
                  checkpoint_dir="ckpt", executor="local")
net = result.best_model()   # the best trial's trained model; result.study, result.history
# n_trials: the study's trials when done, those of earlier runs of this script included
# --8<-- [end:optuna]
assert len(study.trials) == 4
