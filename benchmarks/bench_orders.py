"""What the visit order does to accuracy: the same models in fixed order (a Latin
permutation of its own for every epoch) and in cyclic order (epoch 0's permutation
for every epoch: each model walks one ring of the partitions).

    python benchmarks/bench_orders.py [--epochs 8] [--seeds 5] [--out benchmarks/results]

6 MLP configurations (width x learning rate) on MNIST-1D, trained together by MOP on
the local executor over 8 partitions, with session seeds 0, 1, ... (each seed draws
other permutations and other initial weights). Two ways in: the default partitioning
(a seeded permutation of the rows: every partition a sample of the whole) and rows
sorted by class given with ``shuffle=False`` (each partition holds two or three
classes, so the order of the partitions matters most). Reported: the final
validation accuracy, mean over configurations and seeds, and the largest gap between
the two orders for one seed, written to orders.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_partitioning import CONFIGS, final_accuracies  # noqa: E402
from mnist1d_models import load_mnist1d  # noqa: E402

ORDERS = ("fixed", "cyclic")
PARTITIONS = 8
WAYS = {
    "default partitioning (a seeded permutation of the rows)": ("shuffled", {}),
    "sorted by class, shuffle=False": ("sorted", {"shuffle": False}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    X, y, Xv, yv = load_mnist1d(args.samples)
    by_class = np.argsort(y, kind="stable")
    inputs = {"shuffled": (X, y), "sorted": (X[by_class], y[by_class])}
    rows = []
    for name, (which, options) in WAYS.items():
        acc = {order: [final_accuracies(*inputs[which], (Xv, yv), args.epochs, options, PARTITIONS, seed=seed,
                                        order=order) for seed in range(args.seeds)] for order in ORDERS}
        gaps = [float(np.mean(c) - np.mean(f)) for f, c in zip(acc["fixed"], acc["cyclic"], strict=True)]
        row = {"data": name, **{f"{o}_mean_val_accuracy": float(np.mean(acc[o])) for o in ORDERS},
               **{f"{o}_by_seed": [float(np.mean(a)) for a in acc[o]] for o in ORDERS},
               "largest_gap": max(gaps, key=abs)}
        rows.append(row)
        print(f"{name}: fixed {row['fixed_mean_val_accuracy']:.3f}, cyclic {row['cyclic_mean_val_accuracy']:.3f}, "
              f"largest gap for one seed {row['largest_gap']:+.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"configs": len(CONFIGS), "epochs": args.epochs, "partitions": PARTITIONS, "seeds": args.seeds,
            "train_rows": len(y), "date": datetime.now(timezone.utc).date().isoformat()}
    (out / "orders.json").write_text(json.dumps({"rows": rows, **meta}, indent=1) + "\n")
    lines = [
        "# Fixed and cyclic order: accuracy",
        "",
        f"`python benchmarks/bench_orders.py` — {meta['date']}. MNIST-1D ({len(y)} training rows), "
        f"{len(CONFIGS)} MLP configurations x {args.epochs} epochs, {PARTITIONS} partitions, session seeds "
        f"0-{args.seeds - 1}; final validation accuracy, the mean over configurations and seeds.",
        "",
        "<!-- --8<-- [start:table] -->",
        "| data and partitioning | fixed order | cyclic order | cyclic - fixed, the largest for one seed |",
        "|---|---|---|---|",
        *(f"| {r['data']} | {r['fixed_mean_val_accuracy']:.3f} | {r['cyclic_mean_val_accuracy']:.3f} | "
          f"{r['largest_gap']:+.3f} |" for r in rows),
        "<!-- --8<-- [end:table] -->",
    ]
    (out / "orders.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
