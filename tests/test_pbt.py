"""Population-based training end to end: the same decisions and bitwise-identical
weights on 1, 2 and 3 workers; failed members replaced, never copied; the result's
schedules and plot."""

from __future__ import annotations

import math

import pytest
import torch

from cerebro_automl import PartitionedDataset
from cerebro_automl.adapters.pbt import pbt, plot_pbt

from conftest import make_arrays
from models import make_spec

X, y, Xv, yv = make_arrays(rows=600, valid_rows=150)
MUTATIONS = {"lr": (1e-4, 1.0), "dropout": [0.0, 0.1, 0.3]}


def _data():
    return PartitionedDataset.from_arrays(X, y, num_partitions=3, valid=(Xv, yv))


def sampler(rng):
    return {"lr": float(10 ** rng.uniform(-3, -1)), "width": 8, "dropout": float(rng.choice([0.0, 0.1, 0.3]))}


def _run(**kwargs):
    return pbt(make_spec(), _data(), sampler, population=4, epochs=4, interval=1, mutations=MUTATIONS,
               metric="val_accuracy", mode="max", seed=3, **kwargs)


def _decisions(result):
    return [(g.number, g.epoch, g.values, [(f.loser, f.parent, f.child, f.config) for f in g.forks])
            for g in result.generations]


@pytest.mark.timeout(600)
def test_pbt_gives_the_same_decisions_and_bits_on_1_2_and_3_workers(cluster):
    from distributed import Client

    from cerebro_automl.executors.dask import start_local_cluster

    runs = [_run(executor="local"), _run(client=cluster)]
    with start_local_cluster(3) as local, Client(local) as three:
        runs.append(_run(client=three))
    reference = runs[0]
    assert sum(len(g.forks) for g in reference.generations) >= 3  # it exploited, every generation
    for other in runs[1:]:
        assert _decisions(other) == _decisions(reference)
        assert other.best_model_id == reference.best_model_id
        assert all(torch.equal(other.best_state["model"][k], reference.best_state["model"][k])
                   for k in reference.best_state["model"])


def test_the_result_holds_schedules_lineage_and_decisions():
    result = _run(executor="local")
    final = result.generations[-1]
    assert final.epoch == 4 and len(final.values) == 4
    assert result.best_value == max(final.values.values())
    history = result.history
    for generation in result.generations[:-1]:
        for fork in generation.forks:
            row = history[(history.model_id == fork.child)].iloc[0]
            assert (row.parent, row.parent_epoch, row.epoch) == (fork.parent, generation.epoch, generation.epoch + 1)
            assert set(fork.changes) <= set(MUTATIONS)
            assert history[history.model_id == fork.loser].epoch.max() == generation.epoch  # stopped there
    for m in final.values:
        schedule = result.schedules[m]
        assert schedule[0][0] == 1 and schedule[-1][1] == 4
        assert all(b[0] == a[1] + 1 for a, b in zip(schedule, schedule[1:]))  # contiguous epochs
    # every final member trained 4 epochs along its lineage, in 4 + 3 * (forks per generation) rows
    assert result.epochs_trained == len(history)
    best = result.best_model()  # the best member's whole model, with its trained weights
    assert all(torch.equal(best.state_dict()[k], v) for k, v in result.best_state["model"].items())
    fig = plot_pbt(result)
    assert len(fig.axes) == 3  # lr, dropout, the metric


def test_failed_members_are_replaced_and_never_copied():
    def explosive(rng):
        config = sampler(rng)
        return {**config, "dropout": 1.5} if rng.random() < 0.5 else config  # model_fn raises: it fails

    result = pbt(make_spec(), _data(), explosive, population=6, epochs=3, interval=1, mutations={"lr": "continuous"},
                 metric="val_loss", mode="min", seed=0, executor="local")
    first = result.generations[0]
    failed = [m for m, v in first.values.items() if math.isnan(v)]
    assert failed, "the sampler drew no failing config at this seed"
    assert set(failed) <= {f.loser for f in first.forks}
    assert not set(failed) & {f.parent for g in result.generations for f in g.forks}
    assert all(not math.isnan(v) for v in result.generations[-1].values.values())


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(population=1), ValueError, r"population is 1, but must be an int >= 2"),
    (dict(quantile=0.75), ValueError, r"quantile is 0.75, but must be in \(0, 0.5\]"),
    (dict(resample_probability=2), ValueError, r"resample_probability is 2, but must be in \[0, 1\]"),
    (dict(mutations={"momentum": "continuous"}), ValueError, r"mutations name \['momentum'\], which sampler's config"),
    (dict(mutations={"lr": (0.8, 1.25)}), ValueError,
     r"mutations\['lr'\] is the bounds \(0.8, 1.25\), but the sampler gave lr=0.0\d+, which is outside them"),
    (dict(mutations={"lr": [1e-4, 3e-2]}), ValueError,
     r"mutations\['lr'\] is the list \[0.0001, 0.03\], but the sampler gave lr=0.0\d+, which is not one of its"),
    (dict(metric="val_f1"), ValueError, r"metric is 'val_f1', but the spec produces only"),
    # a fork takes its parent's weights: a width it mutates to could not hold them
    (dict(mutations={"width": [8, 16]}), ValueError,
     r"mutations\['width'\] can give width=16 \(from 8\), which changes the shapes of the model's weights "
     r"\(.*\(8, 8\) -> \(16, 8\).*\): a fork "
     r"continues from its parent's weights"),
    (dict(mutations={"width": "continuous"}), ValueError, r"mutations\['width'\] can give width=6 \(from 8\), which"),
    # one that makes model_fn fail: said so, with bounds as the remedy
    (dict(mutations={"dropout": [0.0, 0.1, 0.3, 1.5]}), ValueError,
     r"mutations\['dropout'\] can give dropout=1.5 \(from 0\.\d\), for which model_fn fails: ValueError: .*; give "
     r"bounds \(low, high\)"),

    (dict(reproducible="yes"), TypeError, r"reproducible is 'yes', but must be True or False"),
    (dict(sampler=lambda rng: None), TypeError, r"sampler returned None, but must return a config dict"),
    (dict(reproducible=True, gang=True), ValueError, r"reproducible is True with gang units, but pbt gives"),
])
def test_bad_arguments_are_refused_before_training(kwargs, error, message):
    args = dict(population=4, epochs=2, interval=1, mutations=MUTATIONS, metric="val_loss", seed=0,
                executor="local")
    args.update(kwargs)
    with pytest.raises(error, match=message):
        pbt(make_spec(), _data(), args.pop("sampler", sampler), **args)



def test_every_first_config_is_checked_for_mutations_that_change_the_weights():
    """The first member's width of 2 stays 2 under x0.8 and x1.2 (rounded); a later
    member's 64 does not: it was accepted, and that member's forks failed mid-search."""
    widths = iter([2, 64, 2, 64])

    def two_widths(rng):
        return {**sampler(rng), "width": next(widths)}

    with pytest.raises(ValueError, match=r"mutations\['width'\] can give width=51 \(from 64\), which changes"):
        pbt(make_spec(), _data(), two_widths, population=4, epochs=2, interval=1, metric="val_loss", seed=0,
            mutations={"width": "continuous"}, executor="local")


def test_numpy_int_values_are_checked_and_kept_ints_as_python_ints():
    """A sampler's rng.integers gives np.int64: the check skipped it, and perturb made
    a width of 64 the float 76.8."""
    import numpy as np

    from cerebro_automl.adapters.pbt import perturb

    changed, _ = perturb({"width": np.int64(64)}, {"width": "continuous"}, np.random.default_rng(0))
    assert type(changed["width"]) is int and changed["width"] in (51, 77)

    def numpy_width(rng):
        return {**sampler(rng), "width": np.int64(8)}

    with pytest.raises(ValueError, match=r"mutations\['width'\] can give width=6 \(from (np.int64\()?8\)?\), which"):
        pbt(make_spec(), _data(), numpy_width, population=4, epochs=2, interval=1, metric="val_loss", seed=0,
            mutations={"width": "continuous"}, executor="local")
