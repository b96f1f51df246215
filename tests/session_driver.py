"""A driver process for the Session resume test: models trained with checkpoints,
slow enough to be killed mid-run.  Run: python session_driver.py DIR [resume]

It writes DIR/weights.pt (torch.save of the final weights, read back in the test
with weights_only=True) when it finishes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from cerebro_automl import PartitionedDataset, Session

from conftest import make_arrays
from models import CONFIGS, make_spec, slow_model_fn

EPOCHS = 4


def run(folder: Path, executor: str = "dask") -> dict[int, dict]:
    X, y, Xv, yv = make_arrays()
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    with Session(make_spec(model_fn=slow_model_fn), data, seed=4, executor=executor, n_workers=2,
                 checkpoint_dir=str(folder / "ckpt"), resume=True) as s:
        ids = [s.add(c, epochs=EPOCHS) for c in CONFIGS]
        history = s.run()
        history.drop(columns=["config", "order"]).to_csv(folder / f"history-{time.time_ns()}.csv")
        return {i: s.model(i).state()["model"] for i in ids}


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    weights = run(folder)
    torch.save(weights, folder / "weights.pt")
