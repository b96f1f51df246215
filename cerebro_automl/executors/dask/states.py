"""The driver's one record of which future holds each version of a model's state.

A model's state versions: its newest state (``current``), its state after each of
its newest two epochs (``ends``), the driver's copy of the state it started from
(``durable``), and, while a unit runs, the state that unit started from (a retry,
a restart or a speculative copy starts there again). A unit in flight has one run,
or two while a speculative copy races it; whichever finishes, its state stands.

:class:`StateVersions` is the only place that changes these; the executor tells it
what it sent and what came of it, and asks it which future to read.

>>> states = StateVersions()
>>> record = states.add(0, {"lr": 0.1}, seed=1)
>>> states.current(0) is None  # initial weights, built from the seed
True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import CancelledError
from typing import Any

from ...protocol import StatesLost, Train
from ..base import ModelRecord, StateUnavailable
from .failures import TIMEOUTS, gone
from .wire import is_future

__all__ = ["StateVersions", "fetch"]

_FROM_RUN = object()  # discard_run's default prior: the one the model's unit in flight started from


class StateVersions:
    """Which future (or driver copy) holds each model's state versions; see the module."""

    def __init__(self) -> None:
        self._records: dict[int, ModelRecord] = {}
        self._runs: dict[int, dict[str, Any]] = {}  # model -> worker -> future of its unit in flight
        self._run_prior: dict[int, Any] = {}  # model -> the state its unit in flight started from
        self._discarded: set[Any] = set()  # unit futures whose result no longer counts
        self._holders: dict[str, str] = {}  # state future key -> the worker it was made on
        self._reported_lost: set[str] = set()  # keys of lost states already reported

    # ---------------------------------------------------------------- models
    def add(self, model_id: int, config: Mapping[str, Any], seed: int, **fields: Any) -> ModelRecord:
        """Register a model (``fields``: more :class:`ModelRecord` fields)."""
        record = self._records[model_id] = ModelRecord(config, seed, **fields)
        return record

    def record(self, model_id: int) -> ModelRecord:
        """What the executor keeps of model ``model_id``."""
        return self._records[model_id]

    def records(self) -> Mapping[int, ModelRecord]:
        """Every model's record, by id (read-only use)."""
        return self._records

    def start_from(self, model_id: int, epoch: int, state: Any, durable: Any, worker: str | None) -> None:
        """Model ``model_id`` starts after ``epoch`` epochs from ``state`` (a future made
        on ``worker``, or the driver's copy), with ``durable`` the driver's copy of it."""
        record = self._records[model_id]
        record.durable = (epoch, durable)
        record.current = state
        if worker is not None:
            self._holders[state.key] = worker
        record.keep_end(epoch, state)

    def end_state(self, model_id: int, epoch: int) -> Any:
        """The state after ``epoch`` epochs (None: not held)."""
        return self._records[model_id].ends.get(epoch)

    def state(self, model_id: int, epoch: int | None = None) -> Any:
        """The newest state, or the one after ``epoch``; ValueError when none is held."""
        record = self._records[model_id]
        state = record.current if epoch is None else record.ends.get(epoch)
        if state is None:
            raise ValueError(
                f"model {model_id} holds no trained state" + ("" if epoch is None else f" after epoch {epoch}")
            )
        return state

    def holder(self, state: Any) -> str | None:
        """The worker a state future was made on (None: unknown, or the driver's copy)."""
        key = getattr(state, "key", None)
        return None if key is None else self._holders.get(key)

    def rollback(self, model_id: int, epoch: int, durable: bool) -> None:
        self._records[model_id].rollback(epoch, durable)

    def release(self, model_id: int) -> None:
        """The model is stopped or failed: it holds no state any more."""
        record = self._records[model_id]
        record.current, record.ends, record.durable = None, {}, None

    # ------------------------------------------------------------------ runs
    def begin_unit(self, ins: Train) -> Any:
        """The state the unit ``ins`` starts from (a copy: where the unit it races started)."""
        record = self._records[ins.model_id]
        if ins.copy:
            return self._run_prior.get(ins.model_id, record.current)
        if ins.step == 0:
            record.ends = {e: s for e, s in record.ends.items() if e == ins.epoch}
        prior = self._run_prior[ins.model_id] = record.current
        self._runs[ins.model_id] = {}
        return prior

    def unit_sent(self, ins: Train, future: Any) -> None:
        """The unit ``ins`` runs as ``future``: its state is the model's newest (a copy's
        only once the unit it races is discarded)."""
        record = self._records[ins.model_id]
        self._runs.setdefault(ins.model_id, {})[ins.worker] = future
        self._hold(future, ins.worker)
        if ins.copy:
            return
        record.current = future
        if ins.epoch_end:
            record.keep_end(ins.epoch + 1, future)

    def run(self, model_id: int, worker: str) -> Any:
        """The future of the model's run on ``worker`` (None: none in flight)."""
        return self._runs.get(model_id, {}).get(worker)

    def discard_run(self, model_id: int, worker: str, restart: bool, prior: Any = _FROM_RUN) -> Any:
        """The model's run on ``worker`` no longer counts: in a race the other run's state
        stands; with ``restart`` the model's state is again ``prior``, the one the run
        started from. Returns the discarded future (None: no such run)."""
        runs = self._runs.get(model_id, {})
        loser = runs.pop(worker, None)
        if loser is None:
            return None
        record = self._records[model_id]
        for winner in runs.values():
            self._hand_over(record, loser, winner)
        if restart and not runs:
            if record.current is loser:  # None is a prior too: a model's initial weights
                record.current = self._run_prior[model_id] if prior is _FROM_RUN else prior
            record.ends = {e: s for e, s in record.ends.items() if s is not loser}
        return loser

    def undo_unit(self, model_id: int, future: Any, prior: Any) -> None:
        """Forget a unit's output: the engine runs it again from ``prior``, the state it
        started from (or, while a speculative copy races it, takes the copy's)."""
        record = self._records.get(model_id)
        if record is None:
            return
        runs = self._runs.get(model_id, {})
        for w in [w for w, f in runs.items() if f is future]:
            del runs[w]
        if runs:  # a speculative copy races it: that run becomes the unit
            self._hand_over(record, future, next(iter(runs.values())))
            return
        if record.current is future:
            record.current = prior
        record.ends = {e: s for e, s in record.ends.items() if s is not future}

    def end_runs(self, model_id: int) -> None:
        """The model's runs in flight no longer count (rollback, stop)."""
        self._runs.pop(model_id, None)
        self._run_prior.pop(model_id, None)

    def forget_priors(self, running: set[int]) -> None:
        """Let go of the start states of the models not in ``running`` (a speculative copy
        could only start while the engine had not yet seen their unit end), so that a
        paused model holds one state on the cluster, not two."""
        for model_id in [m for m in self._run_prior if m not in running]:
            del self._run_prior[model_id]

    def discard(self, future: Any) -> None:
        """The unit ``future``'s result no longer counts; its end only frees its worker."""
        self._discarded.add(future)

    def is_discarded(self, future: Any) -> bool:
        return future in self._discarded

    def settle(self, future: Any) -> bool:
        """The unit ``future`` ended: whether it had been discarded."""
        discarded = future in self._discarded
        self._discarded.discard(future)
        return discarded

    # ------------------------------------------------------------ lost states
    def lost(self, in_flight: Mapping[int, tuple[Any, Any]]) -> Iterator[StatesLost]:
        """StatesLost for each model whose newest state, or an epoch end, is gone, each
        lost state once. ``in_flight``: model -> (its unit's future, the state it
        started from), for the units that count; the newest state of a model with one
        is that prior, and its own future is no loss yet."""
        for model_id, record in self._records.items():
            unit, prior = in_flight.get(model_id, (None, record.current))
            newest = is_future(prior) and gone(prior) and prior.key not in self._reported_lost
            lost_ends = {
                e: s
                for e, s in record.ends.items()
                if is_future(s) and s is not unit and gone(s) and s.key not in self._reported_lost
            }
            if newest or lost_ends:
                self._reported_lost.update([s.key for s in lost_ends.values()] + ([prior.key] if newest else []))
                yield StatesLost(model_id, newest, tuple(sorted(lost_ends)))

    # ---------------------------------------------------------------- close
    def futures(self) -> list[Any]:
        """Every state future held (to release them at once)."""
        held = [
            *self._discarded,
            *self._run_prior.values(),
            *(f for runs in self._runs.values() for f in runs.values()),
            *(f for r in self._records.values() for f in (r.current, *r.ends.values())),
        ]
        return [f for f in held if is_future(f)]

    def clear(self) -> None:
        self._runs.clear()
        self._run_prior.clear()
        self._discarded.clear()
        self._records.clear()

    # -------------------------------------------------------------- helpers
    @staticmethod
    def _hand_over(record: ModelRecord, loser: Any, winner: Any) -> None:
        """The state ``winner`` computes (the same bits) stands wherever ``loser``'s did."""
        if record.current is loser:
            record.current = winner
        record.ends = {e: winner if s is loser else s for e, s in record.ends.items()}

    def _hold(self, future: Any, worker: str) -> None:
        """Remember which worker makes a state; forget the states no model refers to."""
        self._holders[future.key] = worker
        if len(self._holders) > 4 * len(self._records) + 1000:
            used = {s.key for r in self._records.values() for s in (r.current, *r.ends.values()) if is_future(s)}
            self._holders = {k: w for k, w in self._holders.items() if k in used}


def fetch(future: Any, holder: str | None, what: str, timeout: float, workers: Callable[[], list[str]]) -> dict:
    """``future.result()`` in slices, giving up as soon as its worker (``holder``) is
    no longer among ``workers()``: a state whose worker died is recomputed (Dask would
    wait for that worker forever). Raises :class:`StateUnavailable`."""
    deadline = time.monotonic() + timeout
    while True:
        if future.status in ("cancelled", "lost"):
            raise StateUnavailable(f"{what} was lost ({future.status}) with worker {holder}", lost=True)
        try:
            return future.result(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except TIMEOUTS:
            pass
        except CancelledError:
            raise StateUnavailable(f"{what} was lost with worker {holder}", lost=True) from None
        if holder is not None and holder not in workers():
            raise StateUnavailable(f"{what} was lost with worker {holder}", lost=True)
        if time.monotonic() >= deadline:
            raise StateUnavailable(f"{what} did not reach the driver within {timeout} s (worker {holder})", lost=False)
