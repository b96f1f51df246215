"""The same bits on any x86-64 CPU: the kernels' instruction set is pinned to AVX2 in
every process that imports the package first, recorded in the history, and a
cluster whose workers' kernels differ is refused."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import Client

from cerebro_automl import Session
from cerebro_automl.cpu_kernels import PINNED
from cerebro_automl.session.cluster import check_devices

from conftest import cli_cluster, cli_env
from models import make_spec

HERE = Path(__file__).parent
NATIVE = {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "ALL", "MKL_CBWR": "AUTO"}
x86 = pytest.mark.skipif(platform.machine() != "x86_64", reason="the kernels are pinned on x86-64")


def _probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in {*PINNED, "MKL_ENABLE_INSTRUCTIONS"}}
    done = subprocess.run([sys.executable, str(HERE / "isa_probe.py")], env={**clean, **env}, capture_output=True,
                          text=True, timeout=300, cwd=HERE)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def _has_avx512() -> bool:
    return "avx512f" in Path("/proc/cpuinfo").read_text()


@x86
def test_a_search_gives_the_bits_of_an_avx2_machine_on_any_x86_machine():
    """With nothing set, a process takes the AVX2 kernels, whatever the CPU: the digest
    equals that of a process capped at AVX2 in every library, as an AVX2-only CPU is."""
    pinned = _probe()
    capped = _probe(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", MKL_CBWR="AVX2",
                    MKL_ENABLE_INSTRUCTIONS="AVX2")
    assert pinned == capped and pinned.endswith("device=cpu:avx2"), (pinned, capped)
    if _has_avx512():  # the machine's own kernels give other bits: the pinning is what keeps them
        native = _probe(**NATIVE)
        assert native.split()[0] != pinned.split()[0] and "device=cpu:avx512" in native, native


def test_workers_whose_cpu_kernels_differ_are_refused_with_fixed_order():
    devices = {"tcp://a": "cpu:avx2", "tcp://b": "cpu:avx512 (oneDNN: ALL, MKL: AUTO)"}
    with pytest.raises(ValueError, match=r"CPU kernels differ \(tcp://a: cpu:avx2, tcp://b: cpu:avx512 .*"
                                         r"same ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and MKL_CBWR"):
        check_devices(devices, make_spec(), "fixed")
    assert check_devices(devices, make_spec(), "dynamic") == devices
    assert check_devices({"tcp://a": "cpu:avx2", "tcp://b": "cpu:avx2"}, make_spec(), "fixed")


@x86
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_cluster_the_session_did_not_start_is_pinned_or_refused(tmp_path):
    """`dask worker` processes started by hand: pinned when they import the package;
    one started with the machine's own kernels is refused, named, before any work."""
    from conftest import make_arrays
    from cerebro_automl import PartitionedDataset

    X, y, Xv, yv = make_arrays()
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    plain = {k: v for k, v in cli_env().items() if k not in PINNED}
    with cli_cluster(tmp_path, [plain, plain]) as address, Client(address) as client:
        client.wait_for_workers(2, timeout=60)
        with Session(make_spec(), data, client=client) as s:
            assert set(s.devices.values()) == {"cpu:avx2"}
    if not _has_avx512():
        return
    (tmp_path / "mixed").mkdir()
    with cli_cluster(tmp_path / "mixed", [plain, {**plain, **NATIVE}]) as address, Client(address) as client:
        client.wait_for_workers(2, timeout=60)
        with pytest.raises(ValueError, match=r"CPU kernels differ \(") as refused:
            Session(make_spec(), data, client=client)
        # the workers are listed by address, whose ports are drawn at random
        assert ": cpu:avx2" in str(refused.value) and ": cpu:avx512 (oneDNN: ALL" in str(refused.value)


@x86
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_model_code_sent_by_value_still_has_its_workers_kernels_checked(tmp_path, monkeypatch):
    """The CLI guide's advice for model code in the user's own module,
    cloudpickle.register_pickle_by_value: the workers still say what they train on, so
    a worker with other kernels is refused and the history names the device."""
    import importlib

    import cloudpickle
    from conftest import make_arrays
    from cerebro_automl import PartitionedDataset

    (tmp_path / "users_models.py").write_text("import torch\n\ndef model_fn(config):\n"
                                              "    return torch.nn.Linear(8, 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    users = importlib.import_module("users_models")
    cloudpickle.register_pickle_by_value(users)
    try:
        X, y, Xv, yv = make_arrays(rows=60, valid_rows=20)
        data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
        spec = make_spec(model_fn=users.model_fn)
        plain = {k: v for k, v in cli_env().items() if k not in PINNED}
        with cli_cluster(tmp_path, [plain, plain]) as address, Client(address) as client:
            client.wait_for_workers(2, timeout=60)
            with Session(spec, data, client=client) as s:
                s.add({"lr": 0.1, "width": 8}, epochs=1)
                assert set(s.run()["device"]) == {"cpu:avx2"}
        (tmp_path / "mixed").mkdir()
        other = {**plain, "ATEN_CPU_CAPABILITY": "default"}
        with cli_cluster(tmp_path / "mixed", [plain, other]) as address, Client(address) as client:
            client.wait_for_workers(2, timeout=60)
            with pytest.raises(ValueError, match=r"CPU kernels differ \(.*cpu:default"):
                Session(spec, data, client=client)
    finally:
        cloudpickle.unregister_pickle_by_value(users)
        sys.modules.pop("users_models", None)
