"""Gang units through the front door: ``Session(gang=True)`` on a real Dask cluster of
4 worker processes, 4 partitions, real torch training (gloo). A lone model trains on
all 4 workers at once, two models on two each; the bits are the same run to run; an
ASHA and a successive-halving search with ``reproducible=True`` come out the same twice; bad combinations are
refused before any work."""

from __future__ import annotations

import pytest
import torch

from cerebro_automl import Session
from cerebro_automl.protocol import TrainGang

from conftest import same_states
from models import make_spec

pytestmark = pytest.mark.cluster


CONFIGS = [{"lr": 0.05, "width": 16, "dropout": 0.0}, {"lr": 0.02, "width": 8, "dropout": 0.1}]


def train(client, data, configs, *, gang: bool, epochs: int = 2) -> tuple[list[dict], list, object]:
    """Train ``configs`` together; their final weights, the gang units sent, and the history."""
    sent: list[TrainGang] = []
    with Session(make_spec(), data, client=client, seed=5, gang=gang) as s:
        execute = s.executor.execute

        def recording(ins):
            if isinstance(ins, TrainGang):
                sent.append(ins)
            return execute(ins)

        s.executor.execute = recording
        ids = [s.add(c, epochs=epochs) for c in configs]
        s.run()
        return [s.model(i).state()["model"] for i in ids], sent, s.history


def test_a_lone_model_trains_on_every_worker_and_the_same_bits_twice(four, data4, caplog):
    with caplog.at_level("INFO", logger="cerebro_automl"):
        first, sent, history = train(four, data4, CONFIGS[:1], gang=True)
    said = [r.message for r in caplog.records if "gang units of width" in r.message]
    assert said == ["model 0 trains from epoch 1 in gang units of width 4 (4 partitions at once; live models: 1, "
                    "partitions: 4; see the Gang units guide for the rule)"]  # once: the width stays
    again, _, _ = train(four, data4, CONFIGS[:1], gang=True)
    assert [len(g.partitions) for g in sent] == [4, 4]  # one gang unit an epoch, on all 4 workers
    assert len({w for g in sent for w in g.workers}) == 4
    assert same_states(first, again)
    assert list(history["epoch"]) == [1, 2] and history["val_loss"].notna().all()
    assert list(history["gang"]) == [4, 4]  # each epoch's width, in the history
    assert all(torch.isfinite(t).all() for t in first[0].values())


def test_two_models_train_in_gangs_of_two_and_learn_as_plain_mop_does(four, data4):
    gangs, sent, history = train(four, data4, CONFIGS, gang=True, epochs=3)
    _, plain_sent, plain = train(four, data4, CONFIGS, gang=False, epochs=3)
    assert {len(g.partitions) for g in sent} == {2} and not plain_sent
    assert set(history["gang"]) == {2} and "gang" not in plain
    # Each epoch: two gang units per model, together covering its 4 partitions once.
    for model_id in (0, 1):
        for epoch in range(3):
            parts = [p for g in sent if (g.model_id, g.epoch) == (model_id, epoch) for p in g.partitions]
            assert sorted(parts) == [0, 1, 2, 3]
    # The same global batch over the same data: the gang learns as well as plain MOP (here
    # better: each step's batch mixes k partitions).
    final = history[history["epoch"] == 3].set_index("model_id")["val_loss"].sort_index()
    reference = plain[plain["epoch"] == 3].set_index("model_id")["val_loss"].sort_index()
    assert (final < 1.25 * reference).all(), (final, reference)


@pytest.mark.parametrize("tuner", ["asha", "successive_halving"])
def test_a_search_with_gang_units_is_the_same_twice(four, data4, tuner):
    from cerebro_automl.adapters import hyperband

    sent: list[TrainGang] = []

    def sampler(rng):
        return {"lr": float(10 ** rng.uniform(-3, -1)), "width": 8, "dropout": 0.0}

    def search():
        with Session(make_spec(), data4, client=four, seed=1, gang=True) as s:
            execute = s.executor.execute
            s.executor.execute = lambda ins: (sent.append(ins) if isinstance(ins, TrainGang) else None, execute(ins))
            search = {"asha": {"max_trials": 6}, "successive_halving": {"n_configs": 6}}[tuner]
            getattr(hyperband, tuner)(make_spec(), data4, sampler, min_epochs=1, max_epochs=3, eta=3,
                                      metric="val_loss", session=s, reproducible=True, **search)  # fmt: skip
            return s.history[["model_id", "epoch", "gang", "val_loss"]].sort_values(["model_id", "epoch"])

    first, second = search(), search()
    assert first.values.tolist() == second.values.tolist()
    assert len(first) > 6  # some trials were promoted
    assert {len(g.partitions) for g in sent} >= {2}, "the survivors trained in no gang"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"executor": "local"}, "gang is True with the 'local' executor"),
        ({"fuse": 2}, "gang is True with fuse=2"),
        ({"report_every": "unit"}, "gang is True with unit_reports"),
        ({"gang": "yes"}, "gang is 'yes', but must be True or False"),
    ],
)
def test_bad_combinations_are_refused_before_any_work(data4, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Session(make_spec(), data4, **{"gang": True, **kwargs})


def test_a_batch_size_no_gang_width_divides_is_named_once(four, data4, caplog):
    spec = make_spec(batch_size="batch_size")
    with caplog.at_level("WARNING", logger="cerebro_automl"), Session(spec, data4, client=four, gang=True) as s:
        odd = s.add({"lr": 1e-2, "width": 8, "batch_size": 33}, epochs=1)
        s.add({"lr": 1e-3, "width": 8, "batch_size": 33}, epochs=1)
        s.add({"lr": 1e-2, "width": 8, "batch_size": 32}, epochs=1)
        s.run()
        rows = s.history[s.history.model_id == odd]
        assert "gang" not in rows or rows["gang"].fillna(1).eq(1).all()  # it trained alone
    told = [r.message for r in caplog.records if "which no gang width divides" in r.message]
    assert told == [f"model {odd} trains with batch_size 33, which no gang width divides: it will not train in "
                    "gang units (a gang of k ranks gives each b / k rows); an even batch size lets it"]
