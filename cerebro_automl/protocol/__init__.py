"""The language between the layers, in three parts:

* :mod:`.events`: what happened (executors and the session -> engine);
* :mod:`.commands`: what to do (engine -> executors);
* :mod:`.notices`: what the tuner should learn (engine -> session only).

Plain frozen dataclasses with no behaviour: an executor imports this package,
never the engine. ``Scheduler.handle`` returns commands and notices in one list,
in the order they must be acted on (an :class:`Instruction`); the session sends
the commands to its executor and handles the notices itself.
"""

from __future__ import annotations

from .commands import (
    COMMANDS,
    AskProgress,
    Command,
    Discard,
    Drop,
    Evaluate,
    Place,
    Release,
    Rollback,
    Train,
    TrainGang,
)
from .events import (
    BudgetExtended,
    EvaluationCancelled,
    EvaluationDone,
    Event,
    Executing,
    GangWidth,
    ModelsAdded,
    ModelStopped,
    NewModel,
    PartitionLost,
    PartitionPlaced,
    PlaceFailed,
    StatesLost,
    Tick,
    UnitCancelled,
    UnitDone,
    UnitFailed,
    UnitProgress,
    WorkerAdded,
    WorkerLost,
)
from .notices import NOTICES, Abort, Checkpoint, Fail, Notice, Pause, Report
from .status import ModelStatus

__all__ = [
    "ModelStatus",
    "Event",
    "Command",
    "Notice",
    "Instruction",
    "COMMANDS",
    "NOTICES",
    "NewModel",
    "ModelsAdded",
    "BudgetExtended",
    "ModelStopped",
    "GangWidth",
    "UnitDone",
    "UnitFailed",
    "EvaluationDone",
    "WorkerAdded",
    "Tick",
    "UnitProgress",
    "Executing",
    "WorkerLost",
    "PartitionPlaced",
    "PlaceFailed",
    "PartitionLost",
    "UnitCancelled",
    "EvaluationCancelled",
    "StatesLost",
    "Place",
    "Train",
    "TrainGang",
    "Evaluate",
    "Drop",
    "Discard",
    "AskProgress",
    "Rollback",
    "Release",
    "Checkpoint",
    "Report",
    "Pause",
    "Fail",
    "Abort",
]

Instruction = Command | Notice
