"""A search whose bits depend on the CPU kernels' instruction set (GELU, LayerNorm,
convolutions, softmax attention): prints the digest of its weights and the kernels
its units ran with. Run: python isa_probe.py (in a fresh process: the kernels are
chosen at a process's first torch operation)."""

from __future__ import annotations

import hashlib

import cerebro_automl  # noqa: F401  (first: it pins the kernels)
import numpy as np
import torch
from torch import nn

from cerebro_automl import PartitionedDataset, Session, TrainingSpec


class Probe(nn.Module):
    def __init__(self, width: int, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 5, padding=2)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Sequential(nn.Linear(8 * 16, width), nn.GELU(), nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x.unsqueeze(1)).transpose(1, 2)  # (batch, 16, 8)
        h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
        return self.head(h.flatten(1))


def main() -> None:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 16)).astype(np.float32)
    y = (X[:, :3].argmax(1)).astype(np.int64)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(X[:100], y[:100]))
    spec = TrainingSpec(model_fn=lambda c: Probe(c["width"]), optimizer_fn=lambda c, p: torch.optim.Adam(p, c["lr"]),
                        loss_fn=nn.functional.cross_entropy, batch_size=32)
    with Session(spec, data, executor="local", seed=1, progress=False) as s:
        ids = [s.add({"lr": lr, "width": 32}, epochs=2) for lr in (1e-3, 3e-3)]
        history = s.run()
        h = hashlib.blake2b(digest_size=8)
        for i in ids:
            for t in s.model(i).state()["model"].values():
                h.update(t.numpy().tobytes())
    print(f"digest={h.hexdigest()} device={history['device'].iloc[0]}")


if __name__ == "__main__":
    main()
