"""Tuners in the simulator: what reproducible=True costs, and how much waits on the tail.

    python benchmarks/bench_search_sim.py [--workers 8 32 128] [--configs 256] [--out benchmarks/results]

The real tuner adapters drive a SimulatedSession: the real scheduler in virtual
time, P = p partitions, each configuration's unit cost drawn between 1 and 4 s
and its learning curve drawn from it (cerebro_automl.simulate.tuners). Per
worker count p:

* ASHA over ``--configs`` configurations (eta 3, 1 to 27 epochs) and an Optuna
  study of as many trials (TPE, SuccessiveHalvingPruner with reduction factor 3,
  27 epochs), each without and with ``reproducible=True``: the makespans, their
  ratio, and utilization;
* the makespan per epoch trained, whose ratio leaves out that the two runs are
  different searches (canonical order prunes and promotes differently, so the
  number of epochs trained differs);
* for each run, utilization in ten slices of the makespan and the tail: the time
  after which the workers are never again more than half busy, as a share of the
  makespan, and the share of all idle worker-seconds that fell in it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import optuna

from cerebro_automl.adapters.hyperband import asha
from cerebro_automl.adapters.optuna import optimize
from cerebro_automl.simulate import SimulatedSession

ROOT = Path(__file__).resolve().parents[1]


def sampler(rng):
    return {"lr": float(10 ** rng.uniform(-4, -1)), "width": int(rng.choice([32, 64, 128, 256]))}


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
            "width": trial.suggest_categorical("width", [32, 64, 128, 256])}


def run_asha(p: int, configs: int, reproducible: bool) -> SimulatedSession:
    sim = SimulatedSession(workers=p, seed=0)
    asha(sim.spec, sim.data, sampler, min_epochs=1, max_epochs=27, eta=3, max_trials=configs,
         metric="val_loss", session=sim, reproducible=reproducible)
    return sim


def run_optuna(p: int, configs: int, reproducible: bool) -> SimulatedSession:
    sim = SimulatedSession(workers=p, seed=0)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3))
    optimize(study, sim.spec, sim.data, space, n_trials=configs, epochs=27, metric="val_loss", session=sim,
             reproducible=reproducible, parallelism=2 * p)
    return sim


def measure(tuner: str, p: int, configs: int, reproducible: bool) -> dict:
    started = time.perf_counter()
    sim = (run_asha if tuner == "ASHA" else run_optuna)(p, configs, reproducible)
    timeline = sim.timeline(bins=10)
    return {"tuner": tuner, "workers": p, "reproducible": reproducible, "makespan": timeline.makespan,
            "utilization": timeline.utilization_total, "timeline": timeline.utilization,
            "tail_share": timeline.tail_share, "tail_idle_share": timeline.tail_idle_share,
            "epochs": len(sim.history), "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--configs", type=int, default=256)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    logging.getLogger("cerebro_automl").setLevel(logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = [measure(tuner, p, args.configs, rep) for p in args.workers for tuner in ("ASHA", "Optuna")
            for rep in (False, True)]
    lines = [
        "# Tuners in the simulator: the cost of reproducible=True, and the tail",
        "",
        f"`python benchmarks/bench_search_sim.py` — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} cores. The real tuners drive a SimulatedSession (the real scheduler in virtual "
        f"time, P = p partitions, unit costs 1-4 s per configuration, modelled learning curves). ASHA: "
        f"{args.configs} configurations, eta 3, 1 to 27 epochs. Optuna: {args.configs} trials, TPE, "
        "SuccessiveHalvingPruner (reduction factor 3), 27 epochs, parallelism 2p.",
        "",
        "| tuner | p | makespan without / with reproducible | ratio | epochs trained without / with | "
        "makespan per epoch trained, ratio | utilization without / with | "
        "tail: share of makespan / of idle time (without) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in args.workers:
        for tuner in ("ASHA", "Optuna"):
            off, on = (next(r for r in rows if r["tuner"] == tuner and r["workers"] == p and r["reproducible"] == rep)
                       for rep in (False, True))
            lines.append(f"| {tuner} | {p} | {off['makespan']:.0f} / {on['makespan']:.0f} s | "
                         f"{on['makespan'] / off['makespan']:.2f}x | {off['epochs']} / {on['epochs']} | "
                         f"{(on['makespan'] / on['epochs']) / (off['makespan'] / off['epochs']):.2f}x | "
                         f"{off['utilization']:.2f} / "
                         f"{on['utilization']:.2f} | {off['tail_share']:.2f} / {off['tail_idle_share']:.2f} |")
    lines += ["", "Utilization in ten equal slices of the makespan (without reproducible):", "",
              "| tuner | p | " + " | ".join(f"{10 * i}-{10 * (i + 1)}%" for i in range(10)) + " |",
              "|---|---|" + "---|" * 10]
    for r in rows:
        if not r["reproducible"]:
            lines.append(f"| {r['tuner']} | {r['workers']} | " + " | ".join(f"{u:.2f}" for u in r["timeline"]) + " |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "search_sim.md").write_text(table + "\n")
    (out / "search_sim.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
