"""Successive halving, Hyperband and ASHA: pure policies, then real runs."""

from __future__ import annotations

import doctest
import itertools
import math
import pickle

import numpy as np
import pytest
import torch

from cerebro_automl import PartitionedDataset, Session
from cerebro_automl.adapters import hyperband as hyperband_module
from cerebro_automl.adapters.search import SearchFailed, grid_search
from cerebro_automl.adapters.hyperband import (Rung, asha, asha_promotable, hyperband, hyperband_plan,
                                               rung_epochs, successive_halving, top_k)

from conftest import make_arrays
from models import make_spec

# Li et al. 2017, Table 1 (R = 81, eta = 3): (n_i, r_i) per bracket s = 4..0.
PAPER_TABLE_81_3 = [
    [(81, 1), (27, 3), (9, 9), (3, 27), (1, 81)],
    [(34, 3), (11, 9), (3, 27), (1, 81)],
    [(15, 9), (5, 27), (1, 81)],
    [(8, 27), (2, 81)],
    [(5, 81)],
]


def sampler(rng: np.random.Generator) -> dict:
    return {"lr": float(10 ** rng.uniform(-3, -1)), "width": int(rng.choice([4, 8, 16]))}


def _data():
    X, y, Xv, yv = make_arrays()
    return PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))


def _planned_epochs(plan) -> int:
    """Epochs a plan consumes with pause-and-promote: each survivor trains only the new rung's epochs."""
    return sum(rungs[0].n * rungs[0].epochs
               + sum(r.n * (r.epochs - prev.epochs) for prev, r in zip(rungs, rungs[1:]))
               for rungs in plan)


# ------------------------------------------------------------------ policies
def test_hyperband_plan_matches_the_papers_table():
    plan = hyperband_plan(81, 3)
    assert [[(r.n, r.epochs) for r in bracket] for bracket in plan] == PAPER_TABLE_81_3


@pytest.mark.parametrize("max_epochs, eta", [(1, 2), (2, 2), (9, 3), (10, 3), (27, 3), (64, 4), (100, 3)])
def test_hyperband_plan_shape(max_epochs, eta):
    plan = hyperband_plan(max_epochs, eta)
    for bracket in plan:
        assert bracket[-1].epochs == max_epochs
        assert all(a.n >= b.n >= 1 and a.epochs < b.epochs for a, b in zip(bracket, bracket[1:]))
    assert len(plan[0]) == len(plan) and plan[-1] == [Rung(len(plan), max_epochs)]


def test_rung_epochs_and_top_k():
    assert rung_epochs(1, 81, 3) == [1, 3, 9, 27, 81]
    assert rung_epochs(2, 20, 3) == [2, 6, 18, 20] and rung_epochs(5, 5, 2) == [5]
    assert top_k({5: 1.0, 2: 1.0, 7: 0.5}, 2, "min") == ([7, 2], [5])
    assert top_k({0: 0.1, 1: 0.9, 2: math.nan}, 1, "max") == ([1], [0, 2])


def test_asha_promotes_top_fraction_once():
    rung = {i: float(v) for i, v in enumerate([5, 1, 4, 2, 3, 6])}
    assert asha_promotable(rung, set(), 3, "min") == [1, 3]
    assert asha_promotable(rung, {1}, 3, "min") == [3]
    assert asha_promotable({0: 1.0, 1: 2.0}, set(), 3, "min") == []  # fewer than eta reached it
    assert asha_promotable({0: math.nan, 1: math.nan, 2: math.nan}, set(), 3, "min") == []


def _bad_fourth_config():
    """A sampler whose fourth config lacks a key: refused before the first trains."""
    calls = itertools.count()
    return lambda rng: {"lr": 0.01, "width": 8} if next(calls) != 3 else {"width": 8}


@pytest.mark.parametrize("call, error, message", [
    (lambda: hyperband_plan(81, 1), ValueError, r"eta is 1, but must be an int >= 2"),
    (lambda: hyperband_plan(0, 3), ValueError, r"max_epochs is 0, but must be an int >= 1"),
    (lambda: rung_epochs(9, 3, 3), ValueError, r"min_epochs is 9, but must be <= max_epochs \(3\)"),
    (lambda: successive_halving(make_spec(), _data(), [], min_epochs=1, max_epochs=3),
     ValueError, r"configs_or_sampler is an empty list"),
    (lambda: successive_halving(make_spec(), _data(), {"lr": 0.1}, min_epochs=1, max_epochs=3),
     TypeError, r"configs_or_sampler is \{'lr': 0.1\}, but must be a list"),
    (lambda: successive_halving(make_spec(), _data(), sampler, min_epochs=1, max_epochs=3, eta=1.5),
     ValueError, r"eta is 1.5, but must be an int >= 2"),
    (lambda: hyperband(make_spec(), _data(), sampler, max_epochs=9, metric="val_f1"),
     ValueError, r"metric is 'val_f1'"),
    (lambda: hyperband(make_spec(), _data(), "random", max_epochs=9),
     TypeError, r"sampler is 'random', but must be callable"),
    (lambda: asha(make_spec(), _data(), sampler, min_epochs=1, max_epochs=9, max_trials=0),
     ValueError, r"max_trials is 0, but must be an int >= 1"),
    (lambda: asha(make_spec(), _data(), sampler, min_epochs=4, max_epochs=2, max_trials=5),
     ValueError, r"min_epochs is 4, but must be <= max_epochs \(2\)"),
    (lambda: hyperband(make_spec(), _data(), sampler, max_epochs=2, eta=3),
     ValueError, r"max_epochs is 2, but must be >= eta \(3\) for hyperband to stop any configuration early"),
    (lambda: hyperband(make_spec(), _data(), lambda rng: None, max_epochs=9),
     TypeError, r"sampler returned None, but must return a config dict"),
    (lambda: asha(make_spec(), _data(), lambda rng: [("lr", 0.1)], min_epochs=1, max_epochs=3, max_trials=3),
     TypeError, r"sampler returned \[\('lr', 0.1\)\], but must return a config dict"),
    (lambda: asha(make_spec(), _data(), _bad_fourth_config(), min_epochs=1, max_epochs=3, max_trials=9),
     ValueError, r"config \{'width': 8\} lacks key 'lr'"),
    (lambda: asha(make_spec(), _data(), sampler, min_epochs=1, max_epochs=27, eta=3, max_trials=24),
     ValueError, r"max_trials is 24, but must be >= eta \*\* 3 = 27: .* rungs at \[1, 3, 9, 27\] epochs"),
], ids=["eta 1", "max_epochs 0", "min > max", "empty list", "dict not list", "float eta",
        "unknown metric", "sampler string", "max_trials 0", "asha min > max", "hyperband max_epochs < eta",
        "sampler returns None", "sampler returns a list", "asha bad config drawn later", "asha too few trials"])
def test_bad_arguments_are_refused_before_training(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ------------------------------------------------------------------ runs
def test_hyperband_consumes_exactly_its_plan_and_decides_every_rung():
    result = hyperband(make_spec(), _data(), sampler, max_epochs=9, eta=3, seed=1,
                       executor="local", n_workers=2)
    plan = hyperband_plan(9, 3)
    assert result.plan == plan
    assert result.epochs_trained == _planned_epochs(plan) == len(result.history)
    for b, rungs in enumerate(plan):
        mine = [d for d in result.decisions if d.bracket == b]
        assert [d.rung for d in mine] == list(range(len(rungs)))
        for d, rung in zip(mine, rungs):
            assert len(d.values) == rung.n and d.epochs == rung.epochs
        for d, nxt in zip(mine, rungs[1:]):
            assert len(d.promoted) == nxt.n and set(d.promoted) | set(d.stopped) == set(d.values)
            worst_promoted = max(d.values[m] for m in d.promoted)
            assert all(d.values[m] >= worst_promoted for m in d.stopped)  # the best were kept
    assert result.history.groupby("model_id").epoch.max().max() == 9
    assert result.best_value == result.history[result.history.epoch == 9].val_loss.min()
    assert isinstance(result.best_model(), torch.nn.Module)


def test_promotion_resumes_and_equals_training_straight_through():
    configs = [{"lr": lr, "width": 8} for lr in (3e-3, 1e-2, 3e-2, 1e-1)]
    with Session(make_spec(), _data(), executor="local", seed=2) as s:
        result = successive_halving(make_spec(), _data(), configs, min_epochs=1, max_epochs=4, eta=2,
                                    session=s)
        top = [d for d in result.decisions if d.rung == 1][0].promoted[0]
        promoted_weights = s.model(top).state()["model"]
        offset, config = s.model(top).offset, s.model(top).config
    with Session(make_spec(), _data(), executor="local", seed=2) as s:
        straight = s.add(config, epochs=4, offset=offset)
        s.run()
        straight_weights = s.model(straight).state()["model"]
    assert all(torch.equal(promoted_weights[k], straight_weights[k]) for k in promoted_weights)
    # pause and promote trained 4 + 2 + 2 epochs, not 4 + 2*2 + 1*4
    assert result.epochs_trained == 4 * 1 + 2 * 1 + 1 * 2


@pytest.mark.parametrize("tuner", ["successive_halving", "hyperband"])
def test_same_seed_same_decisions_and_bits_on_1_2_3_workers(tuner, cluster):
    from distributed import Client, LocalCluster

    def run(**executor):
        if tuner == "hyperband":
            r = hyperband(make_spec(), _data(), sampler, max_epochs=4, eta=2, seed=7, **executor)
        else:
            r = successive_halving(make_spec(), _data(), sampler, min_epochs=1, max_epochs=4, eta=2,
                                   n_configs=6, seed=7, **executor)
        return r.decisions, r.best_model_id, r.best_state["model"]

    one = run(executor="local")
    two = run(client=cluster)
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None) as c3, \
            Client(c3) as client3:
        three = run(client=client3)
    for other in (two, three):
        assert other[0] == one[0] and other[1] == one[1]
        assert all(torch.equal(one[2][k], other[2][k]) for k in one[2])


def test_asha_keeps_the_hopper_full_and_promotes_the_top_fraction():
    result = asha(make_spec(), _data(), sampler, min_epochs=1, max_epochs=4, eta=2, max_trials=10,
                  parallelism=3, seed=3, executor="local", n_workers=2)
    h = result.history
    assert h.model_id.nunique() == 10
    reached = h.groupby("model_id").epoch.max()
    assert set(reached) <= {1, 2, 4} and (reached == 4).any()
    for d in result.decisions:  # each promotion was in the top 1/eta of its rung at the time
        (m,) = d.promoted
        assert m in top_k(d.values, len(d.values) // 2, "min")[0]
    assert result.best_value == h[h.epoch == 4].val_loss.min()


def test_asha_with_the_fewest_trials_allowed_reaches_max_epochs():
    # eta ** 2 = 4 trials for rungs at 1, 2 and 4 epochs: at least 4 -> 2 -> 1, whatever the timing
    result = asha(make_spec(), _data(), sampler, min_epochs=1, max_epochs=4, eta=2, max_trials=4,
                  parallelism=4, seed=3, executor="local", n_workers=2)
    reached = result.history.groupby("model_id").epoch.max()
    assert len(reached) == 4 and set(reached) <= {1, 2, 4} and (reached == 4).any()
    assert result.best_value == result.history[result.history.epoch == 4].val_loss.min()


def test_the_policies_examples_hold():
    assert doctest.testmod(hyperband_module).failed == 0


def test_asha_with_parallelism_one_is_deterministic():
    runs = [asha(make_spec(), _data(), sampler, min_epochs=1, max_epochs=4, eta=2, max_trials=6,
                 parallelism=1, seed=5, executor="local") for _ in range(2)]
    assert runs[0].decisions == runs[1].decisions
    assert runs[0].history[["model_id", "epoch", "val_loss"]].equals(runs[1].history[["model_id", "epoch", "val_loss"]])


def _sometimes_failing(config):
    if config["width"] == 4:
        raise RuntimeError("width 4 fails")
    return torch.nn.Sequential(torch.nn.Linear(8, config["width"]), torch.nn.ReLU(),
                               torch.nn.Linear(config["width"], 3))


def test_a_failing_configuration_is_never_promoted_and_the_others_go_on():
    configs = [{"lr": 1e-2, "width": w} for w in (4, 8, 16, 4)]
    result = successive_halving(make_spec(model_fn=_sometimes_failing), _data(), configs,
                                min_epochs=1, max_epochs=2, eta=2, executor="local")
    first = result.decisions[0]
    assert all(math.isnan(first.values[m]) for m in (0, 3)) and set(first.promoted) <= {1, 2}
    assert not {0, 3} & set(first.stopped)  # failed, not stopped: the decisions agree with the statuses
    assert result.best_config["width"] in (8, 16)


def test_a_search_whose_every_model_fails_hands_back_what_it_trained():
    spec = make_spec(model_fn=lambda config: torch.nn.Linear(7, 3))  # the rows have 8 features: every unit fails
    with pytest.raises(SearchFailed, match=r"no model reached max_epochs=3 with a finite val_loss; 5 models "
                                           r"failed, the first with '.*'; this exception's history holds the epochs") as info:
        hyperband(spec, _data(), sampler, max_epochs=3, eta=3, executor="local")  # 3 + 2 models
    assert len(info.value.history) == 5 and info.value.history["error"].str.contains("mat1 and mat2").all()
    again = pickle.loads(pickle.dumps(info.value))  # as Dask or a process pool hands it on
    assert str(again) == str(info.value) and again.history.equals(info.value.history)
    with pytest.raises(ValueError, match=r"no model finished with a finite val_loss") as info:  # as before
        grid_search(spec, _data(), {"lr": [0.1, 0.01]}, epochs=1, executor="local")
    assert len(info.value.history) == 2
