"""cerebro_automl: Model Hopper Parallelism (MOP) for PyTorch on Dask.

Many configurations train at once on one partitioned copy of the data: each
unit is one pass of one model over one partition on the worker holding it;
then the model's state hops to the next worker.

>>> from cerebro_automl import Session, TrainingSpec, PartitionedDataset
"""

import logging

from .data import PartitionedDataset
from .executors.base import Executor
from .executors.local import LocalExecutor
from .session import EpochReport, ModelFailed, ModelFinished, ModelHandle, Session
from .training import TrainingSpec, accuracy

__all__ = [
    "Session", "TrainingSpec", "PartitionedDataset", "EpochReport", "ModelFinished",
    "ModelFailed", "ModelHandle", "Executor", "LocalExecutor", "accuracy",
]
__version__ = "0.1.0"

logging.getLogger("cerebro_automl").addHandler(logging.NullHandler())
