"""The Lightning adapter's overhead per unit, and what a Trainer per unit would cost.

    python benchmarks/bench_lightning.py [--full] [--out benchmarks/results]

One MNIST-1D CNN, one partition sized so that a unit takes about 1 s, in this
process with one torch thread. Alternating, several times each:

* plain: ``train_unit`` with a plain-PyTorch TrainingSpec;
* LightningSpec: ``train_unit`` with the same network as a LightningModule
  (``self.log`` in training_step, the adapter's hook loop);
* Trainer per unit: ``lightning.Trainer(max_epochs=1, lean).fit`` on the same
  shard, the way an adapter built on Trainer would run a unit.

Overhead = median(unit seconds) / median(plain) - 1. Target: LightningSpec
under 5% of a 1-second unit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import lightning.pytorch as L
import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from cerebro_automl import TrainingSpec  # noqa: E402
from cerebro_automl.adapters.lightning import LightningSpec  # noqa: E402
from cerebro_automl.data import TensorShard  # noqa: E402
from cerebro_automl.training import train_unit  # noqa: E402
from mnist1d_models import ConvNet, load_mnist1d  # noqa: E402

CONFIG = {"width": 48, "lr": 1e-3}
BATCH = 64


class LitConvNet(L.LightningModule):
    def __init__(self, width: int, lr: float):
        super().__init__()
        self.lr = lr
        self.net = ConvNet(width)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


PLAIN = TrainingSpec(model_fn=lambda c: ConvNet(c["width"]),
                     optimizer_fn=lambda c, params: torch.optim.Adam(params, lr=c["lr"]), batch_size=BATCH)
LIGHTNING = LightningSpec(lambda c: LitConvNet(c["width"], c["lr"]), batch_size=BATCH)


def unit(spec, shard) -> float:
    started = time.perf_counter()
    train_unit(spec, CONFIG, None, shard, seed=0, epoch=0, partition=0, step=0, epoch_end=True, threads=1)
    return time.perf_counter() - started


def trainer_unit(shard) -> float:
    started = time.perf_counter()
    torch.manual_seed(0)
    module = LitConvNet(CONFIG["width"], CONFIG["lr"])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(shard.x, shard.y), batch_size=BATCH,
                                         shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, loader)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="more repetitions")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero",
                 "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    repeats = 15 if args.full else 7

    X, y, _, _ = load_mnist1d(4000)
    probe = TensorShard(torch.from_numpy(X[:1000]), torch.from_numpy(y[:1000]))
    unit(PLAIN, probe)
    rows = int(1000 / unit(PLAIN, probe))  # about 1 s per unit
    X, y, _, _ = load_mnist1d(int(rows / 0.8) + 1)
    shard = TensorShard(torch.from_numpy(X[:rows]), torch.from_numpy(y[:rows]))

    times = {"plain": [], "LightningSpec": [], "Trainer per unit": []}
    unit(LIGHTNING, shard)
    trainer_unit(shard)  # warm-ups
    for _ in range(repeats):
        times["plain"].append(unit(PLAIN, shard))
        times["LightningSpec"].append(unit(LIGHTNING, shard))
        times["Trainer per unit"].append(trainer_unit(shard))
    median = {k: statistics.median(v) for k, v in times.items()}
    overhead = {k: median[k] / median["plain"] - 1 for k in times}
    ms = {k: (median[k] - median["plain"]) * 1000 for k in times}

    lines = [
        "# Lightning adapter: overhead per unit",
        "",
        "<!-- --8<-- [start:table] -->",
        f"`python benchmarks/bench_lightning.py{' --full' if args.full else ''}` — "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, 1 torch thread, "
        f"torch {torch.__version__}, lightning {L.__version__}. One MNIST-1D CNN unit of {rows} rows "
        f"(batch {BATCH}), median of {repeats}, alternating.",
        "",
        "| unit driven by | median unit (s) | overhead vs plain | overhead (ms) | target |",
        "|---|---|---|---|---|",
    ]
    for k in times:
        target = "< 5%" if k == "LightningSpec" else ""
        met = "" if not target else (" yes" if overhead[k] < 0.05 else " NO")
        lines.append(f"| {k} | {median[k]:.3f} | {overhead[k] * 100:+.1f}% | {ms[k]:+.0f} | {target}{met} |")
    lines.append("<!-- --8<-- [end:table] -->")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lightning.md").write_text(table + "\n")
    (out / "lightning.json").write_text(json.dumps({"rows": rows, "times": times, "median": median,
                                                    "overhead": overhead}, indent=2))


if __name__ == "__main__":
    main()
