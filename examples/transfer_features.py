"""Transfer learning: Optuna picks the frozen layer, the head's width and the learning
rate; each worker computes its partition's features of every layer once.

    python examples/transfer_features.py [--trials 16] [--epochs 5] [--rows 10000] [--workers 2]

The backbone is a frozen 4-block CNN (see transfer_models.py; a real search would
load a pretrained network in ``backbone_fn``). ``FrozenFeatures`` names the layers a
trial may read; ``model_fn`` builds only the head on top. The first unit that needs a
partition's features computes all four layers in one pass on the worker holding it;
every later unit of every trial reads them there, and only the head's weights hop.
"""

from __future__ import annotations

import argparse
import logging
import time

import distributed  # noqa: F401  (imported first, so that the log levels below stick)
import optuna
from distributed import Client

from cerebro_automl import FrozenFeatures, PartitionedDataset, TrainingSpec, accuracy
from cerebro_automl.adapters.optuna import optimize
from cerebro_automl.executors.dask import start_local_cluster

from transfer_models import LAYERS, backbone_fn, head_fn, optimizer_fn, synthetic_images

spec = TrainingSpec(
    model_fn=head_fn,  # only the trainable part: it receives the chosen layer's pooled output
    optimizer_fn=optimizer_fn,
    metrics={"accuracy": accuracy},
    batch_size=64,
    features=FrozenFeatures(backbone_fn, layers=LAYERS, layer_key="layer", pool="avg"),
)


def space(trial: optuna.Trial) -> dict:
    return {
        "layer": trial.suggest_categorical("layer", list(LAYERS)),
        "width": trial.suggest_categorical("width", [32, 128]),
        "lr": trial.suggest_float("lr", 3e-4, 1e-2, log=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    X, y = synthetic_images(args.rows)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=args.workers, valid_fraction=0.2)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0))
    with start_local_cluster(args.workers) as cluster, Client(cluster) as client:
        started = time.perf_counter()
        optimize(study, spec, data, space, n_trials=args.trials, epochs=args.epochs,
                 metric="val_accuracy", client=client)
        seconds = time.perf_counter() - started
    print(f"{len(study.trials)} trials in {seconds:.1f} s; best val_accuracy {study.best_value:.4f} "
          f"with {study.best_params}")
    by_layer: dict[str, float] = {}
    for trial in study.trials:
        if trial.value is not None:
            layer = trial.params["layer"]
            by_layer[layer] = max(by_layer.get(layer, 0.0), trial.value)
    for layer in LAYERS:
        print(f"  {layer}: best val_accuracy {by_layer.get(layer, float('nan')):.4f}")


if __name__ == "__main__":
    main()
