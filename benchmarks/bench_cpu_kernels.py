"""What pinning the CPU kernels to AVX2 costs: the same MOP search in fresh
processes with the pinned kernels (what ``import cerebro_automl`` sets) and with the
machine's own (``ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=ALL MKL_CBWR=AUTO``),
alternated, side by side in one run.

    python benchmarks/bench_cpu_kernels.py [--rounds 3] [--out benchmarks/results]

Workloads, each 4 configurations x 3 epochs on 2 partitions, one thread, the local
executor (the Dask workers' bits): the demo's MLP and 1-D CNN on MNIST-1D, and a
small attention model (convolution, multi-head attention, LayerNorm, GELU). The
time is the search's, measured inside each process (no interpreter start).
Reported: the median seconds of each and the ratio pinned / native, written to
cpu_kernels.{md,json}. On a CPU without AVX-512 both are the same kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"}
NATIVE = {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "ALL", "MKL_CBWR": "AUTO"}
WORKLOADS = ("mlp", "cnn", "attention")


def search(workload: str) -> tuple[float, str]:
    """Run one workload here; its seconds and the kernels its units ran with."""
    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT / "tests"))
    import cerebro_automl  # noqa: F401  (first: the kernels are chosen at the first torch operation)
    import torch
    from isa_probe import Probe
    from mnist1d_models import load_mnist1d, model_fn, optimizer_fn

    from cerebro_automl import PartitionedDataset, Session, TrainingSpec

    torch.set_num_threads(1)
    X, y, Xv, yv = load_mnist1d(8000)
    if workload == "attention":
        X, Xv = X[:, :16], Xv[:, :16]
        spec = TrainingSpec(model_fn=lambda c: Probe(c["width"], 10), optimizer_fn=optimizer_fn, batch_size=64)
        configs = [{"width": w, "lr": lr} for w in (32, 64) for lr in (1e-3, 3e-3)]
    else:
        spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn, batch_size=64)
        configs = [{"arch": workload, "width": w, "lr": lr} for w in (32, 64) for lr in (1e-3, 3e-3)]
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    started = time.perf_counter()
    with Session(spec, data, seed=0, executor="local", progress=False) as s:
        for config in configs:
            s.add(config, epochs=3)
        history = s.run()
    return time.perf_counter() - started, str(history["device"].iloc[0])


def timed(workload: str, env: dict[str, str]) -> tuple[float, str]:
    done = subprocess.run([sys.executable, __file__, "--one", workload], env={**os.environ, **env},
                          capture_output=True, text=True, check=True)
    seconds, device = done.stdout.strip().splitlines()[-1].split(" ", 1)
    return float(seconds), device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.one:
        seconds, device = search(args.one)
        print(f"{seconds:.4f} {device}")
        return
    rows = []
    for workload in WORKLOADS:
        times: dict[str, list[float]] = {"pinned": [], "native": []}
        devices = {}
        for _ in range(args.rounds):
            for name, env in (("pinned", PINNED), ("native", NATIVE)):
                seconds, devices[name] = timed(workload, env)
                times[name].append(seconds)
        pinned, native = statistics.median(times["pinned"]), statistics.median(times["native"])
        rows.append({"workload": workload, "pinned_seconds": pinned, "native_seconds": native,
                     "ratio": pinned / native, "pinned_kernels": devices["pinned"],
                     "native_kernels": devices["native"]})
        print(f"{workload}: pinned {pinned:.2f} s ({devices['pinned']}), native {native:.2f} s "
              f"({devices['native']}), ratio {pinned / native:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"rounds": args.rounds, "date": datetime.now(timezone.utc).date().isoformat(),
            "cpu": _cpu_name()}
    (out / "cpu_kernels.json").write_text(json.dumps({"rows": rows, **meta}, indent=1) + "\n")
    lines = [
        "# What pinning the CPU kernels to AVX2 costs",
        "",
        f"`python benchmarks/bench_cpu_kernels.py` — {meta['date']}, {meta['cpu']}. 4 configurations x 3 "
        f"epochs on 2 partitions, one thread, median of {args.rounds} alternated runs of each.",
        "",
        "<!-- --8<-- [start:table] -->",
        "| workload | pinned (AVX2) | the machine's own kernels | pinned / own |",
        "|---|---|---|---|",
        *(f"| {r['workload']} | {r['pinned_seconds']:.2f} s | {r['native_seconds']:.2f} s ({r['native_kernels']}) "
          f"| {r['ratio']:.2f}x |" for r in rows),
        "<!-- --8<-- [end:table] -->",
    ]
    (out / "cpu_kernels.md").write_text("\n".join(lines) + "\n")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
