"""The MOP engine: every scheduling decision, pure (no Dask, no torch, no I/O).

:class:`Scheduler` is its only door: ``handle(event) -> [commands and notices]``
and read-only queries. See :mod:`cerebro_automl.engine.scheduler` for which
module holds which decision.
"""

from __future__ import annotations

from .assignment import HAND_OFF
from .gangs import WidthDecisions, gang_width
from .lifecycle import TRANSITIONS, TransitionError
from .model import ModelRecord
from .orders import FIXED_ORDERS, ORDERS, latin_order
from .placement import Placement
from .runs import RUN_TRANSITIONS, RunState, RunTransitionError, UnitRun
from .scheduler import Scheduler
from .speculation import PROGRESS_EVERY, PROGRESS_INTERVAL, SLOW_PACE, SPECULATE_AFTER, SPECULATE_MIN_LATE
from .timing import MIN_TIMINGS, TIMINGS_KEPT, UnitTimes

__all__ = [
    "Scheduler",
    "gang_width",
    "WidthDecisions",
    "ORDERS",
    "FIXED_ORDERS",
    "latin_order",
    "TRANSITIONS",
    "TransitionError",
    "ModelRecord",
    "RUN_TRANSITIONS",
    "RunState",
    "RunTransitionError",
    "UnitRun",
    "Placement",
    "UnitTimes",
    "MIN_TIMINGS",
    "TIMINGS_KEPT",
    "HAND_OFF",
    "SLOW_PACE",
    "SPECULATE_AFTER",
    "SPECULATE_MIN_LATE",
    "PROGRESS_EVERY",
    "PROGRESS_INTERVAL",
]
