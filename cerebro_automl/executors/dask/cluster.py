"""Starting a local Dask cluster for cerebro_automl, and checks of a user's cluster.

Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_=65536`` in its workers, which slows torch
training on CPU about 2x (``benchmarks/bench_engine.py`` measures it): the clusters
started here set glibc's allocator thresholds of their own instead
(:data:`WORKER_MALLOC`), and a user's cluster that keeps Dask's gets a warning.

>>> cluster = start_local_cluster(2)  # doctest: +SKIP
>>> gpu_cluster = start_local_cluster(gpus="auto", workers_per_gpu=2)  # doctest: +SKIP
"""

from __future__ import annotations

import ast
import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from ...checks import check_int
from ...training import CUBLAS_WORKSPACE

__all__ = [
    "start_local_cluster",
    "visible_gpus",
    "connect",
    "warm_up_workers",
    "scheduler_workers",
    "scheduler_gone",
    "warn_about_malloc_trim",
    "WORKER_MALLOC",
    "WORKER_ENVIRON",
    "DASK_MALLOC_TRIM",
]

logger = logging.getLogger("cerebro_automl")

DASK_MALLOC_TRIM = "65536"
# glibc's allocator in the workers started here. Its own default moves the mmap threshold
# up to the largest block freed (at most 32 MiB) and returns the heap's free top to the
# system beyond twice that, so a step or an evaluation batch that frees tens of MiB gets
# them back as fresh pages: 237,000 page faults and 2.3x the time for a fused CNN's
# evaluation of 10,000 rows (8 members), about 300 faults per fused training step.
# Blocks under 32 MiB come from the heap, and up to 128 MiB of free heap is kept.
WORKER_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(128 << 20)}
# The nanny sets these in os.environ before it spawns a worker, and leaves them there (as it
# does its own); a value already in this process's environment wins.
WORKER_ENVIRON = {f"distributed.nanny.pre-spawn-environ.{name}": value for name, value in WORKER_MALLOC.items()}


def start_local_cluster(
    n_workers: int | None = None, *, gpus: Sequence[str] | str | None = None, workers_per_gpu: int = 1, **kwargs: Any
) -> Any:
    """A LocalCluster of single-threaded worker processes, with the allocator settings
    of :data:`WORKER_MALLOC` in place of the nanny's (a value set in this process's
    environment is kept): ``n_workers`` of them (default: one per core), or, given GPUs,
    ``workers_per_gpu`` per GPU, each seeing only its own GPU through
    ``CUDA_VISIBLE_DEVICES`` (as dask-cuda's LocalCUDACluster does).

    ``gpus``: GPU ids (as ``CUDA_VISIBLE_DEVICES`` lists them), ``"auto"`` for those
    this process sees (none on a machine without CUDA), or None for CPU workers.
    With GPUs and ``n_workers``, the workers take the GPUs in turn.

    >>> cluster = start_local_cluster(gpus="auto", workers_per_gpu=2)  # doctest: +SKIP
    """
    from distributed import LocalCluster

    import dask

    check_int("workers_per_gpu", workers_per_gpu)
    gpu_ids = visible_gpus() if gpus == "auto" else [str(g) for g in gpus or []]
    known = visible_gpus() if gpu_ids else []
    unknown = [g for g in gpu_ids if known and g not in known and not g.startswith(("GPU-", "MIG-"))]
    if unknown:  # a worker told to see a GPU that is not there fails to start (its NVML monitor)
        raise ValueError(f"gpus lists {unknown}, but the GPUs this process sees are {known}")
    # A LocalCluster started earlier in this process with Dask's defaults leaves its
    # value in os.environ, which is not the user's choice (only child processes read it).
    if os.environ.get("MALLOC_TRIM_THRESHOLD_") == DASK_MALLOC_TRIM:
        del os.environ["MALLOC_TRIM_THRESHOLD_"]
    options = dict(
        threads_per_worker=1, processes=True, dashboard_address=kwargs.pop("dashboard_address", ":0"), **kwargs
    )
    with dask.config.set(WORKER_ENVIRON), _hint_at_the_main_guard():
        if not gpu_ids:
            return LocalCluster(n_workers=n_workers or os.cpu_count() or 1, **options)
        slots = [str(gpu_ids[i % len(gpu_ids)]) for i in range(n_workers or len(gpu_ids) * workers_per_gpu)]
        return _gpu_cluster_class()(slots, **options)


@contextlib.contextmanager
def _hint_at_the_main_guard() -> Iterator[None]:
    """Name the usual cause when the workers fail to start from a script's top level:
    Dask starts them with spawn, which runs the script again in each of them, so an
    unguarded script starts a cluster inside every worker, and Python refuses."""
    try:
        yield
    except Exception as err:
        if not _called_from_an_unguarded_script():
            raise
        raise RuntimeError(
            f"the LocalCluster's workers failed to start ({type(err).__name__}: {err}). If the lines "
            "above say 'An attempt has been made to start a new process before the current process has "
            "finished its bootstrapping phase', put the code that starts the Session under "
            '`if __name__ == "__main__":` (each worker process runs the script again), or pass '
            'executor="local"'
        ) from err


def _called_from_an_unguarded_script() -> bool:
    """Whether the call comes from the top level of a main script that has no
    ``if __name__ == "__main__":`` test at its top level."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            path = frame.f_globals.get("__file__")
            return isinstance(path, str) and not _has_main_guard(path)
        frame = frame.f_back
    return False


def _has_main_guard(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return True  # cannot tell: say nothing
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            names = [node.test.left, *node.test.comparators]
            if any(isinstance(n, ast.Name) and n.id == "__name__" for n in names):
                return True
    return False


def visible_gpus() -> list[str]:
    """The ids of the GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set,
    else every GPU torch counts (none without CUDA)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip() and not g.strip().startswith("-")]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


@functools.cache
def _gpu_cluster_class() -> type:
    """The LocalCluster subclass with one GPU per worker (built lazily: distributed
    is imported only when a cluster is started)."""
    from distributed import LocalCluster

    class GPULocalCluster(LocalCluster):
        """A LocalCluster whose worker ``i`` sees only GPU ``slots[i]``. A nanny keeps
        its worker's environment, so a restarted worker sees the same GPU."""

        def __init__(self, slots: list[str], **kwargs: Any) -> None:
            self._slots = slots
            super().__init__(n_workers=0, **kwargs)
            self.scale(len(slots))
            self.sync(self._correct_state)  # wait for them, as LocalCluster(n_workers=...) does

        def new_worker_spec(self) -> dict:
            free = sorted(set(range(len(self._slots))) - set(self.worker_spec))
            if not free:
                raise ValueError(
                    f"this cluster has one worker per GPU slot, {len(self._slots)} in all "
                    f"(GPUs {sorted(set(self._slots))}); it cannot scale beyond them"
                )
            spec = {"cls": self.new_spec["cls"], "options": dict(self.new_spec["options"])}
            spec["options"]["env"] = {
                "CUDA_VISIBLE_DEVICES": self._slots[free[0]],
                "CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE,
            }
            return {free[0]: spec}

    return GPULocalCluster


def warn_about_malloc_trim(client: Any) -> None:
    """Say so when the user's workers run with Dask's MALLOC_TRIM_THRESHOLD_=65536:
    `make bench` measured training about 2x slower with it."""
    try:
        values = client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_"))
    except Exception:  # an old or restricted cluster: not worth failing over
        return
    slow = sorted(w for w, v in values.items() if v == DASK_MALLOC_TRIM)
    if slow:
        logger.warning(
            "%d of %d workers run with Dask's MALLOC_TRIM_THRESHOLD_=%s, which slowed torch "
            "training about 2x in our benchmark; start them with --no-nanny, or with a Dask config "
            "that sets distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_ to null "
            "(dask.config.set around a LocalCluster you start in Python; see the Dask CLI guide)",
            len(slow),
            len(values),
            DASK_MALLOC_TRIM,
        )


def connect(
    client: Any, n_workers: int | None = None, gpus: Sequence[str] | str | None = None, workers_per_gpu: int = 1
) -> tuple[Any, Any]:
    """``(client, cluster)`` for an executor given ``client``: a ``distributed.Client``
    (used as it is; cluster None), a scheduler address (a new client; cluster None), or
    None (a new LocalCluster from :func:`start_local_cluster`, and a client of it)."""
    from distributed import Client

    if client is None:
        cluster = start_local_cluster(n_workers, gpus=gpus, workers_per_gpu=workers_per_gpu)
        return Client(cluster), cluster
    if isinstance(client, str):
        check_not_http(client)
        return Client(client), None
    if not isinstance(client, Client):
        raise TypeError(f"client is {client!r}, but must be a distributed.Client, a scheduler address or None")
    if client.status in ("closed", "closing"):
        raise ValueError(f"client {client!r} is {client.status}; pass an open client")
    return client, None


ANSWER_WAIT = 5.0  # seconds to connect, and for an HTTP server's answer to the probe's request


def check_not_http(address: str, wait: float | None = None) -> None:
    """Raise ValueError when an HTTP server answers at ``address`` (a tcp:// one): the
    dashboard's port given for the scheduler's, on which ``distributed.Client`` waits
    for ever. A Dask scheduler speaks first on a new connection; an HTTP server waits
    for a request, and answers one. The request is sent only after ``wait`` seconds of
    silence (Dask's connect timeout, 30 s by default), so that a slow scheduler is not
    sent it. Any other outcome (refused, silent, unresolvable) is left to the Client."""
    import socket

    from distributed.comm.addressing import parse_address, parse_host_port

    import dask
    from dask.utils import parse_timedelta

    if wait is None:
        wait = float(parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), default="seconds"))

    try:
        scheme, location = parse_address(address)
        host, port = parse_host_port(location)
    except (ValueError, TypeError):
        return
    if scheme != "tcp":
        return
    try:
        with socket.create_connection((host, port), timeout=ANSWER_WAIT) as probe:
            probe.settimeout(wait)
            try:
                if probe.recv(1):
                    return  # it spoke first: a scheduler (or some other server), not HTTP
            except OSError:  # silent until the timeout (or reset: the request below then fails too)
                pass
            probe.settimeout(ANSWER_WAIT)
            probe.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
            answer = probe.recv(5)
    except OSError:  # unreachable, or no answer: the Client says so
        return
    if answer == b"HTTP/":
        raise ValueError(
            f"client is {address!r}, but an HTTP server answers there (the Dask dashboard?), not a Dask "
            "scheduler: give the scheduler's address (port 8786 by default; `dask scheduler` prints it "
            "as 'Scheduler at:')"
        )


def warm_up_workers(client: Any) -> None:
    """Warm every worker up now, and each that joins later (see
    :class:`~cerebro_automl.executors.dask.tasks.WarmUp`), so that no unit pays the
    imports; a cluster that refuses plugins is left to the units, which warm up on
    their own."""
    from .tasks import WarmUp

    try:
        client.register_plugin(WarmUp(), name=WarmUp.name)
    except Exception as err:
        logger.debug("warming the workers up failed: %r", err)


def scheduler_workers(client: Any) -> list[str]:
    """The workers the Dask scheduler knows now, sorted.

    Asked of the scheduler each time: ``Client.scheduler_info()`` returns a cache that
    the client's periodic refresh overwrites with an identity holding no workers,
    and a read racing that refresh saw every worker lost."""
    return sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


def scheduler_gone(client: Any, timeout: float = 5.0) -> str | None:
    """The scheduler's address when a fresh connection to it fails within ``timeout``
    seconds (it died, or its host left), else None. Tried on a new connection, not
    the client's, which may be closed or reconnecting by then."""
    import asyncio

    from distributed.comm import connect

    address = getattr(client.scheduler, "address", None)
    if address is None:
        return None

    async def probe() -> None:
        comm = await connect(address, timeout=timeout, **client.security.get_connection_args("client"))
        await comm.close()

    try:
        asyncio.run(probe())
    except OSError:  # refused, timed out, closed (CommClosedError is one)
        return address
    return None
