"""The fault campaign: a search on a CLI cluster whose workers are killed at random.

    python benchmarks/bench_chaos.py [--healthy 16] [--epochs 4] [--kill-every 6] [--out benchmarks/results]
    make chaos

A `dask scheduler` and 3 `dask worker`s (each with its nanny and a
--memory-limit) run on loopback. A search of MNIST-1D MLPs runs on them while a
thread SIGKILLs a random worker process every few seconds (its nanny starts a
new one). Among the healthy configurations are three bad ones:

* one whose forward allocates past its worker's memory limit (the nanny kills
  the worker each time it runs: it must fail alone after max_unit_retries);
* one that raises in its third unit;
* one whose first batch hangs past unit_timeout.

Recorded: every healthy model ends with weights bitwise equal to a fault-free
run (the in-process executor, the reference result); each bad config fails
alone with its reason in the history; no key is left on the cluster after the
session closes; and the driver's CPU seconds against the run's wall time (the
driver waits for Dask; it must not spin).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import cloudpickle
import torch
from distributed.utils import json_load_robust
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy  # noqa: E402
from mnist1d_models import load_mnist1d, model_fn, optimizer_fn  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import this file

WORKERS = 3
PARTITIONS = 3
BATCH = 64
MEMORY_LIMIT = "1.5GB"
HOG_GB = 3.0          # the memory hog's allocation, twice the worker's limit
UNIT_TIMEOUT = 4.0    # seconds; a healthy unit takes 0.03-0.3 s here (more on a loaded machine)
HANG = 5.0            # the hanging config's first batch, past UNIT_TIMEOUT


# ------------------------------------------------------------------ the configs
class MemoryHog(nn.Module):
    """Allocates ``gigabytes`` in every training forward and holds them a moment."""

    def __init__(self, gigabytes: float) -> None:
        super().__init__()
        self.gigabytes = gigabytes
        self.net = nn.Linear(40, 10)

    def forward(self, x):
        if self.training:
            block = torch.ones(int(self.gigabytes * 2**30) // 4)
            time.sleep(1.0)  # past the nanny's next memory check
            return self.net(x) + block[:1]
        return self.net(x)


class RaisesInThirdUnit(nn.Module):
    """Counts its training batches in a buffer (which hops with the state) and
    raises at the first batch of its third unit: deterministic, retried or not."""

    def __init__(self, batches_per_unit: int) -> None:
        super().__init__()
        self.batches_per_unit = batches_per_unit
        self.net = nn.Linear(40, 10)
        self.register_buffer("batches", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            if int(self.batches) == 2 * self.batches_per_unit:
                raise RuntimeError("chaos: this config raises in its third unit")
            self.batches += 1
        return self.net(x)


class HangsOnce(nn.Module):
    """Its first training batch sleeps ``seconds``: the unit runs past unit_timeout."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.net = nn.Linear(40, 10)
        self.register_buffer("hung", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training and int(self.hung) == 0:
            time.sleep(self.seconds)
            self.hung += 1
        return self.net(x)


def chaos_model_fn(config: dict[str, Any]) -> nn.Module:
    kind = config.get("chaos")
    if kind == "hog":
        return MemoryHog(config["gigabytes"])
    if kind == "raise":
        return RaisesInThirdUnit(config["batches_per_unit"])
    if kind == "hang":
        return HangsOnce(config["seconds"])
    return model_fn(config)


SPEC = TrainingSpec(model_fn=chaos_model_fn, optimizer_fn=optimizer_fn,
                    metrics={"accuracy": accuracy}, batch_size=BATCH)


def configs(healthy: int, batches_per_unit: int) -> tuple[list[dict], dict[str, int]]:
    """``healthy`` MLPs, with the three bad configs among them; returns the list and
    the position of each bad one."""
    rng = random.Random(0)
    good = [{"arch": "mlp", "width": rng.choice([32, 64, 128]), "lr": round(10 ** rng.uniform(-3.5, -2), 6),
             "dropout": rng.choice([0.0, 0.1, 0.2]), "weight_decay": 1e-4} for _ in range(healthy)]
    bad = {"hog": {"chaos": "hog", "gigabytes": HOG_GB},
           "raise": {"chaos": "raise", "batches_per_unit": batches_per_unit},
           "hang": {"chaos": "hang", "seconds": HANG}}
    where = {"hog": 1, "raise": 4, "hang": 7}
    out = list(good)
    for name in sorted(where, key=where.get):
        out.insert(where[name], {**bad[name], "lr": 1e-3})
    return out, where


# ------------------------------------------------------------------ the cluster
class Cluster:
    """`dask scheduler` and WORKERS `dask worker`s with nannies, as real processes."""

    def __init__(self, folder: Path, memory_limit: str) -> None:
        bin_dir = Path(sys.executable).parent
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "examples"), str(Path(__file__).parent)]))
        env.pop("MALLOC_TRIM_THRESHOLD_", None)
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        scheduler_file = folder / "scheduler.json"
        self.scheduler = subprocess.Popen([bin_dir / "dask", "scheduler", "--host", "127.0.0.1", "--port", "0",
                                           "--no-dashboard", "--scheduler-file", scheduler_file], **quiet)
        # Dask's own reader: the scheduler creates the file before it writes it
        self.address = json_load_robust(str(scheduler_file), timeout=60)["address"]
        self.nannies = [subprocess.Popen([bin_dir / "dask", "worker", self.address, "--nthreads", "1",
                                          "--memory-limit", memory_limit, "--no-dashboard",
                                          "--host", "127.0.0.1"], **quiet) for _ in range(WORKERS)]

    def worker_pids(self) -> list[int]:
        """The worker processes the nannies run now (a nanny restarting one has none)."""
        import psutil

        pids = []
        for nanny in self.nannies:
            try:
                pids += [c.pid for c in psutil.Process(nanny.pid).children() if "python" in c.name().lower()
                         or c.cmdline()[:1] == [sys.executable]]
            except psutil.NoSuchProcess:
                pass
        return pids

    def close(self) -> None:
        for p in [*self.nannies, self.scheduler]:
            p.kill()
        for p in [*self.nannies, self.scheduler]:
            p.wait(timeout=30)


class Killer(threading.Thread):
    """SIGKILLs a random worker process every ``every`` seconds (+-1/3, seeded)."""

    def __init__(self, cluster: Cluster, every: float, seed: int = 0) -> None:
        super().__init__(name="chaos-killer", daemon=True)
        self.cluster, self.every, self.rng = cluster, every, random.Random(seed)
        self.stopped = threading.Event()
        self.kills: list[float] = []

    def run(self) -> None:
        started = time.monotonic()
        while not self.stopped.wait(self.every * self.rng.uniform(2 / 3, 4 / 3)):
            pids = self.cluster.worker_pids()
            if pids:
                try:
                    os.kill(self.rng.choice(sorted(pids)), 9)
                    self.kills.append(round(time.monotonic() - started, 2))
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        self.stopped.set()
        self.join()


# ---------------------------------------------------------------- the campaign
def reference(data: PartitionedDataset, healthy: list[tuple[int, dict]], epochs: int) -> list[dict]:
    """The fault-free result: the in-process executor, each model at its offset in the campaign."""
    with Session(SPEC, data, executor="local", seed=0) as s:
        ids = [s.add(c, epochs=epochs, offset=offset) for offset, c in healthy]
        s.run()
        return [s.model(i).state()["model"] for i in ids]


def campaign(healthy: int = 12, epochs: int = 3, kill_every: float = 6.0, samples: int = 4000,
             seed: int = 0) -> dict[str, Any]:
    """Run the campaign; return its record (see the module docstring)."""
    from distributed import Client

    X, y, Xv, yv = load_mnist1d(samples)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=PARTITIONS, valid=(Xv, yv))
    rows = [len(part) for part in torch.arange(len(X)).tensor_split(PARTITIONS)]
    per_unit = {math.ceil(r / BATCH) for r in rows}
    assert len(per_unit) == 1, f"partitions of {rows} rows differ in batches"
    all_configs, bad_at = configs(healthy, per_unit.pop())
    good = [(i, c) for i, c in enumerate(all_configs) if "chaos" not in c]
    started = time.monotonic()
    expected = reference(data, good, epochs)
    reference_seconds = time.monotonic() - started

    with tempfile.TemporaryDirectory() as folder:
        cluster = Cluster(Path(folder), MEMORY_LIMIT)
        try:
            with Client(cluster.address) as client:
                client.wait_for_workers(WORKERS, timeout=120)
                killer = Killer(cluster, kill_every, seed)
                usage = resource.getrusage(resource.RUSAGE_SELF)
                started = time.monotonic()
                with Session(SPEC, data, client=client, seed=seed, unit_timeout=UNIT_TIMEOUT,
                             max_unit_retries=3, no_worker_timeout=120) as s:
                    ids = [s.add(c, epochs=epochs) for c in all_configs]
                    killer.start()
                    try:
                        history = s.run()
                    finally:
                        killer.stop()
                    wall = time.monotonic() - started
                    after = resource.getrusage(resource.RUSAGE_SELF)
                    cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
                    states = {i: s.model(i).state()["model"] for i in ids if s.status(i) == "paused"}
                    status = {i: s.status(i) for i in ids}
                    errors = {i: s.model(i).error for i in ids}
                keys_left = _keys_left(client)
        finally:
            cluster.close()

    healthy_ids = [i for i, _ in good]
    same = [all(torch.equal(states[i][k], ref[k]) for k in ref) if i in states else False
            for i, ref in zip(healthy_ids, expected)]
    error_rows = history[history["error"].notna()] if "error" in history else history.iloc[:0]
    bad = {name: {"model_id": i, "status": status[i],
                  "reason": (errors[i] or "").splitlines()[0][:300],
                  "history_error": error_rows[error_rows.model_id == i]["error"].tolist()}
           for name, i in bad_at.items()}
    return {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "workers": WORKERS, "memory_limit": MEMORY_LIMIT, "partitions": PARTITIONS,
        "healthy_configs": healthy, "epochs": epochs, "kill_every_s": kill_every,
        "unit_timeout_s": UNIT_TIMEOUT, "hog_gb": HOG_GB, "hang_s": HANG,
        "kills": len(killer.kills), "kill_times_s": killer.kills,
        "wall_s": round(wall, 1), "reference_s": round(reference_seconds, 1),
        "driver_cpu_s": round(cpu, 2), "driver_cpu_per_wall": round(cpu / wall, 3),
        "healthy_bitwise_equal": sum(same), "healthy_total": len(same),
        "healthy_status": sorted({status[i] for i in healthy_ids}),
        "bad": bad, "keys_left": keys_left,
        "history_rows": len(history),
    }


def _keys_left(client: Any, wait: float = 30.0) -> list[str]:
    deadline = time.time() + wait
    keys: list[str] = []
    while time.time() < deadline:
        keys = client.run_on_scheduler(lambda dask_scheduler: sorted(map(str, dask_scheduler.tasks)))
        if not keys:
            break
        time.sleep(0.5)  # released keys are forgotten asynchronously
    return keys


def passed(record: dict[str, Any]) -> list[str]:
    """What the campaign requires, as failures (empty: it passed)."""
    out = []
    if record["healthy_bitwise_equal"] != record["healthy_total"]:
        out.append(f"{record['healthy_total'] - record['healthy_bitwise_equal']} healthy models differ")
    if record["healthy_status"] != ["paused"]:
        out.append(f"healthy models ended {record['healthy_status']}")
    want = {"hog": "WorkerDied: its worker died each of the 4 times", "raise": "RuntimeError: chaos",
            "hang": "UnitTimeout: the unit ran"}
    for name, prefix in want.items():
        got = record["bad"][name]
        if got["status"] != "failed" or not got["reason"].startswith(prefix) or \
                not any(e.startswith(prefix) for e in got["history_error"]):
            out.append(f"{name}: {got}")
    if record["keys_left"]:
        out.append(f"keys left: {record['keys_left'][:5]}")
    if record["driver_cpu_per_wall"] > 0.5:
        out.append(f"driver CPU {record['driver_cpu_per_wall']} of wall time")
    if record["kills"] < 3:
        out.append(f"only {record['kills']} kills")
    return out


def _markdown(record: dict[str, Any], failures: list[str]) -> str:
    bad = "\n".join(f"| {name} | {b['model_id']} | {b['status']} | {b['reason'][:140]} |"
                    for name, b in record["bad"].items())
    return f"""# Fault campaign ({record['when']})

`python benchmarks/bench_chaos.py --healthy {record['healthy_configs']} --epochs {record['epochs']} --kill-every {record['kill_every_s']}`
(`make chaos`): {record['workers']} `dask worker`s with nannies and `--memory-limit {record['memory_limit']}`, a
`dask scheduler`, on loopback; {record['partitions']} partitions of MNIST-1D; MLPs.

| what | result |
|---|---|
| worker processes SIGKILLed at random (nanny restarts) | {record['kills']} in {record['wall_s']} s (at {record['kill_times_s']} s) |
| healthy models bitwise equal to the fault-free run (in-process executor) | {record['healthy_bitwise_equal']} of {record['healthy_total']} |
| healthy models' final status | {', '.join(record['healthy_status'])} |
| keys left on the cluster after the session closed | {len(record['keys_left'])} |
| driver CPU seconds / wall seconds | {record['driver_cpu_s']} / {record['wall_s']} = {record['driver_cpu_per_wall']} |
| fault-free reference run (in-process, serial) | {record['reference_s']} s |

Each bad config failed alone, its reason in the history:

| config | model | status | reason |
|---|---|---|---|
{bad}

Verdict: {"passed" if not failures else "FAILED: " + "; ".join(failures)}.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--healthy", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--kill-every", type=float, default=6.0)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    record = campaign(args.healthy, args.epochs, args.kill_every, args.samples)
    failures = passed(record)
    record["failures"] = failures
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos.json").write_text(json.dumps(record, indent=2))
    (args.out / "chaos.md").write_text(_markdown(record, failures))
    print(_markdown(record, failures))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
