"""Hyperopt (TPE, nested space, median stopping) tunes MLPs and CNNs on MNIST-1D with MOP.

    python examples/hyperopt_mnist1d.py [--evals 24] [--epochs 6] [--parallelism 4]

hyperopt's TPE suggests a configuration whenever a slot in the hopper frees;
the MOP session trains the hopper's models together on the embedded Dask
LocalCluster; after each epoch the median stopping rule prunes laggards.
The result is a real ``hyperopt.Trials``: space_eval, best_trial and
hyperopt's plots work on it.
"""

from __future__ import annotations

import argparse
import logging
import math
import time

import distributed  # noqa: F401  (imported first, so that the log levels below stick)
import numpy as np
import torch
from hyperopt import Trials, hp, space_eval, tpe

from cerebro_automl import PartitionedDataset, TrainingSpec, accuracy
from cerebro_automl.adapters.hyperopt import MedianStoppingRule, fmin

from mnist1d_models import load_mnist1d, model_fn, optimizer_fn

# A nested space: each architecture has its own widths. hp.choice yields an
# index in `best`; space_eval turns it back into the config.
SPACE = {
    "model": hp.choice("model", [
        {"arch": "mlp", "width": hp.choice("mlp_width", [32, 64, 128])},
        {"arch": "cnn", "width": hp.choice("cnn_width", [16, 32, 64])},
    ]),
    "lr": hp.loguniform("lr", math.log(3e-4), math.log(1e-2)),
    "weight_decay": hp.loguniform("weight_decay", math.log(1e-6), math.log(1e-2)),
    "batch_size": hp.choice("batch_size", [32, 64, 128]),
}


def flat_model_fn(config):
    """model_fn reads a flat config; the nested choice is unpacked here."""
    return model_fn({**config, **config["model"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evals", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--parallelism", type=int, default=None, help="default: twice the workers")
    parser.add_argument("--workers", type=int, default=None, help="default: one per core")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--samples", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="save hyperopt's loss history plot (PNG)")
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.WARNING)
    logging.getLogger("hyperopt").setLevel(logging.WARNING)

    X, y, X_val, y_val = load_mnist1d(args.samples)  # the held-out rows: the search selects on them
    data = PartitionedDataset.from_arrays(X, y, num_partitions=args.partitions, valid=(X_val, y_val))
    spec = TrainingSpec(model_fn=flat_model_fn, optimizer_fn=optimizer_fn,
                        loss_fn=torch.nn.functional.cross_entropy,
                        metrics={"accuracy": accuracy}, batch_size="batch_size")

    trials = Trials()
    started = time.perf_counter()
    best = fmin(spec, data, SPACE, algo=tpe.suggest, max_evals=args.evals, epochs=args.epochs,
                loss="val_loss", trials=trials, rstate=np.random.default_rng(args.seed),
                parallelism=args.parallelism, prune=MedianStoppingRule(warmup_epochs=1),
                n_workers=args.workers)
    wall = time.perf_counter() - started

    results = [t["result"] for t in trials.trials]
    pruned = sum(r["pruned"] for r in results)
    epochs = sum(r["epochs"] for r in results)
    print(f"\n{len(trials.trials)} trials on MNIST-1D ({len(X)} train / {len(X_val)} validation rows): "
          f"{len(results) - pruned} trained to the end, {pruned} pruned by the median rule")
    print(f"epochs trained: {epochs} of {len(results) * args.epochs} without pruning")
    print("\ntop trials (validation loss, validation accuracy):")
    finished = sorted((r for r in results if r["status"] == "ok"), key=lambda r: r["loss"])
    for r in finished[:5]:
        print(f"  {r['loss']:.3f}  {r['history'][-1]['val_accuracy']:.3f}  {r['config']}")
    result = trials.best_trial["result"]
    print(f"\nbest: {space_eval(SPACE, best)}")
    print(f"      validation accuracy {result['history'][-1]['val_accuracy']:.3f} (published CNN baseline ~0.94) "
          f"in {wall:.0f} s on {args.workers or 'all'} workers, cluster start included")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from hyperopt.plotting import main_plot_history
        main_plot_history(trials, do_show=False)
        plt.savefig(args.plot, dpi=100)
        print(f"loss history plot: {args.plot}")


if __name__ == "__main__":
    main()
