"""Model code for the tests; cloudpickle sends it to Dask workers by value."""

from __future__ import annotations

import sys
import time

import cloudpickle
import torch
from torch import nn

from cerebro_automl import TrainingSpec, accuracy

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def model_fn(config):
    model = nn.Sequential(nn.Linear(8, config["width"]), nn.ReLU(),
                          nn.Dropout(config.get("dropout", 0.1)), nn.Linear(config["width"], 3))
    if config.get("pad"):  # a large buffer: copying the state takes a while
        model.register_buffer("pad", torch.zeros(config["pad"]))
    return model


class TiedMLP(nn.Module):
    """Input and output layers that share one weight, as tied embeddings do."""

    def __init__(self) -> None:
        super().__init__()
        self.encode, self.hidden = nn.Linear(8, 8, bias=False), nn.Linear(8, 8)
        self.decode = nn.Linear(8, 8, bias=False)
        self.decode.weight = self.encode.weight

    def forward(self, x):
        return self.decode(torch.relu(self.hidden(self.encode(x))))[:, :3]


def tied_model_fn(config):
    return TiedMLP()


class SlowLinear(nn.Linear):
    """Slow enough that a driver can be killed mid-epoch (the resume tests)."""

    def forward(self, x):
        time.sleep(0.004)
        return super().forward(x)


def slow_model_fn(config):
    return nn.Sequential(SlowLinear(8, config["width"]), nn.ReLU(), nn.Linear(config["width"], 3))


def optimizer_fn(config, params):
    return torch.optim.Adam(params, lr=config["lr"])


def step_scheduler(config, optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def make_spec(**overrides) -> TrainingSpec:
    kwargs = dict(model_fn=model_fn, optimizer_fn=optimizer_fn,
                  loss_fn=nn.functional.cross_entropy, metrics={"accuracy": accuracy},
                  batch_size=32)
    kwargs.update(overrides)
    return TrainingSpec(**kwargs)


CONFIGS = [{"lr": lr, "width": w} for lr in (1e-3, 1e-2) for w in (8, 16)]


class MemoryHog(nn.Module):
    """Its forward holds ``gigabytes`` of memory for a moment: past a worker's
    memory_limit, the nanny kills the worker."""

    def __init__(self, gigabytes: float) -> None:
        super().__init__()
        self.gigabytes = gigabytes
        self.layer = nn.Linear(8, 3)

    def forward(self, x):
        block = torch.ones(int(self.gigabytes * 2**30) // 4)
        time.sleep(1.0)  # hold it past the nanny's next memory check
        return self.layer(x) + block[:1]


def hog_or_model_fn(config):
    """``model_fn``, except that a config with ``hog`` gigabytes builds a MemoryHog."""
    return MemoryHog(config["hog"]) if config.get("hog") else model_fn(config)


def file_loader(folder, index):
    """A ``from_loader`` fn reading ``<folder>/part-<index>.npz``; it raises while
    ``<folder>/broken`` exists (a storage outage)."""
    import os

    import numpy as np

    if os.path.exists(os.path.join(folder, "broken")):
        raise OSError(f"storage outage: {folder}/broken exists")
    with np.load(os.path.join(folder, f"part-{index}.npz")) as f:
        return f["X"], f["y"], f["Xv"], f["yv"]


def slow_reload_loader(folder, index):
    """A ``from_loader`` fn: partition ``index`` of 3 of ``make_arrays(3000, 300)``'s
    data; while ``<folder>/slow`` exists a load takes 4 s (storage under load)."""
    import os

    import numpy as np

    if os.path.exists(os.path.join(folder, "slow")):
        time.sleep(4.0)
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 3))
    X = rng.normal(size=(3000, 8)).astype(np.float32)
    Xv = rng.normal(size=(300, 8)).astype(np.float32)
    y, yv = (X @ w).argmax(1).astype(np.int64), (Xv @ w).argmax(1).astype(np.int64)
    return X[index::3], y[index::3], Xv[index::3], yv[index::3]


def held_loader(folder, index):
    """``slow_reload_loader``'s partitions; a load waits while ``<folder>/hold`` exists
    (at most 120 s): a test holds the loads until the session has seen what it needs."""
    import os

    deadline = time.time() + 120
    while os.path.exists(os.path.join(folder, "hold")) and time.time() < deadline:
        time.sleep(0.05)
    return slow_reload_loader(folder, index)


class PacedLinear(nn.Linear):
    """A worker started with ``CEREBRO_TEST_SLOW=s`` sleeps ``s`` per batch (a slow
    node); with ``CEREBRO_TEST_STALL=<folder>``, the first training batch to run
    once ``<folder>/stall`` exists sleeps 8 s (one unit held up by a noisy neighbour).
    Neither changes what the layer computes."""

    def forward(self, x):
        import os

        time.sleep(float(os.environ.get("CEREBRO_TEST_SLOW", "0")))
        folder = os.environ.get("CEREBRO_TEST_STALL")
        if folder and self.training and os.path.exists(os.path.join(folder, "stall")):
            try:
                os.mkdir(os.path.join(folder, "stalled"))  # atomic: one batch stalls
            except FileExistsError:
                pass
            else:
                time.sleep(8)
        return super().forward(x)


def paced_model_fn(config):
    return nn.Sequential(PacedLinear(8, config["width"]), nn.ReLU(),
                         nn.Dropout(config.get("dropout", 0.1)), nn.Linear(config["width"], 3))


class CountedLinear(nn.Linear):
    """Sleeps ``seconds`` per batch and appends a line to ``log`` (a file) for each."""

    def __init__(self, width: int, seconds: float, log: str) -> None:
        super().__init__(8, width)
        self.seconds, self.log = seconds, log

    def forward(self, x):
        time.sleep(self.seconds)
        with open(self.log, "a") as f:
            f.write("batch\n")
        return super().forward(x)


def counted_model_fn(config):
    """``model_fn``, except that a config with ``log`` counts its batches there (slowly)."""
    if not config.get("log"):
        return model_fn(config)
    return nn.Sequential(CountedLinear(config["width"], config["seconds"], config["log"]), nn.ReLU(),
                         nn.Linear(config["width"], 3))


class FailsLater(nn.Module):
    """A linear classifier whose output turns NaN after ``after`` forward passes (the
    count is a buffer, so it carries across units): a deterministic failure mid-training."""

    def __init__(self, width: int, after: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))
        self.after = after
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        out = self.net(x)
        return out * float("nan") if self.training and int(self.calls) > self.after else out


def fails_later_model_fn(config):
    """``width`` 13 fails in its second epoch (600 rows of batch 32: 19 batches an epoch)."""
    return FailsLater(config["width"], after=25 if config["width"] == 13 else 10**9)
