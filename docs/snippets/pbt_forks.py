import os
import tempfile

from tiny import data, spec

os.chdir(tempfile.mkdtemp())
# --8<-- [start:pbt]
from cerebro_automl.adapters.pbt import pbt, plot_pbt

def sample(rng):
    return {"width": 32, "lr": float(10 ** rng.uniform(-3.5, -2))}

result = pbt(spec, data, sample, population=4, epochs=3, interval=1, metric="val_accuracy", mode="max",
             mutations={"lr": (1e-4, 3e-2)}, executor="local")
result.best_config, result.schedules[result.best_model_id], result.generations[0].forks
plot_pbt(result, path="pbt.png")
# --8<-- [end:pbt]
# --8<-- [start:fork]
from cerebro_automl import Session

with Session(spec, data, executor="local") as s:
    parent = s.add({"lr": 1e-3, "width": 32}, epochs=2)
    s.run()
    child = s.add({"lr": 3e-3, "width": 32}, epochs=3, init_from=(parent, 2))  # epoch 3 from epoch 2
    warm = s.add({"lr": 1e-3, "width": 32}, epochs=1, init_state=s.model(parent).state())
    s.run()
    s.history[["model_id", "epoch", "parent", "parent_epoch"]]
# --8<-- [end:fork]
assert os.path.exists("pbt.png")
