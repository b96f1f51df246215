"""A session's parts, made and wired together (its composition root): the history,
the admission of workers, fusion, the checkpoint writer, the progress bar, the data
fingerprint, the notices' handler, the event loop, the starts and the models.

The :class:`~.session.Session` keeps the resources (cluster, directory, signals)
and the tuner's API; what its parts are and how they talk is decided here once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..callbacks import CallbackList
from ..checkpoint import CheckpointWriter
from ..data import PartitionedDataset
from ..data.fingerprint import layout_differences
from ..engine import Scheduler, WidthDecisions
from ..executors.base import Executor, partition_count, partition_sources
from ..fusion.signature import Signatures
from ..progress import make_bar
from ..reports import SessionView
from ..retention import Retention
from ..training import TrainingSpec
from .cluster import Admission, checkpoints_left, lost_scheduler
from .fingerprints import DataFingerprint
from .fusion import Fusion
from .history import History
from .loop import EventLoop
from .models import Models, notifier
from .outcomes import Outcomes
from .starts import Starts

__all__ = ["Parts", "Settings", "wire"]


@dataclass(frozen=True)
class Settings:
    """What the session was asked for, as its parts need it."""

    spec: TrainingSpec
    seed: int
    order: str
    threads: int
    deterministic: bool
    fuse: int
    workers_per_gpu: int
    checkpoint_dir: str | None
    resume: bool
    no_worker_timeout: float | None
    retention: Retention | None


@dataclass(frozen=True)
class Parts:
    history: History
    admission: Admission
    fusion: Fusion
    writer: CheckpointWriter
    bar: Any
    fingerprint: DataFingerprint
    outcomes: Outcomes
    loop: EventLoop
    starts: Starts
    models: Models


def wire(
    settings: Settings,
    executor: Executor,
    scheduler: Scheduler,
    data: PartitionedDataset,
    devices: dict[str, str],
    callbacks: CallbackList,
    view: SessionView,
    *,
    progress: bool | None,
    started: float,
    checkpoint_meta: Callable[[], dict[str, Any]],
    fetch_state: Callable[[int, int], dict],
) -> Parts:
    """Make the session's parts and connect them (see the module docstring)."""
    s = settings
    partitions = partition_count(data)
    history = History(s.spec.metric_names if data.has_validation else ["train_loss"])
    admission = Admission(executor, s.spec, s.order, devices, s.workers_per_gpu)
    fusion = Fusion(s.fuse, Signatures(s.spec), partitions)
    writer, bar = CheckpointWriter(), make_bar(progress)
    run_keys = {
        "session_seed": s.seed,
        "num_partitions": partitions,
        "threads": s.threads,
        "deterministic": s.deterministic,
        "fuse": fusion.fuse,
        "cyclic": s.order == "cyclic",  # another order of the partitions past epoch 1, hence other bits
    }
    late: dict[str, Any] = {}  # the parts made after those that call them: looked up when called
    fingerprint = DataFingerprint(
        executor, scheduler, partitions,
        lambda done, deadline: late["loop"].run_until(done, deadline),  # noqa: PLW0108
        s.no_worker_timeout,
    )  # fmt: skip
    outcomes = Outcomes(
        history, callbacks, view, executor=executor, scheduler=scheduler, bar=bar, writer=writer,
        checkpoint_dir=s.checkpoint_dir, run_keys=run_keys, devices=admission.describe, started=started,
        describe_source=lambda p: partition_sources(data)[p].describe(), checkpoint_meta=checkpoint_meta,
        fusion=fusion, retention=s.retention, data_layouts=lambda: layout_differences(fingerprint.known()),
    )  # fmt: skip
    loop = late["loop"] = EventLoop(
        executor, scheduler, outcomes, admits=admission.admits, bar=bar, writer=writer,
        no_worker_timeout=s.no_worker_timeout,
        lost_scheduler=lambda err: lost_scheduler(
            executor, err, s.checkpoint_dir, [m.name for m in history.models.values()]
        ),
        resume_advice=lambda: checkpoints_left(s.checkpoint_dir, [m.name for m in history.models.values()]),
    )  # fmt: skip
    starts = Starts(
        s.spec, executor, scheduler, history, run_keys, s.checkpoint_dir, s.resume, fetch_state,
        fingerprint.complete,
        status=lambda i: late["models"].status(i),  # noqa: PLW0108
        held_epochs=lambda i: late["models"].held_epochs(i),  # noqa: PLW0108
        in_group=lambda i: fusion.group(i) is not None,
    )  # fmt: skip
    models = late["models"] = Models(
        seed=s.seed, partitions=partitions, resume=s.resume, executor=executor, scheduler=scheduler,
        history=history, starts=starts, fusion=fusion, outcomes=outcomes, loop=loop, bar=bar,
        notify=notifier(callbacks, view),
        gang=WidthDecisions(partitions) if scheduler.settings.gang else None, batch_size=s.spec.resolve_batch_size,
    )  # fmt: skip
    return Parts(history, admission, fusion, writer, bar, fingerprint, outcomes, loop, starts, models)
