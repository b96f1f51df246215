"""Every tuner adapter passes the conformance suite (cerebro_automl.testing.check_tuner):
report order, stop and extend, failures alone, no leaked session, reproducibility."""

from __future__ import annotations

import numpy as np
import optuna
import pytest
from hyperopt import hp, tpe

from cerebro_automl.adapters.hyperband import asha, hyperband, successive_halving
from cerebro_automl.adapters.hyperopt import fmin
from cerebro_automl.adapters.optuna import optimize
from cerebro_automl.adapters.pbt import pbt
from cerebro_automl.adapters.search import grid_search, random_search
from cerebro_automl.testing import FAIL_WIDTH, check_tuner, conformance_problem

SPEC, DATA = conformance_problem()
WIDTHS = [4, 8, FAIL_WIDTH]


def sampler(rng: np.random.Generator) -> dict:
    return {"lr": float(10 ** rng.uniform(-2, -0.5)), "width": int(rng.choice(WIDTHS))}


def _optuna(**kwargs):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=4),
                                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1))
    optimize(study, SPEC, DATA, lambda t: {"lr": t.suggest_float("lr", 1e-2, 0.3, log=True),
                                           "width": t.suggest_categorical("width", WIDTHS)},
             n_trials=8, epochs=3, metric="val_loss", seed=0, **kwargs)
    return study


TUNERS = {
    "grid_search": lambda **kw: grid_search(SPEC, DATA, {"lr": [0.05, 0.2], "width": WIDTHS}, epochs=2, **kw),
    "random_search": lambda **kw: random_search(SPEC, DATA, {"lr": [0.05, 0.2], "width": WIDTHS}, n_configs=5,
                                                epochs=2, seed=1, **kw),
    "optuna": _optuna,
    "hyperopt": lambda **kw: fmin(SPEC, DATA, {"lr": hp.loguniform("lr", -4, -1), "width": hp.choice("width", [4, FAIL_WIDTH])},
                                  algo=tpe.suggest, max_evals=6, epochs=2, rstate=np.random.default_rng(0), **kw),
    "successive_halving": lambda **kw: successive_halving(SPEC, DATA, sampler, min_epochs=1, max_epochs=4, eta=2,
                                                          n_configs=6, seed=2, **kw),
    "hyperband": lambda **kw: hyperband(SPEC, DATA, sampler, max_epochs=4, eta=2, seed=2, **kw),
    "asha": lambda **kw: asha(SPEC, DATA, sampler, min_epochs=1, max_epochs=4, eta=2, max_trials=8, seed=2, **kw),
    "pbt": lambda **kw: pbt(SPEC, DATA, lambda rng: {**sampler(rng), "dropout": 0.0}, population=6, epochs=3,
                            interval=1, mutations={"lr": (1e-3, 1.0)}, quantile=0.5, seed=2, **kw),
}


@pytest.mark.parametrize("tuner", list(TUNERS))
def test_every_tuner_passes_the_conformance_suite(tuner):
    check_tuner(TUNERS[tuner])


def test_the_suite_catches_a_tuner_that_leaks_its_session():
    from cerebro_automl import Session

    def leaky(executor, session_callbacks):
        s = Session(SPEC, DATA, executor=executor, callbacks=session_callbacks)
        s.add({"lr": 0.1, "width": FAIL_WIDTH}, epochs=1)
        s.run()
        return s  # never closed

    with pytest.raises(AssertionError, match=r"session 0 started and ended \['start'\]"):
        check_tuner(leaky)


def test_the_suite_catches_a_tuner_that_is_not_reproducible():
    runs = iter(range(100))

    def drifting(**kw):  # another seed every run
        return random_search(SPEC, DATA, {"lr": [0.05, 0.2], "width": WIDTHS}, n_configs=4, epochs=1,
                             seed=next(runs), **kw)

    with pytest.raises(AssertionError, match=r"a second run with the same seed gave another history"):
        check_tuner(drifting, expect_failures=False)
