"""Where a unit runs and how its device behaves: the device a spec picks, the
name the history records, deterministic CUDA kernels, and a clock of the unit's
phases on that device."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..cpu_kernels import cpu_kernels
from .gpus import process_gpu

if TYPE_CHECKING:
    from .contract import RunSpec

__all__ = [
    "CUBLAS_WORKSPACE",
    "pick_device",
    "describe_device",
    "gpu_of",
    "deterministic_algorithms",
    "PhaseClock",
    "PHASES",
    "add_phase_seconds",
]

logger = logging.getLogger("cerebro_automl")

# cuBLAS needs a fixed workspace for bitwise-reproducible matrix products (PyTorch's
# reproducibility notes); read when a process first uses cuBLAS.
CUBLAS_WORKSPACE = ":4096:8"


class NoGpu(ValueError):
    """The spec's device is ``"cuda"``, and this process sees no CUDA GPU."""


def pick_device(spec: RunSpec) -> torch.device:
    """The device a unit of ``spec`` runs on in this process: with ``"auto"`` or
    ``"cuda"``, the process's own GPU (:func:`~.gpus.process_gpu`: of the GPUs it
    sees, the one the fewest processes of its node took). :class:`NoGpu` where the
    device is ``"cuda"`` and the process sees none."""
    if spec.device == "cuda" and not torch.cuda.is_available():
        why = "its torch is built without CUDA" if not torch.backends.cuda.is_built() else "no GPU is visible"
        raise NoGpu(
            f"device is 'cuda', but this process sees no CUDA GPU ({why}; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): run it where GPUs are, or pass device='auto', "
            "which takes a GPU where there is one and the CPU elsewhere"
        )
    if spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", process_gpu().index)
    return torch.device("cpu")


def gpu_of(spec: RunSpec) -> str | None:
    """The UUID of the GPU a unit of ``spec`` runs on in this process; None on the CPU."""
    return process_gpu().uuid if pick_device(spec).type == "cuda" else None


def describe_device(spec: RunSpec) -> str:
    """What a unit of ``spec`` runs on here, as the history records it: ``"cpu:<kernels>"``
    (:func:`~cerebro_automl.cpu_kernels.cpu_kernels`) or ``"cuda:<GPU model>"``: bits
    are reproducible on the same device type and CPU kernels or GPU model.

    >>> from cerebro_automl.training import TrainingSpec
    >>> describe_device(TrainingSpec(model_fn=len, optimizer_fn=len, device="cpu"))
    'cpu:avx2'
    """
    device = pick_device(spec)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{cpu_kernels()}"


@contextlib.contextmanager
def deterministic_algorithms(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """On CUDA, run the block on ``device`` as the current GPU (so that CUDA events,
    streams and tensors made on ``"cuda"`` are its), with deterministic kernels only
    (cuDNN's among them) and cuBLAS's fixed workspace, so that a unit's bits do not
    depend on the run; an operation without a deterministic kernel raises. Does
    nothing on the CPU, whose kernels are deterministic at a fixed thread count."""
    if device.type != "cuda":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.benchmark = before[1] and not enabled
    try:
        with torch.cuda.device(device):
            yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


#: a unit's phases, as its clock marks them: the state moved in (and a group's members
#: stacked), training, the state moved out
PHASES = ("transfer_in", "compute", "transfer_out")


def add_phase_seconds(progress: dict[str, Any], phases: Mapping[str, float] | None) -> None:
    """Add a unit's ``phases`` (from :meth:`PhaseClock.seconds`) to its epoch's ``progress``."""
    if phases:
        total = progress.setdefault("phase_seconds", {})
        for name, seconds in phases.items():
            total[name] = total.get(name, 0.0) + seconds


class PhaseClock:
    """Marks on the device's stream (CUDA events, which need no wait) or the host clock;
    read once the unit's work has finished."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        """Mark now (on a GPU: when the stream reaches this point)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self, names: tuple[str, ...]) -> dict[str, float]:
        """Seconds between consecutive marks, one per name; empty when the device cannot
        say (the clock is instrumentation, and never fails a unit)."""
        pairs = zip(self.marks, self.marks[1:], strict=False)
        if not self.cuda:
            return {n: b - a for n, (a, b) in zip(names, pairs, strict=False)}
        try:
            if self.marks:
                self.marks[-1].synchronize()  # elapsed_time needs both events completed
            return {n: a.elapsed_time(b) / 1000 for n, (a, b) in zip(names, pairs, strict=False)}
        except Exception as err:
            logger.debug("the phase clock could not read the device's events: %r", err)
            return {}
