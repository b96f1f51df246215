"""Replicated partitions on a real cluster: a slow worker, a killed worker, a cluster that grows.

    python benchmarks/bench_replicas.py [--repeats 2] [--out benchmarks/results]

A `dask scheduler` and `dask worker` processes (``--no-nanny``, one thread) on
loopback. The workload: 12 small MLPs x 2 epochs on P = 3 partitions, each
loaded by a loader that takes LOAD_SECONDS (reading from storage). Every batch
sleeps a fixed time on the worker (BATCH_SECONDS; the env of a slow worker sets
twice that): on 2 shared cores that models a slow node without the workers
fighting over the CPU.

1. One worker 2x slower (3 workers): replicas=1, replicas=2, replicas=2 with
   speculate=True.
2. A worker SIGKILLed once the first model reported an epoch (3 workers, no
   nanny: the cluster goes on with 2): replicas=1 (its partition reloads from
   the source, LOAD_SECONDS, while the models that need it wait) against
   replicas=2 (its partitions are still served; new copies load meanwhile).
3. Two workers, and two more started JOIN_SECONDS after the start, while the
   first workers still load their second copies (about a tenth of the run):
   replicas=1 and replicas=2, against replicas=2 with no workers joining.

Makespan is from the first add to the last report; each scenario's runs
alternate, ``--repeats`` times, and the table shows medians and the ratio to the
first column. "same bits" compares every model's final weights with the
replicas=1 run of scenario 1. Train tasks per worker count every run of a
unit (a speculative copy too); the last column is the work speculation added:
copies started and units restarted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import cloudpickle
import distributed  # noqa: F401  (before the log levels are set)
import numpy as np
import torch
from collections import Counter

from distributed import Client, get_task_stream
from distributed.utils import json_load_robust
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cerebro_automl import EpochReport, PartitionedDataset, Session, TrainingSpec, accuracy  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

PARTITIONS = 3
ROWS = 3072            # per partition
FEATURES = 64
BATCH = 128            # 24 batches per unit
BATCH_SECONDS = 0.025  # per batch on a normal worker
LOAD_SECONDS = 4.0
JOIN_SECONDS = 5.0     # after the start: the first copies are held, the second ones load
EPOCHS = 2
CONFIGS = [{"lr": lr, "width": w} for lr in (1e-3, 3e-3, 1e-2) for w in (16, 32, 48, 64)]


class PacedLinear(nn.Linear):
    """Sleeps the worker's ``BENCH_BATCH_SECONDS`` per batch; computes a plain Linear."""

    def forward(self, x):
        time.sleep(float(os.environ.get("BENCH_BATCH_SECONDS", "0")))
        return super().forward(x)


def model_fn(config):
    return nn.Sequential(PacedLinear(FEATURES, config["width"]), nn.ReLU(), nn.Linear(config["width"], 4))


def load(i: int):
    """Partition i, made deterministically after LOAD_SECONDS (a read from storage)."""
    time.sleep(LOAD_SECONDS)
    rng = np.random.default_rng([7, i])
    X = rng.standard_normal((ROWS + 256, FEATURES), dtype=np.float32)
    y = (X[:, :4].argmax(1)).astype(np.int64)
    return X[:ROWS], y[:ROWS], X[ROWS:], y[ROWS:]


SPEC = TrainingSpec(model_fn=model_fn, optimizer_fn=lambda c, p: torch.optim.Adam(p, lr=c["lr"]),
                    loss_fn=nn.functional.cross_entropy, metrics={"accuracy": accuracy}, batch_size=BATCH)
DATA = PartitionedDataset.from_loader(load, PARTITIONS)


class Cluster:
    """`dask scheduler` and `dask worker --no-nanny` processes; workers can be added later."""

    def __init__(self, folder: Path, batch_seconds: list[float]) -> None:
        self.bin = Path(sys.executable).parent
        self.env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
        self.env.pop("MALLOC_TRIM_THRESHOLD_", None)
        scheduler_file = folder / "scheduler.json"
        scheduler_file.unlink(missing_ok=True)
        self.procs = [subprocess.Popen([self.bin / "dask", "scheduler", "--host", "127.0.0.1", "--port", "0",
                                        "--no-dashboard", "--scheduler-file", scheduler_file],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env)]
        # Dask's own reader: the scheduler creates the file before it writes it
        self.address = json_load_robust(str(scheduler_file), timeout=60)["address"]
        self.workers = [self.add_worker(s) for s in batch_seconds]

    def add_worker(self, batch_seconds: float) -> subprocess.Popen:
        env = dict(self.env, BENCH_BATCH_SECONDS=str(batch_seconds), OMP_NUM_THREADS="1")
        proc = subprocess.Popen([self.bin / "dask", "worker", self.address, "--nthreads", "1", "--no-nanny",
                                 "--no-dashboard", "--host", "127.0.0.1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs[::-1]:
            p.kill()
        for p in self.procs:
            p.wait(timeout=30)


def run(folder: Path, batch_seconds: list[float], replicas: int, speculate: bool = False,
        on_first_report=None, after_seconds: tuple[float, object] | None = None) -> dict:
    """One session on a fresh cluster; ``on_first_report(cluster, client)`` runs once an
    epoch reported, and ``after_seconds = (seconds, action)`` runs ``action(cluster,
    client)`` that long after the start."""
    cluster = Cluster(folder, batch_seconds)
    timer = None
    try:
        with Client(cluster.address) as client:
            client.wait_for_workers(len(batch_seconds), timeout=120)
            with Session(SPEC, DATA, client=client, seed=0, replicas=replicas, speculate=speculate,
                         no_worker_timeout=120) as s:
                started = time.perf_counter()
                ids = [s.add(c, epochs=EPOCHS) for c in CONFIGS]
                if after_seconds is not None:
                    timer = threading.Timer(after_seconds[0], after_seconds[1], (cluster, client))
                    timer.start()
                fired = False
                with get_task_stream(client) as stream:
                    for r in s.reports():
                        if isinstance(r, EpochReport) and not fired and on_first_report is not None:
                            on_first_report(cluster, client)
                            fired = True
                makespan = time.perf_counter() - started
                states = [s.model(i).state()["model"] for i in ids]
                status = [s.status(i) for i in ids]
                copies = Counter(w for p in range(PARTITIONS) for w in s.scheduler.holders(p))
                units = Counter(task["worker"] for task in stream.data
                                if str(task["key"]).startswith("cerebro-train-"))
                extra = (s.scheduler.copies_started, s.scheduler.restarts)
            return {"makespan_s": makespan, "states": states, "paused": status.count("paused"),
                    "copies_per_worker": sorted(copies.values()), "units_per_worker": sorted(units.values()),
                    "copies_restarts": extra}
    finally:
        if timer is not None:
            timer.cancel()
        cluster.close()


def kill_one(cluster: Cluster, client: Client) -> None:
    pids = client.run(os.getpid)
    os.kill(pids[sorted(pids)[0]], signal.SIGKILL)


def grow(cluster: Cluster, client: Client) -> None:
    cluster.add_worker(BATCH_SECONDS)
    cluster.add_worker(BATCH_SECONDS)


def same(a: list[dict], b: list[dict]) -> bool:
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


SCENARIOS = {
    "one worker 2x slower": [("replicas=1", dict(batch_seconds=[BATCH_SECONDS] * 2 + [2 * BATCH_SECONDS], replicas=1)),
                             ("replicas=2", dict(batch_seconds=[BATCH_SECONDS] * 2 + [2 * BATCH_SECONDS], replicas=2)),
                             ("replicas=2, speculate", dict(batch_seconds=[BATCH_SECONDS] * 2 + [2 * BATCH_SECONDS],
                                                            replicas=2, speculate=True))],
    "a worker killed mid-run": [("replicas=1", dict(batch_seconds=[BATCH_SECONDS] * 3, replicas=1,
                                                    on_first_report=kill_one)),
                                ("replicas=2", dict(batch_seconds=[BATCH_SECONDS] * 3, replicas=2,
                                                    on_first_report=kill_one))],
    "2 workers, 2 more join mid-run": [("no join, replicas=2", dict(batch_seconds=[BATCH_SECONDS] * 2, replicas=2)),
                                       ("join, replicas=1", dict(batch_seconds=[BATCH_SECONDS] * 2, replicas=1,
                                                                 after_seconds=(JOIN_SECONDS, grow))),
                                       ("join, replicas=2", dict(batch_seconds=[BATCH_SECONDS] * 2, replicas=2,
                                                                 after_seconds=(JOIN_SECONDS, grow)))],
}


def measure(folder: Path, repeats: int) -> dict:
    results: dict = {}
    reference = None
    for scenario, variants in SCENARIOS.items():
        runs: dict[str, list[dict]] = {label: [] for label, _ in variants}
        for _ in range(repeats):
            for label, kwargs in variants:  # alternating: the machine's noise hits every variant
                r = run(folder, **kwargs)
                if reference is None:
                    reference = r["states"]
                r["same_bits"] = same(r.pop("states"), reference)
                runs[label].append(r)
                print(f"{scenario} / {label}: {r['makespan_s']:.1f} s, same bits {r['same_bits']}", flush=True)
        first = statistics.median(r["makespan_s"] for r in runs[variants[0][0]])
        results[scenario] = {label: {"makespan_s": statistics.median(r["makespan_s"] for r in rs),
                                     "ratio": statistics.median(r["makespan_s"] for r in rs) / first,
                                     "same_bits": all(r["same_bits"] for r in rs),
                                     "all_paused": all(r["paused"] == len(CONFIGS) for r in rs),
                                     "copies_per_worker": rs[0]["copies_per_worker"],
                                     "units_per_worker": rs[0]["units_per_worker"],
                                     "copies_restarts": rs[0]["copies_restarts"],
                                     "makespans_s": [r["makespan_s"] for r in rs]}
                             for label, rs in runs.items()}
    return results


def markdown(results: dict, command: str, seconds: float) -> str:
    lines = ["# Replicated partitions on a real cluster", "",
             "<!-- --8<-- [start:table] -->",
             f"`{command}` — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, "
             f"{seconds:.0f} s. {len(CONFIGS)} MLPs x {EPOCHS} epochs, P = {PARTITIONS} partitions of {ROWS} rows, "
             f"{BATCH_SECONDS * 1000:.0f} ms per batch on a normal worker, partitions load in {LOAD_SECONDS:.0f} s. "
             "Medians of the alternating runs; ratio = makespan / the first row's.", "",
             "| scenario | run | makespan s | ratio | same bits as replicas=1 | all models paused "
             "| partitions held per worker at the end | train tasks per worker | speculative copies, restarts |",
             "|---|---|---|---|---|---|---|---|---|"]
    for scenario, variants in results.items():
        for label, r in variants.items():
            lines.append(f"| {scenario} | {label} | {r['makespan_s']:.1f} | {r['ratio']:.2f} | "
                         f"{'yes' if r['same_bits'] else 'NO'} | {'yes' if r['all_paused'] else 'NO'} | "
                         f"{', '.join(map(str, r['copies_per_worker']))} | "
                         f"{', '.join(map(str, r['units_per_worker']))} | "
                         f"{r['copies_restarts'][0]}, {r['copies_restarts'][1]} |")
    lines.append("<!-- --8<-- [end:table] -->")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    logging.getLogger("cerebro_automl").setLevel(logging.ERROR)
    import tempfile

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        results = measure(Path(folder), args.repeats)
    command = f"python benchmarks/bench_replicas.py --repeats {args.repeats}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas.json").write_text(json.dumps({"command": command, "results": results}, indent=2) + "\n")
    text = markdown(results, command, time.perf_counter() - started)
    (out / "replicas.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
