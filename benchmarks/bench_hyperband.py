"""Hyperband on MOP against full training on MOP: time to a target accuracy, and
how full the hopper stays rung by rung.

    python benchmarks/bench_hyperband.py [--full] [--out benchmarks/results]

Both train the same MNIST-1D MLP/CNN configurations (examples/mnist1d_models.py,
``sample_config``) on a LocalCluster of 2 single-threaded workers started
before the clock:

* hyperband(max_epochs, eta=3): all brackets at once in one session;
* full training: every configuration to max_epochs (grid search on MOP).

Figures: the wall time at which any model first reached the target test
accuracy (the history's ``session_seconds``), the makespan, the epochs trained
and the best accuracy; and, per (bracket, rung) of the Hyperband run, the
utilization of the workers while that rung trained: the busy seconds of all
tasks inside the rung's window (first to last of its train units, from Dask's
task stream) over workers x window.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import distributed
import numpy as np
import torch
from distributed import Client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from cerebro_automl import PartitionedDataset, TrainingSpec, accuracy  # noqa: E402
from cerebro_automl.adapters.hyperband import hyperband, hyperband_plan  # noqa: E402
from cerebro_automl.adapters.search import run_configs  # noqa: E402
from cerebro_automl.executors.dask import start_local_cluster  # noqa: E402
from cerebro_automl.results import plot_learning_curves  # noqa: E402
from mnist1d_models import load_mnist1d, model_fn, optimizer_fn, sample_config  # noqa: E402

WORKERS = 2
SPEC = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn, metrics={"accuracy": accuracy},
                    batch_size="batch_size")
TRAIN_KEY = re.compile(r"cerebro-train-m(\d+)-e(\d+)-p\d+-")


def compute_spans(task_stream: list[dict]) -> list[tuple[str, float, float, str]]:
    """(worker, start, stop, key) of every task's compute."""
    return [(t["worker"], ss["start"], ss["stop"], t["key"] if isinstance(t["key"], str) else str(t["key"]))
            for t in task_stream for ss in t["startstops"] if ss["action"] == "compute"]


def busy_fraction(spans, start: float, stop: float) -> float:
    """Busy worker-seconds inside [start, stop] over WORKERS x (stop - start)."""
    busy = sum(max(0.0, min(b, stop) - max(a, start)) for _, a, b, _ in spans)
    return busy / (WORKERS * (stop - start)) if stop > start else float("nan")


def rung_utilization(result, spans) -> list[dict]:
    """Per (bracket, rung): its window (first to last of its train units) and the utilization in it."""
    units = {}  # (model, 0-based epoch) -> [(start, stop)]
    for _, a, b, key in spans:
        match = TRAIN_KEY.match(key)
        if match:
            units.setdefault((int(match[1]), int(match[2])), []).append((a, b))
    rows, previous = [], {}
    for d in result.decisions:
        low = previous.get(d.bracket, 0)
        mine = [span for m in d.values for e in range(low, d.epochs) for span in units.get((m, e), [])]
        previous[d.bracket] = d.epochs
        if not mine:
            continue
        start, stop = min(a for a, _ in mine), max(b for _, b in mine)
        rows.append({"bracket": d.bracket, "rung": d.rung, "models": len(d.values), "epochs": d.epochs,
                     "window_s": stop - start, "utilization": busy_fraction(spans, start, stop)})
    return rows


def time_to(history, target: float) -> float:
    reached = history[history["val_accuracy"] >= target]
    return float(reached["session_seconds"].min()) if len(reached) else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="max_epochs 27 and 4x the data")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--target", type=float, default=0.90, help="test accuracy to reach")
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    max_epochs, samples = (27, 40000) if args.full else (9, 10000)

    X, y, Xv, yv = load_mnist1d(samples)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2 * WORKERS, valid=(Xv, yv))
    rng = np.random.default_rng(0)
    configs = [sample_config(rng) for bracket in hyperband_plan(max_epochs, 3) for _ in range(bracket[0].n)]
    with start_local_cluster(WORKERS) as cluster, Client(cluster) as client:
        client.run(lambda: torch.set_num_threads(1))
        with distributed.get_task_stream(client) as stream:
            started = time.perf_counter()
            hb = hyperband(SPEC, data, sample_config, max_epochs=max_epochs, eta=3, seed=0,
                           metric="val_accuracy", mode="max", client=client)
            hb_wall = time.perf_counter() - started
        spans = compute_spans(stream.data)
        started = time.perf_counter()
        full = run_configs(SPEC, data, configs, epochs=max_epochs, metric="val_accuracy", mode="max",
                           seed=0, client=client)
        full_wall = time.perf_counter() - started

    rungs = rung_utilization(hb, spans)
    whole = busy_fraction(spans, min(a for _, a, _, _ in spans), max(b for _, _, b, _ in spans))
    figures = {
        "hyperband": {"makespan_s": hb_wall, "epochs": hb.epochs_trained, "best": hb.best_value,
                      "time_to_target_s": time_to(hb.history, args.target), "utilization": whole},
        "full": {"makespan_s": full_wall, "epochs": len(full.history), "best": full.best_value,
                 "time_to_target_s": time_to(full.history, args.target)},
        "rungs": rungs, "target": args.target, "configs": len(configs), "max_epochs": max_epochs,
    }
    ratio = figures["full"]["time_to_target_s"] / figures["hyperband"]["time_to_target_s"]
    lines = [
        "# Hyperband on MOP vs full training on MOP",
        "",
        "<!-- --8<-- [start:table] -->",
        f"`python benchmarks/bench_hyperband.py{' --full' if args.full else ''}` — "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, {WORKERS} workers, "
        f"torch {torch.__version__}. {len(configs)} MNIST-1D MLP/CNN configurations, max_epochs={max_epochs}, "
        f"eta=3, {len(X)} train rows in {data.num_partitions} partitions.",
        "",
        f"| run | time to test acc. ≥ {args.target:.2f} (s) | makespan (s) | epochs trained | best test acc. |",
        "|---|---|---|---|---|",
    ]
    for name, key in (("hyperband", "hyperband"), ("full training", "full")):
        f = figures[key]
        lines.append(f"| {name} | {f['time_to_target_s']:.1f} | {f['makespan_s']:.1f} | {f['epochs']} | {f['best']:.3f} |")
    lines += [
        "",
        f"Hyperband reaches the target {ratio:.2f}x sooner; it trains "
        f"{figures['hyperband']['epochs'] / figures['full']['epochs']:.2f}x the epochs in "
        f"{hb_wall / full_wall:.2f}x the makespan. Utilization over the whole Hyperband run: {whole:.2f}.",
        "<!-- --8<-- [end:table] -->",
        "",
        "<!-- --8<-- [start:rungs] -->",
        "| bracket | rung | models | to epoch | window (s) | utilization |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['bracket']} | {r['rung']} | {r['models']} | {r['epochs']} | {r['window_s']:.1f} | "
              f"{r['utilization']:.2f} |" for r in rungs]
    lines.append("<!-- --8<-- [end:rungs] -->")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hyperband.md").write_text(table + "\n")
    (out / "hyperband.json").write_text(json.dumps(figures, indent=2))
    plot_learning_curves(hb.history, "val_accuracy", mode="max", top=None, path=out / "hyperband_curves.png",
                         label=lambda row: f"#{row['model_id']} {row['config']['arch']} bracket {row['bracket']}",
                         title=f"Hyperband on MOP: test accuracy of {len(configs)} configurations per epoch")


if __name__ == "__main__":
    main()
