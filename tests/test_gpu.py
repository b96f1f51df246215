"""GPUs and mixed precision: workers per GPU, shards on the device, one wait per unit,
precision, determinism. The tests marked ``gpu`` need CUDA and skip without it; the
rest run on the CPU (CI has no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import Client
from torch import nn

from cerebro_automl import PartitionedDataset, Session, TrainingSpec
from cerebro_automl.executors.dask import start_local_cluster, visible_gpus
from cerebro_automl.data import TensorShard
from cerebro_automl.session.cluster import check_devices
from cerebro_automl.training import batches, shard_on_device, to_host, train_unit

from conftest import cli_cluster, cli_env, make_arrays
from models import CONFIGS, make_spec

def gpu(test):
    """Marked ``gpu`` (``pytest -m gpu`` runs these alone) and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine")(test))


def _data(partitions: int = 2) -> PartitionedDataset:
    X, y, Xv, yv = make_arrays(rows=1200, valid_rows=300)
    return PartitionedDataset.from_arrays(X, y, num_partitions=partitions, valid=(Xv, yv))


def _weights(session: Session, ids: list[int]) -> list[dict]:
    return [session.model(i).state()["model"] for i in ids]


def _same(a: list[dict], b: list[dict]) -> bool:
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def _run(spec: TrainingSpec, workers: int, epochs: int = 2, **session) -> tuple[list[dict], object]:
    with Session(spec, _data(), executor="local", n_workers=workers, seed=5, **session) as s:
        ids = [s.add(c, epochs=epochs) for c in CONFIGS[:2]]
        history = s.run()
        return _weights(s, ids), (history, [s.model(i).state() for i in ids])


# ------------------------------------------------------------ checks at construction
@pytest.mark.parametrize("kwargs, message", [
    (dict(precision="fp8"), "precision is 'fp8', but must be one of ('32', 'bf16-mixed', '16-mixed')"),
    (dict(precision=16), "precision is 16"),
    (dict(device_data_fraction=1.5), "device_data_fraction is 1.5, but must be a number from 0 to 1"),
])
def test_bad_precision_or_fraction_is_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_spec(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(workers_per_gpu=0), "workers_per_gpu is 0, but must be an int >= 1"),
    (dict(deterministic="yes"), "deterministic is 'yes', but must be True or False"),
])
def test_bad_session_gpu_options_are_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Session(make_spec(), _data(), executor="local", **kwargs)


def test_a_cluster_mixing_cpu_and_gpu_workers_is_refused_with_fixed_order_and_auto_device():
    devices = {"tcp://a": "cpu", "tcp://b": "cuda:NVIDIA H100 80GB HBM3"}
    with pytest.raises(ValueError, match=r"mixes CPU and GPU workers \(tcp://a: cpu, tcp://b: cuda:NVIDIA"):
        check_devices(devices, make_spec(), "fixed")
    assert check_devices(devices, make_spec(device="cuda"), "fixed") == devices  # explicit
    assert check_devices(devices, make_spec(), "dynamic") == devices


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_device_cuda_where_no_worker_sees_a_gpu_is_refused_before_any_work(cluster):
    X, y, _, _ = make_arrays()
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid_fraction=0.2)
    for where in ({"executor": "local"}, {"client": cluster}):
        with pytest.raises(ValueError, match=r"device is 'cuda', but this process sees no CUDA GPU .*device='auto'"):
            Session(make_spec(device="cuda"), data, **where)


def test_the_history_records_the_device_and_determinism():
    with Session(make_spec(), _data(), executor="local", deterministic=False) as s:
        s.add(CONFIGS[0], epochs=1)
        history = s.run()
    expected = f"cuda:{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu:avx2"
    assert list(history["device"]) == [expected] and list(history["deterministic"]) == [False]
    assert s.devices == {"local-0": expected}


# -------------------------------------------------------------- workers per GPU
@pytest.mark.cluster
def test_the_local_cluster_gives_each_worker_its_own_gpu():
    # No GPU is needed to check what each worker process is told to see; on a machine
    # with GPUs the ids must exist (a worker's NVML monitor opens its GPU).
    ids = (visible_gpus() * 2)[:2] if torch.cuda.is_available() else ["0", "1"]
    with start_local_cluster(gpus=ids, workers_per_gpu=2) as cluster, Client(cluster) as client:
        seen = client.run(lambda: (os.environ["CUDA_VISIBLE_DEVICES"], os.environ["CUBLAS_WORKSPACE_CONFIG"]))
        assert sorted(v[0] for v in seen.values()) == sorted(ids * 2)
        assert {v[1] for v in seen.values()} == {":4096:8"}
        with pytest.raises(ValueError, match="one worker per GPU slot, 4 in all"):
            cluster.scale(5)


# ------------------------------------------------------------- mixed precision
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_trains_and_gives_the_same_bits_on_1_and_2_workers(precision):
    one, (history, states) = _run(make_spec(precision=precision), 1)
    two, _ = _run(make_spec(precision=precision), 2)
    assert _same(one, two)
    assert history["val_accuracy"].notna().all()
    if precision == "16-mixed":  # the GradScaler's state hops with the optimizer's
        assert all(state["scaler"]["scale"] > 0 for state in states)
    else:
        assert all("scaler" not in state for state in states)
    fp32, _ = _run(make_spec(), 1)
    assert not _same(one, fp32)  # autocast changed the arithmetic


def test_the_grad_scaler_state_resumes_from_the_incoming_state():
    X, y, _, _ = make_arrays(rows=200)
    shard = TensorShard(torch.from_numpy(X), torch.from_numpy(y))
    args = dict(seed=1, partition=0, step=0, epoch_end=True, threads=1)
    first = train_unit(make_spec(precision="16-mixed"), CONFIGS[0], None, shard, epoch=0, **args)
    first["scaler"] = {**first["scaler"], "scale": 1024.0}
    second = train_unit(make_spec(precision="16-mixed"), CONFIGS[0], first, shard, epoch=1, **args)
    assert second["scaler"]["scale"] == 1024.0  # no step overflowed: the scale it was handed


# ------------------------------------------------------------------------- GPU
@gpu
def test_a_shard_that_fits_moves_to_the_gpu_once_and_batches_come_from_there():
    X, y, _, _ = make_arrays(rows=500)
    shard = TensorShard(torch.from_numpy(X), torch.from_numpy(y))
    device = torch.device("cuda", 0)
    copy = shard_on_device(shard, device, 0.5)
    assert copy is not shard and copy.x.is_cuda and shard_on_device(shard, device, 0.5) is copy
    assert shard_on_device(TensorShard(shard.x.clone(), shard.y.clone()), device, 0.0).x.device.type == "cpu"
    x, y, n = next(batches(make_spec(), shard, 64, device, torch.Generator().manual_seed(0), None))
    assert x.is_cuda and n == 64


@gpu
def test_gpu_results_are_the_same_with_shards_on_the_device_or_copied_per_batch():
    on_device, _ = _run(make_spec(), 2)
    per_batch, _ = _run(make_spec(device_data_fraction=0.0), 2)
    assert _same(on_device, per_batch)


@gpu
@pytest.mark.cluster
def test_gpu_bits_are_the_same_on_1_and_2_workers_sharing_the_gpu():
    results = []
    for per_gpu in (1, 2):
        with start_local_cluster(gpus=["0"], workers_per_gpu=per_gpu) as cluster, Client(cluster) as client:
            with Session(make_spec(), _data(), client=client, seed=5) as s:
                ids = [s.add(c, epochs=2) for c in CONFIGS[:2]]
                history = s.run()
                results.append(_weights(s, ids))
                assert history["device"].str.startswith("cuda:").all()
    assert _same(*results)


@gpu
def test_a_state_comes_back_to_the_host_in_pinned_memory():
    state = {"w": torch.ones(3, device="cuda"), "nested": [torch.zeros(2, device="cuda")], "step": 4}
    host = to_host(state)
    assert host["w"].device.type == "cpu" and host["w"].is_pinned() and host["step"] == 4
    assert torch.equal(host["nested"][0], torch.zeros(2))


class _AdaptivePool(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(8, 64)
        self.pool = nn.AdaptiveAvgPool2d((3, 3))  # its CUDA backward has no deterministic kernel
        self.out = nn.Linear(9, 3)

    def forward(self, x):
        return self.out(self.pool(self.up(x).view(-1, 1, 8, 8)).flatten(1))


@gpu
def test_an_operation_without_a_deterministic_kernel_fails_its_model_naming_the_way_out():
    spec = make_spec(model_fn=lambda c: _AdaptivePool(c["width"]))
    with Session(spec, _data(), executor="local", seed=5) as s:
        mid = s.add(CONFIGS[0], epochs=1)
        s.run()
        assert s.status(mid) == "failed"
        error = s.model(mid).error
    assert "NondeterministicOperationError: adaptive_avg_pool2d_backward_cuda" in error
    assert "deterministic=False" in error
    with Session(spec, _data(), executor="local", seed=5, deterministic=False) as s:
        mid = s.add(CONFIGS[0], epochs=1)
        history = s.run()
        assert s.status(mid) == "paused" and not history["deterministic"].any()


@gpu
def test_a_non_finite_loss_on_the_gpu_fails_its_model_naming_epoch_and_partition():
    def loss_fn(out, y):
        return nn.functional.cross_entropy(out, y) * float("nan")

    with Session(make_spec(loss_fn=loss_fn), _data(), executor="local", seed=5) as s:
        mid = s.add(CONFIGS[0], epochs=1)
        s.run()
        assert "loss is nan at epoch 1, partition" in s.model(mid).error


@gpu
def test_a_gpu_id_the_machine_lacks_is_refused_before_any_worker_starts():
    missing = str(torch.cuda.device_count() + 7)
    with pytest.raises(ValueError, match=rf"gpus lists \['{missing}'\], but the GPUs this process sees are"):
        start_local_cluster(gpus=[missing])


@gpu
@pytest.mark.cluster
def test_a_cpu_worker_that_joins_a_gpu_session_takes_no_units(tmp_path):
    cpu_env = dict(cli_env(), CUDA_VISIBLE_DEVICES="")  # a worker of this machine without its GPU
    with cli_cluster(tmp_path, [cli_env()]) as address, Client(address) as client:
        client.wait_for_workers(1, timeout=60)
        with Session(make_spec(), _data(), client=client, seed=5) as s:
            ids = [s.add(c, epochs=3) for c in CONFIGS[:2]]
            joined = subprocess.Popen([Path(sys.executable).parent / "dask", "worker", address, "--nthreads", "1",
                                       "--no-dashboard", "--host", "127.0.0.1"], env=cpu_env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                client.wait_for_workers(2, timeout=60)
                history = s.run()
                assert s._admission.refused and all(w not in s.devices for w in s._admission.refused)
                assert history["device"].str.startswith("cuda:").all()
                assert [s.status(i) for i in ids] == ["paused", "paused"]
            finally:
                joined.kill()
                joined.wait(timeout=30)


# ------------------------------------------------- one GPU per worker process
def _claims(client, uuids, folder):
    from cerebro_automl.training.gpus import claim_gpu

    return client.run(claim_gpu, uuids, str(folder))


def test_worker_processes_that_see_every_gpu_take_different_ones(tmp_path):
    """Worker processes of one node that all see the same GPUs (``dask worker
    --nworkers``, dask-jobqueue's ``processes=``) each take another GPU; more workers
    than GPUs spread evenly, and a GPU whose holder is gone is free again."""
    from cerebro_automl.training.gpus import shared_gpus

    uuids = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]
    with start_local_cluster(2) as local, Client(local) as client:
        first = _claims(client, uuids, tmp_path)
        assert sorted(c.index for c in first.values()) == [0, 1]
        assert {c.holders_before for c in first.values()} == {0}
        second = _claims(client, uuids, tmp_path)  # a second claim in each process (a second GPU)
        assert sorted(c.index for c in second.values()) == [0, 2]  # the free one, then the first of the least held
        taken = [c.uuid for c in [*first.values(), *second.values()]]
        assert sorted(taken.count(u) for u in uuids) == [1, 1, 2]  # 4 claims on 3 GPUs: even
        assert shared_gpus(dict(enumerate(taken)), 1) != {} and shared_gpus(dict(enumerate(taken)), 2) == {}
        one = _claims(client, ["GPU-only"], tmp_path)  # one visible GPU (CUDA_VISIBLE_DEVICES)
        assert sorted(c.holders_before for c in one.values()) == [0, 1]
        client.restart()  # the processes end: their locks go with them
        again = _claims(client, uuids, tmp_path)
        assert sorted(c.index for c in again.values()) == [0, 1]


def test_a_claim_keeps_the_current_device_the_user_set(tmp_path):
    from cerebro_automl.training.gpus import GpuClaim, claim_gpu

    assert claim_gpu(["GPU-a", "GPU-b"], str(tmp_path), prefer=1) == GpuClaim(1, "GPU-b", 0)
    assert claim_gpu(["GPU-a", "GPU-b"], str(tmp_path), prefer=1) == GpuClaim(1, "GPU-b", 1)
    assert claim_gpu(["GPU-a", "GPU-b"], str(tmp_path)) == GpuClaim(0, "GPU-a", 0)
    with pytest.raises(ValueError, match="uuids is empty"):
        claim_gpu([], str(tmp_path))


def test_workers_sharing_a_gpu_are_reported_unless_workers_per_gpu_says_so(caplog, spec):
    """The session asks each worker for its GPU, at start and as workers join."""
    from cerebro_automl.executors.local import LocalExecutor
    from cerebro_automl.session.cluster import Admission
    from cerebro_automl.protocol import WorkerAdded

    class TwoOnOneGpu(LocalExecutor):  # what two Dask workers on one GPU answer
        def gpus(self, workers=None):
            return {w: "GPU-1234" for w in (workers or self.workers())}

    executor = TwoOnOneGpu(2)
    devices = {w: "cuda:NVIDIA H100" for w in executor.workers()}
    with caplog.at_level("WARNING", logger="cerebro_automl"):
        Admission(executor, spec, "fixed", dict(devices), workers_per_gpu=2)
    assert "share GPU" not in caplog.text
    with caplog.at_level("WARNING", logger="cerebro_automl"):
        admission = Admission(executor, spec, "fixed", dict(devices), workers_per_gpu=1)
    assert caplog.text.count("share GPU GPU-1234") == 1 and "workers_per_gpu=2 if this is meant" in caplog.text
    caplog.clear()
    executor.devices = lambda workers=None: {w: "cuda:NVIDIA H100" for w in workers}
    with caplog.at_level("WARNING", logger="cerebro_automl"):
        assert admission.admits(WorkerAdded("w2"))
    assert "share GPU" not in caplog.text  # reported once per GPU
    caplog.clear()
    cpu = {w: "cpu" for w in executor.workers()}
    with caplog.at_level("WARNING", logger="cerebro_automl"):
        Admission(executor, spec, "fixed", cpu, workers_per_gpu=1)
    assert "share GPU" not in caplog.text


def test_a_worker_without_a_gpu_that_joins_a_cuda_session_takes_no_units(caplog, spec):
    """At start such a worker refuses the session (above); one that joins later is left
    idle, and the session trains on."""
    from cerebro_automl.executors.local import LocalExecutor
    from cerebro_automl.protocol import WorkerAdded, WorkerLost
    from cerebro_automl.session.cluster import Admission
    from cerebro_automl.training.devices import NoGpu

    class LateCpuWorker(LocalExecutor):  # what the DaskExecutor raises for a worker that sees no GPU
        def devices(self, workers=None):
            raise NoGpu("worker w9: device is 'cuda', but this process sees no CUDA GPU")

        def gpus(self, workers=None):
            return {w: f"GPU-{w}" for w in (workers or self.workers())}

    executor = LateCpuWorker(2)
    admission = Admission(executor, spec, "fixed", {w: "cuda:NVIDIA H100" for w in executor.workers()})
    with caplog.at_level("WARNING", logger="cerebro_automl"):
        assert not admission.admits(WorkerAdded("w9"))
    assert admission.refused == {"w9"} and "worker w9 joined, but it takes no units: worker w9: device" in caplog.text
    assert not admission.admits(WorkerLost("w9"))  # nor is its leaving an event


def test_a_lock_file_this_process_cannot_open_counts_as_held(tmp_path):
    """Another user's lock file in a shared /tmp cannot be opened (a sticky folder
    refuses O_CREAT on it): that slot is taken, and the claim goes on to the next."""
    from cerebro_automl.training.gpus import GpuClaim, claim_gpu

    (tmp_path / "cerebro-gpu-GPU-a.0.lock").symlink_to(tmp_path / "nowhere" / "x")
    assert claim_gpu(["GPU-a", "GPU-b"], str(tmp_path)) == GpuClaim(1, "GPU-b", 0)
    assert claim_gpu(["GPU-a", "GPU-b"], str(tmp_path)) == GpuClaim(0, "GPU-a", 1)
