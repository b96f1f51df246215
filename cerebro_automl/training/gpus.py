"""One GPU per worker process, on any cluster.

A node's worker processes may all see every GPU (``dask worker --nworkers 4``,
dask-jobqueue's ``processes=4``): each would train on ``cuda:0``. So the first
time a process trains on a GPU it takes the one that the fewest processes on its
node hold, by locking a file named after that GPU's UUID in the node's temporary
folder (``flock``: the lock goes with the process, however it ends). A launcher
that gives each process its own GPU (``CUDA_VISIBLE_DEVICES``, dask-cuda) leaves
one GPU to take, and a process whose current device was set with
``torch.cuda.set_device`` keeps it.

The UUIDs name GPUs across processes and nodes (``CUDA_VISIBLE_DEVICES``
renumbers them), so the session sees which workers share one
(:func:`shared_gpus`).

>>> shared_gpus({"tcp://a:1": "GPU-1", "tcp://a:2": "GPU-1", "tcp://a:3": "GPU-2"}, 1)
{'GPU-1': ['tcp://a:1', 'tcp://a:2']}
>>> shared_gpus({"tcp://a:1": "GPU-1", "tcp://a:2": "GPU-1", "tcp://b:1": None}, 2)
{}
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["GpuClaim", "claim_gpu", "process_gpu", "shared_gpus"]

_LOCK = threading.Lock()
_CLAIMED: list[GpuClaim] = []  # this process's claim, once taken
_HELD: list[int] = []  # the claims' lock files, open for the life of the process


@dataclass(frozen=True)
class GpuClaim:
    """The GPU a process trains on: its index among the process's visible GPUs, its
    UUID, and how many processes of the node held it before (0: it is this one's alone)."""

    index: int
    uuid: str
    holders_before: int


def claim_gpu(uuids: Sequence[str], lock_dir: str | None = None, prefer: int | None = None) -> GpuClaim:
    """Take the GPU of ``uuids`` (the visible ones, by index) held by the fewest
    processes of this node; the lowest index among equals. ``prefer``: the index to
    take whatever others hold (a current device the user set)."""
    if not uuids:
        raise ValueError("uuids is empty, but a GPU claim needs at least one visible GPU")
    folder = lock_dir or tempfile.gettempdir()
    order = range(len(uuids)) if prefer is None else [prefer]
    for holders in range(4096):
        for index in order:
            handle = _try_lock(os.path.join(folder, f"cerebro-gpu-{_safe(uuids[index])}.{holders}.lock"))
            if handle is not None:
                _HELD.append(handle)
                return GpuClaim(index, uuids[index], holders)
    raise RuntimeError(f"could not claim any of the GPUs {list(uuids)}: 4096 processes hold each")


def _try_lock(path: str) -> int | None:
    """An open descriptor holding ``path``'s lock, or None when another process holds
    it, or this one cannot open it (another user's file in a shared /tmp counts as held)."""
    try:
        try:
            fd = os.open(path, os.O_RDONLY)  # no O_CREAT: a sticky /tmp refuses it on another's file
        except FileNotFoundError:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o666)
            os.fchmod(fd, 0o666)  # other users' workers lock it too (the umask took bits away)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _safe(uuid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in uuid)


def _visible_uuids() -> list[str]:
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def process_gpu() -> GpuClaim:
    """This process's GPU, claimed on the first call (see the module's notes)."""
    with _LOCK:
        if not _CLAIMED:
            current = torch.cuda.current_device()
            _CLAIMED.append(claim_gpu(_visible_uuids(), prefer=current if current != 0 else None))
        return _CLAIMED[0]


def shared_gpus(gpus: Mapping[str, str | None], workers_per_gpu: int) -> dict[str, list[str]]:
    """The GPUs (by UUID) held by more than ``workers_per_gpu`` of the workers
    ``gpus`` maps to their GPU (None: a worker on the CPU), each with its workers."""
    by_gpu: dict[str, list[str]] = {}
    for worker, uuid in sorted(gpus.items()):
        if uuid is not None:
            by_gpu.setdefault(uuid, []).append(worker)
    return {uuid: workers for uuid, workers in by_gpu.items() if len(workers) > workers_per_gpu}
