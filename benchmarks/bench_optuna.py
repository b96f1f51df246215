"""Optuna on MOP against Optuna with task parallelism, on the same 2 workers.

    python benchmarks/bench_optuna.py [--full] [--out benchmarks/results]

Both run the same study: TPE (seed 0) with HyperbandPruner over the MNIST-1D
MLP/CNN space of examples/optuna_mnist1d.py, the same trials and epochs.

* MOP: ``cerebro_automl.adapters.optuna.optimize`` on a LocalCluster of 2
  single-threaded workers; each worker holds half of the data.
* Task parallelism, the way Optuna runs on Dask: every worker holds a full copy
  of the data and runs ``study.optimize`` on a shared JournalStorage, one whole
  trial at a time (its own epoch loop, ``trial.report`` and ``should_prune``).

Figures: wall time, configurations explored per hour (trials / wall time), the
epochs trained, the best test accuracy, and the bytes of training data each
worker holds. Clusters are started before the clock starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import distributed  # noqa: F401  (before the log levels are set)
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

from bench_strategies import _cerebro_bytes  # noqa: E402  (benchmarks/ is the script's folder)


def make_study(storage=None, name="bench", epochs=6) -> optuna.Study:
    return optuna.create_study(
        study_name=name, storage=storage, load_if_exists=True, direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=8),
        pruner=optuna.pruners.HyperbandPruner(min_resource=1, max_resource=epochs, reduction_factor=3))


# ------------------------------------------------------------- task parallelism
def task_parallel_worker(journal: str, n_trials: int, epochs: int, data: tuple) -> dict:
    """Runs on one Dask worker: whole trials on the worker's full copy of the data."""
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    X, y, Xv, yv = (torch.from_numpy(a) for a in data)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(journal))
    study = make_study(storage, epochs=epochs)

    def objective(trial: optuna.Trial) -> float:
        config = space(trial)
        torch.manual_seed(trial.number)
        model = model_fn(config)
        opt = optimizer_fn(config, model.parameters())
        gen = torch.Generator().manual_seed(trial.number)
        acc = 0.0
        for epoch in range(1, epochs + 1):
            model.train()
            for idx in torch.randperm(len(X), generator=gen).split(config["batch_size"]):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                acc = float((model(Xv).argmax(1) == yv).float().mean())
            trial.report(acc, epoch)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return acc

    study.optimize(objective, n_trials=n_trials)
    return {"bytes": sum(a.nbytes for a in data)}


def run_task_parallel(client: Client, arrays, n_trials: int, epochs: int) -> dict:
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    with tempfile.TemporaryDirectory() as tmp:
        journal = os.path.join(tmp, "journal.log")
        make_study(optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(journal)), epochs=epochs)
        copies = [client.scatter(arrays, workers=[w], hash=False) for w in workers]  # a full copy each
        distributed.wait(copies)
        share = [n_trials // len(workers) + (i < n_trials % len(workers)) for i in range(len(workers))]
        started = time.perf_counter()
        futures = [client.submit(task_parallel_worker, journal, k, epochs, copy, workers=[w],
                                 allow_other_workers=False, pure=False)
                   for w, k, copy in zip(workers, share, copies)]
        results = client.gather(futures)
        wall = time.perf_counter() - started
        study = make_study(optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(journal)), epochs=epochs)
        trials = study.trials
    return summary("task parallelism", trials, wall, [r["bytes"] for r in results])


# ------------------------------------------------------------------------- MOP
def run_mop(client: Client, arrays, n_trials: int, epochs: int) -> dict:
    X, y, Xv, yv = arrays
    workers = len(client.scheduler_info(n_workers=-1)["workers"])
    data = PartitionedDataset.from_arrays(X, y, num_partitions=workers, valid=(Xv, yv))
    spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn, metrics={"accuracy": accuracy},
                        batch_size="batch_size")
    study = make_study(epochs=epochs)
    with Session(spec, data, client=client) as session:
        started = time.perf_counter()
        optimize(study, spec, data, space, n_trials=n_trials, epochs=epochs, metric="val_accuracy",
                 session=session)
        wall = time.perf_counter() - started
        held = client.run(_cerebro_bytes)
    return summary("MOP (cerebro_automl)", study.trials, wall, list(held.values()))


def summary(name: str, trials, wall: float, data_bytes: list[int]) -> dict:
    values = [t.value for t in trials if t.value is not None]
    return {"strategy": name, "trials": len(trials), "wall_s": wall,
            "configs_per_hour": len(trials) / wall * 3600,
            "epochs_trained": sum(len(t.intermediate_values) for t in trials),
            "best_accuracy": max(values) if values else float("nan"),
            "data_mb_per_worker": [b / 2**20 for b in data_bytes]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="40 trials x 9 epochs on 20k samples")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    n_trials, epochs, samples = (40, 9, 20000) if args.full else (16, 6, 10000)
    X, y, Xv, yv = load_mnist1d(samples)
    arrays = (X, y, Xv, yv)

    with start_local_cluster(2) as cluster, Client(cluster) as client:
        client.run(lambda: torch.set_num_threads(1))
        rows = [run_mop(client, arrays, n_trials, epochs),
                run_task_parallel(client, arrays, n_trials, epochs)]
    mop, task = rows
    ratio = {"configs_per_hour": mop["configs_per_hour"] / task["configs_per_hour"],
             "data_memory": max(mop["data_mb_per_worker"]) / max(task["data_mb_per_worker"])}

    lines = [
        "# Optuna on MOP vs task parallelism",
        "",
        "<!-- --8<-- [start:table] -->",
        f"`python benchmarks/bench_optuna.py{' --full' if args.full else ''}` — "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, 2 workers, "
        f"torch {torch.__version__}, optuna {optuna.__version__}, dask {distributed.__version__}. "
        f"TPE + HyperbandPruner, {n_trials} trials x up to {epochs} epochs, MNIST-1D {samples} samples.",
        "",
        "| strategy | wall (s) | configs / hour | epochs trained | best test acc. | training data per worker (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['wall_s']:.1f} | {r['configs_per_hour']:.0f} | "
                     f"{r['epochs_trained']} | {r['best_accuracy']:.3f} | "
                     + ", ".join(f"{m:.2f}" for m in r["data_mb_per_worker"]) + " |")
    lines += ["", f"MOP / task parallelism: configs per hour {ratio['configs_per_hour']:.2f}x, "
                  f"data memory per worker {ratio['data_memory']:.2f}x.", "<!-- --8<-- [end:table] -->"]
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "optuna.md").write_text(table + "\n")
    (out / "optuna.json").write_text(json.dumps({"rows": rows, "ratios": ratio}, indent=2))


if __name__ == "__main__":
    main()
