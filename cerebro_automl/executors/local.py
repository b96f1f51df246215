"""The in-process executor: serial, no Dask. For debugging, tests and as the
reference result that the Dask executor must reproduce bit for bit."""

from __future__ import annotations

import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..data import DataError, PartitionData, PartitionedDataset
from ..protocol import (
    AskProgress,
    Command,
    Discard,
    Drop,
    Evaluate,
    EvaluationDone,
    PartitionPlaced,
    Place,
    PlaceFailed,
    Release,
    Rollback,
    Train,
    UnitDone,
    UnitFailed,
)
from ..training import TrainingSpec, UnitError, clear_models, epoch_metrics, evaluate_unit, train_unit
from .base import FETCH_TIMEOUT, Completion, Executor, ModelRecord, idle_wait, partition_count, partition_sources

__all__ = ["LocalExecutor"]


class _Discarded:
    """A queued unit of a model rolled back or released: it only frees its worker."""

    def __init__(self, unit: Train) -> None:
        self.unit = unit


# What waits in the queue: the commands that do work, and the units discarded meanwhile.
_Queued = Place | Train | Evaluate | _Discarded


class LocalExecutor(Executor):
    """Runs every unit in this process, one at a time, in the order instructed.

    ``workers`` only names virtual workers, so that the scheduler sees the
    same cluster shape as a Dask run would; the results do not depend on it.
    """

    def __init__(self, workers: int = 1) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers is {workers!r}, but must be an int >= 1")
        self._names = [f"local-{i}" for i in range(workers)]
        self._instructions: deque[_Queued] = deque()
        self._partitions: dict[int, PartitionData] = {}
        self._models: dict[int, ModelRecord] = {}
        self._scratch: str | None = None  # the folder of disk-cached partitions
        self._idle_delay = 0.01

    def workers(self) -> list[str]:
        return list(self._names)

    def bind(self, spec: TrainingSpec, data: PartitionedDataset, threads: int, deterministic: bool = True) -> None:
        self.spec, self.data, self.threads, self.deterministic = spec, data, threads, deterministic

    def add_model(
        self,
        model_id: int,
        config: Mapping[str, Any],
        seed: int,
        state: dict | None = None,
        epoch: int = 0,
        *,
        fresh_hyperparameters: bool = False,
        worker: str | None = None,
    ) -> str | None:
        record = self._models[model_id] = ModelRecord(config, seed, current=state)
        if fresh_hyperparameters:
            record.fresh_at = epoch
        if state is not None:
            record.keep_end(epoch, state)
            record.durable = (epoch, state)
        return None

    def partition_fingerprints(self, partitions: Iterable[int]) -> dict[int, dict]:
        return {p: self._partitions[p].fingerprint for p in partitions if p in self._partitions}

    def execute(self, instruction: Command) -> None:
        if isinstance(instruction, (Place, Train, Evaluate)):
            self._instructions.append(instruction)
        elif isinstance(instruction, Rollback):
            self._discard_queued(instruction.model_id)
            self._models[instruction.model_id].rollback(instruction.epoch, instruction.durable)
        elif isinstance(instruction, Discard):  # a speculative copy not yet run
            self._discard_queued(instruction.model_id, instruction.worker)
        elif isinstance(instruction, Release):
            self._discard_queued(instruction.model_id)
            record = self._models[instruction.model_id]
            record.current, record.ends, record.durable = None, {}, None
        # AskProgress: a unit here runs to its end within one poll, so none is ever seen midway.
        elif not isinstance(instruction, (Drop, AskProgress)):
            raise TypeError(f"{instruction!r} is not a command an executor carries out")

    def _discard_queued(self, model_id: int, worker: str | None = None) -> None:
        """Queued work of a model whose state is gone no longer runs: its evaluations
        are dropped, and its unit only frees its worker (the scheduler waits for that).
        With ``worker``, only the unit sent there (one run of a speculative race)."""
        kept: deque[_Queued] = deque()
        for ins in self._instructions:
            if isinstance(ins, Train) and ins.model_id == model_id and worker in (None, ins.worker):
                kept.append(_Discarded(ins))
            elif worker is not None or not (isinstance(ins, Evaluate) and ins.model_id == model_id):
                kept.append(ins)
        self._instructions = kept

    def busy(self) -> bool:
        return bool(self._instructions)

    def poll(self, timeout: float) -> list[Completion]:
        if not self._instructions:
            self._idle_delay = idle_wait(self._idle_delay, timeout)  # nothing to run: no spin
            return []
        self._idle_delay = 0.01
        # Units set torch's thread count (process-wide); this process is the user's.
        threads = torch.get_num_threads()
        try:
            return [self._run(self._instructions.popleft())]
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def _run(self, ins: _Queued) -> Completion:
        if isinstance(ins, _Discarded):
            return Completion(UnitDone(ins.unit.model_id, ins.unit.partition, ins.unit.worker))
        if isinstance(ins, Place):
            if ins.partition not in self._partitions:  # one process: load once, keep it
                if self._scratch is None and self.data.options.cache == "disk":
                    self._scratch = tempfile.mkdtemp(prefix="cerebro-cache-", dir=self.data.options.cache_dir)
                try:
                    source = partition_sources(self.data)[ins.partition]
                    self._partitions[ins.partition] = source.load(scratch=self._scratch)
                except Exception as err:  # the scheduler retries, then stops the session
                    lasting = isinstance(err, DataError)
                    return Completion(PlaceFailed(ins.partition, ins.worker, f"{type(err).__name__}: {err}", lasting))
            return Completion(PartitionPlaced(ins.partition, ins.worker))
        record = self._models[ins.model_id]
        if isinstance(ins, Train):
            try:
                state = train_unit(
                    self.spec,
                    record.config,
                    record.current,
                    self._partitions[ins.partition].train,
                    seed=record.seed,
                    epoch=ins.epoch,
                    partition=ins.partition,
                    step=ins.step,
                    epoch_end=ins.epoch_end,
                    threads=self.threads,
                    unit_timeout=self.unit_timeout,
                    fresh_hyperparameters=record.fresh_hyperparameters(ins.epoch, ins.step),
                    deterministic=self.deterministic,
                    budget=ins.budget,
                    partitions=partition_count(self.data),
                )
            except UnitError as err:
                return Completion(UnitFailed(ins.model_id, ins.partition, ins.worker, str(err)))
            record.current = state
            if ins.epoch_end:
                record.keep_end(ins.epoch + 1, state)
            return Completion(UnitDone(ins.model_id, ins.partition, ins.worker))
        try:
            results = [
                evaluate_unit(
                    self.spec,
                    record.config,
                    record.evaluated(ins.epoch, ins.unit),
                    self._partitions[p].valid,
                    seed=record.seed,
                    threads=self.threads,
                    deterministic=self.deterministic,
                )
                for p in range(partition_count(self.data))
            ]
        except UnitError as err:
            return Completion(EvaluationDone(ins.model_id, ins.epoch, str(err), ins.unit))
        return Completion(EvaluationDone(ins.model_id, ins.epoch, unit=ins.unit), epoch_metrics(results))

    def state_fetcher(self, model_id: int, epoch: int | None = None) -> Callable[[float], dict]:
        record = self._models[model_id]
        state = record.current if epoch is None else record.ends.get(epoch)
        if state is None:
            raise ValueError(
                f"model {model_id} holds no trained state" + ("" if epoch is None else f" after epoch {epoch}")
            )

        def fetch(timeout: float = FETCH_TIMEOUT) -> dict:
            return state

        return fetch

    def close(self) -> None:
        if getattr(self, "spec", None) is not None:
            clear_models(self.spec)  # the modules kept between units, their frozen bases with them
        self._instructions.clear()
        self._partitions.clear()
        self._models.clear()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
