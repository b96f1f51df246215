"""What reproducible=True costs: the demo's Optuna search with and without canonical order.

    python benchmarks/bench_reproducible.py [--rounds 2] [--trials 24] [--epochs 9] [--out benchmarks/results]

The search of `make demo` (examples/optuna_mnist1d.py: TPE, HyperbandPruner, 24
trials of up to 9 epochs, MNIST-1D in 4 partitions) on one LocalCluster of 2
single-threaded workers, started before the clock. Both runs use the same
parallelism (twice the partitions, reproducible=True's default), so the ratio is
the cost of holding reports for the canonical order alone. The two run
alternately, ``rounds`` times each; reported: each run's makespan and epochs
trained, and the ratio of the median makespans.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import distributed
import optuna
import torch
from distributed import Client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from cerebro_automl import PartitionedDataset, TrainingSpec, accuracy  # noqa: E402
from cerebro_automl.adapters.optuna import optimize  # noqa: E402
from cerebro_automl.executors.dask import start_local_cluster  # noqa: E402
from mnist1d_models import load_mnist1d, model_fn, optimizer_fn  # noqa: E402
from optuna_mnist1d import space  # noqa: E402

WORKERS, PARTITIONS = 2, 4


def search(client: Client, data: PartitionedDataset, reproducible: bool, trials: int, epochs: int) -> dict:
    spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn, metrics={"accuracy": accuracy},
                        batch_size="batch_size")
    study = optuna.create_study(study_name="demo", direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=8),
                                pruner=optuna.pruners.HyperbandPruner(min_resource=1, max_resource=epochs,
                                                                      reduction_factor=3))
    started = time.perf_counter()
    optimize(study, spec, data, space, n_trials=trials, epochs=epochs, metric="val_accuracy", client=client,
             parallelism=2 * PARTITIONS, reproducible=reproducible)
    return {"makespan_s": time.perf_counter() - started, "best": study.best_value,
            "epochs_trained": sum(len(t.intermediate_values) for t in study.trials)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=9)
    parser.add_argument("--samples", type=int, default=10000)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    logging.getLogger("cerebro_automl").setLevel(logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    X, y, Xt, yt = load_mnist1d(args.samples)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=PARTITIONS, valid=(Xt, yt))
    runs: dict[str, list[dict]] = {"without": [], "reproducible=True": []}
    with start_local_cluster(WORKERS) as cluster, Client(cluster) as client:
        client.run(lambda: torch.set_num_threads(1))
        for _ in range(args.rounds):
            for name in runs:
                runs[name].append(search(client, data, name != "without", args.trials, args.epochs))
    median = {name: statistics.median(r["makespan_s"] for r in rs) for name, rs in runs.items()}
    ratio = median["reproducible=True"] / median["without"]
    same = len({(r["best"], r["epochs_trained"]) for r in runs["reproducible=True"]}) == 1
    lines = [
        "# What reproducible=True costs: the demo's search",
        "",
        f"`python benchmarks/bench_reproducible.py` — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, dask {distributed.__version__}, optuna "
        f"{optuna.__version__}. The demo's Optuna search ({args.trials} trials, at most {args.epochs} epochs, "
        f"TPE + HyperbandPruner, MNIST-1D in {PARTITIONS} partitions) on {WORKERS} workers, parallelism "
        f"{2 * PARTITIONS} in both, {args.rounds} alternating rounds.",
        "",
        "| run | makespans | epochs trained | best val_accuracy |",
        "|---|---|---|---|",
    ]
    for name, rs in runs.items():
        makespans = ", ".join(f"{r['makespan_s']:.1f} s" for r in rs)
        epochs = ", ".join(str(r["epochs_trained"]) for r in rs)
        bests = ", ".join(f"{r['best']:.4f}" for r in rs)
        lines.append(f"| {name} | {makespans} | {epochs} | {bests} |")
    lines += ["", f"reproducible=True / without, median makespan: **{ratio:.2f}x** (goal: at most 1.10x).",
              f"reproducible=True gave the same study in every round: {'yes' if same else 'no'}."]
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reproducible.md").write_text(table + "\n")
    (out / "reproducible.json").write_text(json.dumps({"runs": runs, "ratio": ratio, "same": same}, indent=2))


if __name__ == "__main__":
    main()
