"""The narrow waist: a :class:`Session` trains many configurations with MOP.

Its parts, each in a module of its own:

* :mod:`.session`: the Session facade (add / extend / stop / fork / reports / run / close);
* :mod:`.loop`: the event loop between the executor and the scheduler;
* :mod:`.starts`: the ways a model starts (fresh, resume, fork, warm start);
* :mod:`.outcomes`: what the engine's notices become (reports, rows, hooks, checkpoints);
* :mod:`.history`: the models' records, the history, best and handles;
* :mod:`.cluster`: the executor, which workers' devices may take units, a lost scheduler;
* :mod:`.fingerprints`: the data's fingerprint, as checkpoints record it and a resume checks it;
* :mod:`.checks`: the session's argument checks.

>>> from cerebro_automl.session import Session, EpochReport, ModelHandle
"""

from ..checkpoint import CheckpointError
from ..reports import EpochReport, ModelFailed, ModelPaused, UnitReport
from .history import ModelHandle
from .loop import DataLoadError, SchedulerLost, StalledError
from .session import Session

__all__ = [
    "Session",
    "EpochReport",
    "UnitReport",
    "ModelPaused",
    "ModelFailed",
    "ModelHandle",
    "StalledError",
    "DataLoadError",
    "SchedulerLost",
    "CheckpointError",
]
