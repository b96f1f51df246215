"""Grid and random search adapters."""

from __future__ import annotations

import pytest
import torch

from cerebro_automl import Session
from cerebro_automl.adapters.search import grid_configs, grid_search, random_configs, random_search


def test_grid_search_trains_every_combination_and_returns_the_best(spec, data):
    result = grid_search(spec, data, {"lr": [1e-3, 1e-2], "width": [8, 16]}, epochs=2,
                         metric="val_accuracy", mode="max", executor="local")
    h = result.history
    assert len(h) == 8 and sorted(h.config.map(lambda c: (c["lr"], c["width"])).unique()) == [
        (1e-3, 8), (1e-3, 16), (1e-2, 8), (1e-2, 16)]
    final = h[h.epoch == 2]
    assert result.best_value == final.val_accuracy.max()
    assert result.best_config == final.loc[final.val_accuracy.idxmax(), "config"]
    model = result.best_model()
    assert torch.equal(model.state_dict()["0.weight"], result.best_state["model"]["0.weight"])


def test_random_search_is_reproducible_from_its_seed(spec, data):
    space = {"lr": lambda rng: float(10 ** rng.uniform(-3, -1)), "width": [4, 8, 16]}
    assert random_configs(space, 5, seed=1) == random_configs(space, 5, seed=1)
    assert random_configs(space, 5, seed=1) != random_configs(space, 5, seed=2)
    a = random_search(spec, data, space, n_configs=3, epochs=1, seed=1, executor="local")
    b = random_search(spec, data, space, n_configs=3, epochs=1, seed=1, executor="local")
    timing = ["train_seconds", "val_seconds", "session_seconds"]
    assert a.history.drop(columns=timing).equals(b.history.drop(columns=timing))


def test_random_configs_draw_plain_python_values():
    configs = random_configs({"width": [8, 16]}, 4, seed=0)
    assert all(type(c["width"]) is int for c in configs)


def test_grid_configs_keep_key_order():
    assert grid_configs({"b": [1, 2], "a": ["x"]}) == [{"b": 1, "a": "x"}, {"b": 2, "a": "x"}]


def test_search_reuses_an_open_session(spec, data):
    with Session(spec, data, executor="local") as s:
        result = grid_search(spec, data, {"lr": [1e-2], "width": [8]}, epochs=1, session=s)
        assert len(result.history) == 1
        s.add({"lr": 1e-3, "width": 8}, epochs=1)  # still open
        s.run()


def test_search_on_the_dask_cluster(spec, data, cluster):
    result = grid_search(spec, data, {"lr": [1e-2], "width": [8, 16]}, epochs=1, client=cluster)
    assert len(result.history) == 2 and result.metric == "val_loss"


@pytest.mark.parametrize("bad, message", [
    (dict(space={}), "space is"),
    (dict(space={"lr": []}), r"space\['lr'\]"),
    (dict(metric="val_f1"), "metric is 'val_f1'"),
    (dict(mode="best"), "mode is 'best'"),
    (dict(epochs=0), "epochs is 0"),
])
def test_bad_search_arguments_fail_before_training(spec, data, bad, message):
    args = dict(space={"lr": [1e-2], "width": [8]}, epochs=1, metric="val_loss", mode="min")
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        grid_search(spec, data, args.pop("space"), executor="local", **args)
