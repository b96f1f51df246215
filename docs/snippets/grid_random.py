from tiny import data, spec

# --8<-- [start:grid]
from cerebro_automl.adapters.search import grid_search, random_search

result = grid_search(spec, data, {"lr": [1e-3, 3e-3], "width": [32, 64]}, epochs=2,
                     metric="val_accuracy", mode="max", executor="local")
result.best_config, result.best_value, result.best_model()
random_search(spec, data, {"lr": lambda rng: 10 ** rng.uniform(-4, -2), "width": [32, 64]},
              n_configs=3, epochs=2, seed=0, executor="local")
# --8<-- [end:grid]
assert result.best_config["width"] in (32, 64)
