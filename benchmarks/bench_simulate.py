"""The MOP simulator: visit orders at scale, decision time, and a check against a real run.

    python benchmarks/bench_simulate.py [--full] [--no-real] [--out benchmarks/results]

1. Sweep (virtual time, the real scheduler code): workers p in {2, 8, 32, 128},
   models n in {p/2, p, 2p, 4p}, unit costs uniform or spread 2x and 10x across
   models (log-evenly, shuffled), 5 epochs, order "fixed" (Latin) against
   "dynamic". utilization = busy / (p x makespan); efficiency = lower bound /
   makespan with lower bound = max(total work / p, the longest model chain).
   The default run covers p = 128 only at n = 512 (uniform and 10x); --full runs
   the whole p = 128 row.
2. Noise: the same with 5% of units running 4x slower (random straggler
   units), and with one worker 2x slower.
3. Decision time: Scheduler.handle per event at p = 128, n = 512, 5 epochs
   (wall clock; and the slowest event in thread CPU time, which leaves out the
   time the other processes of this machine held the core).
4. Reality: 8 MNIST-1D CNNs of four widths x 3 epochs on a LocalCluster of 2
   single-threaded workers. The per-model mean unit and evaluation seconds
   measured there go into the simulator; its makespan and utilization are
   compared with the measured ones (with no per-unit overhead, and with the
   measured median idle gap between a worker's tasks charged per hop), for
   both orders.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from bench_engine import worker_gaps  # noqa: E402  (benchmarks/ is the script's folder)
from cerebro_automl.simulate import (Stragglers, format_table, simulate, spread_costs,  # noqa: E402
                                     sweep)

WORKERS = 2
REAL_EPOCHS = 3
REAL_CONFIGS = [{"arch": "cnn", "width": w, "lr": lr} for w in (16, 32, 64, 96) for lr in (1e-3, 3e-3)]


# ------------------------------------------------------------------ simulation
def run_sweep(full: bool) -> list[dict]:
    rows = sweep(workers=(2, 8, 32))
    if full:
        rows += sweep(workers=(128,))
    else:
        rows += sweep(workers=(128,), ratios=(4,), spreads=(1, 10))
    return rows


def run_noise() -> list[dict]:
    rows = []
    for label, stragglers in (("5% of units 4x slower", Stragglers(unit_rate=0.05, unit_slowdown=4.0)),
                              ("one worker 2x slower", Stragglers(slow_workers=1, slowdown=2.0))):
        for p, ratio, spread in ((8, 2, 1), (8, 4, 10), (32, 2, 1), (32, 2, 10), (32, 4, 2)):
            costs = spread_costs(p * ratio, spread)
            for order in ("fixed", "dynamic"):
                r = simulate(costs, p, order=order, stragglers=stragglers)
                rows.append({"stragglers": label, "spread": spread, **r.row()})
    return rows


def noise_table(rows: list[dict]) -> str:
    lines = ["| stragglers | p | n | spread | util fixed | util dynamic | eff fixed | eff dynamic |",
             "|---|---|---|---|---|---|---|---|"]
    for f, d in zip(rows[::2], rows[1::2]):
        lines.append(f"| {f['stragglers']} | {f['workers']} | {f['models']} | {f['spread']:g}x "
                     f"| {f['utilization']:.3f} | {d['utilization']:.3f} "
                     f"| {f['efficiency']:.3f} | {d['efficiency']:.3f} |")
    return "\n".join(lines)


REPLICA_VARIANTS = (("r=1", 1, False), ("r=2", 2, False), ("r=2 + speculate", 2, True), ("r=3", 3, False),
                    ("r=3 + speculate", 3, True))


def run_replicas() -> list[dict]:
    """Fixed order, n = 2p uniform models, 5 epochs: stragglers; and a session started on
    p/2 workers (so P = p/2, the default) that p/2 more workers join at 10% of the work."""
    rows = []
    scenarios = [("one worker 2x slower", Stragglers(slow_workers=1, slowdown=2.0), None),
                 ("one worker 10x slower", Stragglers(slow_workers=1, slowdown=10.0), None),
                 ("5% of units 4x slower", Stragglers(unit_rate=0.05, unit_slowdown=4.0), None),
                 ("p/2 workers (P = p/2), p/2 join at 10% of the work", None, 0.1)]
    for label, stragglers, join_at in scenarios:
        for p in (8, 16, 32):
            costs = [1.0] * (2 * p)
            for name, r, speculate in REPLICA_VARIANTS:
                if join_at is None:
                    res = simulate(costs, p, replicas=r, speculate=speculate, stragglers=stragglers)
                else:  # 5 epochs x 2p models x p/2 units on p/2 workers: 10p; 10% of it is p
                    res = simulate(costs, p // 2, replicas=r, speculate=speculate,
                                   joins=[join_at * 10 * p] * (p // 2), partitions=p // 2)
                rows.append({"scenario": label, "variant": name, **res.row()})
    return rows


def replicas_table(rows: list[dict]) -> str:
    names = [name for name, _, _ in REPLICA_VARIANTS]
    lines = ["| scenario | p | " + " | ".join(f"eff {n}" for n in names)
             + " | r=2 + speculate: copies (won), restarts |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for i in range(0, len(rows), len(names)):
        group = rows[i:i + len(names)]
        spec = group[names.index("r=2 + speculate")]
        p = group[0]["workers"] + (0 if "join" not in group[0]["scenario"] else group[0]["workers"])
        lines.append(f"| {group[0]['scenario']} | {p} | "
                     + " | ".join(f"{r['efficiency']:.3f}" for r in group)
                     + f" | {spec['copies']} ({spec['copies_won']}), {spec['restarts']} |")
    return "\n".join(lines)


def timing_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["workers"] == 128 and r["models"] == 512]


def timing_table(rows: list[dict]) -> str:
    lines = ["| order | spread | events | mean µs | p99 µs | max µs (wall) | max µs (thread CPU) | < 1 ms (mean, p99) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "yes" if r["decision_mean_us"] < 1000 and r["decision_p99_us"] < 1000 else "NO"
        lines.append(f"| {r['order']} | {r['spread']:g}x | {r['events']} | {r['decision_mean_us']:.0f} "
                     f"| {r['decision_p99_us']:.0f} | {r['decision_max_us']:.0f} "
                     f"| {r['decision_cpu_max_us']:.0f} | {ok} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- reality
def run_real(unit_seconds: float = 0.6) -> dict:
    """A real 2-worker MOP run, then the simulator fed with its measured costs."""
    import distributed
    import torch
    from distributed import Client

    from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy
    from cerebro_automl.executors.dask import start_local_cluster
    from cerebro_automl.data import TensorShard
    from cerebro_automl.training import train_unit
    from mnist1d_models import load_mnist1d, model_fn, optimizer_fn

    spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn,
                        metrics={"accuracy": accuracy}, batch_size=64)
    # Rows per partition for which the widest model's unit takes about unit_seconds.
    X, y, _, _ = load_mnist1d(3000)
    shard = TensorShard(torch.from_numpy(X[:2000]), torch.from_numpy(y[:2000]))
    widest = REAL_CONFIGS[-1]
    for _ in range(2):  # the first is a warm-up
        started = time.perf_counter()
        train_unit(spec, widest, None, shard, seed=0, epoch=0, partition=0, step=0,
                   epoch_end=False, threads=1)
    rows = int(unit_seconds / ((time.perf_counter() - started) / 2000))
    X, y, Xv, yv = load_mnist1d(int(rows * WORKERS / 0.8) + 1)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=WORKERS, valid=(Xv, yv))

    out = {}
    with start_local_cluster(WORKERS) as cluster, Client(cluster) as client:
        client.run(lambda: torch.set_num_threads(1))
        for order in ("fixed", "dynamic"):
            with Session(spec, data, client=client, order=order) as s, \
                    distributed.get_task_stream(client) as stream:
                started = time.perf_counter()
                for config in REAL_CONFIGS:
                    s.add(config, epochs=REAL_EPOCHS)
                history = s.run()
                makespan = time.perf_counter() - started
            out[order] = _compare(order, history, makespan, worker_gaps(stream.data),
                                  data.num_partitions, len(X) // data.num_partitions)
    return out


def _compare(order: str, history, makespan: float, gaps: list[float], P: int, rows: int) -> dict:
    """The measured run against the simulator fed with its per-model mean costs."""
    by_model = history.groupby("model_id")
    unit_costs = [float(t) / (REAL_EPOCHS * P) for t in by_model["train_seconds"].sum()]
    eval_costs = [float(v) / REAL_EPOCHS for v in by_model["val_seconds"].sum()]
    compute = sum(unit_costs) * REAL_EPOCHS * P + sum(eval_costs) * REAL_EPOCHS
    real = {"makespan_s": makespan, "utilization": compute / (WORKERS * makespan),
            "rows_per_partition": rows, "gap_ms_median": statistics.median(gaps) * 1000,
            "unit_costs": unit_costs, "eval_costs": eval_costs}
    predictions = {}
    for label, hop in (("compute only", 0.0), ("+ median gap per hop", statistics.median(gaps))):
        r = simulate(unit_costs, WORKERS, epochs=REAL_EPOCHS, partitions=P, order=order,
                     eval_costs=eval_costs, hop=hop)
        predictions[label] = {"makespan_s": r.makespan, "utilization": r.utilization,
                              "makespan_ratio": r.makespan / makespan,
                              "utilization_ratio": r.utilization / real["utilization"]}
    return {"real": real, "predicted": predictions}


def section(name: str, text: str) -> str:
    """``text`` between the markers that let the manual include it (``--8<-- "simulate.md:name"``)."""
    return f"<!-- --8<-- [start:{name}] -->\n{text}\n<!-- --8<-- [end:{name}] -->"


def real_table(results: dict) -> str:
    first = next(iter(results.values()))["real"]
    lines = [f"{len(REAL_CONFIGS)} MNIST-1D CNNs (widths 16-96, two learning rates) x {REAL_EPOCHS} "
             f"epochs, {WORKERS} partitions of {first['rows_per_partition']} rows. The simulator gets "
             "each model's measured mean unit and evaluation seconds.",
             "",
             "| order | | makespan s | utilization | makespan predicted / real "
             "| utilization predicted / real |",
             "|---|---|---|---|---|---|"]
    for order, result in results.items():
        real, costs = result["real"], result["real"]["unit_costs"]
        lines.append(f"| {order} | real run (unit s {min(costs):.2f}-{max(costs):.2f}, median idle gap "
                     f"{real['gap_ms_median']:.1f} ms) | {real['makespan_s']:.1f} | {real['utilization']:.3f} | | |")
        for label, p in result["predicted"].items():
            lines.append(f"| {order} | simulator, {label} | {p['makespan_s']:.1f} | {p['utilization']:.3f} "
                         f"| {p['makespan_ratio']:.3f} | {p['utilization_ratio']:.3f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the whole p = 128 row of the sweep")
    parser.add_argument("--no-real", action="store_true", help="skip the real 2-worker run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)

    started = time.perf_counter()
    rows = run_sweep(args.full)
    noise = run_noise()
    replicas = run_replicas()
    real = None if args.no_real else run_real()
    command = "python benchmarks/bench_simulate.py" + (" --full" if args.full else "") + \
        (" --no-real" if args.no_real else "")
    parts = [
        "# MOP simulator",
        "",
        f"`{command}` — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, "
        f"{time.perf_counter() - started:.0f} s. Virtual time, the real `Scheduler`; 5 epochs, "
        "P = p partitions, unit costs log-evenly spread over the models, no hop or evaluation cost. "
        "util = busy / (p × makespan); eff = lower bound / makespan, lower bound = "
        "max(Σ work / p, longest model chain).",
        "",
        "## Fixed (Latin) against dynamic order",
        "",
        section("order", format_table(rows)),
        "",
        "## Stragglers",
        "",
        section("stragglers", noise_table(noise)),
        "",
        "## Replicated partitions (`Session(replicas=r)`), fixed order, n = 2p",
        "",
        section("replicas", "With joins, p is the number of workers at the end, and the lower bound is the time by "
                "which the workers present could have done the work (see `SimulationResult`). With one replica "
                "the workers that join find no partition to take (each of the p/2 holds one): they idle.\n\n"
                + replicas_table(replicas)),
        "",
        "## Scheduler decision time per event, p = 128, n = 512, 5 epochs",
        "",
        section("decisions", timing_table(timing_rows(rows))),
    ]
    if real is not None:
        parts += ["", "## Simulator against a real 2-worker run", "", section("real", real_table(real))]
    text = "\n".join(parts)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate.md").write_text(text + "\n")
    (out / "simulate.json").write_text(json.dumps({"sweep": rows, "stragglers": noise, "replicas": replicas, "real": real},
                                                  indent=2))


if __name__ == "__main__":
    main()
