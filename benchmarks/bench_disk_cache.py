"""Partitions larger than a worker's memory: cache="disk" against cache="memory".

    python benchmarks/bench_disk_cache.py [--gib 3.2] [--fits-mib 256] [--repeats 3] [--full] [--out benchmarks/results]

1. Larger than memory. A LocalCluster of 2 workers with memory_limit="1GiB"
   (Dask's nanny kills a worker that passes 95% of it) trains two linear models
   for one epoch on 2 partitions of ``--gib`` GiB each (float32 rows of 512
   features). Each partition streams from a loader in 64 MiB chunks into the
   worker's disk cache; batches are read from the memory map. A thread samples
   every worker's RSS every 50 ms: the figure is the peak per worker, against
   the partition's size and the memory limit.
2. On data that fits (``--fits-mib`` per partition), the same workload with
   cache="memory" and with cache="disk", alternating, ``--repeats`` times each:
   training throughput (rows per second of unit compute, from the history's
   train_seconds) and its ratio.

Each cluster runs a small warm-up session first (imports, first model builds).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import cloudpickle
import distributed  # noqa: F401  (before the log levels are set)
import numpy as np
import torch
from distributed import Client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy  # noqa: E402
from cerebro_automl.executors.dask import start_local_cluster  # noqa: E402

FEATURES = 512
ROW_BYTES = FEATURES * 4 + 8  # float32 features and an int64 label
CHUNK_BYTES = 64 * 2**20
CONFIGS = [{"lr": 1e-3}, {"lr": 1e-2}]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the tests import this module


def streaming_loader(rows: int, features: int = FEATURES, chunk_bytes: int = CHUNK_BYTES):
    """``fn(i)``: partition i as a stream of random chunks, made on the worker (no file to read)."""
    chunk_rows = max(1, chunk_bytes // (features * 4 + 8))

    def load(i: int):
        for start in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - start)
            x = np.random.default_rng([i, start]).standard_normal((n, features), dtype=np.float32)
            yield x, (x[:, 0] + x[:, 1] > 0).astype(np.int64)

    return load


def make_spec(features: int = FEATURES) -> TrainingSpec:
    return TrainingSpec(model_fn=lambda c: torch.nn.Linear(features, 2),
                        optimizer_fn=lambda c, p: torch.optim.Adam(p, lr=c["lr"]),
                        metrics={"accuracy": accuracy}, batch_size=4096, eval_batch_size=4096)


class RssSampler:
    """Samples the RSS of some processes every ``interval`` seconds, in a thread; keeps the peaks."""

    def __init__(self, pids: dict[str, int], interval: float = 0.05) -> None:
        import psutil

        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.peak = {name: 0 for name in pids}
        self.interval, self._stop = interval, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, process in self.processes.items():
                try:
                    self.peak[name] = max(self.peak[name], process.memory_info().rss)
                except Exception:  # the process is gone: the caller sees it in the pids
                    pass
            time.sleep(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run(client: Client, rows: int, cache: str, features: int = FEATURES) -> dict:
    """Train CONFIGS for one epoch on 2 partitions of ``rows`` rows; RSS peaks per worker."""
    pids = client.run(os.getpid)
    data = PartitionedDataset.from_loader(streaming_loader(rows, features), num_partitions=2,
                                          valid_fraction=0.02, cache=cache)
    started = time.perf_counter()
    with RssSampler(pids) as sampler, Session(make_spec(features), data, client=client, seed=0) as s:
        for config in CONFIGS:
            s.add(config, epochs=1)
        history = s.run()
        errors = [s.model(i).error for i in range(len(CONFIGS))]
    wall = time.perf_counter() - started
    trained_rows = sum(len(CONFIGS) * rows * 0.98 for _ in range(2))
    return {"cache": cache, "rows_per_partition": rows,
            "partition_gib": rows * (features * 4 + 8) / 2**30,
            "peak_rss_mib": {w: sampler.peak[w] / 2**20 for w in sorted(pids)},
            "workers_restarted": client.run(os.getpid) != pids,
            "train_rows_per_s": trained_rows / history.train_seconds.sum(),
            "wall_s": wall, "val_accuracy": history.val_accuracy.tolist(), "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=3.2, help="GiB per partition for the larger-than-memory run")
    parser.add_argument("--fits-mib", type=float, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--full", action="store_true", help="5 repeats on data that fits")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("distributed").setLevel(logging.ERROR)

    if args.full:
        args.repeats = max(args.repeats, 5)
    big_rows = int(args.gib * 2**30 / ROW_BYTES)
    with start_local_cluster(2, memory_limit="1GiB") as cluster, Client(cluster) as client:
        run(client, 4096, "disk")  # warm-up: imports and first builds in the workers
        larger = run(client, big_rows, "disk")
        print(f"disk cache, {larger['partition_gib']:.2f} GiB per partition, memory_limit 1 GiB: "
              f"peak RSS {larger['peak_rss_mib']} MiB, restarted={larger['workers_restarted']}, "
              f"{larger['train_rows_per_s']:.0f} rows/s, {larger['wall_s']:.0f} s")
    fits_rows = int(args.fits_mib * 2**20 / ROW_BYTES)
    fits = {"memory": [], "disk": []}
    with start_local_cluster(2) as cluster, Client(cluster) as client:
        run(client, 4096, "memory")  # warm-up
        for _ in range(args.repeats):
            for cache in ("memory", "disk"):
                fits[cache].append(run(client, fits_rows, cache))
                print(f"{cache}: {fits[cache][-1]['train_rows_per_s']:.0f} rows/s, "
                      f"peak RSS {fits[cache][-1]['peak_rss_mib']} MiB")
    median = {c: statistics.median(r["train_rows_per_s"] for r in runs) for c, runs in fits.items()}
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
        "larger_than_memory": larger, "fits": fits,
        "fits_median_rows_per_s": median, "disk_over_memory": median["disk"] / median["memory"],
        "command": "python benchmarks/bench_disk_cache.py " + " ".join(sys.argv[1:]),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "disk_cache.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "disk_cache.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    big = r["larger_than_memory"]
    peaks = list(big["peak_rss_mib"].values())
    fits = r["fits"]
    peak = {c: max(max(run["peak_rss_mib"].values()) for run in runs) for c, runs in fits.items()}
    return "\n".join([
        f"Disk cache ({r['date']}, {r['cpus']} CPUs; `{r['command']}`)", "",
        "<!-- --8<-- [start:table] -->",
        "| run | partition | cache | worker memory_limit | peak worker RSS | workers restarted | train rows/s |",
        "|---|---|---|---|---|---|---|",
        f"| larger than memory | {big['partition_gib']:.2f} GiB x 2 | disk | 1 GiB | "
        f"{min(peaks):.0f}-{max(peaks):.0f} MiB | {'yes' if big['workers_restarted'] else 'no'} | "
        f"{big['train_rows_per_s']:,.0f} |",
        *(f"| fits in memory (median of {len(runs)}) | {runs[0]['partition_gib'] * 1024:.0f} MiB x 2 | {c} | "
          f"none | {peak[c]:.0f} MiB | no | {r['fits_median_rows_per_s'][c]:,.0f} |" for c, runs in fits.items()),
        "", f"disk / memory throughput on data that fits: {r['disk_over_memory']:.2f}x",
        "<!-- --8<-- [end:table] -->", ""])


if __name__ == "__main__":
    main()
