"""A driver process for the tuners' resume tests: a search with checkpoints, slow
enough to be killed mid-run, run again with the same call to continue.

    python tuner_resume_driver.py TUNER DIR

It writes DIR/result.json (what the search decided and found) when it finishes."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from cerebro_automl import PartitionedDataset

from conftest import make_arrays
from models import make_spec, slow_model_fn

TUNERS = ("asha", "hyperband", "pbt", "grid", "random", "hyperopt")


def _sampler(rng):
    return {"lr": float(10 ** rng.uniform(-3, -1)), "width": int(rng.choice([8, 16]))}


def run(tuner: str, folder: Path) -> dict:
    X, y, Xv, yv = make_arrays()
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    spec = make_spec(model_fn=slow_model_fn)
    common = dict(executor="local", n_workers=2, checkpoint_dir=str(folder / "ckpt"), resume=True, seed=0)
    if tuner == "asha":
        from cerebro_automl.adapters.hyperband import asha

        r = asha(spec, data, _sampler, min_epochs=1, max_epochs=4, eta=2, max_trials=6, reproducible=True, **common)
        found = {"decisions": [(d.rung, d.epochs, sorted(d.promoted), sorted(d.stopped)) for d in r.decisions]}
    elif tuner == "hyperband":
        from cerebro_automl.adapters.hyperband import hyperband

        r = hyperband(spec, data, _sampler, max_epochs=4, eta=2, reproducible=True, **common)
        found = {"decisions": [(d.bracket, d.rung, sorted(d.promoted), sorted(d.stopped)) for d in r.decisions]}
    elif tuner == "pbt":
        from cerebro_automl.adapters.pbt import pbt

        r = pbt(spec, data, _sampler, population=4, epochs=4, interval=1,
                mutations={"lr": (1e-3, 1e-1)}, **common)
        found = {"generations": [(g.epoch, [(f.loser, f.parent, f.child) for f in g.forks]) for g in r.generations]}
    elif tuner in ("grid", "random"):
        from cerebro_automl.adapters.search import grid_search, random_search

        if tuner == "grid":
            r = grid_search(spec, data, {"lr": [1e-3, 1e-2], "width": [8, 16]}, epochs=3, **common)
        else:
            r = random_search(spec, data, {"lr": lambda rng: float(10 ** rng.uniform(-3, -1)), "width": [8, 16]},
                              n_configs=4, epochs=3, **common)
        found = {}
    else:
        from hyperopt import Trials, hp

        from cerebro_automl.adapters.hyperopt import fmin

        space = {"lr": hp.loguniform("lr", math.log(1e-3), math.log(1e-1)), "width": hp.choice("width", [8, 16])}
        r = fmin(spec, data, space, max_evals=6, epochs=2, trials=Trials(), rstate=np.random.default_rng(0),
                 reproducible=True, return_argmin=False, **common)
        found = {"losses": r.trials.losses(), "argmin": r.argmin}
    history = r.history.sort_values(["model_id", "epoch"])
    return {**found, "best_config": r.best_config, "best_value": getattr(r, "best_value", None),
            "history": [[int(m), int(e), float(v)] for m, e, v in zip(history.model_id, history.epoch,
                                                                        history.val_loss)]}


if __name__ == "__main__":
    tuner, folder = sys.argv[1], Path(sys.argv[2])
    result = run(tuner, folder)
    (folder / "result.json").write_text(json.dumps(result, sort_keys=True, default=lambda v: v.item()))
