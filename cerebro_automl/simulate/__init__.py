"""The simulator: the real MOP scheduler in virtual time, with modelled costs.

* :mod:`.virtual_time`: :func:`simulate` runs a fixed set of models (visit orders,
  stragglers, replicas, speculation, joining workers, gang units); :func:`sweep` tabulates.
* :mod:`.tuners`: :class:`SimulatedSession`, a Session in virtual time that the real
  tuner adapters (Optuna, ASHA, Hyperband, successive halving, Hyperopt) drive, with
  modelled learning curves; it reports makespan and utilization over time.

Run ``python -m cerebro_automl.simulate`` for the sweep table (``--help``).
"""

from .tuners import SimulatedSession, Timeline, modelled_cost, modelled_curve
from .virtual_time import (
    GangCost,
    SimulationResult,
    Stragglers,
    allreduce_seconds,
    format_table,
    hop_seconds,
    main,
    simulate,
    spread_costs,
    sweep,
)

__all__ = [
    "Stragglers",
    "GangCost",
    "allreduce_seconds",
    "SimulationResult",
    "simulate",
    "sweep",
    "spread_costs",
    "hop_seconds",
    "format_table",
    "main",
    "SimulatedSession",
    "Timeline",
    "modelled_curve",
    "modelled_cost",
]
