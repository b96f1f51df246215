"""Grid search on MNIST-1D with MOP on the embedded Dask LocalCluster.

    python examples/grid_search_mnist1d.py [--epochs 8] [--workers 2] [--plot curves.png]

Eight configurations (2 architectures x 2 widths x 2 learning rates) train at
once; each worker holds half of the data, and the models hop between workers.
"""

from __future__ import annotations

import argparse
import logging
import time

import distributed  # noqa: F401  (imported first, so that the log levels below stick)
import torch

from cerebro_automl import PartitionedDataset, TrainingSpec, accuracy
from cerebro_automl.adapters.search import grid_search

from mnist1d_models import load_mnist1d, model_fn, optimizer_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--workers", type=int, default=None, help="default: one per core")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--samples", type=int, default=10000)
    parser.add_argument("--plot", default=None, help="save the learning curves there (PNG)")
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.WARNING)  # Dask's start/stop chatter

    X, y, X_test, y_test = load_mnist1d(args.samples)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=args.partitions, valid=(X_test, y_test))
    spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn,
                        loss_fn=torch.nn.functional.cross_entropy,
                        metrics={"accuracy": accuracy}, batch_size=64)
    space = {"arch": ["mlp", "cnn"], "width": [32, 64], "lr": [1e-3, 3e-3]}

    started = time.perf_counter()
    result = grid_search(spec, data, space, epochs=args.epochs, metric="val_accuracy",
                         mode="max", seed=0, n_workers=args.workers)
    wall = time.perf_counter() - started

    h = result.history
    last = h[h.epoch == h.epoch.max()].copy()
    last["config"] = last["config"].map(lambda c: " ".join(f"{k}={v}" for k, v in c.items()))
    print(f"\n{len(last)} configurations x {args.epochs} epochs on MNIST-1D "
          f"({len(X)} train / {len(X_test)} validation rows, {args.partitions} partitions)")
    print(last.sort_values("val_accuracy", ascending=False)[
        ["model_id", "config", "train_loss", "val_loss", "val_accuracy"]].to_string(index=False))
    compute = h["train_seconds"].sum() + h["val_seconds"].sum()
    print(f"\nbest: model {result.best_model_id} {result.best_config} "
          f"val_accuracy={result.best_value:.3f}")
    print(f"wall time {wall:.1f} s (cluster start included); unit compute {compute:.1f} s")
    model = result.best_model().eval()
    with torch.no_grad():
        acc = (model(torch.from_numpy(X_test)).argmax(1).numpy() == y_test).mean()
    print(f"the best model, rebuilt on the driver: test accuracy {acc:.3f}")
    if args.plot:
        from cerebro_automl.results import plot_learning_curves

        plot_learning_curves(h, "val_accuracy", mode="max", path=args.plot)
        print(f"learning curves saved to {args.plot}")


if __name__ == "__main__":
    main()
