"""The session's executor and its workers: making the executor, and which
workers' devices the session's bits allow.

With fixed or cyclic order and ``device="auto"``, a unit's bits would depend on whether
its worker has a GPU: a cluster that mixes CPU and GPU workers is refused at
start, and a worker that joins with the other kind of device takes no units.
Workers that share a GPU, more of them than ``workers_per_gpu``, are reported.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..checkpoint import CheckpointError, newest_epochs
from ..data import PartitionedDataset
from ..engine import FIXED_ORDERS
from ..executors.base import Executor, partition_count
from ..progress import dashboard_link
from ..protocol import Event, WorkerAdded, WorkerLost
from ..training import TrainingSpec
from ..training.devices import NoGpu
from ..training.gpus import shared_gpus
from .checks import check_cluster, check_own_cluster
from .loop import SchedulerLost

__all__ = [
    "make_executor",
    "start_cluster",
    "Cluster",
    "check_devices",
    "describe_start",
    "Admission",
    "lost_scheduler",
]

logger = logging.getLogger("cerebro_automl")


def make_executor(
    executor: Any, client: Any, n_workers: int | None, gpus: str | None, workers_per_gpu: int
) -> Executor:
    """``executor`` itself if it is an :class:`Executor`, else a new one of that kind."""
    if isinstance(executor, Executor):
        return executor
    if executor == "dask":
        from ..executors.dask import DaskExecutor

        return DaskExecutor(client, n_workers=n_workers, gpus=gpus, workers_per_gpu=workers_per_gpu)
    if executor == "local":
        from ..executors.local import LocalExecutor

        return LocalExecutor(n_workers or 1)
    raise ValueError(f"executor is {executor!r}, but must be 'dask', 'local' or an Executor")


def lost_scheduler(
    executor: Executor, err: BaseException, checkpoint_dir: str | None, names: Sequence[str]
) -> SchedulerLost | None:
    """A :class:`SchedulerLost` when ``executor``'s Dask scheduler cannot be reached any
    more (``err`` is the error that surfaced); it names the checkpoints of the models
    ``names`` in ``checkpoint_dir`` (the newest epoch of each) and how to resume."""
    from ..executors.dask import DaskExecutor
    from ..executors.dask.cluster import scheduler_gone

    if not isinstance(executor, DaskExecutor):
        return None
    address = scheduler_gone(executor.client)
    if address is None:
        return None
    cause = err.__cause__ if isinstance(err, CheckpointError) and err.__cause__ is not None else err
    return SchedulerLost(
        f"the Dask scheduler at {address} is gone ({type(cause).__name__}: {cause}), so "
        f"this session cannot go on. {checkpoints_left(checkpoint_dir, names)}"
    )


def checkpoints_left(checkpoint_dir: str | None, names: Sequence[str], shown: int = 20) -> str:
    """Which checkpoints the models ``names`` have in ``checkpoint_dir`` and how to resume from them."""
    if checkpoint_dir is None:
        return (
            "There is no checkpoint_dir: the models' states lived on the cluster and are lost. Start "
            "the search again (with checkpoint_dir= it could resume after such a loss)"
        )
    newest = newest_epochs(checkpoint_dir, names)
    listed = ", ".join(f"{name} after epoch {epoch}" for name, epoch in list(newest.items())[:shown])
    more = f" and {len(newest) - shown} more" if len(newest) > shown else ""
    none = len(names) - len(newest)
    found = (
        f"Checkpoints in {checkpoint_dir} (the newest of each model): {listed}{more}"
        + (f"; {none} of the {len(names)} models have none" if none else "")
        if newest
        else f"No model has a checkpoint in {checkpoint_dir} yet"
    )
    return (
        f"{found}. To resume, run the same search again on a cluster with workers, with "
        f"Session(..., checkpoint_dir={checkpoint_dir!r}, resume=True) (a tuner: the same "
        "checkpoint_dir and study): each model added under the same name continues after its newest "
        "checkpoint whose epoch was reported (an epoch checkpointed as the cluster went, before its report, "
        "trains again)"
    )


_KERNELS_ADVICE = (
    "start every worker with the same ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and MKL_CBWR "
    "(importing cerebro_automl before any torch operation pins them to AVX2)"
)


@dataclass(frozen=True)
class Cluster:
    """The session's executor, its workers at start, the data resolved for them, and
    the device each worker's units run on."""

    executor: Executor
    workers: list[str]
    data: PartitionedDataset
    devices: dict[str, str]


def start_cluster(
    executor: Any,
    client: Any,
    n_workers: int | None,
    spec: TrainingSpec,
    data: PartitionedDataset,
    *,
    seed: int,
    order: str,
    threads: int,
    deterministic: bool,
    replicas: int,
    unit_timeout: float | None,
    min_workers: int | None,
    no_worker_timeout: float | None,
    workers_per_gpu: int,
) -> Cluster:
    """Make the executor, wait for ``min_workers``, resolve the data for the workers
    there and bind the spec, checking the cluster and its devices; the executor is
    closed again if any of it fails."""
    check_own_cluster(executor, client, n_workers, min_workers, replicas)
    made = make_executor(executor, client, n_workers, None if spec.device == "cpu" else "auto", workers_per_gpu)
    made.unit_timeout = unit_timeout
    try:
        if min_workers is not None:
            made.wait_for_workers(min_workers, no_worker_timeout)
        workers = made.workers()
        check_cluster(workers, replicas)
        resolved = data.resolve(len(workers), seed)
        made.bind(spec, resolved, threads, deterministic)
        return Cluster(made, workers, resolved, check_devices(made.devices(), spec, order))
    except BaseException:
        made.close()
        raise


def describe_start(executor: Executor, data: PartitionedDataset, order: str, seed: int, threads: int) -> str:
    """The session's start as its log line says it: partitions, workers, settings, dashboard."""
    link = dashboard_link(executor)
    return (
        f"{partition_count(data)} partitions on {len(executor.workers())} workers ({type(executor).__name__}), "
        f"order={order}, seed={seed}, threads={threads}" + (f"; Dask dashboard: {link}" if link else "")
    )


def check_devices(devices: dict[str, str], spec: TrainingSpec, order: str) -> dict[str, str]:
    """The workers' devices, refused when fixed order would give worker-dependent
    bits: CPU and GPU workers mixed with ``device="auto"``, or CPU workers whose
    kernels differ (``cpu:avx2`` and ``cpu:avx512``)."""
    listed = ", ".join(f"{w}: {d}" for w, d in sorted(devices.items()))
    kinds = {d.split(":")[0] for d in devices.values()}
    if order in FIXED_ORDERS and spec.device == "auto" and len(kinds) > 1:
        raise ValueError(
            f"the cluster mixes CPU and GPU workers ({listed}), so a unit's bits would depend "
            "on the worker it runs on; pass device='cpu' or device='cuda' in the "
            "TrainingSpec to choose (the history records each session's devices)"
        )
    if order in FIXED_ORDERS and len({d for d in devices.values() if d.startswith("cpu")}) > 1:
        raise ValueError(
            f"the workers' CPU kernels differ ({listed}), so a unit's bits would depend on the "
            f"worker it runs on; {_KERNELS_ADVICE}"
        )
    return devices


class Admission:
    """Which workers that join may take units; ``devices`` grows with the admitted."""

    def __init__(
        self, executor: Executor, spec: TrainingSpec, order: str, devices: dict[str, str], workers_per_gpu: int = 1
    ) -> None:
        self._executor, self._spec, self._order = executor, spec, order
        self.devices = devices
        self.refused: set[str] = set()  # joined with a device the key does not allow
        self._workers_per_gpu = workers_per_gpu
        self._gpus: dict[str, str | None] = {}  # worker -> the UUID of its GPU
        self._shared: set[str] = set()  # GPUs reported as shared
        self._check_gpus(list(devices))

    def admits(self, event: Event) -> bool:
        """Whether the engine hears of ``event``: not of a refused worker joining or leaving."""
        if isinstance(event, WorkerAdded):
            return self._admit(event.worker)
        return not (isinstance(event, WorkerLost) and event.worker in self.refused)

    def describe(self) -> str:
        """The devices the session's units run on, e.g. ``"cpu"`` or ``"cuda:0, cuda:1"``."""
        return ", ".join(sorted(set(self.devices.values())))

    def _admit(self, worker: str) -> bool:
        """With fixed order and ``device="auto"``, a worker whose device type differs
        from the session's is logged and left idle (its units would give other bits), as
        is one without a GPU when the spec's device is ``"cuda"``."""
        try:
            device = self._executor.devices([worker]).get(worker)
        except NoGpu as err:
            self.refused.add(worker)
            logger.warning("worker %s joined, but it takes no units: %s", worker, err)
            return False
        kinds = {d.split(":")[0] for d in self.devices.values()}
        cpus = {d for d in self.devices.values() if d.startswith("cpu")}
        fixed = self._order in FIXED_ORDERS
        if device is not None and fixed and device.startswith("cpu") and cpus and device not in cpus:
            self.refused.add(worker)
            logger.warning(
                "worker %s joined with %s, but this session's units run on %s: it takes no units, "
                "since its bits would differ; %s",
                worker,
                device,
                self.describe(),
                _KERNELS_ADVICE,
            )
            return False
        if device is None or not fixed or self._spec.device != "auto" or not kinds or device.split(":")[0] in kinds:
            if device is not None:
                self.devices[worker] = device
                self._check_gpus([worker])
            return True
        self.refused.add(worker)
        logger.warning(
            "worker %s joined with device %s, but this session's units run on %s: it takes no "
            "units, since its bits would differ (pass device= in the TrainingSpec to mix them)",
            worker,
            device,
            self.describe(),
        )
        return False

    def _check_gpus(self, workers: list[str]) -> None:
        """Warn once per GPU held by more workers than ``workers_per_gpu``: each trains
        at a share of its speed, which is rarely meant (several worker processes per
        node that all see every GPU, or one ``CUDA_VISIBLE_DEVICES`` for all)."""
        if not any(d.startswith("cuda") for w, d in self.devices.items() if w in workers):
            return
        self._gpus.update(self._executor.gpus(workers))
        self._gpus = {w: g for w, g in self._gpus.items() if w in self.devices and w not in self.refused}
        for uuid, sharing in shared_gpus(self._gpus, self._workers_per_gpu).items():
            if uuid not in self._shared:
                self._shared.add(uuid)
                logger.warning(
                    "workers %s share GPU %s, but workers_per_gpu is %d: each trains at a share of "
                    "its speed. Start one worker process per GPU (see the GPU guide), or pass "
                    "workers_per_gpu=%d if this is meant",
                    ", ".join(sharing),
                    uuid,
                    self._workers_per_gpu,
                    len(sharing),
                )
