"""What the MOP scheduler learns from the clock (pure: no Dask, no torch, no I/O).

Each model's units take about the same time on the same worker, and each worker
runs its units at its own pace. :class:`UnitTimes` keeps both: a model's recent
unit durations (with the worker that ran each), and a worker's recent unit times
divided by the typical duration of the unit's model. A model's typical duration
is the median of its durations, each divided by the pace of the worker that ran
it now (not when it ran: paces are learnt as units finish, and a duration divided
by a guess made before would stay wrong). A worker not timed yet is taken to run
at the median pace of those that are. The scheduler asks how fast a worker is (to
prefer fast holders) and how long a unit should take (to spot a straggler).

Example:
    >>> times = UnitTimes()
    >>> for seconds in (1.0, 1.0, 1.0, 1.0):
    ...     times.learn(model_id=0, worker="a", seconds=seconds)
    >>> for seconds in (2.0, 2.0, 2.0):
    ...     times.learn(model_id=0, worker="b", seconds=seconds)
    >>> times.pace("b"), times.typical(0), times.expected(0, "b")
    (2.0, 1.0, 2.0)
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

# MIN_TIMINGS durations make a median; the newest TIMINGS_KEPT count.
MIN_TIMINGS = 3
TIMINGS_KEPT = 16


class UnitTimes:
    """Models' typical unit durations and workers' paces, learnt from finished units."""

    def __init__(self) -> None:
        self._durations: dict[int, deque] = {}  # model -> (seconds, worker) of its recent units
        self._samples: dict[str, deque] = {}  # worker -> its unit times / their models' typical then
        self._paces: dict[str, float] = {}  # worker -> median of its samples, once MIN_TIMINGS
        self._usual = 1.0  # the median of _paces: a worker not timed yet

    def pace(self, worker: str) -> float:
        """How many times its models' typical unit time ``worker`` takes (the usual
        pace of the timed workers until it has ``MIN_TIMINGS`` timed units; 1.0 while none has)."""
        return self._paces.get(worker, self._usual)

    def typical(self, model_id: int) -> float | None:
        """The model's median unit duration at pace 1.0, once it has ``MIN_TIMINGS``; else None."""
        durations = self._durations.get(model_id)
        if durations is None or len(durations) < MIN_TIMINGS:
            return None
        return self._typical(durations)

    def expected(self, model_id: int, worker: str) -> float | None:
        """How long a unit of ``model_id`` should take on ``worker`` (None: not known yet)."""
        typical = self.typical(model_id)
        return None if typical is None else typical * self.pace(worker)

    def learn(self, model_id: int, worker: str, seconds: float) -> None:
        """A unit of ``model_id`` took ``seconds`` on ``worker``: the worker's pace against
        the model's typical duration so far, and the model's durations."""
        durations = self._durations.setdefault(model_id, deque(maxlen=TIMINGS_KEPT))
        if durations:
            self._learn_pace(worker, seconds, self._typical(durations))
        durations.append((seconds, worker))

    def overtaken(self, model_id: int, worker: str, seconds: float) -> None:
        """A unit on ``worker`` lost its race to a copy after ``seconds``: it is at least
        that slow, a lower bound that teaches the worker's pace (a worker that is
        always slow would otherwise never finish a timed unit, and be copied against
        forever)."""
        durations = self._durations.get(model_id)
        if durations and seconds > 0:  # (lost at once, to a copy started with it: no bound)
            self._learn_pace(worker, seconds, self._typical(durations))

    def validate(self) -> None:
        """Check that every duration and pace sample is a finite number > 0 (one
        infinite sample could make a median, and a pace, infinite); raise
        ``AssertionError`` naming the first that is not."""
        for model_id, durations in self._durations.items():
            for seconds, worker in durations:
                if not (math.isfinite(seconds) and seconds > 0):
                    raise AssertionError(f"model {model_id} has a unit duration of {seconds!r} s on {worker}")
        for worker, samples in self._samples.items():
            for sample in samples:
                if not (math.isfinite(sample) and sample > 0):
                    raise AssertionError(f"worker {worker} has a pace sample of {sample!r}")

    def forget_worker(self, worker: str) -> None:
        self._samples.pop(worker, None)
        if self._paces.pop(worker, None) is not None:
            self._usual = median(self._paces.values()) if self._paces else 1.0

    def _typical(self, durations: deque) -> float:
        return median(seconds / self.pace(worker) for seconds, worker in durations)

    def _learn_pace(self, worker: str, seconds: float, typical: float) -> None:
        if typical <= 0:
            return
        samples = self._samples.setdefault(worker, deque(maxlen=TIMINGS_KEPT))
        samples.append(seconds / typical)
        if len(samples) >= MIN_TIMINGS:
            self._paces[worker] = median(samples)
            self._usual = median(self._paces.values())
