"""cerebro_automl: Model Hopper Parallelism (MOP) for PyTorch on Dask.

Many configurations train at once on one partitioned copy of the data: each
unit is one pass of one model over one partition on the worker holding it;
then the model's state hops to the next worker.

>>> from cerebro_automl import Session, TrainingSpec, PartitionedDataset
"""

from __future__ import annotations

import importlib
from typing import Any

from .cpu_kernels import pin_cpu_kernels

pin_cpu_kernels()  # before any torch operation: the same bits on any x86-64 CPU

__all__ = [
    "Session",
    "TrainingSpec",
    "FrozenFeatures",
    "PartitionedDataset",
    "EpochReport",
    "UnitReport",
    "ModelPaused",
    "ModelFailed",
    "ModelHandle",
    "Executor",
    "LocalExecutor",
    "accuracy",
    "StalledError",
    "DataLoadError",
    "SchedulerLost",
    "CheckpointError",
    "CheckpointDirInUse",
]
__version__ = "0.1.0"

# Public names are imported on first use, so that the pure parts (the scheduler)
# load without torch, pandas or Dask.
_HOMES = {
    "Session": "session",
    "EpochReport": "reports",
    "UnitReport": "reports",
    "ModelPaused": "reports",
    "ModelFailed": "reports",
    "ModelHandle": "session",
    "TrainingSpec": "training",
    "FrozenFeatures": "features",
    "accuracy": "training",
    "PartitionedDataset": "data",
    "Executor": "executors.base",
    "LocalExecutor": "executors.local",
    "StalledError": "session",
    "DataLoadError": "session",
    "SchedulerLost": "session",
    "CheckpointError": "checkpoint",
    "CheckpointDirInUse": "checkpoint_dir",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'cerebro_automl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


# The library's logger prints INFO and above to stderr until the user configures
# logging (see cerebro_automl.log).
from .log import _configure as _configure_logging  # noqa: E402

_configure_logging()
