"""Where a fusion group's unit spends its time, on a GPU (or the CPU): bench_gpu's
small CNN (the 8 configurations of one width) or one of its timm models (``--model``,
its first 8 configurations) as one group, one partition's pass per unit, no Dask.

    python benchmarks/profile_fused_unit.py [--rows 50000] [--width 32] [--model cnn|timm-resnet10t|...]
                                            [--units 3] [--apart] [--profile]

Prints each unit's wall time and the samples/s of the group; with ``--apart``,
the same members trained one by one through the one loop (the ratio is fusion's
gain inside a unit); on a GPU, the host synchronisations one unit makes (torch's
sync debug mode); with ``--profile``, the device's kernel time against the wall
time of one unit (how busy the GPU is) and the ops that take the most time.
``bench_gpu.py --parts fusion`` measures the whole search; this says why.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fusion import OneByOneSpec  # noqa: E402
from bench_gpu import CONFIGS, TIMM_MODELS, make_images, model_fn, optimizer_fn  # noqa: E402

from cerebro_automl import TrainingSpec, accuracy  # noqa: E402
from cerebro_automl.data import TensorShard  # noqa: E402
from cerebro_automl.fusion import Member, group_config  # noqa: E402
from cerebro_automl.training import train_group  # noqa: E402

COMMON = dict(model_fn=model_fn, optimizer_fn=optimizer_fn, metrics={"accuracy": accuracy}, batch_size=256,
              eval_batch_size=2048)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def units(spec: TrainingSpec, members: list[Member], shard: TensorShard, device: torch.device,
          count: int) -> tuple[list[float], str | None]:
    """Each unit's wall seconds (one unit per epoch, on ``shard``), and why the group
    did not fuse (None when it did). Prints a fused group's last unit's phases, as the
    device's clock measured them (the state moved in and stacked, training, moved out)."""
    state, seconds = None, []
    for epoch in range(count):
        _sync(device)
        started = time.perf_counter()
        state = train_group(spec, group_config(members), state, shard, device=device, epoch=epoch, partition=0,
                            step=0, epoch_end=True, deadline=None, fresh_hyperparameters=False)
        _sync(device)
        seconds.append(time.perf_counter() - started)
        if state["failed"]:
            raise RuntimeError(f"members failed: {state['failed']}")
    if state["unfused"] is None:  # one by one, a member's phases are its own pass's
        phases = next(iter(state["members"].values()))["progress"].get("phase_seconds", {})
        print("  the fused group's last unit: " + ", ".join(f"{k} {v:.3f} s" for k, v in phases.items()))
    return seconds, state["unfused"]


def host_syncs(members: list[Member], shard: TensorShard, device: torch.device) -> Counter:
    """The synchronisations with the host in one fused unit, by message."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            units(TrainingSpec(**COMMON), members, shard, device, 1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return Counter(str(w.message)[:120] for w in caught)


def profile(members: list[Member], shard: TensorShard, device: torch.device) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        [wall], _ = units(TrainingSpec(**COMMON), members, shard, device, 1)
    table = prof.key_averages()
    if device.type == "cuda":
        busy = sum(e.self_device_time_total for e in table) / 1e6
        print(f"profiled unit: {wall:.3f} s wall, {busy:.3f} s of kernels ({busy / wall:.0%} busy)")
        print(table.table(sort_by="self_device_time_total", row_limit=15))
    print(table.table(sort_by="self_cpu_time_total", row_limit=20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000, help="rows of the partition a unit passes over")
    parser.add_argument("--width", type=int, choices=(16, 32), default=32, help="which group of bench_gpu's grid")
    parser.add_argument("--model", default="cnn", choices=["cnn", *TIMM_MODELS])
    parser.add_argument("--units", type=int, default=3, help="units timed; the first pays the warm-up")
    parser.add_argument("--apart", action="store_true", help="also train the members one by one")
    parser.add_argument("--profile", action="store_true", help="profile one fused unit")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    if args.model == "cnn":
        configs = [c for c in CONFIGS if c["width"] == args.width]
    else:
        configs = [{**c, "model": args.model} for c in CONFIGS[:8]]
    members = [Member(i, c, 100 + i) for i, c in enumerate(configs)]
    shard = TensorShard(*make_images(args.rows, seed=0))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    model = f"width {args.width}" if args.model == "cnn" else args.model
    print(f"{name}: {len(members)} members of {model}, {args.rows} rows, batch 256")
    fused, reason = units(TrainingSpec(**COMMON), members, shard, device, args.units)
    steady = statistics.median(fused[1:] or fused)
    print(f"fused (unfused: {reason}): units {[round(s, 3) for s in fused]} s; "
          f"{len(members) * args.rows / steady:,.0f} samples/s")
    if args.apart:
        apart, _ = units(OneByOneSpec(**COMMON), members, shard, device, 2)
        print(f"one by one: {len(members) * args.rows / apart[-1]:,.0f} samples/s; "
              f"fused / one by one {apart[-1] / steady:.2f}x")
    if device.type == "cuda":
        syncs = host_syncs(members, shard, device)
        print(f"host synchronisations in one fused unit: {sum(syncs.values())}", dict(syncs))
    if args.profile:
        profile(members, shard, device)


if __name__ == "__main__":
    main()
