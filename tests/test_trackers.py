"""TensorBoard event files and MLflow runs, written by real searches and read
back with each tool's own reader (TensorBoard's EventAccumulator, MlflowClient)."""

from __future__ import annotations

import math

import pytest

from cerebro_automl import Session
from cerebro_automl.adapters.hyperband import successive_halving
from cerebro_automl.callbacks import MLflow, TensorBoard, flatten_config

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams.api_pb2 import Status  # noqa: E402
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData  # noqa: E402

LOCAL = dict(executor="local", n_workers=2)
BAD = {"lr": "not-a-number", "width": 8}
CONFIGS = [{"lr": 0.05, "width": 8}, {"lr": 0.01, "width": 16}, {"lr": 0.002, "width": 8}, BAD]
METRICS = ["train_loss", "val_loss", "val_accuracy"]

# MLflow's sqlite store uses an SQLAlchemy loader option that SQLAlchemy 2.1 deprecates
MLFLOW_WARNINGS = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


def _halving(spec, data, callbacks):
    """Rungs at 1, 2 and 4 epochs: two models are extended after a pause (their
    runs reopen), two are stopped, and one config fails."""
    return successive_halving(spec, data, CONFIGS, min_epochs=1, max_epochs=4, eta=2,
                              metric="val_loss", seed=1, session_callbacks=callbacks, **LOCAL)


def _read(run_dir):
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    hparams = {tag: HParamsPluginData.FromString(content)
               for tag, content in acc.PluginTagToContent("hparams").items()}
    return acc, hparams


def test_tensorboard_run_per_model_with_scalars_and_hparams(spec, data, tmp_path):
    result = _halving(spec, data, [TensorBoard(tmp_path / "tb")])
    history = result.history
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == [f"model-{i}" for i in range(4)]
    for model_id, config in enumerate(CONFIGS):
        acc, hparams = _read(tmp_path / "tb" / f"model-{model_id}")
        start = hparams["_hparams_/session_start_info"].session_start_info
        assert start.group_name == f"model-{model_id}"
        values = {k: (v.string_value or v.number_value) for k, v in start.hparams.items()}
        assert values == config  # the config as hparams: the HParams tab's columns
        end = hparams["_hparams_/session_end_info"].session_end_info
        rows = history[(history.model_id == model_id)]
        if config is BAD:
            assert end.status == Status.Value("STATUS_FAILURE")
            assert acc.Tags()["scalars"] == []
            continue
        assert end.status == Status.Value("STATUS_SUCCESS")
        rows = rows.sort_values("epoch")
        assert set(METRICS) <= set(acc.Tags()["scalars"])
        for metric in METRICS:  # every epoch's value, at step = epoch (TensorBoard keeps float32)
            # by step: a run extended after a pause goes on in a new event file, and files
            # made within one second do not sort by their creation
            events = sorted(acc.Scalars(metric), key=lambda e: e.step)
            assert [e.step for e in events] == rows["epoch"].tolist()
            assert [e.value for e in events] == pytest.approx(rows[metric].tolist(), rel=1e-6)
    # extended after pausing at rungs 1 and 2: the steps go on in new files of the same run
    best = tmp_path / "tb" / f"model-{result.best_model_id}"
    assert len(list(best.iterdir())) == 3
    assert sorted(e.step for e in _read(best)[0].Scalars("val_loss")) == [1, 2, 3, 4]


def test_tensorboard_writes_lightning_self_log_names(tmp_path):
    pytest.importorskip("lightning")
    from cerebro_automl.adapters.lightning import LightningSpec
    from cerebro_automl.adapters.search import grid_search

    from conftest import make_arrays
    from lightning_modules import classifier
    from cerebro_automl import PartitionedDataset

    X, y, Xv, yv = make_arrays()
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    result = grid_search(LightningSpec(classifier, batch_size=32), data, {"lr": [0.05]}, epochs=2,
                         metric="val_acc", mode="max", session_callbacks=[TensorBoard(tmp_path)], **LOCAL)
    acc, _ = _read(tmp_path / "model-0")
    assert {"train_loss", "val_loss", "val_acc"} <= set(acc.Tags()["scalars"])
    assert [e.value for e in acc.Scalars("val_acc")] == pytest.approx(result.history["val_acc"].tolist(),
                                                                      rel=1e-6)


def test_tensorboard_hparams_take_nested_and_non_scalar_configs(spec, data, tmp_path):
    config = {"lr": 0.01, "width": 8, "opt": {"name": "adam", "betas": [0.9, 0.99]}, "tag": None,
              "flag": True}
    with Session(spec, data, callbacks=[TensorBoard(tmp_path)], **LOCAL) as s:
        s.add(config, epochs=1)
        s.run()
    _, hparams = _read(tmp_path / "model-0")
    got = hparams["_hparams_/session_start_info"].session_start_info.hparams
    assert got["opt.name"].string_value == "adam" and got["opt.betas"].string_value == "[0.9, 0.99]"
    assert got["tag"].string_value == "null" and got["flag"].bool_value is True
    assert flatten_config(config)["opt.betas"] == "[0.9, 0.99]"


def test_tensorboard_refuses_a_log_dir_that_is_no_path():
    with pytest.raises(TypeError, match="log_dir is 3, but must be a path"):
        TensorBoard(3)


@MLFLOW_WARNINGS
def test_mlflow_parent_run_and_a_child_run_per_model(spec, data, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    callback = MLflow(uri, experiment="halving", run_name="search-1")
    result = _halving(spec, data, [callback])
    history = result.history

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("halving")
    runs = client.search_runs([experiment.experiment_id])
    [parent] = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.info.run_name: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert parent.info.run_name == "search-1" and parent.info.status == "FINISHED"
    assert parent.info.run_id == callback.parent_run_id
    assert parent.data.params == {"seed": "1", "num_partitions": "3", "order": "fixed",
                                  "threads": "1", "workers": "2"}
    assert sorted(children) == [f"model-{i}" for i in range(4)]
    final = history.groupby("model_id")["epoch"].max()
    for model_id, config in enumerate(CONFIGS):
        run = children[f"model-{model_id}"]
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.params == {k: str(v) for k, v in config.items()}
        if config is BAD:
            assert run.info.status == "FAILED"
            assert run.data.tags["cerebro.error"].startswith("TypeError: '<=' not supported")
            assert "Traceback" in run.data.tags["cerebro.error"]
            continue
        # trained to max_epochs: FINISHED; stopped at a rung: KILLED
        expected = "FINISHED" if final[model_id] == 4 else "KILLED"
        assert run.info.status == expected, (model_id, final[model_id])
        rows = history[history.model_id == model_id].sort_values("epoch")
        for metric in METRICS:  # float64 in MLflow: the same numbers, at step = epoch
            logged = sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)
            assert [m.step for m in logged] == rows["epoch"].tolist()
            assert [m.value for m in logged] == rows[metric].tolist()
    statuses = sorted(r.info.status for r in children.values())
    assert statuses == ["FAILED", "FINISHED", "KILLED", "KILLED"]


@MLFLOW_WARNINGS
def test_mlflow_marks_the_parent_failed_and_a_training_model_killed_when_the_code_raises(spec, data, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(RuntimeError, match="tuner bug"):
        with Session(spec, data, callbacks=[MLflow(uri)], **LOCAL) as s:
            s.add({"lr": 0.01, "width": 8}, epochs=3)
            next(iter(s.reports()))  # one epoch done, the model trains on
            raise RuntimeError("tuner bug")
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("cerebro_automl").experiment_id])
    status = {("child" if "mlflow.parentRunId" in r.data.tags else "parent"): r.info.status for r in runs}
    assert status == {"parent": "FAILED", "child": "KILLED"}
    [child] = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert [m.step for m in client.get_metric_history(child.info.run_id, "val_loss")] == [1]


@MLFLOW_WARNINGS
def test_mlflow_that_cannot_log_never_stops_training(spec, data, tmp_path, caplog):
    """A tracking store that refuses (here: a path that cannot be a database) is
    reported with its traceback, logging stops, and the session trains on."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with Session(spec, data, callbacks=[MLflow(f"sqlite:///{blocker}/sub/mlflow.db")], **LOCAL) as s:
        s.add({"lr": 0.01, "width": 8}, epochs=2)
        history = s.run()
    assert "MLflow logging failed and stops for this session; training goes on" in caplog.text
    assert "Traceback" in caplog.text
    assert len(history) == 2 and all(math.isfinite(v) for v in history["val_loss"])


@pytest.mark.timeout(60)
def test_mlflow_whose_tracking_server_cannot_be_reached_says_so_at_once(spec, data, caplog):
    """MLflow's own client retried for about 4 minutes, which the session's end waited
    for, before the error showed."""
    import socket

    pytest.importorskip("mlflow")

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with Session(spec, data, callbacks=[MLflow(uri)], **LOCAL) as s:
        s.add({"lr": 0.01, "width": 8}, epochs=1)
        history = s.run()
    assert f"the MLflow tracking server at {uri} cannot be reached" in caplog.text
    assert len(history) == 1


def test_mlflow_arguments_are_checked():
    pytest.importorskip("mlflow")
    with pytest.raises(ValueError, match="experiment is '', but must be a non-empty str"):
        MLflow(experiment="")
    with pytest.raises(TypeError, match="tracking_uri is 5, but must be a str or None"):
        MLflow(5)
