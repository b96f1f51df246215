"""The Dask executor on real clusters: reproducibility, state hops, a CLI cluster."""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch
from distributed import Client

from cerebro_automl import EpochReport, ModelFailed, PartitionedDataset, Session
from cerebro_automl.adapters.search import grid_search
from cerebro_automl.executors.dask import start_local_cluster

from conftest import cli_cluster, cli_env, make_arrays
from models import CONFIGS, make_spec

pytestmark = pytest.mark.cluster

EPOCHS = 2
METRICS = ["train_loss", "val_loss", "val_accuracy"]


def _run(spec, data, configs, *, stop_plan=None, **session_kwargs):
    """Train ``configs``; return ({model_id: weights}, {model_id: metric rows}).

    ``stop_plan`` maps model ids to the epoch after which the model is stopped.
    """
    stop_plan = stop_plan or {}
    with Session(spec, data, seed=5, **session_kwargs) as s:
        ids = [s.add(c, epochs=EPOCHS) for c in configs]
        for r in s.reports():
            if isinstance(r, EpochReport) and stop_plan.get(r.model_id) == r.epoch:
                s.stop(r.model_id)
        h = s.history
        weights = {i: s.model(i).state()["model"] for i in ids if s.status(i) == "paused"}
    rows = {i: h[h.model_id == i][METRICS].to_numpy().tolist() for i in ids}
    return weights, rows


def _assert_identical(a, b):
    weights_a, rows_a = a
    weights_b, rows_b = b
    assert weights_a.keys() == weights_b.keys()
    for i in weights_a:
        for k in weights_a[i]:
            assert torch.equal(weights_a[i][k], weights_b[i][k]), (i, k)
    assert rows_a == rows_b  # every metric, bit for bit


@pytest.fixture(scope="module")
def reference(spec_and_data):
    spec, data = spec_and_data
    return _run(spec, data, CONFIGS, executor="local")


@pytest.fixture(scope="module")
def spec_and_data():
    X, y, Xv, yv = make_arrays()
    return make_spec(), PartitionedDataset.from_arrays(X, y, num_partitions=3, valid=(Xv, yv))


def test_the_workers_warm_up_when_the_executor_starts_not_in_their_first_unit(cluster):
    # A fresh worker's first unit would pay torch's lazy imports (torch._dynamo: seconds).
    # The executor registers a worker plugin that imports them on every worker now, and
    # on each worker that joins later, before it runs a task.
    from cerebro_automl.executors.dask import DaskExecutor
    from cerebro_automl.executors.dask.tasks import WarmUp

    executor = DaskExecutor(cluster)
    try:
        plugins = cluster.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.worker_plugins))
        assert WarmUp.name in plugins
        assert all(cluster.run(lambda: "torch._dynamo" in __import__("sys").modules).values())
    finally:
        executor.close()


def test_two_runs_are_bitwise_identical(cluster, spec_and_data):
    spec, data = spec_and_data
    _assert_identical(_run(spec, data, CONFIGS, client=cluster),
                      _run(spec, data, CONFIGS, client=cluster))


def test_dask_executor_equals_the_local_executor(cluster, spec_and_data, reference):
    spec, data = spec_and_data
    _assert_identical(reference, _run(spec, data, CONFIGS, client=cluster))


@pytest.mark.parametrize("workers", [1, 3])
def test_results_do_not_depend_on_the_number_of_workers(workers, spec_and_data, reference):
    spec, data = spec_and_data
    with start_local_cluster(workers) as local, Client(local) as client:
        _assert_identical(reference, _run(spec, data, CONFIGS, client=client))


def test_a_model_alone_equals_the_same_model_beside_pruned_others(cluster, spec_and_data):
    spec, data = spec_and_data
    configs = [{"lr": 1e-2, "width": 8}] + [{"lr": 10 ** -random.Random(i).uniform(1, 3), "width": 4 + i}
                                           for i in range(7)]
    rng = random.Random(0)
    stop_plan = {i: rng.randint(1, EPOCHS - 1) for i in range(1, 8) if rng.random() < 0.8}
    crowd = _run(spec, data, configs, stop_plan=stop_plan, client=cluster)
    alone = _run(spec, data, configs[:1], executor="local")
    assert torch.equal(crowd[0][0]["0.weight"], alone[0][0]["0.weight"])
    assert crowd[1][0] == alone[1][0]


def test_states_hop_worker_to_worker_and_never_through_the_driver(cluster, spec_and_data):
    spec, data = spec_and_data

    def outgoing(dask_worker):
        return [dict(who=e["who"], keys=list(e["keys"]), total=e["total"])
                for e in dask_worker.transfer_outgoing_log]

    before = {w: len(log) for w, log in cluster.run(outgoing).items()}
    workers = set(cluster.scheduler_info(n_workers=-1)["workers"])
    with Session(spec, data, client=cluster) as s:
        for c in CONFIGS:
            s.add(c, epochs=EPOCHS)
        s.run()
        logs = {w: log[before.get(w, 0):] for w, log in cluster.run(outgoing).items()}
        hops = [e for log in logs.values() for e in log if any("cerebro-train" in k for k in e["keys"])]
        assert hops, "no state moved between workers: the test would prove nothing"
        assert all(e["who"] in workers for e in hops), [e["who"] for e in hops]
        # Control: asking for a model does bring its state to the driver, and it shows.
        s.model(0).state()
        logs = {w: log[before.get(w, 0):] for w, log in cluster.run(outgoing).items()}
        to_driver = [e for log in logs.values() for e in log if e["who"] not in workers]
        assert any(any("cerebro-train" in k for k in e["keys"]) for e in to_driver)


def test_a_failing_model_fails_alone_on_dask(cluster, spec_and_data):
    _, data = spec_and_data
    spec = make_spec(model_fn=_unlucky_model)
    with Session(spec, data, client=cluster) as s:
        bad = s.add({"lr": 1e-2, "width": 13}, epochs=1)
        good = s.add({"lr": 1e-2, "width": 8}, epochs=1)
        failed = [r for r in s.reports() if isinstance(r, ModelFailed)]
        assert [r.model_id for r in failed] == [bad] and "unlucky" in failed[0].error
        assert s.status(good) == "paused"


def _unlucky_model(config):
    if config["width"] == 13:
        raise RuntimeError("width 13 is unlucky")
    return torch.nn.Linear(8, 3)


def test_embedded_local_cluster_is_started_and_closed(spec_and_data):
    spec, data = spec_and_data
    with Session(spec, data, n_workers=2) as s:
        assert len(s.executor.workers()) == 2
        s.add(CONFIGS[0], epochs=1)
        s.run()
        cluster = s.executor._cluster
    assert cluster.status.name == "closed"


MALLOC_TRIM_ADVICE = """\
distributed:
  nanny:
    pre-spawn-environ:
      MALLOC_TRIM_THRESHOLD_: null
"""


@pytest.mark.timeout(240)
def test_search_on_a_cli_started_scheduler_and_workers(tmp_path, spec_and_data, reference, caplog):
    """`dask scheduler` and two `dask worker` processes on loopback, used by address.
    One worker follows the README's advice on MALLOC_TRIM_THRESHOLD_, one does not:
    the session warns about the one."""
    spec, data = spec_and_data
    env = cli_env()
    config_dir = tmp_path / "dask-config"  # the README's advice, as a Dask config file
    config_dir.mkdir()
    (config_dir / "cerebro.yaml").write_text(MALLOC_TRIM_ADVICE)
    advised = dict(env, DASK_CONFIG=str(config_dir))
    with cli_cluster(tmp_path, [env, advised], ("--nworkers", "1")) as address:
        with Client(address) as client:
            client.wait_for_workers(2, timeout=60)
            trims = client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_"))
            assert sorted(trims.values(), key=str) == ["65536", None]
        caplog.set_level(logging.WARNING, logger="cerebro_automl")
        result = grid_search(spec, data, {"lr": [1e-3, 1e-2], "width": [8, 16]}, epochs=EPOCHS,
                             metric="val_accuracy", mode="max", seed=5, client=address)
        assert len(result.history) == 4 * EPOCHS
        # the same configs in the same order as the reference: the same bits
        rows = {i: result.history[result.history.model_id == i][METRICS].to_numpy().tolist()
                for i in range(4)}
        assert rows == reference[1]
        assert "1 of 2 workers run with Dask's MALLOC_TRIM_THRESHOLD_=65536" in caplog.text


def test_local_cluster_workers_run_with_our_allocator_settings_not_dasks(monkeypatch):
    """A default LocalCluster leaves MALLOC_TRIM_THRESHOLD_=65536 in os.environ;
    workers of start_local_cluster must not inherit it, but get WORKER_MALLOC's values."""
    from distributed import LocalCluster

    from cerebro_automl.executors.dask.cluster import WORKER_MALLOC

    names = sorted(WORKER_MALLOC)
    for name in names:  # an earlier cluster of ours left them, as a nanny leaves what it sets
        monkeypatch.delenv(name, raising=False)

    def allocator():
        return tuple(os.environ.get(name) for name in names)

    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as default, \
            Client(default) as client:
        assert set(client.run(allocator).values()) == {(None, "65536")}
    with start_local_cluster(1) as ours, Client(ours) as client:
        assert set(client.run(allocator).values()) == {tuple(WORKER_MALLOC[name] for name in names)}


def test_a_users_own_allocator_setting_wins_over_ours(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1048576")
    with start_local_cluster(1) as ours, Client(ours) as client:
        assert set(client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_")).values()) == {"1048576"}


def test_a_stopped_models_running_unit_stops_after_its_batch(cluster, tmp_path):
    """Dask cannot interrupt a task: the driver tells the worker, and the unit stops
    at its next batch instead of running its 94 batches to the end. (Two replicas let
    the other model train and evaluate beside it on the other worker.)"""
    from models import counted_model_fn

    import numpy as np

    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((3000, 8)).astype("float32"), rng.integers(0, 3, 3000)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=1)  # 94 batches of 32
    log = tmp_path / "batches"
    with Session(make_spec(model_fn=counted_model_fn), data, client=cluster, seed=3, replicas=2) as s:
        slow = s.add({"lr": 1e-2, "width": 8, "seconds": 0.05, "log": str(log)}, epochs=1)
        s.add({"lr": 1e-2, "width": 8}, epochs=2)
        for r in s.reports():
            if isinstance(r, EpochReport) and r.model_id != slow and s.status(slow) == "training":
                s.stop(slow)
        assert s.status(slow) == "stopped"
    batches = log.read_text().count("batch")
    assert 1 <= batches < 60, batches


@pytest.mark.timeout(240)
def test_a_script_that_starts_a_session_unguarded_is_told_to_guard_it(tmp_path):
    """The guide's LocalCluster code pasted into a script without the main guard: each
    spawned worker runs the script again and fails; the error says what to do."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "search.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from conftest import make_arrays\n"
        "from models import make_spec\n"
        "from cerebro_automl import PartitionedDataset, Session\n"
        "X, y, Xv, yv = make_arrays(rows=40, valid_rows=10)\n"
        "data = PartitionedDataset.from_arrays(X, y, num_partitions=1, valid=(Xv, yv))\n"
        "with Session(make_spec(), data, n_workers=1) as s:\n"
        "    s.add({'lr': 0.1, 'width': 8}, epochs=1)\n"
        "    s.run()\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200)
    assert done.returncode != 0
    assert "put the code that starts the Session under `if __name__ == \"__main__\":`" in done.stderr, \
        done.stderr[-3000:]


@pytest.mark.timeout(240)
def test_a_spec_from_a_module_the_workers_lack_fails_naming_the_remedies(tmp_path, monkeypatch):
    """The README's CLI cluster with the model code in the user's own module, which the
    workers cannot import: each model fails saying how to get the code to them."""
    import importlib
    import sys

    module = tmp_path / "only_on_the_driver.py"
    module.write_text("import torch\n\ndef model_fn(config):\n    return torch.nn.Linear(8, 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    user = importlib.import_module("only_on_the_driver")
    try:
        data = PartitionedDataset.from_arrays(*make_arrays(rows=40, valid_rows=10)[:2], num_partitions=1,
                                              valid_fraction=0.25)
        with cli_cluster(tmp_path, [cli_env()]) as address, \
                Session(make_spec(model_fn=user.model_fn), data, client=address, min_workers=1) as s:
            s.add({"lr": 0.1, "width": 8}, epochs=1)
            s.run()
            error = s.model(0).error
    finally:
        sys.modules.pop("only_on_the_driver", None)
    assert error.startswith("ModuleNotFoundError: No module named 'only_on_the_driver' on the worker"), error
    assert "the task refers to your module" in error
    assert "cloudpickle.register_pickle_by_value(only_on_the_driver)" in error
