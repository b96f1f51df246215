from tiny import data, spec

# --8<-- [start:hyperopt]
import numpy as np
from hyperopt import Trials, hp, space_eval, tpe
from cerebro_automl.adapters.hyperopt import MedianStoppingRule, fmin

space = {"width": hp.choice("width", [16, 32, 64]),
         "lr": hp.loguniform("lr", np.log(3e-4), np.log(1e-2))}
trials = Trials()
best = fmin(spec, data, space, algo=tpe.suggest, max_evals=4, epochs=2, loss="val_loss",
            trials=trials, rstate=np.random.default_rng(0), prune=MedianStoppingRule(warmup_epochs=1),
            executor="local")
space_eval(space, best), trials.best_trial["result"]["history"]
# --8<-- [end:hyperopt]
assert len(trials.trials) == 4
