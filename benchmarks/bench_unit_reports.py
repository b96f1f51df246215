"""What pruning inside epochs gains: a short Optuna search with epoch reports and with
``report_every="unit"``, side by side in one run.

    python benchmarks/bench_unit_reports.py [--trials 24] [--epochs 3] [--note "..."] [--out benchmarks/results]

A 3-epoch search, as fine-tunes are: TPE and SuccessiveHalvingPruner (reduction
factor 3, first rung at the smallest resource), 24 trials of the demo's MNIST-1D
models in 4 partitions, on a LocalCluster of 2 single-threaded workers,
``reproducible=True`` (so the decisions, the units trained and the best value are
the same on every run; the makespan varies with the machine). With epoch reports
the pruner's resource is an epoch (rungs at 1 and 3 epochs); with unit reports it
is a unit, a quarter of an epoch: a first rung at 1 unit (rungs at 1, 3 and 9
units), or at 2 units (rungs at 2 and 6). Reported: the units trained (the
training work), the evaluations made, the makespan and the best value.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
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

from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy  # noqa: E402
from cerebro_automl.adapters.optuna import optimize  # noqa: E402
from cerebro_automl.executors.dask import start_local_cluster  # noqa: E402
from mnist1d_models import load_mnist1d, model_fn, optimizer_fn  # noqa: E402
from optuna_mnist1d import space  # noqa: E402

WORKERS, PARTITIONS = 2, 4


def search(client: Client, data: PartitionedDataset, every: str, first_rung: int, trials: int, epochs: int) -> dict:
    spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn, metrics={"accuracy": accuracy},
                        batch_size="batch_size")
    study = optuna.create_study(study_name="units", direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=8),
                                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=first_rung,
                                                                              reduction_factor=3))
    started = time.perf_counter()
    with Session(spec, data, client=client, report_every=every, progress=False) as session:
        optimize(study, spec, data, space, n_trials=trials, epochs=epochs, metric="val_accuracy",
                 session=session, reproducible=True)
        units = session.scheduler.units_trained  # models train on while their reports wait
    makespan = time.perf_counter() - started
    steps = session.reports_per_epoch
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    return {
        "makespan_s": makespan,
        "units_trained": units,
        "evaluations": sum(len(t.intermediate_values) for t in study.trials),
        "pruned": len(pruned),
        "pruned_in_first_epoch": sum(max(t.intermediate_values) < steps for t in pruned),
        "best": study.best_value,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=10000)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--note", default="", help="a sentence on the run's conditions, for the results file")
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    logging.getLogger("cerebro_automl").setLevel(logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    X, y, Xt, yt = load_mnist1d(args.samples)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=PARTITIONS, valid=(Xt, yt))
    runs: dict[str, dict] = {}
    with start_local_cluster(WORKERS) as cluster, Client(cluster) as client:
        client.run(lambda: torch.set_num_threads(1))
        for every, first_rung, name in (("epoch", 1, "every epoch, first rung at 1 epoch"),
                                        ("unit", 1, "every unit, first rung at 1 unit"),
                                        ("unit", 2, "every unit, first rung at 2 units")):
            runs[name] = search(client, data, every, first_rung, args.trials, args.epochs)
    lines = [
        "# Pruning inside epochs: report_every=\"unit\"",
        "",
        f"`python benchmarks/bench_unit_reports.py` — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, dask {distributed.__version__}, optuna "
        f"{optuna.__version__}. {args.trials} trials of at most {args.epochs} epochs (TPE + "
        f"SuccessiveHalvingPruner, reduction factor 3), MNIST-1D in {PARTITIONS} partitions, {WORKERS} workers, "
        "reproducible=True. The pruner's resource is an epoch with epoch reports, a unit (1/4 epoch) with unit "
        f"reports. {args.note}".rstrip(),
        "",
        "<!-- --8<-- [start:table] -->",
        "| reports | units trained | evaluations | pruned (in epoch 1) | makespan | s per unit | best val_accuracy |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        per_unit = r["makespan_s"] / r["units_trained"]
        lines.append(f"| {name} | {r['units_trained']} | {r['evaluations']} | {r['pruned']} "
                     f"({r['pruned_in_first_epoch']}) | {r['makespan_s']:.1f} s | {per_unit:.2f} | {r['best']:.4f} |")
    lines.append("<!-- --8<-- [end:table] -->")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "unit_reports.md").write_text(table + "\n")
    (out / "unit_reports.json").write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
