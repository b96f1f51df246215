"""The instruction set of the CPU kernels, pinned so that bits do not depend on the machine.

PyTorch picks its vectorized kernels by the CPU it runs on, at the first operation
of a process: ATen's (AVX-512, AVX2 or none), oneDNN's (which also runs
``nn.Linear`` and convolutions) and MKL's each their own. The same seed and
configs then give other weights on an AVX-512 machine than on an AVX2 one, and a
cluster that mixes them gives bits that depend on which worker ran a unit.

So ``import cerebro_automl`` pins all three to AVX2, which every x86-64 server
CPU of the last decade has (Intel from Haswell, AMD from Zen), by setting
``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2`` and ``MKL_CBWR=AVX2``
(MKL's conditional numerical reproducibility, the same results on Intel and
AMD) in the process's environment, unless they are set already. Worker processes
inherit them, or set them when they first import the package. A process that ran
a torch operation before importing the package keeps what it chose.

Set the variables yourself to choose otherwise (``ATEN_CPU_CAPABILITY=avx512``,
``ONEDNN_MAX_CPU_ISA=ALL``, ``MKL_CBWR=AUTO`` for the machine's fastest kernels):
the history's ``device`` column records what the units ran with (``cpu:avx2``),
and a session refuses workers whose kernels differ, since their bits would.

>>> describe_cpu_kernels("AVX2", {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"})
'avx2'
>>> describe_cpu_kernels("AVX512", {})
'avx512 (oneDNN: native, MKL: native)'
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping

__all__ = ["PINNED", "pin_cpu_kernels", "cpu_kernels", "describe_cpu_kernels"]

PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"}


def pin_cpu_kernels() -> None:
    """Set the variables of :data:`PINNED` that are not set, on an x86-64 CPU with AVX2
    and FMA (ATen would take the AVX2 kernels on the variable's word alone, and crash
    on a CPU without them; elsewhere the kernels are the CPU's, recorded as they are)."""
    if platform.machine().lower() in ("x86_64", "amd64") and _has_avx2():
        for name, value in PINNED.items():
            os.environ.setdefault(name, value)


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma"} <= flags
    except OSError:
        pass
    return False


def describe_cpu_kernels(aten: str, environ: Mapping[str, str]) -> str:
    """``aten`` (ATen's capability) lowercased when oneDNN and MKL are pinned to
    match it, else with what they run."""
    aten = aten.lower()
    onednn, mkl = environ.get("ONEDNN_MAX_CPU_ISA", "native"), environ.get("MKL_CBWR", "native")
    if onednn.lower() == aten and mkl.lower() == aten:
        return aten
    return f"{aten} (oneDNN: {onednn}, MKL: {mkl})"


def cpu_kernels() -> str:
    """The kernels this process's CPU operations run with, e.g. ``"avx2"``."""
    import torch

    return describe_cpu_kernels(torch.backends.cpu.get_cpu_capability(), os.environ)
