"""The benchmark harness and the examples, at a tiny size: they run, and what they
compare is really the same workload (the figures themselves are `make bench`'s job)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def strategies():
    import bench_strategies

    return bench_strategies


@pytest.fixture(scope="module")
def mnist(strategies):
    return strategies.load_mnist1d(1000)


def test_the_grid_is_the_papers_16_configurations(strategies):
    configs = strategies.grid()
    assert len(configs) == 16
    assert len({tuple(sorted(c.items())) for c in configs}) == 16
    for key, values in {"arch": {"mlp", "cnn"}, "batch_size": {64, 256}}.items():
        assert {c[key] for c in configs} == values
    assert len({c["lr"] for c in configs}) == len({c["weight_decay"] for c in configs}) == 2


def test_task_parallelism_and_sequential_train_the_same_models(strategies, mnist):
    # The two strategies differ only in how many workers take the whole-config tasks,
    # so every configuration's curve must be the same bits.
    configs = strategies.grid()[::5]
    task = strategies.run_whole_configs("task", 2, mnist, configs, 2)
    sequential = strategies.run_whole_configs("sequential", 1, mnist, configs, 2)
    assert task["curves"] == sequential["curves"]
    assert len(task["data_mb_per_worker"]) == 2 and len(sequential["data_mb_per_worker"]) == 1
    full = sum(a.nbytes for a in mnist) / 2**20
    assert task["data_mb_per_worker"] == pytest.approx([full, full])
    assert sequential["compute_s"] > 0 and task["moved_mb"] > full  # a copy shipped to each worker


def test_mop_holds_half_the_data_per_worker_and_reports_every_epoch(strategies, mnist):
    configs = strategies.grid()[::5]
    mop = strategies.run_mop(mnist, configs, 2)
    full = sum(a.nbytes for a in mnist) / 2**20
    assert sum(mop["data_mb_per_worker"]) == pytest.approx(full, rel=0.01)
    assert max(mop["data_mb_per_worker"]) <= 0.51 * full
    assert sorted(mop["curves"]) == [str(i) for i in range(len(configs))]
    assert all(len(c) == 2 and all(0 <= a <= 1 for a in c) for c in mop["curves"].values())
    assert 0 < mop["engine_utilization"] <= 1
    assert mop["workers_cpu_s"] > 0.5 * mop["compute_s"]  # the units ran in the worker processes


@pytest.mark.parametrize("mode", ["ddp", "average"])
def test_data_parallel_strategies_run_on_two_gloo_processes(strategies, mnist, mode):
    configs = strategies.grid()[:2]
    result = strategies.run_distributed(mode, mode, mnist, configs, 2)
    assert sorted(result["curves"]) == ["0", "1"]
    assert all(len(c) == 2 for c in result["curves"].values())
    full = sum(a.nbytes for a in mnist) / 2**20
    assert result["data_mb_per_worker"] == pytest.approx([full / 2, full / 2], rel=0.01)
    assert result["moved_mb"] > 0  # gradients or weights crossed between the processes


def test_synthetic_partitions_are_the_full_datasets_rows(strategies):
    full = strategies.synthetic_full(1000)
    parts = [strategies.synthetic_partition(i, 2, 1000) for i in range(2)]
    for k in range(4):
        np.testing.assert_array_equal(full[k], np.concatenate([p[k] for p in parts]))
    assert 0.3 < parts[0][1].mean() < 0.7  # the teacher's labels are not all one class


def test_grid_search_example_runs_and_plots(tmp_path):
    png = tmp_path / "curves.png"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grid_search_mnist1d.py"), "--epochs", "1",
         "--samples", "800", "--workers", "2", "--partitions", "2", "--plot", str(png)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "best: model" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_transfer_features_example_runs_an_optuna_search_over_layers(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "transfer_features.py"), "--trials", "4", "--epochs", "1",
         "--rows", "400"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 trials in" in done.stdout and "best val_accuracy" in done.stdout


def test_bench_transfer_runs_and_writes_its_table(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_transfer.py"), "--rows", "400", "--epochs", "1",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "transfer.md").read_text()
    assert "| FrozenFeatures |" in table and "val_loss equal bit for bit in every model-epoch: yes" in table


def test_bench_transfer_runs_a_resnet50_shaped_backbone(tmp_path):
    """The GPU figure's run, at a tiny size on the CPU: its path works before a GPU is lent."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_transfer.py"), "--backbone", "resnet50", "--rows", "60",
         "--epochs", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "transfer_resnet50.md").read_text()
    assert "ResNet-50-shaped backbone" in table and "val_loss equal bit for bit in every model-epoch: yes" in table


def test_bench_fusion_runs_and_writes_its_table(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_fusion.py"), "--arch", "mlp", "--samples", "2000",
         "--epochs", "1", "--fuse", "1", "8", "--repeat", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "fusion_mlp.md").read_text()
    assert "| 8 |" in table and "fuse=8 against fuse=1, samples/s" in table and "the median of 2 round(s)" in table
    runs = json.loads((tmp_path / "fusion_mlp.json").read_text())["runs"]
    assert [len(r["makespans_s"]) for r in runs] == [2, 2, 2] and runs[-1]["one_by_one"]
    assert "the same final metrics, bit for bit: yes" in table


def test_bench_gpu_fusion_part_runs_on_the_cpu(tmp_path):
    """The GPU figures' run (fused against co-located workers and task parallelism), at a
    tiny size on the CPU: its path works before a GPU is lent."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--parts", "fusion", "--quick", "--workers",
         "1", "--rows", "400", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "gpu_fusion.md").read_text()
    assert "MOP fused (fuse=8), 2 worker(s)" in table and "task parallelism, 2 processes" in table


def test_profile_fused_unit_runs_on_the_cpu(tmp_path):
    """The GPU profile of a fused unit, at a tiny size on the CPU: it runs before a GPU is lent."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "profile_fused_unit.py"), "--rows", "256", "--width", "16",
         "--units", "1", "--apart", "--profile"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fused (unfused: None)" in done.stdout and "fused / one by one" in done.stdout
    assert "the fused group's last unit: transfer_in " in done.stdout
    assert "Self CPU" in done.stdout


def test_compare_fused_unit_times_the_batched_layers_vmap_and_one_by_one(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare_fused_unit.py"), "--arch", "mlp", "-k", "3",
         "--rows", "256", "--repeat", "1", "--eval"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fused through vmap" in done.stdout and "one by one / fused" in done.stdout
    assert "evaluation of 256 rows" in done.stdout and "batched / own" in done.stdout


def test_compare_allocator_times_both_settings_in_fresh_processes(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare_allocator.py"), "--arch", "mlp", "--rounds", "1",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "allocator.md").read_text()
    assert "| evaluate fused, s for 10,000 rows (page faults) |" in table and "WORKER_MALLOC" in table
    record = json.loads((tmp_path / "allocator.json").read_text())
    assert record["environ"] == {
        "glibc default": {"MALLOC_MMAP_THRESHOLD_": None, "MALLOC_TRIM_THRESHOLD_": None},
        "WORKER_MALLOC": {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "134217728"},
    }


def test_bench_finetune_runs_and_the_frozen_base_keeps_the_whole_models_bits(tmp_path):
    pytest.importorskip("peft")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_finetune.py"), "--rows", "64", "--epochs", "1",
         "--rounds", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "finetune.json").read_text())
    assert results["same_val_loss"]
    runs = results["runs"]
    assert runs["the frozen base (default)"]["hop_bytes"] * 50 < runs["the whole model hops (frozen_base=False)"]["hop_bytes"]


def test_bench_partitioning_runs_and_the_sorted_given_order_trains_worse(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_partitioning.py"), "--epochs", "3", "--samples", "3000",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "partitioning.json").read_text())["rows"]
    given, default, shards = (rows[i]["mean_val_accuracy"] for i in (0, 1, 3))
    assert default > given + 0.1
    assert shards == default  # tar shards written class by class: the same seeded sample of the rows


def test_bench_cpu_kernels_runs_each_workload_pinned_and_native(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_cpu_kernels.py"), "--rounds", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "cpu_kernels.json").read_text())["rows"]
    assert [r["workload"] for r in rows] == ["mlp", "cnn", "attention"]
    assert all(r["pinned_kernels"] == "cpu:avx2" and r["ratio"] > 0 for r in rows)
    assert "| mlp |" in (tmp_path / "cpu_kernels.md").read_text()


def test_bench_fusion_models_sets_the_fused_unit_its_steps_alone_and_the_ceiling_side_by_side(tmp_path):
    """Each model's rows at a tiny size: the fused unit, its steps without the unit (timed
    in rounds of their own against the k models' steps) and the rest of the unit."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_fusion_models.py"), "--quick", "--models", "resnet10t",
         "bert-lora", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "fusion_models.json").read_text())["rows"]
    assert [r["model"] for r in rows] == ["resnet10t", "bert-lora"]
    assert all(r["step_fused_s"] > 0 and r["step_apart_s"] > 0 and r["step_speedup"] > 0 for r in rows)
    table = (tmp_path / "fusion_models.md").read_text()
    assert table.count("fuse=k, its steps alone (no unit") == 2 and table.count("; the rest of the unit ") == 2


def test_bench_fusion_models_takes_one_batch_size_for_all_and_one_per_model():
    from bench_fusion_models import batch_size

    assert batch_size("vit", []) == 32 and batch_size("bert", []) == 16  # each model's own
    assert batch_size("vit", ["256", "bert=16"]) == 256 and batch_size("bert", ["256", "bert=16"]) == 16
    assert batch_size("resnet18", ["vit=8"]) == 32
    with pytest.raises(ValueError, match="-b names vitt, but the models are"):
        batch_size("vit", ["vitt=8"])


def test_bench_fusion_models_keeps_the_others_when_one_model_fails_and_exits_non_zero(tmp_path):
    """timm's models need timm, which this CPU torch cannot have: that model fails, named
    under the table, the other's rows are kept, and the run exits 1."""
    try:
        import timm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("timm imports here, so its model would not fail")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_fusion_models.py"), "--quick", "--models", "timm-vit",
         "resnet10t", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    record = json.loads((tmp_path / "fusion_models.json").read_text())
    assert [r["model"] for r in record["rows"]] == ["resnet10t"]
    assert record["failed"] and record["failed"][0].startswith("timm-vit k=2: ")
    assert "Not measured (the error each raised): timm-vit k=2: " in (tmp_path / "fusion_models.md").read_text()


def test_bench_fusion_ceiling_times_each_model_at_k_b_and_fused(tmp_path):
    """The ceiling (one model at batch k·b against k at batch b) and the fused unit, for
    every model at a tiny size: ResNet- and ViT-shaped models, HF BERT and a LoRA BERT build and train."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_fusion_ceiling.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "fusion_ceiling.json").read_text())["rows"]
    assert [r["model"] for r in rows] == ["cnn", "resnet18", "resnet10t", "vit", "bert", "bert-lora"]
    assert all(r["k"] == 2 and r["ceiling"] > 0 and r["fused_speedup"] > 0 for r in rows)
    assert {r["path"] for r in rows} == {"batched calls"}  # every model fuses without vmap
    table = (tmp_path / "fusion_ceiling.md").read_text()
    assert "<!-- --8<-- [start:table] -->" in table and "| ResNet-10t-shaped (BatchNorm) | 2 | 2 | 1 |" in table
    assert "--quick" in table and str(tmp_path) not in table
