"""Survivors in gang units, for real: an ASHA search on a LocalCluster of 4 CPU
workers, in plain MOP and with ``gang=True``, and the gang run again.

    python benchmarks/bench_tail_real.py [--trials 12] [--samples 30000] [--note "..."] [--out benchmarks/results]

MNIST-1D (``--samples``, 80% for training) in 4 partitions on a LocalCluster of 4
single-threaded worker processes. The demo's 1-D CNN of width 32, 64 or 128 with
AdamW (learning rate and weight decay log-uniform), batch size 1024: a rank of a
gang of 4 takes 256 rows a step, about 45 ms of compute for the widest model on one
core, so that a step's all-reduce (4 processes meeting on 2 cores: about 20 ms of
waiting for each other here) does not dominate it, as it does at 64 rows a rank.
ASHA (``asha``) over ``--trials`` configurations, eta 3, 1 to 9 epochs, metric
val_accuracy, ``reproducible=True``, seed 0: the rungs at 1 and 3 epochs keep the
workers busy, and the one or two models of the last rung train 6 epochs nearly
alone, which MOP runs one partition, one worker, at a time.

Four searches on one cluster, in turn: plain MOP (``gang=False``), gang units
(``gang=True``), MOP again, gang units again (alternated, so that a change in the
machine's load weighs on both). Reported: the makespan (wall seconds of the search),
the last rung alone (from the last report of a model that stopped before the last
rung to the end), the epochs trained, the best val_accuracy, the units sent by
width, the load average (1 min) during each search, and whether each pair of runs
made the same study (model ids, epochs and val metrics equal). The goal (issue 47):
makespan with gangs <= 0.75x plain MOP's, best accuracy within 0.01.

On a machine with fewer cores than workers the gain has a ceiling: MOP keeps as
many cores busy as there are live models (up to the cores), and a lone survivor
uses one core; a gang of 4 uses at most all of them. With c cores and a share t of
MOP's makespan spent with one model training, the makespan with gangs is at best
``1 - t (1 - 1/c)`` of MOP's (all-reduces and the ranks' smaller batches cost more).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import distributed
import numpy as np
import torch
from distributed import Client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy  # noqa: E402
from cerebro_automl.adapters.hyperband import asha  # noqa: E402
from cerebro_automl.executors.dask import start_local_cluster  # noqa: E402
from cerebro_automl.protocol import Train, TrainGang  # noqa: E402
from mnist1d_models import load_mnist1d, model_fn, optimizer_fn  # noqa: E402

WORKERS = PARTITIONS = 4
BATCH = 1024
SEED = 0
MIN_EPOCHS, MAX_EPOCHS, ETA = 1, 9, 3


def sampler(rng: np.random.Generator) -> dict:
    return {"arch": "cnn", "width": int(rng.choice([32, 64, 128])),
            "lr": float(10 ** rng.uniform(np.log10(5e-4), np.log10(5e-3))),
            "weight_decay": float(10 ** rng.uniform(-5, -2))}


class LoadSampler:
    """The 1-minute load average, read every second while a search runs."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.values.append(os.getloadavg()[0])
            self._stop.wait(1.0)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def search(client: Client, data: PartitionedDataset, spec: TrainingSpec, gang: bool, trials: int) -> dict:
    """One reproducible ASHA search; its makespan, study and the units it sent."""
    widths: Counter = Counter()
    with Session(spec, data, client=client, seed=SEED, gang=gang, progress=False) as s:
        execute = s.executor.execute

        def counting(ins):
            if isinstance(ins, TrainGang):
                widths[len(ins.partitions)] += 1
            elif isinstance(ins, Train) and not ins.copy:
                widths[1] += 1
            return execute(ins)

        s.executor.execute = counting
        with LoadSampler() as load:
            started = time.perf_counter()
            result = asha(spec, data, sampler, min_epochs=MIN_EPOCHS, max_epochs=MAX_EPOCHS, eta=ETA,
                          max_trials=trials, metric="val_accuracy", mode="max", seed=SEED, session=s,
                          reproducible=True)
            makespan = time.perf_counter() - started
    history = result.history.sort_values(["model_id", "epoch"])
    rows = history[["model_id", "epoch", "val_loss", "val_accuracy"]].values.tolist()
    epochs_of = history.groupby("model_id")["epoch"].max()
    # The tail: from the last report of a model that stops before the last rung to the
    # last report of all (session clock), while the last rung's survivors train alone.
    survivors = set(epochs_of[epochs_of == MAX_EPOCHS].index)
    others = history[~history.model_id.isin(survivors)]
    tail = float(history["session_seconds"].max() - others["session_seconds"].max()) if len(others) else 0.0
    return {
        "gang": gang,
        "makespan_s": makespan,
        "epochs_trained": len(history),
        "best_val_accuracy": float(result.best_value),
        "best_model_id": int(result.best_model_id),
        "best_config": result.best_config,
        "tail_s": tail,
        "survivors": sorted(int(m) for m in survivors),
        "models_per_epochs": {int(e): int(n) for e, n in epochs_of.value_counts().sort_index().items()},
        "units_by_width": {int(k): int(v) for k, v in sorted(widths.items())},
        "load_average": {"mean": float(np.mean(load.values)), "max": float(np.max(load.values))},
        "study": [[int(m), int(e), float(vl), float(va)] for m, e, vl, va in rows],
    }


def ceiling(mop: dict, cores: int) -> float:
    """The best ratio gangs can reach on ``cores`` cores: MOP's tail (one model
    training, on one core) sped up ``min(cores, WORKERS)`` times, the rest not at all."""
    share = mop["tail_s"] / mop["makespan_s"]
    return 1 - share * (1 - 1 / min(cores, WORKERS))


def summarize(runs: dict[str, dict], settings: dict) -> dict:
    """The comparisons the results file states, from the four runs."""
    mop, gangs, mop_again, again = runs["mop"], runs["gangs"], runs["mop_again"], runs["gangs_again"]

    def mean(key: str, *rs: dict) -> float:
        return float(np.mean([r[key] for r in rs]))

    mop_mean = {"makespan_s": mean("makespan_s", mop, mop_again), "tail_s": mean("tail_s", mop, mop_again)}
    ratio = mean("makespan_s", gangs, again) / mop_mean["makespan_s"]
    gap = round(gangs["best_val_accuracy"] - mop["best_val_accuracy"], 6) + 0.0  # no "-0.0000"
    return {
        **settings,
        "mop_mean_makespan_s": mop_mean["makespan_s"],
        "ratio": ratio,
        "tail_ratio": mean("tail_s", gangs, again) / mop_mean["tail_s"],
        "best_accuracy_gap": gap,
        "same_study_twice": gangs["study"] == again["study"],
        "same_study_mop_twice": mop["study"] == mop_again["study"],
        "mop_tail_share": mop_mean["tail_s"] / mop_mean["makespan_s"],
        "ceiling_ratio": ceiling(mop_mean, settings["cores"]),
        "goals": {"ratio_at_most_0.75": ratio <= 0.75, "accuracy_within_0.01": abs(gap) <= 0.01},
    }


def best_val_loss(run: dict) -> float:
    """The best model's val_loss at its last epoch."""
    return [vl for m, _, vl, _ in run["study"] if m == run["best_model_id"]][-1]


def render(summary: dict, runs: dict[str, dict]) -> str:
    """The results file: settings, the table, and what it says."""
    s = summary
    mop, gangs = runs["mop"], runs["gangs"]
    cores, lanes = s["cores"], min(s["cores"], s["workers"])

    def row(label: str, r: dict) -> str:
        widths = ", ".join(f"{k}: {v}" for k, v in r["units_by_width"].items())
        return (f"| {label} | {r['makespan_s']:.1f} s | {r['makespan_s'] / s['mop_mean_makespan_s']:.2f}x | "
                f"{r['tail_s']:.1f} s | {r['epochs_trained']} | {r['best_val_accuracy']:.4f} | {widths} | "
                f"{r['load_average']['mean']:.1f} ({r['load_average']['max']:.1f}) |")

    verdict_ratio = "met" if s["goals"]["ratio_at_most_0.75"] else "not met"
    verdict_gap = "met" if s["goals"]["accuracy_within_0.01"] else "not met"
    lines = [
        "# Survivors in gang units: a real ASHA search",
        "",
        f"`python benchmarks/bench_tail_real.py` — {s['date']}, {cores} cores, torch {s['torch']}, "
        f"dask {s['dask']}, {s['total_seconds'] / 60:.0f} min. MNIST-1D ({s['samples']} samples, 80% for training) "
        f"in {s['partitions']} partitions on a LocalCluster of {s['workers']} single-threaded workers; the demo's "
        f"1-D CNN (width 32, 64 or 128), AdamW, batch size {s['batch_size']}. ASHA over {s['trials']} "
        f"configurations, eta {ETA}, {MIN_EPOCHS} to {MAX_EPOCHS} epochs, val_accuracy, reproducible=True, seed "
        f"{SEED}; plain MOP, gang=True, MOP, gang=True in turn on one cluster. vs MOP: against the mean of the two "
        "MOP runs. Last rung alone: from the last report of a model that stopped before the last rung to the end. "
        "Units by width: the Train (1) and TrainGang (k) commands sent. Load: the 1-minute load average during "
        f"the search, mean (max); {s['load_average_before']:.1f} before the first. {s['note']}".rstrip(),
        "",
        "<!-- --8<-- [start:table] -->",
        "| run | makespan | vs MOP | last rung alone | epochs trained | best val_accuracy | units by width "
        "| load average |",
        "|---|---|---|---|---|---|---|---|",
        row("plain MOP", mop),
        row("gang=True", gangs),
        row("plain MOP, again", runs["mop_again"]),
        row("gang=True, again", runs["gangs_again"]),
        "",
        f"With gang units the makespan is {s['ratio']:.2f}x plain MOP's, each averaged over its two runs (goal "
        f"<= 0.75x: {verdict_ratio}), and the last rung alone takes {s['tail_ratio']:.2f}x its time in MOP. The best "
        f"val_accuracy is {gangs['best_val_accuracy']:.4f} against {mop['best_val_accuracy']:.4f}, a difference of "
        f"{s['best_accuracy_gap']:+.4f} (goal within 0.01: {verdict_gap}); the best model's val_loss is "
        f"{best_val_loss(gangs):.4f} against {best_val_loss(mop):.4f}: its gang units trained it otherwise (each "
        "step's batch mixes 4 partitions). The two gang runs made "
        + ("the same study: the same models, epochs and validation metrics, bit for bit"
           if s["same_study_twice"] else "different studies (see tail_real.json)")
        + (", as did the two MOP runs. " if s["same_study_mop_twice"] else "; the two MOP runs did not. ")
        + f"With {s['workers']} workers on {cores} cores, a gang of {s['workers']} gets at most {lanes} cores' "
        "worth where MOP's lone survivor has one, and MOP keeps the cores busy whenever two models train: only "
        f"the last rung alone ({s['mop_tail_share']:.0%} of MOP's makespan) can speed up, at most {lanes}x, a "
        f"ceiling of {s['ceiling_ratio']:.2f}x on the makespan's ratio before the all-reduces and the ranks' "
        "smaller batches; other processes on the machine share the same cores (the load average).",
        "<!-- --8<-- [end:table] -->",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--samples", type=int, default=30000)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--note", default="", help="a sentence on the run's conditions, for the results file")
    parser.add_argument("--render", action="store_true", help="rewrite tail_real.md from tail_real.json; no runs")
    args = parser.parse_args()
    out = Path(args.out)
    if args.render:
        saved = json.loads((out / "tail_real.json").read_text())
        saved["summary"] = summarize(saved["runs"], saved["settings"])
        (out / "tail_real.md").write_text(render(saved["summary"], saved["runs"]) + "\n")
        (out / "tail_real.json").write_text(json.dumps(saved, indent=2, default=str) + "\n")
        print(render(saved["summary"], saved["runs"]))
        return
    logging.getLogger("distributed").setLevel(logging.ERROR)
    logging.getLogger("cerebro_automl").setLevel(logging.WARNING)
    total = time.perf_counter()
    X, y, Xt, yt = load_mnist1d(args.samples)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=PARTITIONS, valid=(Xt, yt))
    spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn, metrics={"accuracy": accuracy},
                        batch_size=BATCH)
    load_before = os.getloadavg()[0]
    runs: dict[str, dict] = {}
    with start_local_cluster(WORKERS) as cluster, Client(cluster) as client:
        client.wait_for_workers(WORKERS)
        for name, gang in (("mop", False), ("gangs", True), ("mop_again", False), ("gangs_again", True)):
            runs[name] = search(client, data, spec, gang, args.trials)
            r = runs[name]
            print(f"{name}: {r['makespan_s']:.1f} s, {r['epochs_trained']} epochs, best {r['best_val_accuracy']:.4f}, "
                  f"units by width {r['units_by_width']}, load {r['load_average']['mean']:.1f}", flush=True)
    settings = {
        "date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "cores": os.cpu_count() or 1,
        "workers": WORKERS, "partitions": PARTITIONS, "trials": args.trials, "samples": args.samples,
        "batch_size": BATCH, "torch": torch.__version__, "dask": distributed.__version__,
        "load_average_before": load_before, "total_seconds": time.perf_counter() - total, "note": args.note,
    }
    summary = summarize(runs, settings)
    table = render(summary, runs)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tail_real.md").write_text(table + "\n")
    (out / "tail_real.json").write_text(
        json.dumps({"settings": settings, "summary": summary, "runs": runs}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
