import optuna

from tiny import data, spec

optuna.logging.set_verbosity(optuna.logging.WARNING)


def study_on(n_workers):
    # --8<-- [start:optuna]
    from cerebro_automl.adapters.optuna import optimize

    def space(trial):
        return {"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True),
                "width": trial.suggest_int("width", 8, 64, log=True)}

    study = optuna.create_study(direction="maximize",
                                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1))
    optimize(study, spec, data, space, n_trials=8, epochs=3, metric="val_accuracy",
             seed=0, reproducible=True,       # the same study on any workers, any timing
             executor="local", n_workers=n_workers)
    # --8<-- [end:optuna]
    return [(t.params, t.intermediate_values, t.value) for t in study.trials]


assert study_on(1) == study_on(3)
