from tiny import data, spec

# --8<-- [start:hyperband]
from cerebro_automl.adapters.hyperband import asha, hyperband, successive_halving

def sampler(rng):                                   # a numpy Generator -> a config
    return {"lr": float(10 ** rng.uniform(-4, -2)), "width": int(rng.choice([16, 32, 64]))}

result = hyperband(spec, data, sampler, max_epochs=3, eta=3, metric="val_accuracy", mode="max",
                   executor="local")
result.best_config, result.epochs_trained, result.decisions   # each rung: promoted and stopped models
configs = [{"lr": 1e-3, "width": 16}, {"lr": 3e-3, "width": 32}, {"lr": 1e-2, "width": 64}]
successive_halving(spec, data, configs, min_epochs=1, max_epochs=3, eta=3, executor="local")
asha(spec, data, sampler, min_epochs=1, max_epochs=3, eta=3, max_trials=4, executor="local")
# --8<-- [end:hyperband]
assert result.epochs_trained > 0
