"""Bad input across the public API: each gets an error that names the value and
the rule, before any training, and leaves everything else in the run alone."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
import torch

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

SPEC_CASES = {
    "batch_size 0": (dict(batch_size=0), ValueError, r"batch_size is 0, but must be a positive int"),
    "batch_size float": (dict(batch_size=2.5), TypeError, r"batch_size is 2.5, but must be a positive int"),
    "model_fn not callable": (dict(model_fn=3), TypeError, r"model_fn is 3, but must be callable"),
    "metrics as a list": (dict(metrics=["acc"]), TypeError, r"metrics is \['acc'\], but must be a dict"),
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
                                  r"replicas is 3, but the cluster has 2 workers"),
    "speculate as an int": (dict(speculate=1, replicas=2), TypeError, r"speculate is 1, but must be True or False"),
    "prefetch as a string": (dict(prefetch="yes"), TypeError, r"prefetch is 'yes', but must be True, False or None"),
    "speculate with one replica": (dict(speculate=True), ValueError,
                                   r"speculate is True with replicas=1, but a speculative copy runs on another holder"),
}

ADD_CASES = {
    "zero epochs": (GOOD, dict(epochs=0), ValueError, r"epochs is 0, but must be an int >= 1"),
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


def test_a_closed_session_refuses_work():
    s = _session()
    s.close()
    with pytest.raises(RuntimeError, match="the session is closed"):
        s.add(GOOD, epochs=1)


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


def test_messages_name_values_not_types_only():
    """Spot-check the convention every error above follows: '<name> is <value>, but must ...'."""
    with pytest.raises(ValueError) as info:
        PartitionedDataset.from_arrays(X, y, num_partitions=-3)
    assert re.search(r"num_partitions is -3, but must be", str(info.value))


def test_data_persisted_on_another_cluster_is_refused_before_training():
    """from_dask with a collection persisted on cluster A, and a session on cluster B."""
    import dask.array as da
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as a, Client(a) as client_a, \
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
