"""The Session's argument checks, each rule in one place.

The engine's settings (``order``, ``replicas``, ``speculate``, ``prefetch``,
``max_unit_retries``) are checked by the :class:`~cerebro_automl.engine.Scheduler`
and its placement, which own them: :func:`check_engine` asks them before the
session starts any work. What only the session knows is checked here.

Example:
    >>> check_engine({"order": "random"})
    Traceback (most recent call last):
    ValueError: order is 'random', but must be one of ('fixed', 'cyclic', 'dynamic')
"""

from __future__ import annotations

import os
from typing import Any, TypedDict

from ..checks import check_int, check_timeout
from ..data import PartitionedDataset
from ..engine.state import Settings
from ..training import TrainingSpec

__all__ = ["EngineOptions", "REPORT_EVERY", "check_session", "check_engine", "check_cluster", "check_prefetch",
           "unit_reports", "check_gang"]  # fmt: skip

REPORT_EVERY = ("epoch", "unit")


class EngineOptions(TypedDict, total=False):
    """The session's settings for its engine: the :class:`~cerebro_automl.engine.Scheduler`'s
    keyword arguments (its ``num_partitions`` comes once the data is resolved)."""

    seed: int
    order: str
    checkpoint: bool
    max_unit_retries: int
    max_place_retries: int
    replicas: int
    speculate: bool
    prefetch: bool
    unit_reports: bool
    gang: bool


def check_session(
    spec: Any,
    data: Any,
    *,
    seed: Any,
    threads: Any,
    unit_timeout: Any,
    no_worker_timeout: Any,
    min_workers: Any,
    deterministic: Any,
    workers_per_gpu: Any,
    resume: bool,
    checkpoint_dir: str | os.PathLike | None,
    n_workers: Any = None,
    executor: Any = "dask",
    client: Any = None,
    progress: Any = None,
) -> None:
    """The Session's own arguments: TypeError or ValueError naming the value and the rule."""
    if not isinstance(spec, TrainingSpec):
        raise TypeError(f"spec is {type(spec).__name__}, but must be a TrainingSpec")
    if not isinstance(data, PartitionedDataset):
        raise TypeError(f"data is {type(data).__name__}, but must be a PartitionedDataset")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed is {seed!r}, but must be an int")
    check_int("seed", seed, 0)  # it seeds numpy, which refuses negative seeds
    check_int("threads", threads)
    check_timeout(unit_timeout, "unit_timeout")
    check_timeout(no_worker_timeout, "no_worker_timeout")
    check_int("min_workers", min_workers, optional=True)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic is {deterministic!r}, but must be True or False")
    check_int("workers_per_gpu", workers_per_gpu)
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir is {checkpoint_dir!r}, but must be a path (str or os.PathLike) or None")
    if resume and checkpoint_dir is None:
        raise ValueError("resume is True, but there is no checkpoint_dir to resume from")
    check_int("n_workers", n_workers, optional=True)
    if client is not None and executor != "dask":
        raise ValueError(f"client is given with executor={executor!r}, which does not use it: leave one of them out")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress is {progress!r}, but must be True, False or None")


def check_prefetch(prefetch: Any, replicas: Any) -> bool:
    """``prefetch`` as the scheduler takes it: None means on with one replica only."""
    if prefetch is not None and not isinstance(prefetch, bool):
        raise TypeError(f"prefetch is {prefetch!r}, but must be True, False or None")
    return replicas == 1 if prefetch is None else prefetch


def unit_reports(report_every: Any) -> bool:
    """Whether ``report_every`` asks for reports inside epochs (after every unit)."""
    if report_every not in REPORT_EVERY:
        raise ValueError(f"report_every is {report_every!r}, but must be one of {REPORT_EVERY}")
    return report_every == "unit"


def check_gang(gang: Any, fuse: int, executor: Any) -> None:
    """Gang units need an executor that runs them (the Dask executor's, not the local
    one's) and models that train alone (a fused group's unit already holds several)."""
    if not isinstance(gang, bool):
        raise TypeError(f"gang is {gang!r}, but must be True or False")
    if not gang:
        return
    if fuse > 1:
        raise ValueError(f"gang is True with fuse={fuse}, but a fused group trains on one worker: give one of them")
    runs_gangs = executor == "dask" if isinstance(executor, str) else getattr(executor, "gang_units", False)
    if not runs_gangs:
        name = executor if isinstance(executor, str) else type(executor).__name__
        raise ValueError(
            f"gang is True with the {name!r} executor, which cannot run a model on several workers at "
            "once: use the Dask executor (executor='dask', the default)"
        )


def check_engine(settings: EngineOptions) -> None:
    """Raise what the Scheduler would raise for ``settings`` (its keyword arguments),
    before the session starts a cluster: the engine's ``Settings`` own these rules
    (the partitions are checked once the data is resolved)."""
    Settings(num_partitions=1, **settings).check()


def check_own_cluster(
    executor: Any, client: Any, n_workers: int | None, min_workers: int | None, replicas: int
) -> None:
    """A cluster the session starts itself (``n_workers`` of them) never grows: what
    needs more workers is refused before it starts."""
    if executor == "local" and n_workers is None:
        n_workers = 1  # the local executor's default
    if client is not None or n_workers is None or executor not in ("dask", "local"):
        return
    for name, wanted in (("min_workers", min_workers), ("replicas", replicas)):
        if wanted is not None and wanted > n_workers:
            raise ValueError(
                f"{name} is {wanted}, but the session starts its own cluster of n_workers={n_workers}, which no "
                f"other worker joins: pass n_workers={wanted} or more"
            )


def check_cluster(workers: list[str], replicas: int) -> None:
    """The cluster has a worker, and at least ``replicas`` of them."""
    if not workers:
        raise ValueError("the cluster has no workers; start at least one, or pass min_workers= to wait for them")
    if replicas > len(workers):
        raise ValueError(
            f"replicas is {replicas}, but the cluster has {len(workers)} "
            f"worker{'s' if len(workers) != 1 else ''}: each partition is held by that many different workers "
            "(start more workers, and pass min_workers= to wait for them to join)"
        )
