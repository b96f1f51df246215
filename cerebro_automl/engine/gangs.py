"""Gang units: when few models are left, a model trains data-parallel over k
partitions at once, one rank on a holder of each, so that the survivors of a
search use the workers that would otherwise idle.

Three decisions live here.

**The width** (:func:`gang_width`) is a pure function of the search state at a
point that timing does not move: the number of live models ``L`` when the tuner
has handled a model's report (with ``reproducible=True``, at a logical time of the
canonical order), and the number of partitions ``P`` (fixed by the
reproducibility key, unlike the workers)::

    width = the largest power of two k <= P // L with P % k == 0, b % k == 0 and b / k >= 2

capped by ``max_width``. ``P // L`` shares the partitions' workers evenly among
the live models; a power of two halves as the survivors of a successive-halving
rung thin out, and divides the batch sizes people choose, so that each rank's
``b / k`` rows keep the global batch at ``b``; at least ``MIN_RANK_ROWS`` of them,
since a rank's BatchNorm in training needs more than one row. Width 1 is plain MOP.

**When** (:class:`WidthDecisions`): a session gives the engine an epoch's width
at its next decision point after the epoch becomes due, and the epoch waits for it.
With fixed or cyclic order the width comes with a *lane*: the model's place among the live
models then, which picks the block of partitions its epoch starts at (see
``orders``), so that survivors in lock-step train disjoint blocks at once.

**The gang** (:func:`pick_gang`): which partitions a model's next gang unit trains
and on which workers. With fixed or cyclic order, the next ``k`` partitions of the model's
order for the epoch (its lane's blocks); with dynamic order, ``k`` unvisited partitions whose
holders are free (an epoch trained again after a rollback: the next ``k`` of the
order it was reported with). The ranks need ``k`` distinct workers. A partition with no
live holder (still loading, or held by a worker that was lost, and so loading again on
a survivor) gets its rank's worker once it has loaded: the gang waits for it, as long
as ``k`` workers live. When the live holders cannot give ``k`` distinct workers (fewer
workers than ranks, or a partition held only by another rank's worker), or fewer than
``k`` partitions are left in the epoch, the next unit trains one partition, as in MOP.
A gang whose workers are not all free yet holds the free ones, so that they are not
given to other models meanwhile (the busy ones are not sent more work either): in a
search's tail most workers idle anyway.

Example:
    >>> gang_width(live=3, partitions=8), gang_width(live=1, partitions=8, batch_size=12)
    (2, 4)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..protocol import GangWidth
from .model import ModelRecord
from .orders import FIXED_ORDERS
from .state import EngineState

__all__ = ["MIN_RANK_ROWS", "gang_width", "Gang", "pick_gang", "width_of", "widths_wanted", "WidthDecisions"]


MIN_RANK_ROWS = 2  # a rank's rows of a batch, at least


def gang_width(live: int, partitions: int, *, batch_size: int | None = None, max_width: int | None = None) -> int:
    """The ranks of a model's gang units when ``live`` models are left (see the module
    docstring for the rule and why)."""
    for name, value in (("live", live), ("partitions", partitions)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} is {value!r}, but must be an int >= 1")
    cap = partitions // live if max_width is None else min(partitions // live, max_width)
    if batch_size is not None:
        cap = min(cap, batch_size // MIN_RANK_ROWS)
    k = 1
    while k * 2 <= cap and partitions % (k * 2) == 0 and (batch_size is None or batch_size % (k * 2) == 0):
        k *= 2
    return k


def width_of(state: EngineState, m: ModelRecord) -> int | None:
    """The width of ``m``'s current epoch; None while it waits for it (gang units on,
    and the session has not decided it yet)."""
    if not state.settings.gang:
        return 1
    given = m.widths.get(m.epochs_done + 1)
    return None if given is None else given[0]


def widths_wanted(m: ModelRecord) -> list[int]:
    """The epochs of training model ``m`` that wait for a width: its next, and after a
    rollback every epoch up to the one after its last report."""
    last = min(m.budget, max(m.epochs_done, m.reported) + 1)
    return [e for e in range(m.epochs_done + 1, last + 1) if e not in m.widths]


@dataclass(frozen=True)
class Gang:
    """A gang unit's ranks: ``partitions[r]`` on ``workers[r]`` ("" while the partition
    has no holder: it loads); ``waits_for``: the chosen workers still busy."""

    partitions: tuple[int, ...]
    workers: tuple[str, ...]
    waits_for: frozenset[str]

    @property
    def startable(self) -> bool:
        return not self.waits_for and "" not in self.workers


def pick_gang(state: EngineState, m: ModelRecord, width: int, free: set[str]) -> Gang | None:
    """``m``'s next gang unit of ``width`` ranks, preferring the ``free`` workers; None
    when its next unit trains one partition (see the module docstring)."""
    left = state.num_partitions - len(m.visited)
    if width < 2 or left < width:
        return None
    v = len(m.visited)
    if v % width:  # a block's partitions trained one at a time: so is the rest of the block
        return None
    # An epoch trained again after a rollback follows the order it was reported with.
    replay = m.reported_orders.get(m.epochs_done + 1, ())
    fixed = state.order in FIXED_ORDERS
    if fixed or v < len(replay):
        order = state.model_order(m, m.epochs_done) if fixed else replay
        return _ranks(state, list(order[v : v + width]), width, free, every=True)
    seen = set(m.visited)
    unvisited = [p for p in range(state.num_partitions) if p not in seen]
    holders = state.placement.holders
    # Partitions with a free holder first, so that the gang starts as soon as it can.
    unvisited.sort(key=lambda p: (holders[p].isdisjoint(free), p))
    return _ranks(state, unvisited, width, free, every=False)


def _ranks(state: EngineState, candidates: list[int], width: int, free: set[str], every: bool) -> Gang | None:
    """A distinct holder for each of ``width`` partitions among ``candidates`` (the
    first ``width`` when ``every``), a free one where there is one. A partition still
    loading gets its holder later (the gang waits); None when the holders cannot be
    distinct (fewer workers than ranks)."""
    holders = state.placement.holders
    chosen: list[tuple[int, str]] = []
    loading: list[int] = []
    used: set[str] = set()
    for p in candidates:
        if not holders[p]:
            loading.append(p)
            if every:
                chosen.append((p, ""))
            continue
        options = sorted(holders[p] - used)
        if not options:
            if every:
                return None
            continue
        idle = [h for h in options if h in free]
        w = idle[0] if idle else options[0]
        used.add(w)
        chosen.append((p, w))
        if len(chosen) == width:
            break
    if len(chosen) < width:
        if len(chosen) + len(loading) < width or len(state.workers) < width:
            return None
        chosen.extend((p, "") for p in loading[: width - len(chosen)])
    partitions, workers = zip(*chosen, strict=True)
    return Gang(tuple(partitions), tuple(workers), frozenset(w for w in workers if w and w not in free))


class WidthDecisions:
    """When a session gives the engine each epoch's width.

    An epoch waits for its width from the moment nothing trained so far decides it:
    a model's first epoch when it is added, the next epoch when a report leaves
    budget, a paused model's next epoch when it is extended. The session decides at
    its next decision point, the tuner back for more reports having handled those:
    every waiting epoch gets :func:`gang_width` of the live models counted then. No
    timing enters the width, only the search's state.

    A session decides the epochs the engine names as waiting (``wanted``). With
    ``reproducible=True`` the canonical report stream decides instead, at each logical
    time, for the epochs it marked (:meth:`starting`, :meth:`reported`): the engine's
    waiting epochs then depend on timing, the stream's marks do not. The stream
    decides ``LOOKAHEAD`` epochs ahead (at the release of epoch ``e``, the width of
    ``e + 2``), so that a model may train one epoch past its last report released
    without waiting, as models do while their reports wait for slower ones.

    A tuner that resumes a search in the middle of its canonical order (Optuna's
    ``optimize``) hands back the widths the dead driver had decided (``decided`` in
    :meth:`starting`): an epoch keeps its width, whenever it is trained again. Deciding
    it again, from the models live at the resume, could give another width or lane,
    hence other bits.
    """

    LOOKAHEAD = 1

    def __init__(self, partitions: int, max_width: int | None = None) -> None:
        self.partitions, self.max_width = partitions, max_width
        self._due: set[tuple[int, int]] = set()  # (model, epoch) the stream marked
        self._kept: dict[tuple[int, int], tuple[int, int]] = {}  # (model, epoch) -> (width, lane) decided before
        self._rungs: dict[tuple[int, int], tuple[int, int]] = {}  # (model, epoch) -> (live, lane) of its rung
        self.automatic = True  # False once a canonical report stream decides

    def starting(
        self,
        model_id: int,
        after: int,
        budget: int,
        released: int | None = None,
        decided: Mapping[int, tuple[int, int]] | None = None,
    ) -> None:
        """The stream's mark: ``model_id`` starts (or goes on from a pause) after epoch
        ``after``, to ``budget``: its next epochs, up to the lookahead past the epochs
        already ``released`` (a resume trains again epochs reported before), wait.
        ``decided``: epoch -> ``(width, lane)`` of the epochs a run before decided (a
        resume's), which they keep."""
        for epoch, (width, lane) in (decided or {}).items():
            if after < epoch <= budget:
                self._kept[model_id, epoch] = (width, lane)
        last = max(after, released or 0) + 1 + self.LOOKAHEAD
        for epoch in range(after + 1, min(last, budget) + 1):
            self._due.add((model_id, epoch))

    def reported(self, model_id: int, epoch: int, budget: int) -> None:
        """The stream's mark: ``model_id`` reported ``epoch`` of its ``budget``; the
        epoch the lookahead reaches now waits, if within the budget."""
        ahead = epoch + 1 + self.LOOKAHEAD
        if ahead <= budget:
            self._due.add((model_id, ahead))

    def rung(self, models: Sequence[int], after: int, budget: int, *, sharing: int = 1, place: int = 0) -> None:
        """The mark of a synchronous rung (successive halving's, Hyperband's): ``models``
        train from epoch ``after`` to ``budget``, and the tuner decides nothing before they
        all have. Every epoch of the rung waits, to be decided at the next :meth:`decide`
        as if the rung's models were the live ones, beside ``sharing - 1`` other rungs of
        as many (Hyperband's brackets, which run at once); ``place``, this rung's index
        among them, sets its models' lanes apart. Only the tuner's plan enters: which
        other brackets timing has ended by then does not."""
        for j, model_id in enumerate(sorted(models)):
            for epoch in range(after + 1, budget + 1):
                self._due.add((model_id, epoch))
                self._rungs[model_id, epoch] = (len(models) * sharing, place * len(models) + j)

    def decide(
        self,
        live: list[int],
        batch_size: Callable[[int], int | None],
        wanted: Iterable[tuple[int, int]] | None = None,
    ) -> list[GangWidth]:
        """The widths of the ``wanted`` epochs (default: those marked, which are then
        cleared), with ``live`` (sorted ids) the models left. A model's lane is its
        place among them, so that the survivors' gangs start on distinct blocks. An
        epoch decided before a resume keeps its width and lane (see :meth:`starting`)."""
        if wanted is None:
            wanted, self._due = sorted(self._due), set()
        out = []
        for model_id, epoch in wanted:
            kept = self._kept.pop((model_id, epoch), None)
            if kept is not None:
                out.append(GangWidth(model_id, epoch, *kept))
                continue
            lane = live.index(model_id) if model_id in live else 0
            count, lane = self._rungs.pop((model_id, epoch), (len(live), lane))
            b = batch_size(model_id)
            width = gang_width(max(count, 1), self.partitions, batch_size=b, max_width=self.max_width)
            out.append(GangWidth(model_id, epoch, width, lane))
        return out
