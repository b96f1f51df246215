"""One fusion group's unit in this process, no Dask: k members trained fused, against
the same group trained one by one (the same data order), for bench_fusion's MLP or
1-D CNN on 8,000 random rows, one torch thread.

    python benchmarks/compare_fused_unit.py [--arch mlp|cnn] [-k 8] [--repeat 5]

Prints the median seconds of each and their ratio: the compute side of fusion,
without the scheduling around it (``bench_fusion.py`` measures the whole search).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fusion import COMMON, OneByOneSpec  # noqa: E402

from cerebro_automl import TrainingSpec  # noqa: E402
from cerebro_automl.data import TensorShard  # noqa: E402
from cerebro_automl.fusion import Member, group_config  # noqa: E402
from cerebro_automl.training import train_group  # noqa: E402


def unit_seconds(
    spec: TrainingSpec, members: list[Member], shard: TensorShard, repeat: int
) -> tuple[float, str | None]:
    """The median seconds of a group's second unit (the first pays vmap's first call)."""
    times, reason = [], None
    for _ in range(repeat):
        state = None
        for epoch in range(2):
            started = time.perf_counter()
            state = train_group(spec, group_config(members), state, shard, device=torch.device("cpu"), epoch=epoch,
                                partition=0, step=0, epoch_end=True, deadline=None, fresh_hyperparameters=False)
        times.append(time.perf_counter() - started)
        reason = state["unfused"]
    return statistics.median(times), reason


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("-k", type=int, default=8, help="members in the group")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    width = 128 if args.arch == "mlp" else 32
    members = [Member(i, {"arch": args.arch, "width": width, "batch_size": 64, "lr": 1e-3 * (i + 1),
                          "weight_decay": 1e-3}, 100 + i) for i in range(args.k)]
    generator = torch.Generator().manual_seed(0)
    shard = TensorShard(torch.randn(8000, 40, generator=generator), torch.randint(0, 10, (8000,), generator=generator))
    fused, reason = unit_seconds(TrainingSpec(**COMMON), members, shard, args.repeat)
    apart, _ = unit_seconds(OneByOneSpec(**COMMON), members, shard, args.repeat)
    assert reason is None, reason
    print(f"{args.arch}, k={args.k}, 8000 rows, batch 64: fused {fused:.3f} s, one by one {apart:.3f} s, "
          f"one by one / fused {apart / fused:.2f}x")


if __name__ == "__main__":
    main()
