"""Which workers hold which partition replicas: pure decisions, no Dask, no torch.

The scheduler owns one :class:`Placement` and asks it where a partition goes;
the model lifecycle stays in the scheduler. Each partition wants ``replicas``
holders (fewer while fewer workers live). A *copy* of a partition is a worker
that holds it or is loading it.

How replicas are spread: each new copy goes to the live worker, among those
without one, that (1) holds the fewest copies of any partition (memory stays
even: about ``replicas * P / workers`` each), then (2) shares the fewest
partitions with the partition's other holders, then (3) comes soonest after one
of those holders in the ring of workers sorted by name (the first by name when
it has none).
At start the copies are handed out round by round (every partition gets its
first copy, then its second, ...), so with P = p and r = 2 the second copies
form a ring (partition i on workers i and i + 1), and r = 3 adds a third
worker that shares no other partition with those two. Two workers thus share
few partitions: when one dies or straggles its load spreads over many peers
rather than doubling one, and two deaths lose as few partitions as possible.

A copy made after start on a worker that already holds a partition, of a
partition another worker still serves, is a *background* load: it holds the
task slot of a worker that has units to run (loads run one at a time with
units on a worker), and nothing waits for it. At most half the live workers
(at least one) load in the background at once; the other copies wait for
those loads to end. Otherwise a lost worker's partitions would load on every
survivor at once and stall the cluster for a load's time. A partition no
worker holds loads at once, and so do copies on a worker holding nothing (one
that joined: it has nothing else to do).

A worker that joins gets its share by moves (:meth:`Placement.balance`): a copy
goes from the most loaded worker to the least loaded until no worker holds two
more than another, and the donor drops it once the newcomer holds it. Of the
donors' copies, the one that moves is of the partition with the least share of
workers' time (:meth:`Placement.shares`), so that with r = 3 on twice as many
workers as partitions nearly every partition gets one copy alone on a newcomer
and two on workers holding two. Only held copies move, so a worker that joins
while the first copies still load gets its share once they are held (the
scheduler balances after every load).

Example:
    >>> pl = Placement(4, replicas=2)
    >>> sorted(pl.replicate(["a", "b", "c", "d"]))
    [(0, 'a'), (0, 'b'), (1, 'b'), (1, 'c'), (2, 'c'), (2, 'd'), (3, 'a'), (3, 'd')]
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Placement"]


class Placement:
    """The partitions' holders, the loads in flight and the moves under way.

    Args:
        num_partitions: P.
        replicas: how many workers should hold each partition (r >= 1).

    Attributes:
        holders: per partition, the live workers holding it.
        placing: per partition, the live workers loading it.
        moves: ``(partition, target) -> donor``: once ``target`` holds the
            partition, ``donor`` drops it (see :meth:`balance`).
        failed: ``(partition, worker)`` loads that failed; no move tries them again.
    """

    def __init__(self, num_partitions: int, replicas: int = 1) -> None:
        self.check_replicas(replicas)
        self.num_partitions = num_partitions
        self.replicas = replicas
        self.holders: list[set[str]] = [set() for _ in range(num_partitions)]
        self.placing: list[set[str]] = [set() for _ in range(num_partitions)]
        self.moves: dict[tuple[int, str], str] = {}
        self.failed: set[tuple[int, str]] = set()

    @staticmethod
    def check_replicas(replicas: object) -> None:
        """Raise unless ``replicas`` is an int >= 1."""
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas is {replicas!r}, but must be an int >= 1")

    # ---------------------------------------------------------------- queries
    def copies(self, p: int) -> int:
        """Workers holding or loading partition ``p``."""
        return len(self.holders[p]) + len(self.placing[p])

    def leaving(self, p: int) -> set[str]:
        """Workers that drop ``p`` once a move of it completes."""
        return {donor for (q, _), donor in self.moves.items() if q == p}

    def served(self, p: int) -> bool:
        return bool(self.holders[p])

    def unserved(self) -> list[int]:
        """Partitions no live worker holds or loads."""
        return [p for p in range(self.num_partitions) if not self.copies(p)]

    def partitions_of(self, workers: Iterable[str]) -> dict[str, set[int]]:
        """Each worker's copies (held or loading)."""
        out: dict[str, set[int]] = {w: set() for w in workers}
        for p in range(self.num_partitions):
            for w in self.holders[p] | self.placing[p]:
                if w in out:
                    out[w].add(p)
        return out

    def loads(self, workers: Iterable[str]) -> dict[str, int]:
        """Copies per worker, not counting those it hands over in a move under way."""
        loads = {w: len(ps) for w, ps in self.partitions_of(workers).items()}
        for donor in self.moves.values():
            if donor in loads:
                loads[donor] -= 1
        return loads

    def target(self, live: int) -> int:
        """Copies each partition should have with ``live`` workers."""
        return min(self.replicas, live)

    def background_loaders(self) -> set[str]:
        """The workers loading a copy in the background (see the module docstring)."""
        holding = set().union(*self.holders)
        return {w for p in range(self.num_partitions) if self.holders[p] for w in self.placing[p] if w in holding}

    @staticmethod
    def background_limit(live: int) -> int:
        """How many of ``live`` workers may load in the background at once."""
        return max(1, live // 2)

    def waiting(self, p: int, live: int) -> bool:
        """``p`` is short of copies only because the background loads are at their limit."""
        return bool(self.holders[p]) and len(self.background_loaders()) >= self.background_limit(live)

    # -------------------------------------------------------------- decisions
    def choose(self, p: int, workers: Iterable[str], avoid: frozenset[str] = frozenset()) -> str | None:
        """The worker to hold a new copy of ``p`` (see the module docstring). ``avoid``
        is skipped unless nothing else is left. None: every live worker has a copy."""
        live = sorted(workers)
        index = {w: i for i, w in enumerate(live)}
        have = sorted((self.holders[p] | self.placing[p]) & index.keys())
        candidates = [w for w in live if w not in have]
        preferred = [w for w in candidates if w not in avoid] or candidates
        if not preferred:
            return None
        parts = self.partitions_of(live)
        loads = self.loads(live)

        def key(w: str) -> tuple[int, int, int]:
            shared = sum(len(parts[w] & parts[h]) for h in have)
            after = min(((index[w] - index[h]) % len(live) for h in have), default=index[w])
            return loads[w], shared, after

        return min(preferred, key=key)

    def replicate(self, workers: Iterable[str], avoid: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
        """Bring every partition up to its target number of copies, but for the
        background loads past the limit, which wait (see the module docstring);
        return the new placements ``(partition, worker)``, now in flight. The
        partitions with the fewest copies go first, one copy per round, so that a
        shortage is spread over all partitions before any gets a further copy."""
        live = sorted(workers)
        target = self.target(len(live))
        limit = self.background_limit(len(live))
        out: list[tuple[int, str]] = []
        waiting: set[int] = set()
        while True:
            short = [p for p in range(self.num_partitions) if self.copies(p) < target and p not in waiting]
            if not short:
                return out
            fewest = min(self.copies(p) for p in short)
            for p in short:
                if self.copies(p) != fewest:
                    continue
                w = self.choose(p, live, avoid)
                if w is None:  # cannot happen while target <= live workers
                    raise RuntimeError(f"partition {p} has {self.copies(p)} copies on {len(live)} workers")
                loaders = self.background_loaders()
                if self._background(p, w) and w not in loaders and len(loaders) >= limit:
                    waiting.add(p)
                    continue
                self.placing[p].add(w)
                out.append((p, w))

    def _background(self, p: int, w: str) -> bool:
        return bool(self.holders[p]) and any(w in held for held in self.holders)

    def balance(self, workers: Iterable[str]) -> list[tuple[int, str]]:
        """Move copies from the most loaded workers onto the least loaded until no
        worker holds two more than another, as far as held copies allow; each donor
        drops its copy once the receiver holds it. Returns the new placements.

        A worker that joined gets its copies this way, and so does one that joined
        while the copies it would take were still loading: the scheduler balances
        after every load, so it gets them once they are held. A move onto a worker
        that holds something is a background load and waits for the limit; a
        partition is not moved onto a worker where it failed to load.
        """
        live = sorted(workers)
        out: list[tuple[int, str]] = []
        while True:
            move = self._next_move(live)
            if move is None:
                return out
            p, receiver, donor = move
            self.placing[p].add(receiver)
            self.moves[(p, receiver)] = donor
            out.append((p, receiver))

    def _next_move(self, live: list[str], background: bool = True) -> tuple[int, str, str] | None:
        """The move that evens loads most: the least loaded receiver that can take
        one (first by name on ties), from the most loaded donors that can give one,
        of the partition with the least share. ``background``: also moves onto
        workers that hold something (limited)."""
        loads = self.loads(live)
        if not live or max(loads.values()) - min(loads.values()) < 2:
            return None  # even already: the usual case, after every load
        holding = set().union(*self.holders)
        loaders = self.background_loaders()
        limit = self.background_limit(len(live))
        receivers = sorted(live, key=lambda w: loads[w])
        donors = sorted(live, key=lambda w: -loads[w])
        for receiver in receivers:
            if receiver in holding and (not background or (receiver not in loaders and len(loaders) >= limit)):
                continue
            moves: list[tuple[int, str, str]] = []
            for donor in donors:
                if loads[donor] - loads[receiver] < 2 or (moves and loads[donor] < loads[moves[0][2]]):
                    break
                leaving = {p for (p, _), d in self.moves.items() if d == donor}
                moves.extend(
                    (p, receiver, donor)
                    for p in range(self.num_partitions)
                    if donor in self.holders[p]
                    and p not in leaving
                    and receiver not in self.holders[p] | self.placing[p]
                    and (p, receiver) not in self.failed
                )
            if moves:  # of the most loaded donors' copies, the partition with the least share
                shares = self.shares(live)
                return min(moves, key=lambda move: (shares[move[0]], -move[0]))
        return None

    def shares(self, workers: Iterable[str]) -> list[float]:
        """Per partition, how many workers' time its copies can give it: each copy
        counts one over its worker's number of copies (copies on their way out of a
        move not counted). Every model visits every partition, so the partition with
        the least share bounds the cluster: a move gives its copy to the partition
        that has least.

        >>> placement = Placement(2, replicas=2)
        >>> placement.holders = [{"a", "b"}, {"a"}]
        >>> placement.shares(["a", "b"])
        [1.5, 0.5]
        """
        live = sorted(workers)
        loads = self.loads(live)
        out = []
        for p in range(self.num_partitions):
            copies = (self.holders[p] | self.placing[p]) - self.leaving(p)
            out.append(sum(1 / loads[w] for w in copies if w in loads and loads[w] > 0))
        return out

    # ----------------------------------------------------------------- events
    def placed(self, p: int, w: str) -> tuple[bool, str | None]:
        """``w`` finished loading ``p``. Returns (whether the load was wanted, the
        donor that must drop ``p`` now, if this completes a move)."""
        if w not in self.placing[p]:
            return False, None  # stale: its worker was lost meanwhile
        self.placing[p].discard(w)
        self.holders[p].add(w)
        donor = self.moves.pop((p, w), None)
        if donor is not None and donor in self.holders[p]:
            self.holders[p].discard(donor)
            return True, donor
        return True, None

    def place_failed(self, p: int, w: str) -> bool:
        """Loading ``p`` on ``w`` failed; False if that load was no longer wanted."""
        if w not in self.placing[p]:
            return False
        self.placing[p].discard(w)
        self.moves.pop((p, w), None)  # a move that failed: the donor keeps its copy
        self.failed.add((p, w))
        return True

    def lose_copy(self, p: int, w: str, live: int) -> bool:
        """``w``'s copy of ``p`` is gone (the worker lives; ``live`` workers do);
        False if it had none."""
        if w not in self.holders[p]:
            return False
        self.holders[p].discard(w)
        self._keep_moves(live)
        return True

    def remove_worker(self, w: str, live: int) -> tuple[list[int], list[int]]:
        """Forget worker ``w`` (``live`` workers are left); return the partitions it
        held and those it was loading."""
        held = [p for p in range(self.num_partitions) if w in self.holders[p]]
        loading = [p for p in range(self.num_partitions) if w in self.placing[p]]
        for p in held:
            self.holders[p].discard(w)
        for p in loading:
            self.placing[p].discard(w)
        self.moves = {(p, t): d for (p, t), d in self.moves.items() if t != w}
        self.failed = {(p, t) for p, t in self.failed if t != w}
        self._keep_moves(live)
        return held, loading

    def _keep_moves(self, live: int) -> None:
        """A move whose donor is gone, or whose partition lost a copy meanwhile, no
        longer takes a copy away: its placement just adds one."""
        target = self.target(live)
        for (p, t), donor in list(self.moves.items()):
            if donor not in self.holders[p] or self.copies(p) - 1 < target:
                del self.moves[(p, t)]

    # ------------------------------------------------------------- invariants
    def validate(self, workers: Iterable[str], complete: bool) -> None:
        """Raise AssertionError naming the broken invariant. ``complete``: every
        partition must have its target number of copies (false before start and
        after an Abort)."""
        live = set(workers)
        target = self.target(len(live))
        for p in range(self.num_partitions):
            for w in sorted(self.holders[p]):
                if w not in live:
                    raise AssertionError(f"partition {p} is held by {w!r}, which is not a live worker")
            for w in sorted(self.placing[p]):
                if w not in live:
                    raise AssertionError(f"partition {p} is loading on {w!r}, which is not a live worker")
            if self.holders[p] & self.placing[p]:
                raise AssertionError(
                    f"partition {p} is loading on {sorted(self.holders[p] & self.placing[p])}, which already hold it"
                )
            settled = self.copies(p) - len(self.leaving(p))
            if settled > max(target, 1):
                raise AssertionError(f"partition {p} has {settled} copies, more than the {target} wanted")
            if complete and live and self.copies(p) < target and not self.waiting(p, len(live)):
                raise AssertionError(
                    f"partition {p} has {self.copies(p)} copies, fewer than the {target} "
                    f"wanted with {len(live)} live workers"
                )
        for (p, target_worker), donor in self.moves.items():
            if target_worker not in self.placing[p] or donor not in self.holders[p]:
                raise AssertionError(f"the move of partition {p} from {donor} to {target_worker} is not under way")
        move = self._next_move(sorted(live), background=False) if complete else None
        if move is not None:
            p, receiver, donor = move
            raise AssertionError(
                f"worker {receiver!r} holds no partition while {donor!r} could move it "
                f"partition {p}: a worker idles that could take units"
            )
