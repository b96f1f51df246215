"""A session's models between the tuner and the engine: how each starts (fresh,
resumed, forked, warm-started or replayed), is extended and stopped, which fusion
group it trains in, and its status.

The tuner speaks of models; the engine trains models and fusion groups. This is
where the two meet: :class:`Models` turns the tuner's calls (checked by the
:class:`~.session.Session` first) into engine events, and answers for a group's
members from their group. The progress bar's total follows the units to train.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..callbacks import CallbackList
from ..engine import Scheduler, WidthDecisions
from ..executors.base import Executor, StateUnavailable
from ..protocol import BudgetExtended, GangWidth, ModelsAdded, ModelStatus, ModelStopped, NewModel
from ..training import model_seed
from .fusion import Fusion, Pending
from .history import History, ModelInfo
from .loop import EventLoop
from .outcomes import Outcomes
from .starts import Start, Starts

__all__ = ["Models", "LIVE", "ENDED"]

logger = logging.getLogger("cerebro_automl")

LIVE = (ModelStatus.TRAINING, ModelStatus.EVALUATING)
ENDED = (ModelStatus.STOPPED, ModelStatus.FAILED)


class Models:
    """The models of one session (see the module docstring).

    Args:
        seed: the session seed (a model's seed comes from it and its config).
        partitions: the data's partitions (a model-epoch is that many units).
        resume: whether the session resumes from its checkpoint directory.
        notify: ``(hook, model_id)``: a callback hook for the model (``on_model_added``,
            ``on_model_stopped``).
    """

    def __init__(
        self,
        *,
        seed: int,
        partitions: int,
        resume: bool,
        executor: Executor,
        scheduler: Scheduler,
        history: History,
        starts: Starts,
        fusion: Fusion,
        outcomes: Outcomes,
        loop: EventLoop,
        bar: Any,
        notify: Callable[[str, int], None],
        gang: WidthDecisions | None = None,
        batch_size: Callable[[dict[str, Any]], int] | None = None,
    ) -> None:
        self._seed, self._partitions, self._resume = seed, partitions, resume
        self.gang, self._batch_size = gang, batch_size
        self._odd_batches: set[int] = set()  # batch sizes told not to gang
        self._widths_logged: dict[int, int] = {}  # model -> the gang width last logged
        self._executor, self._scheduler, self._history = executor, scheduler, history
        self._starts, self._fusion, self._outcomes, self._loop = starts, fusion, outcomes, loop
        self._bar, self._notify = bar, notify

    # ----------------------------------------------------------- the tuner's calls
    def add(
        self,
        config: dict[str, Any],
        epochs: int,
        offset: int | None,
        name: str | None,
        resume: tuple[int, dict] | None,
        init_from: tuple[int, int] | None,
        init_state: dict | None,
    ) -> int:
        """Start a model of ``config`` (checked and frozen by the caller); its id."""
        start = self._starts.given(config, epochs, resume, init_from, init_state)
        model_id = self._history.next_id
        name = self._history.check_name(f"model-{model_id}" if name is None else str(name))
        ordinal = model_id if offset is None else offset
        if start is None:
            start = self._starts.fresh(name, config, epochs, ordinal)
        elif start.parent is not None and self._resume:
            start = self._starts.resumed_fork(name, config, epochs, ordinal, start)
        seed = model_seed(self._seed, config)
        reported = start.epoch - sum(r.unit is None for r in start.replayed)
        self._history.add(ModelInfo(config, seed, ordinal, name, epochs=reported, lineage=start.lineage))
        self._outcomes.replay(model_id, start.replayed)
        if self._fusion.enabled and start.state is None and start.epoch == 0:
            # It waits for the models added with it; the next wait for reports groups them.
            self._fusion.hold(Pending(model_id, config, seed, ordinal, 0, epochs))
            self.grow_bar(epochs)
            logger.debug("model %d (%s) added for %d epochs, to be grouped: %s", model_id, name, epochs, config)
        else:
            worker = self._starts.send(model_id, config, seed, start)
            new = NewModel(model_id, epochs, offset, start.epoch, worker, from_state=start.warm)
            self._loop.handle(ModelsAdded((new,)))
            self.grow_bar(epochs - start.epoch)
            self._log_added(model_id, name, config, epochs, start)
        self._notify("on_model_added", model_id)
        self._check_gang_batch(model_id, config)
        return model_id

    def _check_gang_batch(self, model_id: int, config: dict[str, Any]) -> None:
        """Say, once per batch size, that an odd one rules out gang units: a gang of k
        ranks splits the batch into k equal parts (the global batch is kept)."""
        b = self._batch_size(config) if self.gang is not None and self._batch_size else None
        if b is not None and b % 2 and b not in self._odd_batches:
            self._odd_batches.add(b)
            logger.warning(
                "model %d trains with batch_size %d, which no gang width divides: it will not train in "
                "gang units (a gang of k ranks gives each b / k rows); an even batch size lets it",
                model_id, b,
            )  # fmt: skip

    def _log_added(self, model_id: int, name: str, config: dict[str, Any], epochs: int, start: Start) -> None:
        if start.parent is None:
            logger.debug("model %d (%s) added for %d epochs: %s", model_id, name, epochs, config)
            return
        parent = self._history.models[start.parent].config
        changes = {k: (parent.get(k), v) for k, v in config.items() if parent.get(k) != v}
        logger.debug(
            "model %d (%s) forked from model %d after epoch %d for %d epochs, changes %s",
            model_id,
            name,
            start.parent,
            start.epoch,
            epochs,
            changes,
        )

    def extend(self, model_id: int, epochs: int) -> None:
        """Give a model ``epochs`` more epochs (checked by the caller)."""
        if model_id in self._fusion.ended:  # as the engine says of a model stopped or failed alone
            raise ValueError(f"model {model_id} is {self._fusion.ended[model_id].value} and cannot be extended")
        if self._fusion.extend(model_id, epochs):  # pending, or in a group: see form_groups
            self.grow_bar(epochs)
            group = self._fusion.group(model_id)
            if group is not None and self._scheduler.status(group.gid) is ModelStatus.PAUSED:
                self._detach_extended(group.gid)
            return
        info = self._history.models[model_id]
        continued = (
            self._starts.continued(
                model_id, info.name, info.config, info.seed, info.offset, info.epochs, info.epochs + epochs
            )
            if self._resume and self.status(model_id) is ModelStatus.PAUSED
            else None
        )
        if continued is None:
            self.grow_bar(epochs)
            self._loop.handle(BudgetExtended(model_id, epochs))
            return
        self.grow_bar(info.epochs + epochs - continued.epoch)  # the epochs still to train
        self._outcomes.replay(model_id, continued.replayed)
        self._loop.handle(BudgetExtended(model_id, epochs, continued.epoch, continued.worker))

    def stop(self, model_id: int) -> None:
        """Stop a model for good and free its state."""
        was = self.status(model_id)
        group = self._fusion.group(model_id)
        if self._fusion.is_pending(model_id):
            pending = self._fusion.drop_pending(model_id)
            self._bar.total -= (pending.target - pending.epoch) * self._partitions
        elif group is not None:
            self._fusion.leave(model_id, ModelStatus.STOPPED)
            self.apply_fusion({group.gid})
        else:
            self._bar.total -= self._scheduler.remaining_units(model_id) if was in LIVE else 0
            self._loop.handle(ModelStopped(model_id))
        if was not in ENDED:  # stopping those changes nothing
            self._notify("on_model_stopped", model_id)

    # ------------------------------------------------------------ fusion groups
    def form_groups(self) -> None:
        """Group the models added since the last call and start them (see
        ``Session.form_groups``)."""
        if not self._fusion.pending:
            return
        formed = self._fusion.form()
        started: list[tuple[int, NewModel]] = []
        for p in formed.alone:
            self._fusion.targets.pop(p.model_id, None)
            worker = self._starts.send(p.model_id, p.config, p.seed, Start(p.epoch, p.state))
            started.append((p.model_id, NewModel(p.model_id, p.target, p.offset, p.epoch, worker)))
        for group, chunk in formed.groups:
            first = chunk[0]
            state = None if first.state is None else {"members": {p.model_id: p.state for p in chunk}, "failed": {}}
            worker = self._starts.send(group.gid, group.config(), group.seed, Start(first.epoch, state))
            # Its Latin offset is the engine's ordinal: consecutive groups start on different
            # partitions (their first members' ordinals, 0 and 8 on 2 partitions, would not).
            started.append((first.model_id, NewModel(group.gid, group.epochs, None, first.epoch, worker)))
            # The bar counts units run: a group's unit is one.
            self._bar.total -= (len(chunk) - 1) * (group.epochs - first.epoch) * self._partitions
        started.sort(key=lambda pair: pair[0])
        self._loop.handle(ModelsAdded(tuple(new for _, new in started)))

    def _detach_extended(self, gid: int) -> None:
        """Members of paused group ``gid`` with epochs to go wait to be grouped again."""
        group = self._fusion.groups[gid]
        self._fusion.detach_extended(group, lambda: self._executor.fetch_state(gid)["members"])
        self.apply_fusion({gid})

    def apply_fusion(self, gids: set[int]) -> None:
        """Groups whose members changed: the next unit drops those gone; a group with
        none left stops."""
        for gid in sorted(gids):
            group = self._fusion.groups[gid]
            status = self._scheduler.status(gid)
            if status in ENDED:
                continue
            if not group.members:
                self._bar.total -= self._scheduler.remaining_units(gid) if status in LIVE else 0
                self._loop.handle(ModelStopped(gid))
            else:
                self._executor.set_config(gid, group.config())

    # ------------------------------------------------------------- gang units
    def give_widths(self, live: list[int] | None = None) -> list[GangWidth]:
        """Give the engine the widths of the epochs waiting for one (see
        :class:`~cerebro_automl.engine.WidthDecisions`): by default those the engine
        names, from the models training now; a canonical report stream gives ``live``
        (the models live at its logical time) and decides the epochs it marked. The
        widths given (a tuner that resumes in canonical order journals them)."""
        if self.gang is None:
            return []
        wanted = self._scheduler.widths_wanted() if live is None else None
        live = self._scheduler.live_models() if live is None else live
        batch = self._batch_size
        given = self.gang.decide(live, lambda i: batch(self._history.models[i].config) if batch else None, wanted)
        for event in given:
            self._log_width(event, len(live))
            self._loop.handle(event)
        return given

    def _log_width(self, event: GangWidth, live: int) -> None:
        """Say when a model's epochs start to train in gang units, or change width."""
        before = self._widths_logged.get(event.model_id, 1)
        self._widths_logged[event.model_id] = event.width
        if event.width != before and event.width == 1:
            logger.info(
                "model %d trains from epoch %d one partition at a time again (plain MOP)", event.model_id, event.epoch
            )
        elif event.width != before:
            logger.info(
                "model %d trains from epoch %d in gang units of width %d (%d partitions at once; live models: %d, "
                "partitions: %d; see the Gang units guide for the rule)",
                event.model_id, event.epoch, event.width, event.width, live, self._partitions,
            )  # fmt: skip

    # ---------------------------------------------------------------- answers
    def status(self, model_id: int) -> ModelStatus:
        """A model's status; a fusion group member's from its group's."""
        if model_id in self._fusion.ended:
            return self._fusion.ended[model_id]
        if self._fusion.is_pending(model_id):
            return ModelStatus.TRAINING
        group = self._fusion.group(model_id)
        if group is not None:
            return self._fusion.member_status(model_id, self._scheduler.status(group.gid))
        return self._scheduler.status(model_id)

    def statuses(self) -> dict[int, ModelStatus]:
        """Every model's status, by id, in the order added (a group's members their own)."""
        return {i: self.status(i) for i in self._history.models}

    def held_epochs(self, model_id: int) -> set[int]:
        group = self._fusion.group(model_id)
        return self._executor.held_epochs(model_id if group is None else group.gid)

    def fetch_state(self, model_id: int, epoch: int | None, timeout: float, closed: Callable[[], bool]) -> dict:
        """A model's state on the driver (a member's from its group's). If its worker
        died, the events are handled until the scheduler has recomputed it (at most
        ``timeout`` s in all)."""
        self.form_groups()
        if model_id in self._fusion.never_grouped:
            raise ValueError(f"model {model_id} holds no trained state: it was stopped before it trained")
        if model_id in self._fusion.ended:  # its slice left the group's state when it ended
            raise ValueError(
                f"model {model_id} holds no trained state: it {self._fusion.ended[model_id].value} in its fusion "
                "group, whose state keeps only the members that train on (with checkpoint_dir, its checkpoints do)"
            )
        group = self._fusion.group(model_id)
        if group is not None:
            return self._fetch(group.gid, epoch, timeout, closed)["members"][model_id]
        return self._fetch(model_id, epoch, timeout, closed)

    def _fetch(self, model_id: int, epoch: int | None, timeout: float, closed: Callable[[], bool]) -> dict:
        deadline = time.monotonic() + timeout
        paused = self._scheduler.status(model_id) is ModelStatus.PAUSED
        # A paused model is trained again up to where it paused; a training one
        # needs only the rollback, after which its newest state is another.
        recomputed = lambda: not paused or self._scheduler.status(model_id) not in LIVE  # noqa: E731
        while True:
            try:
                return self._executor.fetch_state(model_id, epoch, timeout=max(0.1, deadline - time.monotonic()))
            except StateUnavailable as err:
                if not err.lost or time.monotonic() > deadline or closed():
                    raise
                logger.warning("%s; handling events until it is recomputed", err)
            self._loop.run_until(recomputed, deadline)

    def grow_bar(self, epochs: int) -> None:
        self._bar.total += epochs * self._partitions
        self._bar.refresh()


def notifier(callbacks: CallbackList, view: Any) -> Callable[[str, int], None]:
    """``(hook, model_id)`` -> the callbacks' hook called with the session's view."""
    return lambda hook, model_id: callbacks.call(hook, view, model_id)
