"""MOP on a GPU: co-location, the cost of a unit, mixed precision, and CPU scaling.

Runs on whatever torch it finds (the H100 machines carry their own CUDA build),
and needs only dask and distributed besides (carried as wheels there). Four parts:

1. Co-location on one GPU: 16 configurations of a small CNN on synthetic
   32x32 RGB images (``--rows`` of them: 1.2 GB of float32 by default), one
   epoch each, with MOP on 1, 2, 4 and 8 worker processes sharing the GPU
   (``workers_per_gpu``; as many partitions as workers, each worker's shards
   in device memory), against one model at a time in a tight loop. Samples per
   second summed over models, GPU utilization and memory (NVML, sampled every
   50 ms) for each.
2. The time of a unit, split: one worker, one model, one partition, so that a
   unit is a whole pass; transfer in, compute and transfer out as the unit
   measures them on the GPU's clock (``progress["phase_seconds"]``), and
   scheduling (the rest of the driver's wall time per unit), against the same
   pass in a tight loop.
3. Precision: ``bf16-mixed`` against ``32``, throughput and final accuracy, on
   4 workers sharing the GPU.
4. ``--cpu-scaling``: MOP against task parallelism on ``p`` = 8 and 16 CPU
   workers on bench_strategies.py's workload (run with the GPU hidden).
5. ``--parts fusion``: the same 16 configurations as fusion groups (``fuse=8``:
   the 8 of each width) on 1 and 2 workers sharing the GPU, against one model at
   a time, against 1, 2, 4 and 8 co-located unfused workers, and against task
   parallelism as users run it today: 8 processes on the GPU, each with its own
   copy of the data, one whole configuration per task. Written to
   ``gpu_fusion.{json,md}``. With ``--model``, timm's own ``resnet10t``,
   ``resnet18`` or a small ViT instead of the CNN (the 16 configurations then
   differ in learning rate and momentum only, so any 8 share a group), written to
   ``gpu_fusion_<model>.{json,md}``; ``--workers``, ``--fused-workers`` and
   ``--task-processes`` choose the runs.

Usage::

    python benchmarks/bench_gpu.py                 # parts 1-3, on the GPU
    CUDA_VISIBLE_DEVICES= python benchmarks/bench_gpu.py --cpu-scaling
    python benchmarks/bench_gpu.py --quick         # a small run, CPU or GPU
    python benchmarks/bench_gpu.py --parts fusion  # part 5, on the GPU
    python benchmarks/bench_gpu.py --parts fusion --model timm-resnet10t --rows 40000 --epochs 2

Results go to ``benchmarks/results/gpu.{json,md}`` (``cpu_scaling.{json,md}``
for part 4), with the device named.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

import distributed  # noqa: F401  (before the log levels are set)
import torch
from distributed import Client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fusion_ceiling import TIMM_MODELS  # noqa: E402  (--model: timm comes with the GPU's torch)

from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy  # noqa: E402
from cerebro_automl.executors.dask import start_local_cluster, visible_gpus  # noqa: E402
from cerebro_automl.training import PhaseClock, deterministic_algorithms  # noqa: E402

CLASSES = 10
CONFIGS = [{"lr": lr, "width": width, "momentum": momentum}
           for lr in (0.01, 0.03) for width in (16, 32) for momentum in (0.0, 0.5, 0.8, 0.9)]


# ----------------------------------------------------------------- workload
def make_images(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic 3x32x32 images whose class a fixed random teacher reads off their
    4x4-pooled pixels: learnable, but not in one epoch."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, 32, 32, generator=gen)
    teacher = torch.randn(3 * 8 * 8, CLASSES, generator=torch.Generator().manual_seed(12345))
    pooled = torch.nn.functional.avg_pool2d(x, 4).flatten(1)
    return x, (pooled @ teacher).argmax(1)


def load_partition(index: int, *, rows: int, parts: int) -> tuple:
    """One partition, made on the worker that loads it (nothing crosses the network)."""
    x, y = make_images(rows // parts, seed=index)
    xv, yv = make_images(max(rows // parts // 10, 1), seed=1000 + index)
    return x, y, xv, yv


def model_fn(config: dict) -> torch.nn.Module:
    if config.get("model", "cnn") in TIMM_MODELS:
        import timm

        _, name, options = TIMM_MODELS[config["model"]]
        return timm.create_model(name, num_classes=CLASSES, **options)
    w = config["width"]
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, w, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(w, 2 * w, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(2 * w * 8 * 8, 128), torch.nn.ReLU(), torch.nn.Linear(128, CLASSES))


def optimizer_fn(config: dict, params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=config["lr"], momentum=config["momentum"])


def spec(precision: str = "32", batch_size: int = 256) -> TrainingSpec:
    return TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn, metrics={"accuracy": accuracy},
                        batch_size=batch_size, eval_batch_size=2048, precision=precision)


# ---------------------------------------------------------------- measuring
class GPUSampler:
    """GPU utilization and memory in use, from NVML every 50 ms (None without NVML)."""

    def __init__(self) -> None:
        self.util: list[int] = []
        self.memory: list[int] = []
        self._stop = threading.Event()
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            self._nvml = None

    def __enter__(self) -> "GPUSampler":
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.util.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            self.memory.append(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._nvml is not None:
            self._thread.join()

    def summary(self) -> dict[str, Any]:
        if not self.util:
            return {"gpu_util_mean": None, "gpu_memory_peak_gib": None}
        return {"gpu_util_mean": sum(self.util) / len(self.util),
                "gpu_memory_peak_gib": max(self.memory) / 2**30}


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no GPU)"


def dataset(rows: int, parts: int) -> PartitionedDataset:
    return PartitionedDataset.from_loader(functools.partial(load_partition, rows=rows, parts=parts), parts,
                                          has_validation=True)


def run_mop(rows: int, workers: int, configs: list[dict], epochs: int, precision: str = "32", fuse: int = 1) -> dict:
    """MOP with ``workers`` processes sharing the GPU: the data is placed and every
    worker warmed up by a first session, then the measured one runs."""
    data = dataset(rows, workers)
    gpus = visible_gpus()[:1]
    with start_local_cluster(workers, gpus=gpus or None, memory_limit=0) as cluster, Client(cluster) as client:
        with Session(spec(precision), data, client=client, seed=0, fuse=fuse) as warm:
            for c in configs[:fuse]:  # a fused warm-up runs vmap once too
                warm.add(c, epochs=1)
            warm.run()
        with GPUSampler() as sampler, Session(spec(precision), data, client=client, seed=0, fuse=fuse) as s:
            started = time.perf_counter()
            for c in configs:
                s.add(c, epochs=epochs)
            history = s.run()
            makespan = time.perf_counter() - started
            device = ", ".join(sorted(set(s.devices.values())))
            unfused = sorted(s._fusion._reasons_logged)  # why groups trained one by one, if they did
    trained = len(configs) * epochs * (rows // workers) * workers
    last = history[history.epoch == epochs]
    return {"workers": workers, "precision": precision, "fuse": fuse, "unfused": unfused, "makespan_s": makespan,
            "samples_per_s": trained / makespan, "device": device,
            "best_accuracy": float(last["val_accuracy"].max()),
            "mean_accuracy": float(last["val_accuracy"].mean()), **sampler.summary()}


def tight_loop_pass(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                    y: torch.Tensor, batch_size: int, generator: torch.Generator) -> None:
    """One pass in the plainest loop there is: the data on the device, no reads back."""
    order = torch.randperm(len(x), generator=generator).to(x.device)
    for idx in order.split(batch_size):
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()


def run_one_at_a_time(rows: int, configs: list[dict], epochs: int) -> dict:
    """Each configuration alone, in a tight loop, the whole dataset on the device."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, y = (t.to(device) for t in make_images(rows, seed=0))
    with GPUSampler() as sampler:
        started = time.perf_counter()
        for i, c in enumerate(configs):
            torch.manual_seed(i)
            model = model_fn(c).to(device)
            optimizer = optimizer_fn(c, model.parameters())
            for e in range(epochs):
                tight_loop_pass(model, optimizer, x, y, 256, torch.Generator().manual_seed(e))
        if device.type == "cuda":
            torch.cuda.synchronize()
        makespan = time.perf_counter() - started
    del x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the workers that follow share this GPU
    return {"workers": "one model at a time", "precision": "32", "makespan_s": makespan,
            "samples_per_s": len(configs) * epochs * rows / makespan, **sampler.summary()}


def _whole_config(config: dict, rows: int, epochs: int, index: int) -> float:
    """One configuration, every epoch, in a worker process that made its own copy of
    the whole dataset on its device (task parallelism); returns the final accuracy."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, y = (t.to(device) for t in make_images(rows, seed=0))
    xv, yv = (t.to(device) for t in make_images(max(rows // 10, 1), seed=1000))
    torch.manual_seed(index)
    model = model_fn(config).to(device)
    optimizer = optimizer_fn(config, model.parameters())
    for e in range(epochs):
        tight_loop_pass(model, optimizer, x, y, 256, torch.Generator().manual_seed(e))
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(xv[i:i + 2048]).argmax(1) == yv[i:i + 2048]).sum()) for i in range(0, len(xv), 2048))
    return correct / len(xv)


def run_task_parallel(rows: int, processes: int, configs: list[dict], epochs: int) -> dict:
    """Task parallelism on one GPU: ``processes`` workers, each a full copy of the data."""
    gpus = visible_gpus()[:1]
    with start_local_cluster(processes, gpus=gpus or None, memory_limit=0) as cluster, Client(cluster) as client:
        client.gather(client.map(lambda i: torch.ones(1).sum().item(), range(processes), pure=False))  # warm
        with GPUSampler() as sampler:
            started = time.perf_counter()
            futures = [client.submit(_whole_config, c, rows, epochs, i, pure=False) for i, c in enumerate(configs)]
            accuracies = client.gather(futures)
            makespan = time.perf_counter() - started
    return {"workers": f"task parallelism, {processes} processes (a data copy each)", "precision": "32",
            "makespan_s": makespan, "samples_per_s": len(configs) * epochs * rows / makespan,
            "best_accuracy": max(accuracies), **sampler.summary()}


def fusion_report(result: dict) -> str:
    rows = result["fusion"]
    colocated = [r for r in rows if isinstance(r["workers"], int) and r.get("fuse", 1) == 1]
    fused_rows = [r for r in rows if r.get("fuse", 1) > 1]
    base = rows[0]["samples_per_s"]
    name = result.get("model", "cnn")
    model = "a small CNN" if name == "cnn" else TIMM_MODELS[name][0]
    grouped = "one width each" if name == "cnn" else "any 8"
    goal = "1.5x" if name == "cnn" else "1.3x, as for the models people tune"
    lines = [f"# Fused models on a GPU: {result['device']}", "",
             f"`{result.get('command', 'python benchmarks/bench_gpu.py --parts fusion')}`, "
             f"{result['date']}. {len(result['configs'])} configurations of {model} (fusion groups of 8: {grouped}), "
             f"{result['rows']:,} synthetic 3x32x32 images, {result['epochs']} epoch(s), batch 256.", "",
             "| run | samples/s (all models) | vs one at a time | wall time | GPU utilization | GPU memory peak |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = (r["workers"] if isinstance(r["workers"], str) else
                f"MOP fused (fuse={r['fuse']}), {r['workers']} worker(s)" if r.get("fuse", 1) > 1 else
                f"MOP, {r['workers']} worker(s)")
        util = "n/a" if r["gpu_util_mean"] is None else f"{r['gpu_util_mean']:.0f}%"
        mem = "n/a" if r["gpu_memory_peak_gib"] is None else f"{r['gpu_memory_peak_gib']:.1f} GiB"
        lines.append(f"| {name} | {r['samples_per_s']:,.0f} | {r['samples_per_s'] / base:.2f}x | "
                     f"{r['makespan_s']:.1f} s | {util} | {mem} |")
    if fused_rows and colocated:
        best_colocated = max(colocated, key=lambda r: r["samples_per_s"])
        fused = max(fused_rows, key=lambda r: r["samples_per_s"])
        lines += ["", f"Best fused against the best co-located unfused run ({best_colocated['workers']} workers): "
                  f"**{fused['samples_per_s'] / best_colocated['samples_per_s']:.2f}x** (goal: at least {goal})."]
    else:
        lines += ["", f"No {'co-located' if fused_rows else 'fused'} run finished, so none is set against the other."]
    for r in rows:
        if r.get("unfused"):
            lines.append(f"The fused run on {r['workers']} worker(s) trained its groups one by one: {'; '.join(r['unfused'])}.")
    return "\n".join(lines)


def unit_split(rows: int, epochs: int, deterministic: bool = True) -> dict:
    """One worker, one model, one partition: each unit is a whole pass. The tight loop
    runs with the same ``deterministic`` setting as the units."""
    data = dataset(rows, 1)
    config = CONFIGS[-1]
    gpus = visible_gpus()[:1]
    with start_local_cluster(1, gpus=gpus or None, memory_limit=0) as cluster, Client(cluster) as client:
        with Session(spec(), data, client=client, seed=0) as warm:
            warm.add(config, epochs=1)
            warm.run()
        with Session(spec(), data, client=client, seed=0, deterministic=deterministic) as s:
            mid = s.add(config, epochs=epochs)
            history = s.run()
            phases = s.model(mid).state()["progress"]["phase_seconds"]  # the last epoch's one unit
        pure = client.submit(_tight_loop_seconds, rows, config, deterministic, pure=False).result()
    # Each epoch is one unit and one evaluation; the time between two epochs' reports
    # is what a unit costs in the steady state (the session's data placement and
    # first unit come before the first report).
    # The split is the last epoch's: its unit's phases are those the final state holds.
    history = history.sort_values("epoch")
    last = history.iloc[-1]
    wall = float(history["session_seconds"].diff().iloc[-1])
    train, evaluation = float(last["train_seconds"]), float(last["val_seconds"])
    return {"unit_wall_s": wall, "unit_train_s": train, "evaluation_s": evaluation,
            "scheduling_s": wall - train - evaluation, "pure_pass_s": pure, **phases,
            "overhead_vs_pure": (wall - evaluation) / pure - 1,
            "train_seconds_by_epoch": [float(v) for v in history["train_seconds"]],
            "wall_seconds_by_epoch": [float(v) for v in history["session_seconds"].diff().iloc[1:]]}


def _tight_loop_seconds(rows: int, config: dict, deterministic: bool) -> float:
    """On the worker: the same pass over its partition in the tight loop (warm, then timed)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, y = (t.to(device) for t in make_images(rows, seed=0))
    model = model_fn(config).to(device)
    optimizer = optimizer_fn(config, model.parameters())
    with deterministic_algorithms(device, deterministic):
        tight_loop_pass(model, optimizer, x, y, 256, torch.Generator().manual_seed(0))
        clock = PhaseClock(device)
        clock.mark()
        tight_loop_pass(model, optimizer, x, y, 256, torch.Generator().manual_seed(1))
        clock.mark()
        if device.type == "cuda":
            torch.cuda.synchronize()
    return clock.seconds(("pass",))["pass"]


# ------------------------------------------------------------------ reports
def report(result: dict) -> str:
    lines = [f"# MOP on a GPU: {result['device']}", "",
             f"`python benchmarks/bench_gpu.py{' --quick' if result['quick'] else ''}`, "
             f"{result['date']}. {len(result['configs'])} configurations of a small CNN, "
             f"{result['rows']:,} synthetic 3x32x32 images ({result['data_gib']:.2f} GiB of float32), "
             f"{result['epochs']} epoch(s) each, batch 256."
             + ("".join(f" Part {k} is from an earlier run ({d}, `--previous`)."
                        for k, d in result.get("earlier_runs", {}).items() if k != "unit_nondeterministic")), "",
             "## 1. Co-location: worker processes sharing one GPU", "",
             "<!-- --8<-- [start:colocation] -->",
             "| run | samples/s (all models) | vs one at a time | GPU utilization | GPU memory peak |",
             "|---|---:|---:|---:|---:|"]
    base = result["colocation"][0]["samples_per_s"]
    for r in result["colocation"]:
        name = r["workers"] if isinstance(r["workers"], str) else f"MOP, {r['workers']} worker(s)"
        util = "n/a" if r["gpu_util_mean"] is None else f"{r['gpu_util_mean']:.0f}%"
        mem = "n/a" if r["gpu_memory_peak_gib"] is None else f"{r['gpu_memory_peak_gib']:.1f} GiB"
        lines.append(f"| {name} | {r['samples_per_s']:,.0f} | {r['samples_per_s'] / base:.2f}x | {util} | {mem} |")
    lines.append("<!-- --8<-- [end:colocation] -->")
    runs = [(label, result[key]) for label, key in (("deterministic kernels (default)", "unit"),
                                                    ("deterministic=False", "unit_nondeterministic"))
            if key in result]
    lines += ["", "## 2. One unit, split (one worker, one partition: a unit is a whole pass)", "",
              "<!-- --8<-- [start:unit] -->",
              "Seconds, and the share of the same pass in a tight loop (data on the device, "
              "no reads back) with the same kernel setting.", "",
              "| part | " + " | ".join(label for label, _ in runs) + " |",
              "|---|" + "---:|" * len(runs)]
    for name, key in (("the same pass in a tight loop", "pure_pass_s"), ("transfer in", "transfer_in"),
                      ("compute", "compute"), ("transfer out", "transfer_out"),
                      ("unit wall time on the worker", "unit_train_s"),
                      ("scheduling (driver wall per unit - unit - evaluation)", "scheduling_s"),
                      ("**overhead against the tight loop**", None)):
        cells = [f"{u['overhead_vs_pure']:+.1%}" if key is None else
                 f"{u[key]:.4f} ({u[key] / u['pure_pass_s']:.1%})" for _, u in runs]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Goal: overhead under 5% for a unit of 1 s or more. The split is each run's last of "
              "5 epochs; the units of the epochs took " + "; ".join(
                  ", ".join(f"{v:.3f}" for v in u.get("train_seconds_by_epoch", [])) + f" s ({label})"
                  for label, u in runs) + ".", "<!-- --8<-- [end:unit] -->", "",
              f"## 3. Precision (4 workers sharing the GPU, {result['precision_epochs']} epochs)", "",
              "<!-- --8<-- [start:precision] -->",
              "| precision | samples/s | best accuracy | mean accuracy |", "|---|---:|---:|---:|"]
    for r in result["precision"]:
        lines.append(f"| {r['precision']} | {r['samples_per_s']:,.0f} | {r['best_accuracy']:.3f} | "
                     f"{r['mean_accuracy']:.3f} |")
    lines.append("<!-- --8<-- [end:precision] -->")
    return "\n".join(lines)


def cpu_scaling(out: Path, quick: bool) -> None:
    import bench_strategies as strategies

    samples, epochs = (20_000, 1) if quick else (100_000, 4)
    arrays = strategies.load_mnist1d(samples)
    configs = strategies.grid()
    rows = []
    for p in (8, 16):
        strategies.WORKERS = p
        mop = strategies.run_mop(arrays, configs, epochs)
        tp = strategies.run_whole_configs("task parallelism", p, arrays, configs, epochs)
        rows.append({"p": p, "mop_s": mop["makespan_s"], "task_parallel_s": tp["makespan_s"],
                     "ratio": mop["makespan_s"] / tp["makespan_s"],
                     "mop_best": mop["best_accuracy"], "tp_best": tp["best_accuracy"]})
        print(rows[-1], flush=True)
    text = ["# MOP against task parallelism on CPU workers", "",
            "<!-- --8<-- [start:table] -->",
            f"`CUDA_VISIBLE_DEVICES= python benchmarks/bench_gpu.py --cpu-scaling`, {_now()}, "
            f"{torch.get_num_threads()}-core machine. bench_strategies.py's workload: 16 configurations, "
            f"MNIST-1D {samples:,} samples, {epochs} epochs, single-threaded workers.", "",
            "| p | MOP makespan | task parallelism | MOP / TP | best accuracy MOP / TP |",
            "|---:|---:|---:|---:|---|"]
    for r in rows:
        text.append(f"| {r['p']} | {r['mop_s']:.1f} s | {r['task_parallel_s']:.1f} s | {r['ratio']:.2f} | "
                    f"{r['mop_best']:.3f} / {r['tp_best']:.3f} |")
    text.append("<!-- --8<-- [end:table] -->")
    (out / "cpu_scaling.md").write_text("\n".join(text) + "\n")
    (out / "cpu_scaling.json").write_text(json.dumps({"samples": samples, "epochs": epochs, "rows": rows},
                                                     indent=2))
    print("\n".join(text))


def _shown(argv: list[str]) -> list[str]:
    """The command's arguments without ``--out`` and its folder (a machine's own path)."""
    return [a for i, a in enumerate(argv) if not a.startswith("--out") and (i == 0 or argv[i - 1] != "--out")]


def _now() -> str:
    return time.strftime("%Y-%m-%d", time.gmtime())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run (minutes on a CPU)")
    parser.add_argument("--rows", type=int, help="training images (default 100,000: 1.2 GB; --quick 4,000)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--precision-epochs", type=int, default=2)
    parser.add_argument("--workers", default="1,2,4,8", help="worker counts sharing the GPU")
    parser.add_argument("--cpu-scaling", action="store_true", help="part 4 only")
    parser.add_argument("--parts", default="colocation,unit,precision",
                        help="which of parts 1-3 and 5 (fusion) to run")
    parser.add_argument("--previous", help="an earlier gpu.json to take the parts not run from")
    parser.add_argument("--model", default="cnn", choices=["cnn", *TIMM_MODELS], help="part 5's model")
    parser.add_argument("--fused-workers", default="1,2", help="part 5: worker counts of the fused runs")
    parser.add_argument("--task-processes", type=int, help="part 5: task parallelism's processes (0: none)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu_scaling:
        cpu_scaling(out, args.quick)
        return
    rows = args.rows or (4_000 if args.quick else 100_000)
    configs = CONFIGS[:4] if args.quick else CONFIGS
    if args.model != "cnn":
        configs = [{**c, "model": args.model} for c in configs]
    counts = [int(n) for n in args.workers.split(",")]
    result: dict[str, Any] = {"device": device_name(), "torch": torch.__version__, "date": _now(),
                              "quick": args.quick, "rows": rows, "epochs": args.epochs, "configs": configs,
                              "precision_epochs": args.precision_epochs,
                              "data_gib": rows * 3 * 32 * 32 * 4 / 2**30, "model": args.model,
                              "command": shlex.join(["python", "benchmarks/bench_gpu.py", *_shown(sys.argv[1:])])}
    print(f"device: {result['device']}; {rows:,} images", flush=True)

    def save() -> None:  # after every step, so that a run cut short keeps what it measured
        (out / "gpu.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=None)[-600:], flush=True)

    parts = args.parts.split(",")
    if parts == ["fusion"]:
        runs = [lambda: run_one_at_a_time(rows, configs, args.epochs)]
        runs += [functools.partial(run_mop, rows, n, configs, args.epochs) for n in counts]
        fused_counts = [int(n) for n in args.fused_workers.split(",") if n]
        runs += [functools.partial(run_mop, rows, n, configs, args.epochs, fuse=8) for n in fused_counts]
        processes = args.task_processes if args.task_processes is not None else 2 if args.quick else 8
        if processes:
            runs.append(lambda: run_task_parallel(rows, processes, configs, args.epochs))
        stem = "gpu_fusion" if args.model == "cnn" else f"gpu_fusion_{args.model}"
        result["fusion"] = []
        for measure in runs:  # saved after each, so that a run cut short keeps what it measured
            result["fusion"].append(measure())
            (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
            print(json.dumps(result["fusion"][-1]), flush=True)
        text = fusion_report(result)
        (out / f"{stem}.md").write_text(text + "\n")
        (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
        print(text)
        return
    if args.previous:  # the parts not run now come from an earlier run's results
        earlier = json.loads(Path(args.previous).read_text())
        carried = [k for k in ("colocation", "unit", "unit_nondeterministic", "precision")
                   if k in earlier and k.split("_")[0] not in parts]
        result.update({k: earlier[k] for k in carried})
        result["earlier_runs"] = {k: earlier.get("earlier_runs", {}).get(k, earlier["date"]) for k in carried}
    if "colocation" in parts:
        result["colocation"] = [run_one_at_a_time(rows, configs, args.epochs)]
        save()
        for n in counts:
            result["colocation"].append(run_mop(rows, n, configs, args.epochs))
            save()
    if "unit" in parts:
        result["unit"] = unit_split(rows, 5)
        save()
        result["unit_nondeterministic"] = unit_split(rows, 5, deterministic=False)
        save()
    if "precision" in parts:
        result["precision"] = []
        for precision in ("32", "bf16-mixed"):
            result["precision"].append(run_mop(rows, 4, configs, args.precision_epochs, precision))
            save()
    text = report(result)
    (out / "gpu.md").write_text(text + "\n")
    (out / "gpu.json").write_text(json.dumps(result, indent=2))
    print(text)


if __name__ == "__main__":
    main()
