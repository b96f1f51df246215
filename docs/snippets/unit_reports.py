from tiny import data, spec

# --8<-- [start:units]
import optuna
from cerebro_automl.adapters.optuna import optimize

def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
            "width": trial.suggest_int("width", 16, 128, log=True)}

units = data.num_partitions                   # reports per epoch: one after each unit
study = optuna.create_study(direction="maximize", pruner=optuna.pruners.SuccessiveHalvingPruner(
    min_resource=1, reduction_factor=3))      # resources count units: 1 is 1/p of an epoch
result = optimize(study, spec, data, space, n_trials=6, epochs=3, metric="val_accuracy",
                  report_every="unit", executor="local")
# trial.intermediate_values: {1: ..., 2: ..., ...}, step = units trained (epoch e ends at e * units)
# --8<-- [end:units]
assert all(max(t.intermediate_values) <= 3 * units for t in study.trials)
assert any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
