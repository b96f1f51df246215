"""Fusion groups in a session: which added configurations train together, and
what the group's notices mean for each member.

With ``Session(fuse=k)``, a fresh model the tuner adds waits (as *pending*) until
the session next waits for reports or fetches a state. Then the pending models
are grouped in the order added: those with one fusion signature (see
:class:`~cerebro_automl.fusion.signature.Signatures`), the same start epoch and
the same budget share groups of up to ``k`` (see :func:`split`). A group is one model
to the engine and the executors, under an id of its own (negative, so never a
member's); its reports, pauses, failures and checkpoints are its members'.

A member leaves its group when it is stopped or fails (its slice is dropped at
the next unit), and when its budget outgrows the group's: extended, it waits
again as pending at the group's next pause, with its own state, and joins a new
group with the members extended alike. A group with no member left is stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from ..fusion import Member, group_config
from ..fusion.signature import Signatures, Unfusable
from ..protocol import Checkpoint, Fail, ModelStatus, Pause, Report

__all__ = ["Pending", "Group", "Fusion", "MemberNotice", "split"]

logger = logging.getLogger("cerebro_automl")


@dataclass
class Pending:
    """A model waiting to be grouped: it starts after ``epoch`` epochs (from ``state``,
    its own, or fresh when None) and trains until ``target`` epochs in all."""

    model_id: int
    config: dict[str, Any]
    seed: int
    offset: int
    epoch: int
    target: int
    state: dict | None = None


@dataclass
class Group:
    """A group the engine trains as model ``gid``; ``members`` are those still in it."""

    gid: int
    members: list[Member]
    epochs: int
    seed: int  # its data order's and in-model randomness': its first member's

    def config(self) -> dict[str, Any]:
        """The config the engine and the executors carry for the group now."""
        return group_config(self.members, seed=self.seed)


def split(items: list[Any], fuse: int, partitions: int) -> list[list[Any]]:
    """``items`` (models that may share groups, in the order added) in consecutive groups
    of at most ``fuse``, as even as can be, and at least ``partitions`` of them while
    there are as many items: MOP keeps ``p`` workers busy with ``p`` models, so a group
    of all 16 models on 2 partitions would leave a worker idle.

    >>> [len(g) for g in split(list(range(16)), 16, 2)], [len(g) for g in split(list(range(10)), 4, 2)]
    ([8, 8], [4, 3, 3])
    """
    count = max(-(-len(items) // fuse), min(len(items), partitions))
    size, extra = divmod(len(items), count) if count else (0, 0)
    out, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


@dataclass
class Formed:
    """What :meth:`Fusion.form` decided: models to start alone, and groups to start."""

    alone: list[Pending]
    groups: list[tuple[Group, list[Pending]]]


@dataclass(frozen=True)
class MemberNotice:
    """A member's share of its group's notice: the notice, its metrics (a report's),
    and the group whose state holds the member's (a checkpoint's)."""

    notice: Report | Pause | Fail | Checkpoint
    metrics: dict[str, float] | None = None
    group: int | None = None


class Fusion:
    """The session's fusion groups: pending models, members, and their groups.

    Args:
        fuse: the largest group (1: no fusion, every model trains alone).
        signatures: the spec's fusion signatures.
        partitions: the data's partitions (see :func:`split`).
    """

    def __init__(self, fuse: int, signatures: Signatures, partitions: int = 1) -> None:
        self.fuse, self.partitions = fuse, partitions
        self._signatures = signatures
        self.pending: list[Pending] = []
        self.groups: dict[int, Group] = {}
        self.group_of: dict[int, int] = {}  # member -> its group's id, while in one
        self.targets: dict[int, int] = {}  # member -> the epochs it trains in all
        self.ended: dict[int, ModelStatus] = {}  # members stopped or failed inside a group
        self.never_grouped: set[int] = set()  # of those, stopped while pending
        self.offsets: dict[int, int] = {}  # member -> its Latin-order offset
        self._next_gid = -1
        self._alone_logged: set[str] = set()
        self._reasons_logged: set[str] = set()
        self.changed: set[int] = set()  # groups that members left, for the session to update

    @property
    def enabled(self) -> bool:
        return self.fuse > 1

    # ------------------------------------------------------------- forming
    def hold(self, pending: Pending) -> None:
        """A model waits to be grouped."""
        self.pending.append(pending)
        self.targets[pending.model_id] = pending.target
        self.offsets[pending.model_id] = pending.offset

    def is_pending(self, model_id: int) -> bool:
        return any(p.model_id == model_id for p in self.pending)

    def drop_pending(self, model_id: int) -> Pending:
        """A pending model is stopped before it started."""
        [found] = [p for p in self.pending if p.model_id == model_id]
        self.pending.remove(found)
        self.ended[model_id] = ModelStatus.STOPPED
        self.never_grouped.add(model_id)
        return found

    def extend(self, model_id: int, epochs: int) -> bool:
        """Give a pending or grouped model ``epochs`` more; False: it trains alone (the
        engine extends it)."""
        for p in self.pending:
            if p.model_id == model_id:
                p.target += epochs
                return True
        if model_id in self.group_of:
            self.targets[model_id] += epochs
            return True
        return False

    def form(self) -> Formed:
        """Group the pending models (in the order held) and clear them."""
        pending, self.pending = self.pending, []
        buckets: dict[Hashable, list[Pending]] = {}
        alone: list[Pending] = []
        for p in pending:
            key = self._key(p)
            if key is None:
                alone.append(p)
            else:
                buckets.setdefault(key, []).append(p)
        formed = Formed(alone, [])
        for members in buckets.values():
            chunks = split(members, self.fuse, self.partitions)
            for chunk in chunks:
                if len(chunk) == 1:
                    self._log_alone(chunk[0], *self._why_alone(len(members), len(chunks)))
                    formed.alone.append(chunk[0])
                else:
                    formed.groups.append((self._new_group(chunk), chunk))
        formed.alone.sort(key=lambda p: p.model_id)
        return formed

    def _key(self, p: Pending) -> Hashable | None:
        try:
            signature = self._signatures.of(p.config)
        except Unfusable as err:
            self._log_alone(p, str(err))
            return None
        except Exception as err:  # model_fn cannot run on the meta device: train it alone
            self._log_alone(p, f"its model cannot be compared ({err!r})")
            return None
        return (signature, p.epoch, p.target, p.state is None)

    def _why_alone(self, alike: int, groups: int) -> tuple[str, str]:
        """Why a model whose signature others may share trains alone, and the kind of reason."""
        if alike == 1:
            return (
                "no other model waiting with it has its fusion signature, start epoch and budget (models fuse when "
                "built alike, e.g. not with a function made per config, and added before the session next waits)",
                "no peer",
            )
        return (
            f"the {alike} models built alike are split into {groups} groups, as many as the partitions while there "
            "are enough models (MOP keeps a partition's worker busy only with a model or group for it), and it is "
            "its group's only member",
            "split",
        )

    def _log_alone(self, p: Pending, why: str, kind: str = "unfusable") -> None:
        if kind not in self._alone_logged:  # once a session per kind: every such model says the same
            self._alone_logged.add(kind)
            verb = "trains unfused" if kind == "unfusable" else "trains alone"  # it could fuse, with others
            logger.info("fuse=%d: model %d %s: %s", self.fuse, p.model_id, verb, why)

    def _new_group(self, chunk: list[Pending]) -> Group:
        gid, self._next_gid = self._next_gid, self._next_gid - 1
        members = [Member(p.model_id, p.config, p.seed) for p in chunk]
        group = Group(gid, members, chunk[0].target, seed=chunk[0].seed)
        self.groups[gid] = group
        for p in chunk:
            self.group_of[p.model_id] = gid
        logger.debug(
            "fusion group %d: models %s for epochs %d..%d",
            gid,
            [p.model_id for p in chunk],
            chunk[0].epoch,
            chunk[0].target,
        )
        return group

    # ------------------------------------------------------------- members
    def group(self, model_id: int) -> Group | None:
        """The group model ``model_id`` trains in now, if any."""
        gid = self.group_of.get(model_id)
        return None if gid is None else self.groups[gid]

    def leave(self, model_id: int, status: ModelStatus | None) -> Group:
        """Member ``model_id`` leaves its group (``status``: stopped or failed; None:
        it goes on elsewhere); returns the group."""
        group = self.groups[self.group_of.pop(model_id)]
        group.members = [m for m in group.members if m.model_id != model_id]
        if status is not None:
            self.ended[model_id] = status
        return group

    def member_status(self, model_id: int, group_status: ModelStatus) -> ModelStatus:
        """A grouped member's status from its group's: an extended member of a paused
        group is about to train on in a new one."""
        group = self.groups[self.group_of[model_id]]
        if group_status is ModelStatus.PAUSED and self.targets[model_id] > group.epochs:
            return ModelStatus.TRAINING
        return group_status

    def member_metrics(
        self, metrics: Mapping[str, Any]
    ) -> tuple[dict[int, dict[str, float]], dict[int, str], str | None]:
        """A group's epoch metrics: each member's, the failures, why it trained unfused."""
        return dict(metrics.get("members", {})), dict(metrics.get("failed", {})), metrics.get("unfused")

    def log_unfused(self, group: Group, reason: str | None) -> None:
        """Say why a group's members train one by one (once per reason in a session)."""
        if reason and reason not in self._reasons_logged:
            self._reasons_logged.add(reason)
            logger.warning(
                "fusion group of models %s trains unfused (one after the other, same data order): %s",
                [m.model_id for m in group.members],
                reason,
            )

    def detach_extended(self, group: Group, states: Callable[[], Mapping[int, dict]]) -> list[int]:
        """At a pause: members whose budget outgrew the group's wait again as pending,
        with their states; returns the members that pause."""
        going = [m for m in group.members if self.targets.get(m.model_id, group.epochs) > group.epochs]
        if going:
            held = states()
            for m in going:
                self.leave(m.model_id, None)
                self.pending.append(
                    Pending(
                        m.model_id,
                        dict(m.config),
                        m.seed,
                        self.offsets[m.model_id],
                        group.epochs,
                        self.targets[m.model_id],
                        held[m.model_id],
                    )
                )
        return [m.model_id for m in group.members]

    # ------------------------------------------------------------- notices
    def owns(self, model_id: int) -> bool:
        """Whether ``model_id`` is a group's (whose notices are its members')."""
        return model_id in self.groups

    def take_changed(self) -> set[int]:
        """The groups that members left since the last call."""
        changed, self.changed = self.changed, set()
        return changed

    def members_of(
        self,
        notice: Report | Pause | Fail | Checkpoint,
        metrics: Mapping[str, Any] | None,
        states: Callable[[], Mapping[int, dict]],
    ) -> list[MemberNotice]:
        """Group ``notice``'s (a report with its ``metrics``) as its members' notices,
        in order; members leave the group as it says (``states``: the members' states,
        fetched only when members detach at a pause).

        * a report: the members that failed in the epoch fail, the others report;
        * a pause: members extended beyond it wait to be grouped again, the others pause;
        * a failure: every member fails; a checkpoint: every member's is written.
        """
        gid = notice.model_id
        group = self.groups[gid]
        if isinstance(notice, Report):
            members, failed, unfused = self.member_metrics(metrics or {})
            self.log_unfused(group, unfused)
            current = {m.model_id for m in group.members}
            out = []
            for model_id, reason in sorted(failed.items()):
                if model_id in current:
                    self.leave(model_id, ModelStatus.FAILED)
                    self.changed.add(gid)
                    out.append(MemberNotice(Fail(model_id, reason)))
            reports = [m.model_id for m in group.members if m.model_id in members]
            return out + [MemberNotice(Report(i, notice.epoch, notice.order, notice.unit), members[i]) for i in reports]
        if isinstance(notice, Pause):
            pausing = self.detach_extended(group, states)
            self.changed.add(gid)
            return [MemberNotice(Pause(i, notice.epochs)) for i in pausing]
        if isinstance(notice, Fail):
            failing = [m.model_id for m in group.members]
            for model_id in failing:
                self.leave(model_id, ModelStatus.FAILED)
            return [MemberNotice(Fail(i, notice.error)) for i in failing]
        return [MemberNotice(Checkpoint(m.model_id, notice.epoch), group=gid) for m in group.members]
