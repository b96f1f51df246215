"""glibc's allocator settings under a fusion group's training and evaluation: glibc's
default against the settings of the workers ``start_local_cluster`` starts
(``WORKER_MALLOC``: ``MALLOC_MMAP_THRESHOLD_`` 32 MiB, ``MALLOC_TRIM_THRESHOLD_`` 128 MiB).

    python benchmarks/compare_allocator.py [--arch cnn|mlp] [--rounds 3] [--out benchmarks/results]

glibc reads these variables when a process starts, so each measurement is a fresh
process with one setting, the two settings taking turns round by round. A process
trains a group of 8 members of bench_fusion's model on 4,000 random rows, fused and
one by one (the best of 4 units, in ms per step), and evaluates the group on 10,000
rows, fused and one by one (the best of 4). It counts the minor page faults each
took: a fault is a page the allocator returned to the system and got back.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("glibc default", "WORKER_MALLOC")
STEPS = 4000 // 64 + 1  # batches of one unit


def measure(arch: str) -> dict[str, float]:
    """This process's figures: best seconds and faults of each way of training and evaluating."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_fusion import COMMON, OneByOneSpec

    from cerebro_automl import TrainingSpec
    from cerebro_automl.data import TensorShard
    from cerebro_automl.fusion import Member, group_config
    from cerebro_automl.training import train_group
    from cerebro_automl.training.groups import evaluate_group

    torch.set_num_threads(1)
    width = 128 if arch == "mlp" else 32
    members = [Member(i, {"arch": arch, "width": width, "batch_size": 64, "lr": 1e-3 * (i + 1),
                          "weight_decay": 1e-3}, 100 + i) for i in range(8)]
    generator = torch.Generator().manual_seed(0)
    train = TensorShard(torch.randn(4000, 40, generator=generator), torch.randint(0, 10, (4000,), generator=generator))
    valid = TensorShard(torch.randn(10000, 40, generator=generator), torch.randint(0, 10, (10000,), generator=generator))
    specs = {"fused": TrainingSpec(**COMMON), "one by one": OneByOneSpec(**COMMON)}
    states = dict.fromkeys(specs)
    out: dict[str, float] = {}

    def timed(key: str, fn) -> None:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        fn()
        seconds = time.perf_counter() - started
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        if seconds < out.get(f"{key} s", float("inf")):
            out[f"{key} s"], out[f"{key} faults"] = seconds, faults

    for epoch in range(5):  # the first unit pays the imports and is not counted
        for name, spec in specs.items():
            def unit(name=name, spec=spec, epoch=epoch) -> None:
                states[name] = train_group(spec, group_config(members), states[name], train,
                                           device=torch.device("cpu"), epoch=epoch, partition=0, step=0,
                                           epoch_end=True, deadline=None, fresh_hyperparameters=False)
            if epoch == 0:
                unit()
                continue
            timed(f"train {name}", unit)
            timed(f"evaluate {name}", lambda name=name, spec=spec: evaluate_group(
                spec, group_config(members), states[name], valid))
    return out


def child_env(setting: str) -> dict[str, str]:
    from cerebro_automl.executors.dask.cluster import WORKER_MALLOC

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if setting == "WORKER_MALLOC":
        env.update(WORKER_MALLOC)
    return env


def report(arch: str, rounds: list[dict[str, dict[str, float]]]) -> tuple[str, dict]:
    keys = list(rounds[0][SETTINGS[0]])
    medians = {s: {k: statistics.median(r[s][k] for r in rounds) for k in keys} for s in SETTINGS}
    import torch

    lines = [
        "# glibc's allocator settings under fused training and evaluation",
        "",
        f"`python benchmarks/compare_allocator.py --arch {arch}` — {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, "
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores, one torch thread; 8 members of bench_fusion's {arch}, "
        f"batch 64; medians of {len(rounds)} rounds, each a fresh process per setting.",
        "",
        "| | " + " | ".join(SETTINGS) + " | default / WORKER_MALLOC |",
        "|---|---|---|---|",
    ]
    for way in ("train fused", "train one by one", "evaluate fused", "evaluate one by one"):
        a, b = (medians[s][f"{way} s"] for s in SETTINGS)
        scale, unit = (1e3 / STEPS, "ms per step") if way.startswith("train") else (1.0, "s for 10,000 rows")
        fa, fb = (medians[s][f"{way} faults"] for s in SETTINGS)
        lines.append(f"| {way}, {unit} (page faults) | {a * scale:.3f} ({fa:,.0f}) | {b * scale:.3f} ({fb:,.0f}) "
                     f"| {a / b:.2f}x |")
    return "\n".join(lines) + "\n", {"arch": arch, "rounds": rounds, "medians": medians}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("cnn", "mlp"), default="cnn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write allocator.{md,json} into this folder")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        environ = {name: os.environ.get(name) for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
        print(json.dumps({"environ": environ, "figures": measure(args.arch)}))
        return
    rounds, environs = [], {}
    for _ in range(args.rounds):
        found = {}
        for setting in SETTINGS:
            done = subprocess.run([sys.executable, __file__, "--child", "--arch", args.arch], env=child_env(setting),
                                  check=True, capture_output=True, text=True)
            child = json.loads(done.stdout.strip().splitlines()[-1])
            found[setting], environs[setting] = child["figures"], child["environ"]
        rounds.append(found)
    text, record = report(args.arch, rounds)
    record["environ"] = environs
    print(text)
    if args.out:
        Path(args.out, "allocator.md").write_text(text)
        Path(args.out, "allocator.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
