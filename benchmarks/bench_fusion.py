"""Fused models: 16 configurations of one architecture trained as fusion groups of
1, 4, 8 and 16, on 2 workers.

    python benchmarks/bench_fusion.py [--arch cnn|mlp] [--samples 100000] [--epochs 3] [--repeat 3]
                                      [--out benchmarks/results]

The 16-configuration MNIST-1D grid of ``bench_strategies`` restricted to one
architecture (default: its 1-D CNN, width 32, batch size 64): 4 learning rates x
4 weight decays, AdamW. Each ``fuse`` value runs the same search on a fresh
LocalCluster of 2 single-threaded workers started before the clock. The ``fuse``
values run in turn, ``--repeat`` rounds of them, so that each is timed beside the
others: the makespan is the median over the rounds, and "vs fuse=1" the median
of each round's ratio, with the rounds' lowest and highest (the machine's noise).

Reported per run: makespan; training samples per second summed over the models
(16 x epochs x training rows / makespan); peak worker memory (max RSS over the
workers); the best final val_accuracy; and how far each configuration's final
val_accuracy and val_loss are from the unfused run's. A fused member sees its
group's data order (and partition order), not its own, so that difference is
data order and rounding. Rounding alone: the fuse=8 groups run once more one by
one (a spec with training hooks of its own cannot fuse), in the same data order,
and their final metrics are compared with the fused run's.

The makespan includes each worker's first units; the imports that a first fused
step needs (torch._dynamo, about 1 s) are paid by the warm-up plugin before any
unit starts, as for unfused training.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import resource
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import distributed
import torch
from distributed import Client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from mnist1d_models import load_mnist1d, model_fn, optimizer_fn  # noqa: E402

from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy  # noqa: E402
from cerebro_automl.executors.dask import start_local_cluster  # noqa: E402
from cerebro_automl.training.plain import PlainTrainHooks  # noqa: E402

WORKERS = 2
FUSE = (1, 4, 8, 16)
COMMON = dict(model_fn=model_fn, optimizer_fn=optimizer_fn, metrics={"accuracy": accuracy},
              batch_size="batch_size", eval_batch_size=4096)
SPEC = TrainingSpec(**COMMON)


class OneByOneHooks(PlainTrainHooks):
    """The plain hooks under a class of their own: a group trains its members one by one."""


class OneByOneSpec(TrainingSpec):
    """The same training, which cannot fuse: the rounding reference for a fused run."""

    def train_hooks(self, config, *, state, progress, epoch, step):
        return OneByOneHooks(self, config)


def grid(arch: str) -> list[dict[str, Any]]:
    """One architecture of bench_strategies' grid: 4 learning rates x 4 weight decays."""
    width = 128 if arch == "mlp" else 32
    return [{"arch": arch, "width": width, "batch_size": 64, "lr": lr, "weight_decay": wd}
            for lr, wd in itertools.product((5e-4, 1e-3, 2e-3, 4e-3), (1e-4, 1e-3, 1e-2, 1e-1))]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(data: PartitionedDataset, configs: list[dict], epochs: int, fuse: int, train_rows: int,
        spec: TrainingSpec = SPEC) -> dict:
    """One search with ``fuse``; its figures and every configuration's final metrics."""
    with start_local_cluster(WORKERS) as cluster, Client(cluster) as client:
        client.run(lambda: torch.set_num_threads(1))
        with Session(spec, data, client=client, fuse=fuse, seed=0) as s:
            started = time.perf_counter()
            ids = [s.add(c, epochs=epochs) for c in configs]
            history = s.run()
            makespan = time.perf_counter() - started
        peak = max(client.run(_peak_rss_mib).values())
    final = history[history.epoch == epochs].set_index("model_id").loc[ids]
    return {
        "fuse": fuse,
        "makespan_s": makespan,
        "samples_per_s": len(configs) * epochs * train_rows / makespan,
        "peak_worker_rss_mib": peak,
        "best_val_accuracy": float(final["val_accuracy"].max()),
        "val_accuracy": [float(v) for v in final["val_accuracy"]],
        "val_loss": [float(v) for v in final["val_loss"]],
        "train_seconds": float(history["train_seconds"].sum()),
    }


def merged(rounds: list[dict]) -> dict:
    """One fuse value's runs over the rounds: the median makespan, every round's makespan,
    and the first round's metrics (a run's results are the same bits every round)."""
    makespans = [r["makespan_s"] for r in rounds]
    middle = statistics.median(makespans)
    same = all(r["val_accuracy"] == rounds[0]["val_accuracy"] and r["val_loss"] == rounds[0]["val_loss"]
               for r in rounds)
    return {**rounds[0], "makespan_s": middle, "makespans_s": makespans, "same_metrics_every_round": same,
            "samples_per_s": rounds[0]["samples_per_s"] * rounds[0]["makespan_s"] / middle,
            "peak_worker_rss_mib": max(r["peak_worker_rss_mib"] for r in rounds)}


def speedups(run_: dict, base: dict) -> list[float]:
    """Each round's fuse=1 makespan over this run's in the same round."""
    return [b / m for b, m in zip(base["makespans_s"], run_["makespans_s"])]


def differences(run_: dict, base: dict) -> dict[str, float]:
    """Largest |difference| of every configuration's final val_accuracy and val_loss
    between two runs, and the mean difference of val_accuracy."""
    acc = [abs(a - b) for a, b in zip(run_["val_accuracy"], base["val_accuracy"], strict=True)]
    loss = [abs(a - b) for a, b in zip(run_["val_loss"], base["val_loss"], strict=True)]
    mean = sum(a - b for a, b in zip(run_["val_accuracy"], base["val_accuracy"], strict=True)) / len(acc)
    return {"acc": max(acc), "loss": max(loss), "mean_acc_delta": mean}


def cpu_model() -> str:
    """The CPU's model name: fusion's gain on the CPU differs from one to another."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def report(runs: list[dict], args: argparse.Namespace, options: str, configs: list[dict], train_rows: int) -> str:
    base = runs[0]
    device = f"{os.cpu_count()} CPU cores ({cpu_model()})"
    lines = [
        f"# Fused models: {len(configs)} configurations of one architecture as fusion groups",
        "",
        f"`python benchmarks/bench_fusion.py --arch {args.arch}{options}` — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{device}, torch {torch.__version__}, dask {distributed.__version__}. MNIST-1D {args.samples} samples "
        f"({train_rows} training rows in {WORKERS} partitions), {configs[0]['arch']} width {configs[0]['width']}, "
        f"batch size 64, AdamW, 4 learning rates x 4 weight decays, {args.epochs} epochs; "
        f"{WORKERS} single-threaded workers, a fresh LocalCluster per run.",
        "",
        "| fuse | makespan | samples/s (all models) | vs fuse=1 | peak worker memory | best val_accuracy "
        "| max Δ val_accuracy / val_loss | mean Δ val_accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        d = differences(r, base)
        name = f"{r['fuse']}, one by one" if r.get("one_by_one") else str(r["fuse"])
        lines.append(
            f"| {name} | {r['makespan_s']:.1f} s | {r['samples_per_s']:,.0f} | {_speedup(r, base)} | "
            f"{r['peak_worker_rss_mib']:.0f} MiB | "
            f"{r['best_val_accuracy']:.4f} | {d['acc']:.4f} / {d['loss']:.2g} | {d['mean_acc_delta']:+.4f} |"
        )
    eight = next(r for r in runs if r["fuse"] == 8 and not r.get("one_by_one"))
    lines += [
        "",
        f"fuse=8 against fuse=1, samples/s: **{statistics.median(speedups(eight, base)):.2f}x**, the median of "
        f"{len(eight['makespans_s'])} round(s) (goal: at least 2x on the CPU).",
        "Δ: final-epoch difference from the fuse=1 run of the same configuration. A fused member sees its "
        "group's data and partition order, so Δ is data order and float rounding.",
        "Every round gave each run the same final metrics, bit for bit: "
        f"{'yes' if all(r['same_metrics_every_round'] for r in runs) else 'no'}.",
    ]
    apart = next((r for r in runs if r.get("one_by_one")), None)
    if apart is not None:
        d = differences(eight, apart)
        lines.append(
            f"Rounding alone (fuse=8 fused against the same groups trained one by one, in the same data order): "
            f"max |Δ val_accuracy| {d['acc']:.4f}, max |Δ val_loss| {d['loss']:.2g} after {args.epochs} epochs."
        )
    return "\n".join(lines)


def _non_default(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The options other than --arch and --out that differ from their defaults, as typed."""
    shown = []
    for name in ("samples", "epochs", "fuse", "repeat"):
        value = getattr(args, name)
        if value != parser.get_default(name):
            shown.append(f" --{name} {' '.join(map(str, value)) if isinstance(value, list) else value}")
    return "".join(shown)


def _speedup(run_: dict, base: dict) -> str:
    """The median ratio to fuse=1 over the rounds, with their range when there are several."""
    if run_ is base:
        return "1.00x"
    ratios = speedups(run_, base)
    middle = f"{statistics.median(ratios):.2f}x"
    return middle if len(ratios) == 1 else f"{middle} ({min(ratios):.2f}-{max(ratios):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("cnn", "mlp"), default="cnn")
    parser.add_argument("--samples", type=int, default=100_000, help="MNIST-1D samples (80%% train, 20%% test)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--fuse", type=int, nargs="+", default=list(FUSE))
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the fuse values, in turn")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.fuse[0] != 1:
        parser.error("--fuse must start with 1: the other runs are compared with it")
    logging.getLogger("distributed").setLevel(logging.ERROR)
    X, y, Xv, yv = load_mnist1d(args.samples)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=WORKERS, valid=(Xv, yv))
    configs = grid(args.arch)
    # (fuse, spec) in each round; fuse=8 once more one by one: the rounding reference.
    plan = [(fuse, SPEC) for fuse in args.fuse] + ([(8, OneByOneSpec(**COMMON))] if 8 in args.fuse else [])
    rounds = [[run(data, configs, args.epochs, fuse, len(X), spec) for fuse, spec in plan] for _ in range(args.repeat)]
    runs = [merged(list(same)) for same in zip(*rounds, strict=True)]
    if 8 in args.fuse:
        runs[-1]["one_by_one"] = True
    table = report(runs, args, _non_default(args, parser), configs, len(X))
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "fusion" if args.arch == "cnn" else f"fusion_{args.arch}"
    (out / f"{name}.md").write_text(table + "\n")
    (out / f"{name}.json").write_text(json.dumps({"runs": runs, "configs": configs, "samples": args.samples,
                                                   "epochs": args.epochs}, indent=2))


if __name__ == "__main__":
    main()
