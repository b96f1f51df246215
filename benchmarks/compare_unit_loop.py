"""The CPU training loop alone, from the source tree given: 6 train units and
evaluations of an MLP (batch 32, 20,000 rows) in this process, no Dask.

Pair two trees with farm-bench to compare a change to the unit's loop:

    git worktree add /tmp/before <commit>
    farm-bench -n 9 --timeout 900 --vs "python benchmarks/compare_unit_loop.py /tmp/before" \\
        -- python benchmarks/compare_unit_loop.py .
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(sys.argv[1]).resolve()))

import torch  # noqa: E402

import cerebro_automl  # noqa: E402
from cerebro_automl.data import TensorShard  # noqa: E402
from cerebro_automl.training import TrainingSpec, evaluate_unit, train_unit  # noqa: E402

assert cerebro_automl.__file__.startswith(str(Path(sys.argv[1]).resolve())), cerebro_automl.__file__


def model_fn(config: dict) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def optimizer_fn(config: dict, params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


if __name__ == "__main__":
    torch.manual_seed(0)
    shard = TensorShard(torch.randn(20_000, 40), torch.randint(0, 10, (20_000,)))
    spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn, batch_size=32, device="cpu")
    state = None
    for epoch in range(6):
        state = train_unit(spec, {}, state, shard, seed=1, epoch=epoch, partition=0, step=0, epoch_end=True,
                           threads=1)
        evaluate_unit(spec, {}, state, shard, seed=1, threads=1)
