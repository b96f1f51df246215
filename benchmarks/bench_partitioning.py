"""What the partitioning costs on a dataset sorted by class: MNIST-1D's rows sorted
by label, cut into 4 partitions in their given order (``shuffle=False``) or by the
default seeded permutation, against the same rows shuffled before they are given;
and the sorted rows as files, written class by class into 20 tar shards (``.npy``
members), read with ``from_tar_shards``'s default partitioning.

    python benchmarks/bench_partitioning.py [--epochs 4] [--out benchmarks/results]

6 MLP configurations (width x learning rate), trained together by MOP on the local
executor (the bits are the Dask executor's). MOP visits a model's partitions one
after another, so partitions that each hold a few classes give every model long
runs of those classes: the sequential-SGD convergence MOP promises assumes
partitions that are samples of the whole. Reported: mean and best final validation
accuracy of each way in, written to partitioning.{md,json}.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy  # noqa: E402
from mnist1d_models import load_mnist1d, model_fn, optimizer_fn  # noqa: E402

CONFIGS = [{"arch": "mlp", "width": w, "lr": lr} for w in (64, 128) for lr in (1e-3, 3e-3, 1e-2)]
WAYS = {
    "sorted by class, shuffle=False (the given order)": ("sorted", {"shuffle": False}),
    "sorted by class, default (seeded permutation)": ("sorted", {}),
    "shuffled before it is given, default": ("shuffled", {}),
    "sorted by class as 20 tar shards written class by class, default": ("sorted", {"shards": 20}),
}


def decode_npy(payload: bytes) -> np.ndarray:
    """A ``.npy`` member's array (``from_tar_shards(decode=...)``)."""
    return np.load(io.BytesIO(payload))


def write_shards(folder: Path, X: np.ndarray, y: np.ndarray, shards: int, prefix: str) -> str:
    """``X``/``y`` in their order as ``shards`` tar files of ``.npy`` + ``.cls`` members; their glob."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, rows in enumerate(np.array_split(np.arange(len(y)), shards)):
        with tarfile.open(folder / f"{prefix}-{k:03d}.tar", "w") as tar:
            for i in rows.tolist():
                buffer = io.BytesIO()
                np.save(buffer, X[i])
                for ext, data in (("npy", buffer.getvalue()), ("cls", str(int(y[i])).encode())):
                    info = tarfile.TarInfo(f"{i:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(folder / f"{prefix}-*.tar")


def final_accuracies(X, y, valid, epochs: int, options: dict, partitions: int = 4, **session: Any) -> list[float]:
    """CONFIGS trained together by MOP for ``epochs`` (``options`` partition the rows,
    ``session`` overrides the session's seed 0 and more); each one's last validation accuracy."""
    spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn, metrics={"accuracy": accuracy}, batch_size=64)
    options = dict(options)
    shards = options.pop("shards", None)
    with tempfile.TemporaryDirectory(prefix="bench_partitioning_") as folder:
        if shards is None:
            data = PartitionedDataset.from_arrays(X, y, num_partitions=partitions, valid=valid, **options)
        else:
            data = PartitionedDataset.from_tar_shards(
                write_shards(Path(folder), X, y, shards, "train"), partitions, input="npy", decode=decode_npy,
                valid=write_shards(Path(folder), *valid, partitions, "valid"), **options,
            )  # fmt: skip
        return _trained(spec, data, epochs, session)


def _trained(spec: TrainingSpec, data: PartitionedDataset, epochs: int, session: dict) -> list[float]:
    with Session(spec, data, **{"seed": 0, **session}, executor="local", progress=False) as s:
        for config in CONFIGS:
            s.add(config, epochs=epochs)
        for _ in s.reports():
            pass
        h = s.history
    return [float(v) for v in h[h.epoch == epochs].val_accuracy]  # history epochs count from 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    X, y, Xv, yv = load_mnist1d(args.samples)
    by_class = np.argsort(y, kind="stable")
    shuffled = np.random.default_rng(1).permutation(len(y))
    inputs = {"sorted": (X[by_class], y[by_class]), "shuffled": (X[shuffled], y[shuffled])}
    rows = []
    for name, (which, options) in WAYS.items():
        acc = final_accuracies(*inputs[which], (Xv, yv), args.epochs, options)
        rows.append({"data": name, "mean_val_accuracy": float(np.mean(acc)), "best_val_accuracy": max(acc)})
        print(f"{name}: mean {rows[-1]['mean_val_accuracy']:.3f}, best {rows[-1]['best_val_accuracy']:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"configs": len(CONFIGS), "epochs": args.epochs, "partitions": 4, "train_rows": len(y),
            "date": datetime.now(timezone.utc).date().isoformat()}
    (out / "partitioning.json").write_text(json.dumps({"rows": rows, **meta}, indent=1) + "\n")
    lines = [
        "# Partitioning a dataset sorted by class",
        "",
        f"`python benchmarks/bench_partitioning.py` — {meta['date']}. MNIST-1D ({len(y)} training rows "
        f"sorted by label), {len(CONFIGS)} MLP configurations x {args.epochs} epochs, 4 partitions, "
        "final validation accuracy. The tar shards hold the sorted rows in order, 20 shards (two per "
        "class), as a dataset exported class by class; their partitions are a seeded sample of the samples.",
        "",
        "<!-- --8<-- [start:table] -->",
        "| data and partitioning | mean val accuracy | best val accuracy |",
        "|---|---|---|",
        *(f"| {r['data']} | {r['mean_val_accuracy']:.3f} | {r['best_val_accuracy']:.3f} |" for r in rows),
        "<!-- --8<-- [end:table] -->",
    ]
    (out / "partitioning.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
