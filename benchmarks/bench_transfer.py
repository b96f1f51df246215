"""Transfer learning: frozen features computed once per partition against the frozen
backbone inside model_fn, on 2 workers.

    python benchmarks/bench_transfer.py [--rows 10000] [--epochs 5] [--backbone cnn|resnet50] [--out benchmarks/results]

A frozen 4-block CNN (weights fixed by a seed, standing in for a pretrained one) and
synthetic 3x32x32 images (``--backbone resnet50``: a ResNet-50-shaped one, for a GPU,
written to transfer_resnet50.md). 16 configurations: 4 layers x 2 head widths x 2 learning
rates, each an MLP on one layer's average-pooled output. The same search runs twice,
each on a fresh LocalCluster of 2 single-threaded workers started before the clock:

* ``FrozenFeatures``: each worker computes its partition's four layers once, in one
  staged pass, and the heads train on them;
* the backbone inside ``model_fn`` (kept in eval mode, under ``no_grad``): every unit
  of every configuration runs the frozen layers again.

Reported: makespan, configurations per hour and their ratio, the best validation
accuracy of each run, whether every model-epoch's val_loss is equal bit for bit,
the bytes of one model's state (what hops and is checkpointed), and each run's peak
worker memory (max RSS over the workers).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import functools

import distributed
import torch
from distributed import Client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from cerebro_automl import FrozenFeatures, PartitionedDataset, Session, TrainingSpec, accuracy  # noqa: E402
from cerebro_automl.executors.dask import start_local_cluster  # noqa: E402
from transfer_models import LAYERS, backbone_fn, full_model_fn, head_fn, optimizer_fn, synthetic_images  # noqa: E402

WORKERS = 2
COMMON = {"optimizer_fn": optimizer_fn, "metrics": {"accuracy": accuracy}, "batch_size": 64}


def configs_of(backbone: str) -> list[dict]:
    """4 layers x 2 head widths x 2 learning rates (the CNN's configs name no arch)."""
    arch = {} if backbone == "cnn" else {"arch": backbone}
    return [{"layer": layer, "width": width, "lr": lr, **arch}
            for layer in LAYERS for width in (32, 128) for lr in (1e-3, 3e-3)]


def specs_of(backbone: str) -> dict[str, TrainingSpec]:
    features = FrozenFeatures(functools.partial(backbone_fn, backbone), LAYERS, pool="avg")
    return {
        "FrozenFeatures": TrainingSpec(model_fn=head_fn, features=features, **COMMON),
        "backbone inside model_fn": TrainingSpec(model_fn=full_model_fn, **COMMON),
    }


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(spec: TrainingSpec, data: PartitionedDataset, configs: list[dict], epochs: int) -> dict:
    with start_local_cluster(WORKERS) as cluster, Client(cluster) as client:
        client.run(lambda: torch.set_num_threads(1))
        with Session(spec, data, client=client) as s:
            started = time.perf_counter()
            ids = [s.add(c, epochs=epochs) for c in configs]
            history = s.run()
            makespan = time.perf_counter() - started
            state = s.model(ids[-1]).state()
        peak = max(client.run(_peak_rss_mib).values())
    state_bytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    return {"makespan_s": makespan, "configs_per_hour": len(configs) / makespan * 3600,
            "best_val_accuracy": float(history["val_accuracy"].max()),
            "best_by_layer": {layer: float(history[history.model_id.isin(
                [i for i, c in zip(ids, configs) if c["layer"] == layer])]["val_accuracy"].max()) for layer in LAYERS},
            "val_loss": [float(v) for v in history.sort_values(["model_id", "epoch"])["val_loss"]],
            "model_state_bytes": state_bytes, "peak_worker_rss_mib": peak,
            "train_seconds": float(history["train_seconds"].sum()),
            "val_seconds": float(history["val_seconds"].sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000, help="images (80%% train, 20%% validation)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--backbone", choices=("cnn", "resnet50"), default="cnn")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    X, y = synthetic_images(args.rows)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=WORKERS, valid_fraction=0.2)
    configs = configs_of(args.backbone)
    runs = {name: run(spec, data, configs, args.epochs) for name, spec in specs_of(args.backbone).items()}
    fast, slow = runs["FrozenFeatures"], runs["backbone inside model_fn"]
    ratio = fast["configs_per_hour"] / slow["configs_per_hour"]
    same = fast["val_loss"] == slow["val_loss"]
    resnet = args.backbone == "resnet50"
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"{os.cpu_count()} CPU cores"
    lines = [
        "# Transfer learning: frozen features against the backbone inside model_fn"
        + (", ResNet-50-shaped backbone" if resnet else ""),
        "",
        f"`python benchmarks/bench_transfer.py{' --backbone resnet50' if resnet else ''}` — "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {device}, torch {torch.__version__}, "
        f"dask {distributed.__version__}. A frozen {'ResNet-50-shaped backbone' if resnet else '4-block CNN'}; "
        f"{len(configs)} configurations (4 layers x 2 head widths x 2 learning rates) x {args.epochs} epochs, "
        f"{args.rows} synthetic 3x32x32 images in {WORKERS} partitions, {WORKERS} single-threaded workers.",
        "",
        "| | makespan | configurations per hour | best val_accuracy | one model's state | peak worker memory |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        lines.append(f"| {name} | {r['makespan_s']:.1f} s | {r['configs_per_hour']:.0f} | "
                     f"{r['best_val_accuracy']:.4f} | {r['model_state_bytes'] / 1024:.0f} KiB | "
                     f"{r['peak_worker_rss_mib']:.0f} MiB |")
    lines += [
        "",
        f"FrozenFeatures / backbone inside model_fn, configurations per hour: **{ratio:.2f}x** (goal: at least 5x).",
        f"val_loss equal bit for bit in every model-epoch: {'yes' if same else 'no'}.",
        "Best val_accuracy by layer: " + ", ".join(f"{k} {v:.4f}" for k, v in fast["best_by_layer"].items()) + ".",
    ]
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "transfer_resnet50" if resnet else "transfer"
    (out / f"{name}.md").write_text(table + "\n")
    (out / f"{name}.json").write_text(json.dumps({"runs": runs, "ratio": ratio, "same_val_loss": same,
                                                   "rows": args.rows, "epochs": args.epochs}, indent=2))


if __name__ == "__main__":
    main()
