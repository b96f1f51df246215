"""The ways a model starts, and their checks.

* fresh: from ``model_fn(config)``'s initial weights at epoch 0, or, when the
  session resumes, after the newest valid checkpoint of the model's name;
* resume: ``add(resume=(epoch, state))``, a checkpoint of this same model;
* fork: ``add(init_from=(model_id, epoch))``, another model's state after an
  epoch it reported (population-based training is built on it);
* warm start: ``add(init_state=state)``, any state whose weights fit, at epoch 0.

When the session resumes, a fresh start or a fork whose name has checkpoints and
journaled reports (:mod:`.replay`) continues from them instead, its reports
replayed; so does a paused model that is extended (:meth:`Starts.continued`).

Example:
    >>> Starts.check_choice(2, resume=None, init_from=(0, 1), init_state={"model": {}})
    Traceback (most recent call last):
    ValueError: init_from and init_state are given, but a model starts from one state at most
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint import latest_checkpoint
from ..data.fingerprint import differences
from ..engine import Scheduler
from ..executors.base import Executor
from ..protocol import ModelStatus
from ..training import TrainingSpec, canonical_config, layout_mismatch, weights_layout
from .history import History
from .replay import Replay, Replayed

__all__ = ["Start", "Starts", "Continued"]

logger = logging.getLogger("cerebro_automl")


@dataclass(frozen=True)
class Start:
    """Where a model starts: after ``epoch`` epochs, from ``state`` (None: fresh weights)."""

    epoch: int = 0
    state: dict | None = None
    lineage: dict[str, Any] = field(default_factory=dict)  # the history's parent / warm_start columns
    parent: int | None = None  # a fork: the model whose state it starts from
    warm: bool = False  # a warm start: the config's optimizer hyperparameters are in force
    # A resume's: the reports of the epochs it starts after, handed to the tuner again
    # (the run before trained and reported them).
    replayed: tuple[Replayed, ...] = ()


@dataclass(frozen=True)
class Continued:
    """A paused model extended by a resume continues after ``epoch`` epochs, from the
    checkpoint sent to ``worker``; ``replayed`` as in :class:`Start`."""

    epoch: int
    worker: str | None
    replayed: tuple[Replayed, ...]


class Starts:
    """Plans and checks a new model's start, and hands it to the executor.

    Args:
        run_keys: ``session_seed``, ``num_partitions`` and ``threads``: what a
            checkpoint must share with this run to be continued in it.
        fetch_state: ``(model_id, epoch) -> state`` on the driver (a fork's parent).
        data_fingerprint: the fingerprint of every partition (see
            :class:`~.fingerprints.DataFingerprint`), which a checkpoint's must match.
    """

    def __init__(
        self,
        spec: TrainingSpec,
        executor: Executor,
        scheduler: Scheduler,
        history: History,
        run_keys: Mapping[str, Any],
        checkpoint_dir: str | None,
        resume: bool,
        fetch_state: Callable[[int, int], dict],
        data_fingerprint: Callable[[], list[dict | None]],
        *,
        status: Callable[[int], ModelStatus] | None = None,
        held_epochs: Callable[[int], set[int]] | None = None,
        in_group: Callable[[int], bool] = lambda model_id: False,
    ) -> None:
        self._spec, self._executor, self._scheduler, self._history = spec, executor, scheduler, history
        self._run_keys, self._dir, self._resume = dict(run_keys), checkpoint_dir, resume
        self._journal = Replay(checkpoint_dir) if checkpoint_dir is not None and resume else None
        # What the run before journaled, read before this session journals anything.
        self._journaled = self._journal.first_epochs() if self._journal is not None else {}
        self._fetch_state, self._data_fingerprint = fetch_state, data_fingerprint
        self._warned_unfingerprinted = False
        # A fusion group's member is no model of the engine's: the session answers for it.
        self._status = status or scheduler.status
        self._held_epochs = held_epochs or executor.held_epochs
        self._in_group = in_group

    @staticmethod
    def check_choice(epochs: int, resume: Any, init_from: Any, init_state: Any) -> None:
        """At most one of ``resume``, ``init_from`` and ``init_state``; ``resume`` an
        ``(epoch, state)`` with ``0 < epoch < epochs`` and a checkpoint's state."""
        given = [
            k for k, v in (("resume", resume), ("init_from", init_from), ("init_state", init_state)) if v is not None
        ]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are given, but a model starts from one state at most")
        if resume is None:
            return
        epoch, state = resume
        if not (isinstance(epoch, int) and 0 < epoch < epochs and isinstance(state, dict) and "model" in state):
            raise ValueError(
                f"resume is ({epoch!r}, ...), but must be (epoch, state) with "
                f"0 < epoch < epochs={epochs} and a state from a checkpoint"
            )

    def given(
        self,
        config: dict[str, Any],
        epochs: int,
        resume: tuple[int, dict] | None,
        init_from: tuple[int, int] | None,
        init_state: dict | None,
    ) -> Start | None:
        """The start the caller chose (checked by :meth:`check_choice` first), or None: fresh."""
        if resume is not None:
            return Start(resume[0], resume[1])
        if init_from is not None:
            parent, epoch = self._check_init_from(init_from, epochs)
            state = self._fetch_state(parent, epoch)  # the fork's fallback, kept on the driver
            start = Start(epoch, state, {"parent": parent, "parent_epoch": epoch}, parent=parent)
            self._check_fits(config, state, f"model {parent} after epoch {epoch}")
            return start
        if init_state is not None:
            if not (isinstance(init_state, Mapping) and isinstance(init_state.get("model"), Mapping)):
                raise TypeError(
                    f"init_state is a {type(init_state).__name__}, but must be a state dict "
                    "with a 'model' entry (a checkpoint's state, or {'model': state_dict})"
                )
            state = {k: v for k, v in init_state.items() if k != "progress"}
            self._check_fits(config, state, "init_state")
            return Start(0, state, {"warm_start": True}, warm=True)
        return None

    def fresh(self, name: str, config: Mapping[str, Any], epochs: int, offset: int) -> Start:
        """A fresh start; when the session resumes, after the furthest epoch within
        ``epochs`` that ``name``'s checkpoints and journal reach (its reports
        replayed). A checkpoint whose epoch's report the run before did not journal (it
        died in between) trains again, so that no report is missing. In a directory
        whose runs kept no journal, the model continues after its newest valid
        checkpoint; resumed again, after the furthest its journal reaches from there."""
        if not self._resume:
            return Start()
        first = self._journaled.get(name, 1)
        replayed = self._replayed(name, config, offset, after=first - 1, upto=epochs)
        if replayed is not None:
            return replayed
        if self._journaled and first == 1:
            return Start()
        found = self._checkpoint_to_resume(name, config, epochs, offset)
        return Start() if found is None else Start(*found)

    def resumed_fork(self, name: str, config: Mapping[str, Any], epochs: int, offset: int, fork: Start) -> Start:
        """A fork that the run before had trained on: after the furthest epoch its own
        checkpoints and journal reach (its lineage kept), else the fork itself."""
        replayed = self._replayed(name, config, offset, after=fork.epoch, upto=epochs)
        if replayed is None:
            return fork
        return Start(replayed.epoch, replayed.state, fork.lineage, replayed=replayed.replayed)

    def continued(
        self, model_id: int, name: str, config: Mapping[str, Any], seed: int, offset: int, done: int, epochs: int
    ) -> Continued | None:
        """A paused model after ``done`` epochs, extended to ``epochs``: where the run
        before's checkpoints and journal let it continue (its state sent to the worker
        the engine names), or None."""
        replayed = self._replayed(name, config, offset, after=done, upto=epochs)
        if replayed is None:
            return None
        worker = self._executor.add_model(
            model_id, copy.deepcopy(dict(config)), seed, replayed.state, replayed.epoch,
            worker=self._scheduler.state_home(model_id),
        )  # fmt: skip
        return Continued(replayed.epoch, worker, replayed.replayed)

    def _replayed(self, name: str, config: Mapping[str, Any], offset: int, after: int, upto: int) -> Start | None:
        if self._journal is None:
            return None
        settings = self._scheduler.settings
        units = settings.num_partitions if settings.unit_reports else 1
        found = self._journal.furthest(name, after, upto, units)
        if found is None:
            return None
        epoch, state, meta = found
        self.check_checkpoint(name, meta, config, offset)
        entries = self._journal.replayed(name, after, epoch, units)
        assert entries is not None  # furthest found them
        logger.info("model %r continues after epoch %d from %s, its reports replayed", name, epoch, self._dir)
        return Start(epoch, state, replayed=entries)

    def send(self, model_id: int, config: Mapping[str, Any], seed: int, start: Start) -> str | None:
        """Give the executor the new model's state, to send to the worker the engine names
        for it; return the worker holding it, if any."""
        home = self._scheduler.state_home(model_id) if start.state is not None else None
        if start.parent is not None and not self._in_group(start.parent):
            if start.state is None:
                raise ValueError(f"the fork of model {start.parent} has no state, but a fork starts from its parent's")
            return self._executor.add_fork(
                model_id, copy.deepcopy(config), seed, start.parent, start.epoch, start.state, worker=home
            )
        return self._executor.add_model(
            model_id,
            copy.deepcopy(config),
            seed,
            start.state,
            start.epoch,
            fresh_hyperparameters=start.warm or start.parent is not None,
            worker=home,
        )

    def check_checkpoint(self, name: str, meta: Mapping[str, Any], config: Mapping[str, Any], offset: int) -> None:
        """Raise ValueError unless checkpoint ``meta`` of ``name`` was written by this
        model in a run like this one (see ``Session.check_checkpoint``)."""
        expected = {
            "config": json.loads(canonical_config(config)),
            "session_seed": self._run_keys["session_seed"],
            "offset": offset,
            "num_partitions": self._run_keys["num_partitions"],
            "threads": self._run_keys["threads"],
            "fuse": self._run_keys.get("fuse", 1),
            "cyclic": self._run_keys.get("cyclic", False),
        }
        meta = {**meta, "fuse": meta.get("fuse", 1), "cyclic": meta.get("cyclic", False)}
        differ = {k: (meta.get(k), v) for k, v in expected.items() if meta.get(k) != v}
        if differ:
            raise ValueError(
                f"checkpoint {name!r} in {self._dir} (after epoch {meta.get('epoch')}) "
                f"was written by another run (checkpoint, now): {differ}; use another "
                "checkpoint_dir or name"
            )
        self._check_data(name, meta)

    def _check_data(self, name: str, meta: Mapping[str, Any]) -> None:
        """Raise ValueError naming what differs when the checkpoint's data fingerprint is
        not this session's; one written without a fingerprint passes, with a warning."""
        if "data" not in meta:
            if not self._warned_unfingerprinted:
                self._warned_unfingerprinted = True
                logger.warning(
                    "checkpoint %r in %s (after epoch %s) records no fingerprint of its data "
                    "(written by an older version): the data it resumes on is not checked",
                    name,
                    self._dir,
                    meta.get("epoch"),
                )
            return
        found = differences(meta["data"] or [], self._data_fingerprint())
        if found:
            raise ValueError(
                f"checkpoint {name!r} in {self._dir} (after epoch {meta.get('epoch')}) was "
                f"trained on other data: {'; '.join(found[:8])}"
                f"{f' (and {len(found) - 8} more)' if len(found) > 8 else ''}. Resume with the "
                "data it was trained on, or use another checkpoint_dir or name"
            )

    # --------------------------------------------------------------- helpers
    def _check_fits(self, config: dict[str, Any], state: dict, source: str) -> None:
        if "base" in state:  # what trains, where the state has it; the base is config's own build
            layout = weights_layout(self._spec, config, hopping_only=True)
            expected = {k: v for k, v in layout.items() if k in state["model"]}
            mismatch = layout_mismatch(expected, state["model"])
        else:
            mismatch = layout_mismatch(weights_layout(self._spec, config), state["model"])
        if mismatch:
            raise ValueError(f"the state of {source} does not fit the model config {config} builds: {mismatch}")

    def _check_init_from(self, init_from: Any, epochs: int) -> tuple[int, int]:
        """``(parent id, epoch)``, checked: a known model that reported ``epoch`` and
        still holds its state after it, and ``epoch < epochs``."""
        if not (
            isinstance(init_from, tuple)
            and len(init_from) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in init_from)
        ):
            raise TypeError(f"init_from is {init_from!r}, but must be a tuple (model_id, epoch)")
        parent, epoch = init_from
        self._history.check_id(parent)
        reported = self._history.models[parent].epochs
        if not 1 <= epoch <= reported:
            raise ValueError(
                f"init_from is {init_from}, but model {parent} has reported epochs 1..{reported}"
                if reported
                else f"init_from is {init_from}, but model {parent} has not reported an epoch yet"
            )
        if epoch >= epochs:
            raise ValueError(
                f"init_from epoch is {epoch}, but must be < epochs={epochs}: the new model continues after that epoch"
            )
        status = self._status(parent)
        if status in (ModelStatus.STOPPED, ModelStatus.FAILED):
            raise ValueError(
                f"init_from is {init_from}, but model {parent} is {status.value} and its "
                "state is freed; fork it before stopping it"
            )
        held = self._held_epochs(parent)
        if epoch not in held:
            raise ValueError(
                f"init_from is {init_from}, but model {parent} holds its state only after "
                f"epochs {sorted(held)} (it keeps its newest two)"
            )
        return parent, epoch

    def _checkpoint_to_resume(
        self, name: str, config: Mapping[str, Any], epochs: int, offset: int
    ) -> tuple[int, dict] | None:
        """The newest valid checkpoint of ``name`` to continue from, checked against this model."""
        directory = self._dir
        if directory is None:  # (resume needs a checkpoint_dir: the session checks it)
            return None
        found = latest_checkpoint(directory, name)
        if found is None:
            return None
        self.check_checkpoint(name, found[1], config, offset)
        if found[1]["epoch"] >= epochs:  # finished: train the last epoch again, from a checkpoint before it
            found = latest_checkpoint(directory, name, before=epochs)
            if found is None:
                return None
            self.check_checkpoint(name, found[1], config, offset)
        state, meta = found
        logger.info("model %r resumes after epoch %d from %s", name, meta["epoch"], self._dir)
        return meta["epoch"], state
