"""The dask.distributed executor: partitions pinned to workers, model states hop.

With no client, a LocalCluster of single-threaded worker processes (one per
core) is started and closed with the session.

Modules: :mod:`.cluster` (starting a local cluster, checks of a user's),
:mod:`.wire` (how tasks and their inputs travel), :mod:`.tasks` (what runs on the
workers, and their warm-up), :mod:`.failures` (Dask's facts as protocol events),
:mod:`.states` (which future holds each model state), :mod:`.inflight`,
:mod:`.partitions`, :mod:`.evaluations`, :mod:`.progress` and :mod:`.watch` (the
executor's other books) and :mod:`.executor` (:class:`DaskExecutor`).

>>> from cerebro_automl.executors.dask import DaskExecutor, start_local_cluster
>>> executor = DaskExecutor(start_local_cluster(2))  # doctest: +SKIP
"""

from .cluster import start_local_cluster, visible_gpus
from .executor import DaskExecutor
from .failures import TIMEOUTS

__all__ = ["DaskExecutor", "start_local_cluster", "visible_gpus", "TIMEOUTS"]
