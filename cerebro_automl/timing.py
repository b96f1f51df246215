"""What the MOP scheduler learns from the clock (pure: no Dask, no torch, no I/O).

Each model's units take about the same time on the same worker, and each worker
runs its units at its own pace. :class:`UnitTimes` keeps both: a model's recent
unit durations, each divided by the pace of the worker that ran it, and a
worker's recent unit times divided by the typical duration of the unit's model.
The scheduler asks it how fast a worker is (to prefer fast holders) and how long a
model's unit should take (to spot a straggler).

Example:
    >>> times = UnitTimes()
    >>> for seconds in (1.0, 1.0, 1.0):
    ...     times.learn(model_id=0, worker="a", seconds=seconds)
    >>> for seconds in (2.0, 2.0, 2.0):
    ...     times.learn(model_id=0, worker="b", seconds=seconds)
    >>> times.pace("b"), times.typical(0)
    (2.0, 1.0)
"""

from __future__ import annotations

from collections import deque
from statistics import median

# MIN_TIMINGS durations make a median; the newest TIMINGS_KEPT count.
MIN_TIMINGS = 3
TIMINGS_KEPT = 16


class UnitTimes:
    """Models' typical unit durations and workers' paces, learnt from finished units."""

    def __init__(self) -> None:
        self._durations: dict[int, deque] = {}  # model -> its unit times / the pace of their workers
        self._paces: dict[str, deque] = {}      # worker -> its unit times / their models' median

    def pace(self, worker: str) -> float:
        """How many times its models' median unit time ``worker`` takes (1.0 until
        it has ``MIN_TIMINGS`` timed units)."""
        samples = self._paces.get(worker)
        return median(samples) if samples is not None and len(samples) >= MIN_TIMINGS else 1.0

    def typical(self, model_id: int) -> float | None:
        """The model's median unit duration at pace 1.0, once it has ``MIN_TIMINGS``; else None."""
        durations = self._durations.get(model_id)
        return median(durations) if durations is not None and len(durations) >= MIN_TIMINGS else None

    def learn(self, model_id: int, worker: str, seconds: float) -> None:
        """A unit of ``model_id`` took ``seconds`` on ``worker``: the worker's pace against
        the model's median so far, and the model's duration in units of that pace."""
        durations = self._durations.setdefault(model_id, deque(maxlen=TIMINGS_KEPT))
        if durations:
            self._learn_pace(worker, seconds, median(durations))
        durations.append(seconds / self.pace(worker))

    def overtaken(self, model_id: int, worker: str, seconds: float) -> None:
        """A unit on ``worker`` lost its race to a copy after ``seconds``: it is at least
        that slow, a lower bound that teaches the worker's pace (a worker that is
        always slow would otherwise never finish a timed unit, and be copied against
        forever)."""
        durations = self._durations.get(model_id)
        if durations:
            self._learn_pace(worker, seconds, median(durations))

    def forget_worker(self, worker: str) -> None:
        self._paces.pop(worker, None)

    def _learn_pace(self, worker: str, seconds: float, typical: float) -> None:
        if typical > 0:
            self._paces.setdefault(worker, deque(maxlen=TIMINGS_KEPT)).append(seconds / typical)
