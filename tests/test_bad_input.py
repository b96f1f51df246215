"""Bad input across the public API: each gets an error that names the value and
the rule, before any training, and leaves everything else in the run alone."""

from __future__ import annotations

import logging

import re

import numpy as np
import pandas as pd
import pytest
import torch

from cerebro_automl.training.restore import check_optimizer_params

from cerebro_automl import PartitionedDataset, Session

from conftest import make_arrays
from models import CONFIGS, make_spec

X, y, Xv, yv = make_arrays()
GOOD = {"lr": 1e-2, "width": 8}


def _data(**kwargs):
    return PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv), **kwargs)


def _session(**kwargs):
    return Session(make_spec(), _data(), executor="local", **kwargs)


def _parquet(tmp_path, name, frame, **kwargs):
    path = tmp_path / name
    frame.to_parquet(path, **kwargs)
    return str(path)


# (call, exception type, a regex the message must match: the value and the rule)
DATA_CASES = {
    "X and y lengths differ": (lambda tmp: PartitionedDataset.from_arrays(X[:10], y[:9], num_partitions=2),
                               ValueError, r"X has 10 rows but y has 9"),
    "labels as class names": (lambda tmp: PartitionedDataset.from_arrays(X[:4], np.array(["cat", "dog"] * 2)),
                              TypeError, r"y has dtype <U3, but must be numeric .*; labels that are class names "
                                         r"must become class indices"),
    "zero partitions": (lambda tmp: PartitionedDataset.from_arrays(X, y, num_partitions=0),
                        ValueError, r"num_partitions is 0, but must be >= 1"),
    "more partitions than rows": (lambda tmp: PartitionedDataset.from_arrays(X[:5], y[:5], num_partitions=6),
                                  ValueError, r"num_partitions is 6, but must be <= the 5 training rows"),
    "partitions as a string": (lambda tmp: PartitionedDataset.from_arrays(X, y, num_partitions="2"),
                               TypeError, r"num_partitions is '2', but must be an int"),
    "empty X": (lambda tmp: PartitionedDataset.from_arrays(X[:0], y[:0], num_partitions=1),
                ValueError, r"X has 0 rows"),
    "validation feature shape differs": (
        lambda tmp: PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv[:, :5], yv)),
        ValueError, r"X_valid rows have shape \(5,\), but X rows have \(8,\)"),
    "valid_fraction above 1": (lambda tmp: PartitionedDataset.from_arrays(X, y, num_partitions=2,
                                                                          valid_fraction=1.5),
                               ValueError, r"valid_fraction is 1.5, but must be in \(0, 1\)"),
    "object dtype features": (lambda tmp: PartitionedDataset.from_arrays(X.astype(object), y, num_partitions=2),
                              TypeError, r"X has dtype object, but must be numeric"),
    "loader not callable": (lambda tmp: PartitionedDataset.from_loader(5, num_partitions=2),
                            TypeError, r"fn is 5, but must be callable"),
    "has_validation not a bool": (
        lambda tmp: PartitionedDataset.from_loader(abs, num_partitions=2, has_validation="yes"),
        TypeError, r"has_validation is 'yes', but must be True, False or None"),
    "has_validation False with valid_fraction": (
        lambda tmp: PartitionedDataset.from_loader(abs, num_partitions=2, has_validation=False,
                                                   valid_fraction=0.2),
        ValueError, r"has_validation is False, but valid_fraction=0.2 holds out validation rows"),
    "parquet label column missing": (
        lambda tmp: PartitionedDataset.from_parquet(
            _parquet(tmp, "a.parquet", pd.DataFrame({"a": [1.0, 2.0], "y": [0, 1]})),
            features=["a"], label="label", num_partitions=1),
        ValueError, r"'label'.*not"),
    "parquet string feature column": (
        lambda tmp: PartitionedDataset.from_parquet(
            _parquet(tmp, "s.parquet", pd.DataFrame({"a": [1.0, 2.0], "b": ["x", "z"], "y": [0, 1]})),
            features=["a", "b"], label="y", num_partitions=1),
        TypeError, r"'b'.*type"),
}

IDS = np.arange(2**24, 2**24 + 10, dtype=np.int64)  # float32 cannot hold most of them
FRAME = pd.DataFrame({"x": np.linspace(0, 1, 10), "id": IDS, "y": np.arange(10) % 2})


def _load_first(data):
    return data.resolve(data.num_partitions).sources[0].load()


def _chunks_that_change_dtype(i):
    yield np.zeros((4, 2), np.float32), np.zeros(4, np.int64)
    yield np.zeros((4, 2), np.float32), np.zeros(4, np.int32)


STRUCTURE_CASES = {
    "leaves of X differ in length": (
        lambda tmp: PartitionedDataset.from_arrays({"dense": X[:10], "cat": IDS[:9]}, y[:10], num_partitions=2),
        ValueError, r"from_arrays: X\['dense'\] has 10 rows but X\['cat'\] has 9; every leaf of X and y"),
    "a leaf of y is shorter": (
        lambda tmp: PartitionedDataset.from_arrays((X[:10], IDS), {"a": y[:10], "b": y[:3]}, num_partitions=2),
        ValueError, r"X\[0\] has 10 rows but y\['b'\] has 3"),
    "string leaf": (lambda tmp: PartitionedDataset.from_arrays({"x": X[:4], "name": np.array(list("abcd"))},
                                                               y[:4], num_partitions=1),
                    TypeError, r"X\['name'\] has dtype <U1, but must be numeric"),
    "structured dtype": (lambda tmp: PartitionedDataset.from_arrays(
        np.zeros(4, dtype=[("a", "f4"), ("b", "i8")]), y[:4], num_partitions=1),
        TypeError, r"X has dtype \[\('a', '<f4'\), \('b', '<i8'\)\], but must be numeric"),
    "nested too deep": (lambda tmp: PartitionedDataset.from_arrays({"a": (X, X)}, y, num_partitions=2),
                        TypeError, r"X\['a'\] is a tuple, but a batch is one level deep"),
    "dict key not str": (lambda tmp: PartitionedDataset.from_arrays({1: X}, y, num_partitions=2),
                         TypeError, r"X has key 1; the keys of a dict input must be str"),
    "validation leaves differ": (lambda tmp: PartitionedDataset.from_arrays(
        {"a": X, "b": X}, y, num_partitions=2, valid=({"a": Xv}, yv)),
        ValueError, r"X_valid has leaves \[\"X_valid\['a'\]\"\], but X has"),
    "integer ids in a float input (Parquet statistics)": (
        lambda tmp: PartitionedDataset.from_parquet(_parquet(tmp, "ids.parquet", FRAME), features=["x", "id"],
                                                    label="y", num_partitions=1),
        ValueError, r"integer column 'id' holds 16777225, which float32 cannot hold exactly .* give it "
                    r"an input of its own"),
    "integer ids in a float input (no statistics: found on load)": (
        lambda tmp: _load_first(PartitionedDataset.from_parquet(
            _parquet(tmp, "nostats.parquet", FRAME, write_statistics=False), features=["x", "id"],
            label="y", num_partitions=1)),
        ValueError, r"integer column 'id' holds 16777225, which float32 cannot hold exactly"),
    "a null in a Parquet column": (
        lambda tmp: PartitionedDataset.from_parquet(
            _parquet(tmp, "null.parquet", pd.DataFrame({"x": [1.0, None], "y": [0, 1]})),
            features=["x"], label="y", num_partitions=1),
        ValueError, r"column 'x' holds 1 nulls; fill or drop them"),
    "a Parquet URL that matches nothing": (
        lambda tmp: PartitionedDataset.from_parquet(f"file://{tmp}/none-*.parquet", features=["x"], label="y"),
        ValueError, r"matches no Parquet files"),
    "negative shuffle_seed": (lambda tmp: PartitionedDataset.from_arrays(X, y, shuffle_seed=-1),
                              ValueError, r"shuffle_seed is -1, but must be None or an int >= 0"),
    "unknown cache": (lambda tmp: PartitionedDataset.from_arrays(X, y, cache="ssd"),
                      ValueError, r"cache is 'ssd', but must be one of \('memory', 'disk'\)"),
    "loader chunks that change dtype": (
        lambda tmp: _load_first(PartitionedDataset.from_loader(_chunks_that_change_dtype, 1)),
        ValueError, r"chunk 1 has y of dtype torch.int32 and row shape \(\), but the first chunk had "
                    r"torch.int64"),
    "loader chunk not a tuple": (
        lambda tmp: _load_first(PartitionedDataset.from_loader(lambda i: iter([np.zeros(3)]), 1)),
        TypeError, r"loader fn\(0\) yielded ndarray as chunk 0, but each chunk must be a tuple \(X, y\)"),
    "dataset_fn builds no Dataset": (
        lambda tmp: _load_first(PartitionedDataset.from_torch(lambda: iter([1, 2, 3]), 1)),
        TypeError, r"dataset_fn\(\) is a list_iterator, but must be a map-style torch Dataset"),
    "not a DataModule": (lambda tmp: PartitionedDataset.from_datamodule(object(), 2),
                         TypeError, r"datamodule is a object, but must be a LightningDataModule"),
}
DATA_CASES.update(STRUCTURE_CASES)


def _with(array, row, value):
    """A copy of ``array`` with ``value`` at ``row`` (every column of it)."""
    out = array.copy()
    out[row] = value
    return out


def _loader_with_validation(Xv_part, yv_part):
    return lambda i: (X[:300], y[:300], Xv_part, yv_part)


# Validation data is checked when the data is made (from_arrays, on the driver) or when
# a partition loads (on its worker), before any model trains on it.
VALIDATION_CASES = {
    "NaN in X_valid": (lambda tmp: PartitionedDataset.from_arrays(X, y, 2, valid=(_with(Xv, 5, np.nan), yv)),
                       ValueError, r"from_arrays: X_valid is nan in row 5; validation inputs and labels must "
                                   r"be finite \(a NaN or infinity there makes every model's val_loss NaN\)"),
    "infinity in a float y_valid": (
        lambda tmp: PartitionedDataset.from_arrays(X, y.astype(np.float32), 2,
                                                   valid=(Xv, _with(yv.astype(np.float32), 7, np.inf))),
        ValueError, r"from_arrays: y_valid is inf in row 7; validation inputs and labels must be finite"),
    "NaN in a leaf of a dict X_valid": (
        lambda tmp: PartitionedDataset.from_arrays({"a": X, "b": X}, y, 2,
                                                   valid=({"a": Xv, "b": _with(Xv, 3, np.nan)}, yv)),
        ValueError, r"from_arrays: X_valid\['b'\] is nan in row 3"),
    "NaN in held-out rows (valid_fraction, found on load)": (
        lambda tmp: _load_first(PartitionedDataset.from_arrays(_with(X, 299, np.nan), y, 2, valid_fraction=0.1,
                                                               shuffle=False)),
        ValueError, r"partition 0 validation: X is nan in row 29; validation inputs and labels must be finite"),
    "NaN in held-out rows of a disk cache": (
        lambda tmp: _load_first(PartitionedDataset.from_arrays(_with(X, 299, np.nan), y, 2, valid_fraction=0.1, shuffle=False,
                                                               cache="disk", cache_dir=str(tmp))),
        ValueError, r"partition 0 validation: X is nan in row 29"),
    "NaN in a loader's validation data": (
        lambda tmp: _load_first(PartitionedDataset.from_loader(
            _loader_with_validation(_with(Xv[:50], 4, -np.inf), yv[:50]), 1)),
        ValueError, r"loader fn\(0\) validation: X is -inf in row 4"),
    "y_valid int32 beside y int64": (
        lambda tmp: PartitionedDataset.from_arrays(X, y, 2, valid=(Xv, yv.astype(np.int32))),
        ValueError, r"y_valid has dtype torch.int32, but y has torch.int64; validation data must have the "
                    r"training data's dtypes"),
    "X_valid int beside X float": (
        lambda tmp: PartitionedDataset.from_arrays(X, y, 2, valid=(Xv.astype(np.int64), yv)),
        ValueError, r"X_valid has dtype torch.int64, but X has torch.float32"),
    "a loader's validation labels of another dtype": (
        lambda tmp: _load_first(PartitionedDataset.from_loader(_loader_with_validation(Xv[:50], yv[:50].astype(np.int32)), 1)),
        ValueError, r"loader fn\(0\) validation has y of dtype torch.int32 and row shape \(\), but the training "
                    r"data has torch.int64 and \(\); validation data must match the training data leaf for leaf"),
    "valid_fraction that holds out no row": (
        lambda tmp: PartitionedDataset.from_arrays(X, y, 2, valid_fraction=0.0001).resolve(2),
        ValueError, r"valid_fraction is 0.0001, but a partition of 300 rows \(600 rows in 2 partitions\) holds "
                    r"out round\(300 x 0.0001\) = 0 of its 300 rows; each partition holds out that fraction "
                    r"of its own rows, rounded, and must keep at least one validation row and one training row"),
    "valid_fraction that holds out no row of the smaller partitions": (
        lambda tmp: PartitionedDataset.from_arrays(X[:13], y[:13], 2, valid_fraction=0.08).resolve(2),
        ValueError, r"valid_fraction is 0.08, but a partition of 6 rows \(13 rows in 2 partitions\) holds out "
                    r"round\(6 x 0.08\) = 0"),
    "valid_fraction that leaves no training row": (
        lambda tmp: PartitionedDataset.from_arrays(X[:4], y[:4], 4, valid_fraction=0.9).resolve(4),
        ValueError, r"valid_fraction is 0.9, but a partition of 1 rows .* = 1 of its 1 rows"),
    "valid_fraction that holds out no row of a loader's partition (found on load)": (
        lambda tmp: _load_first(PartitionedDataset.from_loader(lambda i: (X[:10], y[:10]), 1, valid_fraction=0.01)),
        ValueError, r"valid_fraction is 0.01, but partition 0 holds out round\(10 x 0.01\) = 0 of its 10 rows"),
}
DATA_CASES.update(VALIDATION_CASES)

SPEC_CASES = {
    "batch_size 0": (dict(batch_size=0), ValueError, r"batch_size is 0, but must be a positive int"),
    "batch_size float": (dict(batch_size=2.5), TypeError, r"batch_size is 2.5, but must be a positive int"),
    "batch_size an empty key": (dict(batch_size=""), ValueError, r"batch_size is '', but must be a positive int"),
    "model_fn not callable": (dict(model_fn=3), TypeError, r"model_fn is 3, but must be callable"),
    "metrics as a list": (dict(metrics=["acc"]), TypeError, r"metrics is \['acc'\], but must be a dict"),
    # val_loss would be the metric's and the search would rank by it, silently
    "a metric named loss": (dict(metrics={"loss": lambda o, t: o.mean()}), ValueError,
                            r"metrics has a metric named 'loss', but a name must be non-empty and not one of "
                            r"\['loss', 'seconds'\]"),
    "a metric with no name": (dict(metrics={"": lambda o, t: o.mean()}), ValueError, r"metric named ''"),
    "forward_fn not callable": (dict(forward_fn="model"), TypeError,
                                r"forward_fn is 'model', but must be callable or None"),
    "no optimizer_fn": (dict(optimizer_fn=None), TypeError,
                        r"optimizer_fn is None, but a TrainingSpec trains with optimizer_fn\(config, parameters\)"),
    "no loss_fn": (dict(loss_fn=None), TypeError,
                   r"loss_fn is None, but a TrainingSpec trains with loss_fn\(outputs, targets\)"),
}

SESSION_CASES = {
    "seed as a string": (dict(seed="1"), TypeError, r"seed is '1', but must be an int"),
    "unknown order": (dict(order="random"), ValueError, r"order is 'random', but must be one of"),
    "zero threads": (dict(threads=0), ValueError, r"threads is 0, but must be an int >= 1"),
    "unknown executor": (dict(executor="spark"), ValueError, r"executor is 'spark', but must be"),
    "zero replicas": (dict(replicas=0), ValueError, r"replicas is 0, but must be an int >= 1"),
    "replicas as a string": (dict(replicas="2"), ValueError, r"replicas is '2', but must be an int >= 1"),
    "replicas past the workers": (dict(replicas=3, n_workers=2), ValueError,
                                  r"replicas is 3, but the session starts its own cluster of n_workers=2, which no "
                                  r"other worker joins: pass n_workers=3 or more"),
    "min_workers past the workers": (dict(min_workers=3, n_workers=2), ValueError,
                                     r"min_workers is 3, but the session starts its own cluster of n_workers=2"),
    "speculate as an int": (dict(speculate=1, replicas=2), TypeError, r"speculate is 1, but must be True or False"),
    "prefetch as a string": (dict(prefetch="yes"), TypeError, r"prefetch is 'yes', but must be True, False or None"),
    "speculate with one replica": (dict(speculate=True), ValueError,
                                   r"speculate is True with replicas=1, but a speculative copy runs on another holder"),
    "zero workers": (dict(n_workers=0), ValueError, r"n_workers is 0, but must be an int >= 1"),
    "workers as a string": (dict(n_workers="2"), ValueError, r"n_workers is '2', but must be an int >= 1"),
    "a client the local executor ignores": (dict(client="tcp://10.0.0.1:8786"), ValueError,
                                            r"client is given with executor='local', which does not use it"),
    "progress as a string": (dict(progress="yes"), TypeError, r"progress is 'yes', but must be True, False or None"),
}

ADD_CASES = {
    "zero epochs": (GOOD, dict(epochs=0), ValueError, r"epochs is 0, but must be an int >= 1"),
    # a name is a folder under checkpoint_dir and the trackers' log folders: it must stay inside them
    "a name with a path": (GOOD, dict(epochs=1, name="../escaped"), ValueError,
                           r"name is '../escaped', but must not hold a slash or a backslash, nor start with '.'"),
    "an empty name": (GOOD, dict(epochs=1, name=""), ValueError, r"name is '', but must not be empty"),
    "epochs as a float": (GOOD, dict(epochs=2.0), ValueError, r"epochs is 2.0, but must be an int"),
    "config lacks a key": ({"lr": 0.1}, dict(epochs=1), ValueError,
                           r"config \{'lr': 0.1\} lacks key 'width'"),
    "config value not JSON": ({"lr": 0.1, "width": 8, "act": torch.nn.ReLU}, dict(epochs=1), TypeError,
                              r"not JSON-serialisable.*ReLU"),
    "config not a dict": ([("lr", 0.1)], dict(epochs=1), TypeError, r"config is \[\('lr', 0.1\)\], but must be a dict"),
    "negative offset": (GOOD, dict(epochs=1, offset=-1), ValueError, r"offset is -1, but must be an int >= 0"),
}


@pytest.mark.parametrize("case", DATA_CASES, ids=list(DATA_CASES))
def test_bad_data_sources(case, tmp_path):
    call, error, message = DATA_CASES[case]
    with pytest.raises(error, match=message):
        call(tmp_path)


@pytest.mark.parametrize("case", SPEC_CASES, ids=list(SPEC_CASES))
def test_bad_training_specs(case):
    overrides, error, message = SPEC_CASES[case]
    with pytest.raises(error, match=message):
        make_spec(**overrides)


@pytest.mark.parametrize("case", SESSION_CASES, ids=list(SESSION_CASES))
def test_bad_session_arguments(case):
    kwargs, error, message = SESSION_CASES[case]
    kwargs = {"executor": "local", **kwargs}
    with pytest.raises(error, match=message):
        Session(make_spec(), _data(), **kwargs)


@pytest.mark.parametrize("case", ADD_CASES, ids=list(ADD_CASES))
def test_bad_configs_and_budgets_at_add(case):
    config, kwargs, error, message = ADD_CASES[case]
    with _session() as s:
        with pytest.raises(error, match=message):
            s.add(config, **kwargs)
        assert s.history.empty  # nothing was added


def test_batch_size_from_a_config_key_is_checked_at_add():
    with Session(make_spec(batch_size="bs"), _data(), executor="local") as s:
        with pytest.raises(ValueError, match=r"config\['bs'\] \(the batch size\) is -1, but must be a positive"):
            s.add({**GOOD, "bs": -1}, epochs=1)
        with pytest.raises(ValueError, match=r"batch_size names config key 'bs', which config .* lacks"):
            s.add(GOOD, epochs=1)


def test_a_warmup_decay_budget_key_is_checked_at_add():
    from cerebro_automl.training.schedulers import WarmupDecay

    with Session(make_spec(lr_schedule=WarmupDecay(epochs="max_epochs")), _data(), executor="local") as s:
        with pytest.raises(ValueError, match=r"WarmupDecay\(epochs='max_epochs'\) names config key 'max_epochs', "
                                             r"which config .* lacks"):
            s.add(GOOD, epochs=1)
        with pytest.raises(ValueError, match=r"which is 0 in config .*, but must be a positive int"):
            s.add({**GOOD, "max_epochs": 0}, epochs=1)
        assert s.history.empty and s.statuses() == {}


def test_unknown_and_stopped_model_ids():
    with _session() as s:
        with pytest.raises(ValueError, match=r"model id 99 is unknown; known ids are none yet"):
            s.stop(99)
        mid = s.add(GOOD, epochs=1)
        with pytest.raises(ValueError, match=r"model id 99 is unknown; known ids are 0..0"):
            s.extend(99, 1)
        s.stop(mid)
        with pytest.raises(ValueError, match=r"model 0 is stopped.*cannot be extended|stopped"):
            s.extend(mid, 1)
        with pytest.raises(ValueError, match=r"epochs is -2, but must be an int >= 1"):
            s.extend(mid, -2)


def test_a_wrongly_typed_config_value_fails_only_its_model():
    """model_fn(config) raising for some configs fails those models, reason kept;
    add() cannot refuse them without building every model for real on the driver."""
    from cerebro_automl import ModelFailed
    with _session() as s:
        bad = s.add({"lr": 0.1, "width": "8"}, epochs=2)
        good = s.add(GOOD, epochs=2)
        failed = [r for r in s.reports() if isinstance(r, ModelFailed)]
        assert [r.model_id for r in failed] == [bad]
        assert failed[0].error.startswith("TypeError:") and "str" in failed[0].error
        assert s.model(bad).status == "failed" and s.model(bad).error == failed[0].error
        assert s.status(good) == "paused" and list(s.model(good).history.epoch) == [1, 2]


def test_model_fn_returning_something_else_is_refused_at_add():
    spec = make_spec(model_fn=lambda config: "not a module")
    with Session(spec, _data(), executor="local") as s:
        with pytest.raises(TypeError, match=r"model_fn returned str, but must return a torch.nn.Module"):
            s.add(GOOD, epochs=1)


def test_optimizer_fn_returning_something_else_is_refused_at_add_and_named_in_a_unit():
    spec = make_spec(optimizer_fn=lambda config, params: None)  # a forgotten return
    with Session(spec, _data(), executor="local") as s:
        with pytest.raises(TypeError, match=r"optimizer_fn returned NoneType for config .*, but must return a "
                                            r"torch.optim.Optimizer"):
            s.add(GOOD, epochs=1)
    with pytest.raises(TypeError, match=r"optimizer_fn returned NoneType for config"):  # where add could not check
        check_optimizer_params(torch.nn.Linear(2, 1), None, GOOD)


def test_a_closed_session_refuses_work():
    s = _session()
    s.close()
    with pytest.raises(RuntimeError, match="the session is closed"):
        s.add(GOOD, epochs=1)


def test_building_a_model_after_the_session_closed_says_where_to_build_it():
    with _session() as s:
        s.add(GOOD, epochs=1)
        s.run()
        best = s.best("val_loss")
    with pytest.raises(RuntimeError, match=r"the session is closed, and model 0's state went with its workers: "
                                           r"call build\(\) or state\(\) inside the `with Session"):
        best.build()


def test_a_closed_client_is_refused(cluster):
    from distributed import Client, LocalCluster
    with LocalCluster(n_workers=1, processes=False) as local:
        client = Client(local)
        client.close()
    with pytest.raises(ValueError, match=r"closed"):
        Session(make_spec(), _data(), client=client)


def test_bad_calls_mid_session_leave_the_good_models_alone():
    """A good model's history is the same whether or not bad calls came in between."""
    def run(with_bad_calls: bool) -> pd.DataFrame:
        with _session(seed=5) as s:
            good = [s.add(c, epochs=2) for c in CONFIGS[:2]]
            if with_bad_calls:
                for bad in ({"lr": 0.1}, {"lr": 0.1, "width": 8, "x": object()}, "config"):
                    with pytest.raises((TypeError, ValueError)):
                        s.add(bad, epochs=2)
                for call in (lambda: s.stop(7), lambda: s.extend(good[0], 0), lambda: s.add(GOOD, epochs=-1)):
                    with pytest.raises(ValueError):
                        call()
            h = s.run()
            weights = [s.model(m).state()["model"] for m in good]
        return h, weights

    clean, clean_weights = run(False)
    noisy, noisy_weights = run(True)
    columns = ["model_id", "epoch", "train_loss", "val_loss", "val_accuracy"]
    pd.testing.assert_frame_equal(clean[columns], noisy[columns])
    for a, b in zip(clean_weights, noisy_weights):
        assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ tuners
def test_search_refuses_an_unknown_metric_and_an_empty_space():
    from cerebro_automl.adapters.search import grid_search
    with pytest.raises(ValueError, match=r"metric is 'val_f1', but the spec produces only \["):
        grid_search(make_spec(), _data(), {"lr": [0.1], "width": [8]}, epochs=1, metric="val_f1",
                    executor="local")
    with pytest.raises(ValueError, match=r"space\['lr'\] is \[\], but must be a non-empty list"):
        grid_search(make_spec(), _data(), {"lr": [], "width": [8]}, epochs=1, executor="local")


def test_val_metric_without_validation_data_says_how_to_add_it():
    from cerebro_automl.adapters.search import grid_search
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2)
    with pytest.raises(ValueError, match=r"no validation data: pass valid=\.\.\. or valid_fraction"):
        grid_search(make_spec(), data, {"lr": [0.1], "width": [8]}, epochs=1, metric="val_loss",
                    executor="local")


@pytest.mark.parametrize("kwargs, message", [
    (dict(timeout=-1), r"timeout is -1, but must be a positive number of seconds"),
    (dict(timeout=float("nan")), r"timeout is nan, but must be a positive"),
    (dict(metric="val_f1"), r"metric is 'val_f1', but the spec produces only"),
    (dict(n_trials=0), r"n_trials is 0, but must be an int >= 1"),
    (dict(epochs="3"), r"epochs is '3', but must be an int >= 1"),
    (dict(parallelism=0), r"parallelism is 0, but must be an int >= 1"),
], ids=["negative timeout", "nan timeout", "unknown metric", "zero trials", "epochs as str", "zero parallelism"])
def test_optuna_optimize_refuses_bad_arguments_before_any_trial(kwargs, message):
    import optuna
    from cerebro_automl.adapters.optuna import optimize
    study = optuna.create_study()
    arguments = {**dict(n_trials=2, epochs=1, metric="val_loss", executor="local"), **kwargs}
    with pytest.raises(ValueError, match=message):
        optimize(study, make_spec(), _data(), lambda t: GOOD, **arguments)
    assert study.trials == []


def test_optuna_refuses_multi_objective_studies():
    import optuna
    from cerebro_automl.adapters.optuna import optimize
    study = optuna.create_study(directions=["minimize", "maximize"])
    with pytest.raises(ValueError, match=r"study has 2 objectives, but optimize supports single-objective"):
        optimize(study, make_spec(), _data(), lambda t: GOOD, n_trials=1, epochs=1, metric="val_loss",
                 executor="local")


def test_an_optuna_space_that_returns_no_dict_is_named():
    """A space that forgets its return: the error names space and the rule, and the
    trial is told FAIL with it."""
    import optuna
    from cerebro_automl.adapters.optuna import optimize
    study = optuna.create_study()

    def space(trial):
        trial.suggest_float("lr", 1e-3, 1e-1, log=True)  # no return

    with pytest.raises(TypeError, match=r"space returned None, but must return a config dict"):
        optimize(study, make_spec(), _data(), space, n_trials=1, epochs=1, metric="val_loss", executor="local")
    assert [t.state.name for t in study.trials] == ["FAIL"]


def test_messages_name_values_not_types_only():
    """Spot-check the convention every error above follows: '<name> is <value>, but must ...'."""
    with pytest.raises(ValueError) as info:
        PartitionedDataset.from_arrays(X, y, num_partitions=-3)
    assert re.search(r"num_partitions is -3, but must be", str(info.value))


def test_data_persisted_on_another_cluster_is_refused_before_training(caplog):
    """from_dask with a collection persisted on cluster A, and a session on cluster B."""
    import dask.array as da
    from distributed import Client, LocalCluster

    with caplog.at_level("WARNING", logger="cerebro_automl"), \
            LocalCluster(n_workers=1, processes=False, dashboard_address=None) as a, Client(a) as client_a, \
            LocalCluster(n_workers=1, processes=False, dashboard_address=None) as b, \
            Client(b, set_as_default=False) as client_b:
        Xd = da.from_array(X, chunks=150).persist()
        yd = da.from_array(y, chunks=150).persist()
        data = PartitionedDataset.from_dask(Xd, yd, num_partitions=2, valid_fraction=0.2)
        with pytest.raises(ValueError, match=r"the data reads 4 persisted blocks .* that the scheduler at "
                                             r"\S+ does not hold: the dask collection was persisted on "
                                             r"another cluster"):
            Session(make_spec(), data, client=client_b)
        with Session(make_spec(), data, client=client_a) as s:  # its own cluster: it trains
            s.add(GOOD, epochs=1)
            assert len(s.run()) == 1
    # 4 blocks for 2 partitions: drawn row by row, every block would reach each loading worker at once
    assert "persisted in 4 blocks, fewer than 16 per partition, so its partitions take whole blocks" in caplog.text


# ------------------------------------------------- issue 34: values that were accepted silently
def _ignores_its_parameters(config, params):
    """An optimizer over a tensor of its own: it steps, and the model never changes."""
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config["lr"])


class _ReadsAValueInInit(torch.nn.Module):
    """``.item()`` in ``__init__`` cannot run on the meta device, so add() cannot build it there."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.rate = torch.linspace(0, 0.1, 3)[1].item()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))

    def forward(self, x):
        return self.net(x)


def test_an_optimizer_that_ignores_the_models_parameters_is_refused_at_add():
    with Session(make_spec(optimizer_fn=_ignores_its_parameters), _data(), executor="local") as s:
        with pytest.raises(ValueError, match=r"optimizer_fn built, for config \{'lr': 0.01, 'width': 8\}, an "
                                             r"optimizer that holds 0 of the model's 4 trainable parameters "
                                             r"\(it lacks '0.weight', '0.bias', '3.weight', '3.bias'\); it must "
                                             r"hold every parameter with requires_grad=True"):
            s.add(GOOD, epochs=1)
        assert s.history.empty


def test_frozen_parameters_left_out_of_the_optimizer_are_accepted():
    def head_only(config, params):
        return torch.optim.SGD([p for p in params if p.requires_grad], lr=config["lr"])

    def frozen_body(config):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        model[0].requires_grad_(False)
        return model

    with Session(make_spec(model_fn=frozen_body, optimizer_fn=head_only), _data(), executor="local") as s:
        mid = s.add(GOOD, epochs=1)
        s.run()
        assert s.status(mid) == "paused", s.model(mid).error


def test_an_optimizer_that_ignores_the_parameters_fails_its_model_in_the_unit():
    """Where add() cannot build the model on the meta device, the unit refuses it: that model fails."""
    def optimizer_fn(config, params):
        return _ignores_its_parameters(config, params) if config["ignore"] else \
            torch.optim.SGD(params, lr=config["lr"])

    spec = make_spec(model_fn=lambda c: _ReadsAValueInInit(c["width"]), optimizer_fn=optimizer_fn)
    with Session(spec, _data(), executor="local") as s:
        bad = s.add({**GOOD, "ignore": True}, epochs=2)
        good = s.add({**GOOD, "ignore": False}, epochs=2)
        s.run()
        assert s.status(bad) == "failed" and s.status(good) == "paused"
        assert s.model(bad).error.startswith(
            "ValueError: optimizer_fn built, for config {'lr': 0.01, 'width': 8, 'ignore': True}, an optimizer "
            "that holds 0 of the model's 4 trainable parameters")


@pytest.mark.parametrize("metric, returned", [
    (lambda out, y: "0.5", r"str '0.5'"),
    (lambda out, y: (out.argmax(-1) == y).float(), r"a tensor of shape \(100,\)"),
    (lambda out, y: None, r"NoneType None"),
], ids=["a string", "a vector", "None"])
def test_a_metric_that_returns_no_scalar_fails_naming_the_metric_and_the_rule(metric, returned):
    with Session(make_spec(metrics={"odd": metric}), _data(), executor="local") as s:
        mid = s.add(GOOD, epochs=1)
        history = s.run()
        assert s.status(mid) == "failed"
        assert re.match(rf"TypeError: metric 'odd' returned {returned} for a validation batch, but must return "
                        r"a scalar per batch: the batch mean", s.model(mid).error)
        assert history["val_odd"].isna().all()  # the column is the spec's; the failed model gave no value


class _GrowsAfterItsFirstBuild(torch.nn.Module):
    """A model_fn that is not a function of the config: every real build after the
    first is wider (the meta device's builds are the wide one too)."""
    real_builds = 0

    def __init__(self) -> None:
        super().__init__()
        on_meta = torch.empty(0).device.type == "meta"
        width = 16 if on_meta or _GrowsAfterItsFirstBuild.real_builds else 8
        _GrowsAfterItsFirstBuild.real_builds += 0 if on_meta else 1
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))

    def forward(self, x):
        return self.net(x)


def test_a_model_fn_that_changes_the_architecture_keeps_the_size_mismatch_in_the_history(caplog):
    _GrowsAfterItsFirstBuild.real_builds = 0
    with Session(make_spec(model_fn=lambda c: _GrowsAfterItsFirstBuild()), _data(), executor="local") as s:
        mid = s.add(GOOD, epochs=1)
        history = s.run()
    first_line = (r"RuntimeError: Error\(s\) in loading state_dict for _GrowsAfterItsFirstBuild: size mismatch "
                  r"for net.0.weight: copying a param with shape torch.Size\(\[8, 8\]\) from checkpoint, the "
                  r"shape in current model is torch.Size\(\[16, 8\]\)")
    assert re.fullmatch(first_line + r"\.?", history.loc[history.model_id == mid, "error"].iloc[0])
    assert re.search(rf"model 0 \(model-0\) failed: {first_line}", caplog.text)


def test_nan_validation_data_from_a_loader_stops_the_session_at_load_naming_it():
    from cerebro_automl import DataLoadError
    data = PartitionedDataset.from_loader(_loader_with_validation(_with(Xv[:50], 4, np.nan), yv[:50]), 2)
    with Session(make_spec(), data, executor="local") as s:
        s.add(GOOD, epochs=1)
        with pytest.raises(DataLoadError, match=r"loader fn\(0\) validation: X is nan in row 4; validation "
                                                r"inputs and labels must be finite"):
            s.run()
        assert s.history.empty


def test_best_says_the_metric_is_nan_when_every_model_reported_nan():
    spec = make_spec(metrics={"ratio": lambda out, y: torch.tensor(float("nan"))})
    with Session(spec, _data(), executor="local") as s:
        for config in CONFIGS[:2]:
            s.add(config, epochs=1)
        s.run()
        with pytest.raises(ValueError, match=r"no model has a number for metric 'val_ratio': models \[0, 1\] "
                                             r"reported it as NaN"):
            s.best("val_ratio", "max")
        assert s.best("val_loss", "min").model_id in (0, 1)  # the finite metric still ranks


def test_search_refuses_a_valid_fraction_that_holds_out_no_row_before_training(caplog):
    from cerebro_automl.adapters.search import grid_search
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid_fraction=0.0001)
    with pytest.raises(ValueError, match=r"valid_fraction is 0.0001, but a partition of 300 rows \(600 rows in 2 "
                                         r"partitions\) holds out round\(300 x 0.0001\) = 0 of its 300 rows"):
        grid_search(make_spec(), data, {"lr": [0.1], "width": [8]}, epochs=1, metric="val_loss",
                    executor="local")
    assert "epoch" not in caplog.text


@pytest.mark.parametrize("label, row", [(3, 11), (-1, 0)])
def test_validation_labels_past_the_training_labels_are_named_in_a_warning(label, row, caplog):
    """A class index past every training label is likely out of the model's range, so
    it is named when the data is made; integer targets may be counts, so not refused."""
    with caplog.at_level(logging.WARNING, logger="cerebro_automl"):
        PartitionedDataset.from_arrays(X, y, 2, valid=(Xv, _with(yv, row, label)))
    assert f"y_valid is {label} in row {row}, outside 0..2, the span of the training labels" in caplog.text


class SequenceClassifierOutput(dict):
    """What a HuggingFace classifier returns: a dict-like record holding ``logits``."""

    @property
    def logits(self):
        return self["logits"]


class HFStyleClassifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 3)

    def forward(self, x):
        return SequenceClassifierOutput(logits=self.layer(x))


def test_model_output_that_is_not_a_tensor_points_to_forward_fn():
    """torch's own error names only the type it wanted; ours says what maps it."""
    spec = make_spec(model_fn=lambda config: HFStyleClassifier())
    with Session(spec, _data(), executor="local") as s:
        model_id = s.add(GOOD, epochs=1)
        s.run()
        error = s.model(model_id).error
    assert "SequenceClassifierOutput, not a tensor" in error
    assert "forward_fn=...) maps a model's output to the loss's input" in error
    assert "forward_fn=lambda model, x, y: (model(x).logits, y)" in error


def test_datamodule_without_validation_names_its_own_remedy(tmp_path):
    """from_datamodule takes no valid=: the hint names what it does take."""
    L = pytest.importorskip("lightning")
    from cerebro_automl.adapters.search import grid_search
    from structured_models import FileDataModule

    class TrainOnlyDataModule(L.LightningDataModule):  # FileDataModule without val_dataloader
        def __init__(self, folder: str, rows: int = 480) -> None:
            super().__init__()
            self.folder, self.rows = folder, rows

        prepare_data, setup = FileDataModule.prepare_data, FileDataModule.setup
        train_dataloader = FileDataModule.train_dataloader

    data = PartitionedDataset.from_datamodule(TrainOnlyDataModule(str(tmp_path)), 2)
    with pytest.raises(ValueError, match=r"define val_dataloader\(\) on the DataModule, or pass "
                                         r"valid_fraction=\.\.\.") as info:
        grid_search(make_spec(), data, {"lr": [1e-2], "width": [8]}, epochs=1, metric="val_accuracy",
                    executor="local")
    assert "valid=" not in str(info.value)


# ------------------------------- issue 34, item 10: a checkpoint_dir that cannot be written
NO_CLUSTER = "tcp://127.0.0.1:1"  # nothing listens: a check made after connecting would fail otherwise


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_any_cluster_or_training(tmp_path):
    """It was found only after the first epoch, when the first checkpoint failed."""
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match=rf"checkpoint_dir '{afile}' is a file, but must be a directory"):
        Session(make_spec(), _data(), client=NO_CLUSTER, checkpoint_dir=str(afile))
    with pytest.raises(ValueError, match=rf"checkpoint_dir '{afile}/ck' is not a directory this process can "
                                         r"write \(NotADirectoryError: Not a directory\)"):
        Session(make_spec(), _data(), client=NO_CLUSTER, checkpoint_dir=str(afile / "ck"))
    with pytest.raises(TypeError, match=r"checkpoint_dir is 3, but must be a path"):
        Session(make_spec(), _data(), client=NO_CLUSTER, checkpoint_dir=3)


def test_a_read_only_checkpoint_dir_is_refused_before_any_cluster_or_training():
    import contextlib
    import os
    import shutil
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="cerebro-ro-"))  # in /tmp: any user may reach it
    folder.chmod(0o555)

    @contextlib.contextmanager
    def unprivileged():
        """Root writes anywhere: run the check as nobody, as a user would."""
        if os.geteuid() != 0:
            yield
            return
        os.seteuid(65534)
        try:
            yield
        finally:
            os.seteuid(0)

    try:
        with unprivileged(), pytest.raises(ValueError, match=rf"checkpoint_dir '{folder}' is not a directory "
                                                             r"this process can write \(PermissionError: "
                                                             r"Permission denied\)"):
            Session(make_spec(), _data(), client=NO_CLUSTER, checkpoint_dir=str(folder))
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


# -------------------------------------------- silent mistakes the hostile probe found
def test_a_model_fn_that_builds_another_network_per_call_fails_naming_the_module():
    """Same shapes, a random activation per call: the weights load into every build, so
    the model would train silently as a different network in each unit."""
    import random

    from cerebro_automl import Session

    from conftest import make_arrays

    draw = random.Random(0)  # a draw per call, not per config

    def model_fn(config):
        act = draw.choice([torch.nn.ReLU, torch.nn.GELU, torch.nn.Tanh, torch.nn.SiLU, torch.nn.ELU])
        return torch.nn.Sequential(torch.nn.Linear(8, 16), act(), torch.nn.Linear(16, 3))

    X, y, Xv, yv = make_arrays()
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    with Session(make_spec(model_fn=model_fn), data, executor="local") as s:
        s.add({"lr": 0.01, "width": 16}, epochs=3)
        history = s.run()
        assert s.status(0) == "failed"
    assert history["error"].dropna().str.contains(
        r"model_fn built another network for the same config \{.*\}: module '1' is \w+ in this build, "
        r"\w+ in the model's first build").all()


def test_a_fork_into_a_config_that_changes_the_network_is_allowed():
    from cerebro_automl import Session

    from conftest import make_arrays

    def model_fn(config):
        act = {"relu": torch.nn.ReLU, "gelu": torch.nn.GELU}[config["act"]]
        return torch.nn.Sequential(torch.nn.Linear(8, 16), act(), torch.nn.Linear(16, 3))

    X, y, Xv, yv = make_arrays()
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    with Session(make_spec(model_fn=model_fn), data, executor="local") as s:
        parent = s.add({"lr": 0.01, "act": "relu"}, epochs=1)
        s.run()
        child = s.add({"lr": 0.01, "act": "gelu"}, epochs=2, init_from=(parent, 1))
        s.run()
        assert s.status(child) == "paused", s.history.get("error")


def test_a_validation_label_past_the_training_ones_fails_naming_the_validation_data():
    from cerebro_automl import Session

    from conftest import make_arrays

    X, y, Xv, yv = make_arrays()
    yv = yv.copy()
    yv[3] = 7  # the model has 3 classes
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    with Session(make_spec(), data, executor="local") as s:
        s.add({"lr": 0.01, "width": 16}, epochs=1)
        history = s.run()
    [error] = history["error"].dropna()
    assert error.startswith("IndexError") and "in the validation pass, over the validation data" in error


def test_a_lazy_module_is_the_network_it_becomes():
    """nn.LazyLinear becomes nn.Linear at its first forward: the same network to the
    structure check, so the model trains on in its later units."""
    from conftest import make_arrays

    X, y, Xv, yv = make_arrays()
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    spec = make_spec(model_fn=lambda c: torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.ReLU(),
                                                            torch.nn.Linear(16, 3)))
    with Session(spec, data, executor="local") as s:
        s.add({"lr": 0.01, "width": 16}, epochs=2)
        history = s.run()
        assert s.status(0) == "paused", history.get("error")


def test_int32_labels_fail_saying_to_store_them_as_int64():
    """cross_entropy takes int64 class indices; the data keeps the labels' int32."""
    data = PartitionedDataset.from_arrays(X, y.astype("int32"), num_partitions=2, valid=(Xv, yv.astype("int32")))
    with Session(make_spec(), data, executor="local") as s:
        s.add(GOOD, epochs=1)
        s.run()
        error = s.model(0).error
    assert error.startswith("RuntimeError: expected target dtype to be Long or Byte, but got Int: the loss takes "
                            "class indices as int64 (torch.long), and the data keeps the labels' dtype"), error


def test_a_history_whose_models_all_failed_still_has_the_metric_columns():
    with _session() as s:
        s.add({"lr": "not-a-number", "width": 8}, epochs=1)
        history = s.run()
    assert {"train_loss", "val_loss"} <= set(history.columns)
    assert history[["val_loss"]].isna().all().all() and history["error"].notna().all()


@pytest.mark.parametrize("loss_fn, said", [
    (lambda out, y: torch.nn.functional.cross_entropy(out, y).item(), r"loss_fn returned 1\.\d+, but must"),
    (lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"),
     r"loss_fn returned a tensor of shape \(\d+,\), but must return the batch's loss as a one-element tensor"),
])
def test_a_loss_that_is_not_a_one_element_tensor_fails_its_model_naming_the_rule(loss_fn, said):
    from cerebro_automl import ModelFailed

    with Session(make_spec(loss_fn=loss_fn), _data(), executor="local") as s:
        s.add(GOOD, epochs=1)
        [failed] = [r for r in s.reports() if isinstance(r, ModelFailed)]
    assert re.search(said, failed.error), failed.error


def test_an_http_servers_address_given_for_the_scheduler_is_refused_not_waited_on():
    """The dashboard's port given for the scheduler's: distributed.Client waited for
    ever on it (an HTTP server never speaks first)."""
    import http.server
    import threading

    import dask

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"tcp://127.0.0.1:{server.server_address[1]}"
    try:  # the request goes after Dask's connect timeout of silence (30 s by default)
        with dask.config.set({"distributed.comm.timeouts.connect": "2s"}), \
                pytest.raises(ValueError, match=rf"client is '{address}', but an HTTP server answers there \(the Dask "
                                                r"dashboard\?\), not a Dask scheduler"):
            Session(make_spec(), _data(), client=address)
    finally:
        server.shutdown()
        server.server_close()


def test_a_scheduler_slow_to_speak_is_not_sent_the_http_probe():
    """The probe writes its HTTP request only after Dask's connect timeout of silence:
    a scheduler that speaks later than that is busy, not a web server."""
    import socket
    import threading
    import time

    import dask

    from cerebro_automl.executors.dask.cluster import check_not_http

    server = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def slow_scheduler():
        conn, _ = server.accept()
        with conn:
            time.sleep(2.5)  # busy: its handshake comes late, within Dask's connect timeout
            conn.sendall(b"\x00")
            conn.settimeout(1.0)
            try:
                received.append(conn.recv(64))
            except OSError:
                received.append(b"")

    thread = threading.Thread(target=slow_scheduler, daemon=True)
    thread.start()
    try:
        with dask.config.set({"distributed.comm.timeouts.connect": "4s"}):
            check_not_http(f"tcp://127.0.0.1:{server.getsockname()[1]}")
        thread.join(timeout=10)
    finally:
        server.close()
    assert received == [b""]  # nothing was sent to it
