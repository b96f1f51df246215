"""Gang units: one model trained data-parallel by k ranks at once, each rank on the
worker that holds its partition, so that no data moves (DESIGN.md, "Gang units").

Rank r trains partition ``partitions[r]`` through the one unit loop
(:func:`~.units.train_unit`, under :func:`~.loop.synced_passes`) with ``b/k`` rows a
batch, shuffled and seeded as a plain unit over that partition would be. Before
every optimizer step the ranks' gradients are summed, each weighted by its rank's
share of the step's rows, so that a step is that of one batch of all the ranks'
rows. The ranks' partitions may differ in size: every rank runs the most steps any
rank's rows make, one whose rows ran out with no rows and no gradients of its own,
so that every rank holds the same weights after every step. Rank 0 returns the
state; the others a small :class:`RankSummary`.

The ranks meet through a ``TCPStore`` of their own (rank 0 its master) and a
process group made from it (gloo on the CPU, NCCL on CUDA) for the unit, closed
with it: never the process-global default group, since a worker process joins
many gangs over time, and other gangs run beside it. The rendezvous and every
collective have timeouts: a rank whose peer died, hung or failed raises
:class:`GangError`, which is no fault of its model's code. A rank whose unit is
abandoned stops after its batch, as a unit does, or at once while it waits for its
peers, and the peers waiting with it then fail at once.

>>> rank_batch_size(32, 4)
8
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import socket
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..fusion import is_group
from .devices import pick_device
from .errors import UnitAbandoned, UnitError
from .loop import synced_passes
from .schedulers import UnitProgress
from .units import train_unit
from .watch import check_deadline

if TYPE_CHECKING:
    from ..data import Shard
    from .spec import TrainingSpec
    from .transfer import State

__all__ = [
    "GangTimeouts",
    "GangPlan",
    "GangError",
    "RankSummary",
    "train_gang_rank",
    "rank_batch_size",
    "free_port",
    "weights_digest",
]

BUCKET_BYTES = 32 * 2**20  # gradients are summed in buckets of about this size (DDP's: 25 MiB)


@dataclass(frozen=True)
class GangTimeouts:
    """Seconds a gang's ranks wait for each other: to meet (``rendezvous``: until every
    rank has joined the gang's store, counted from when each rank starts), then to make
    the process group and in each collective (``collective``). A rank that waits longer
    fails with :class:`GangError`."""

    rendezvous: float = 60.0
    collective: float = 300.0

    def __post_init__(self) -> None:
        for name in ("rendezvous", "collective"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"GangTimeouts.{name} is {value!r}, but must be a number of seconds > 0")


@dataclass(frozen=True)
class GangPlan:
    """What every rank of one gang unit is told: rank ``r`` trains partition
    ``partitions[r]``; the ranks meet at rank 0's store, ``host:port``."""

    partitions: tuple[int, ...]
    host: str
    port: int
    timeouts: GangTimeouts = field(default_factory=GangTimeouts)

    def __post_init__(self) -> None:
        if not self.partitions or len(set(self.partitions)) != len(self.partitions):
            raise ValueError(f"a gang's partitions are {self.partitions!r}, but must be one or more, each once")
        if not 0 < self.port < 2**16:
            raise ValueError(f"a gang's port is {self.port!r}, but must be a TCP port (1 to 65535)")

    @property
    def width(self) -> int:
        """The number of ranks, k."""
        return len(self.partitions)


class GangError(RuntimeError):
    """A gang unit failed through no fault of this rank's model code: a peer rank
    died, hung or failed (its own error says why), or the ranks could not meet. The
    unit may run again from the state it started from."""


@dataclass(frozen=True)
class RankSummary:
    """What a rank other than 0 returns: its partition and rows, the gang's steps, its
    seconds, and, when asked, the digest of the weights it ended with (every rank's
    must be rank 0's: see :func:`weights_digest`)."""

    rank: int
    partition: int
    rows: int
    steps: int
    seconds: float
    weights: str | None = None


def rank_batch_size(batch_size: int, width: int) -> int:
    """Each rank's rows a batch: the global ``batch_size`` split over ``width`` ranks."""
    if width < 1:
        raise ValueError(f"a gang's width is {width}, but must be >= 1")
    if batch_size % width:
        raise ValueError(
            f"the batch size is {batch_size}, which a gang of {width} ranks cannot split: each rank trains "
            f"b/k rows a step so that the gang keeps the batch size, and b % k must be 0 (here {batch_size % width})"
        )
    return batch_size // width


def free_port() -> int:
    """A TCP port free on this machine now (the OS's choice), for a gang's store. Another
    process may take it before the store listens: the gang then fails to meet."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def weights_digest(weights: Mapping[str, Any]) -> str:
    """A digest of a state's weights (names, dtypes, shapes and bytes): equal digests,
    equal bits."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        value = weights[name]
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()[:16]


def train_gang_rank(
    spec: TrainingSpec,
    config: Mapping[str, Any],
    state: State | None,
    shard: Shard,
    *,
    rank: int,
    plan: GangPlan,
    seed: int,
    epoch: int,
    step: int,
    epoch_end: bool,
    threads: int,
    unit_timeout: float | None = None,
    fresh_hyperparameters: bool = False,
    deterministic: bool = True,
    budget: int | None = None,
    partitions: int | None = None,
    local_host: str | None = None,
    digest: bool = False,
) -> State | RankSummary:
    """Rank ``rank`` of a gang unit: train ``shard`` (partition ``plan.partitions[rank]``)
    in step with the other ranks; rank 0 returns the new state, the others a
    :class:`RankSummary` (with the digest of their weights if ``digest``).

    The arguments are :func:`~.units.train_unit`'s; ``step`` counts the epoch's
    partitions trained before this unit, which trains ``plan.width`` of them (the
    spec's ``lr_schedule`` spans them). The state's loss and samples are the sums
    over the ranks, its steps the gang's. ``local_host``: the address of this
    machine the peers reach (gloo's interface; None: the one its host name gives).

    Raises ValueError for a request no gang can carry out (a batch size that ``k``
    does not divide, a fusion group); :class:`GangError` when the gang fails through a
    peer or the network; :class:`UnitError` when this rank's model code failed.
    """
    started = time.perf_counter()
    batch_size = _checked_request(spec, config, rank, plan)
    group = _Group(plan, rank, pick_device(spec), local_host)
    try:
        sync = _GangSync.agree(group, rank, plan.width, len(shard), batch_size, spec.accumulate_grad_batches)
        try:
            with synced_passes(sync):
                new_state = train_unit(
                    spec,
                    config,
                    state,
                    shard,
                    seed=seed,
                    epoch=epoch,
                    partition=plan.partitions[rank],
                    step=step,
                    epoch_end=epoch_end,
                    threads=threads,
                    unit_timeout=unit_timeout,
                    fresh_hyperparameters=fresh_hyperparameters,
                    deterministic=deterministic,
                    budget=budget,
                    partitions=partitions,
                )
        except UnitError:
            if group.failure is not None:  # a collective failed: the peer's failure, not this rank's code
                raise group.failure from None
            raise
    finally:
        group.close()  # peers still in a collective fail now, not at their timeout
    if rank == 0:
        return new_state
    weights = weights_digest(new_state["model"]) if digest else None
    elapsed = time.perf_counter() - started
    return RankSummary(rank, plan.partitions[rank], len(shard), sync.steps, elapsed, weights)


def _checked_request(spec: TrainingSpec, config: Mapping[str, Any], rank: int, plan: GangPlan) -> int:
    """This rank's batch size; a ValueError for what no gang trains. Checked before the
    ranks meet, so that every rank refuses at once."""
    if is_group(config):
        raise ValueError(
            "a fusion group (its members trained as one batched model) cannot train as a gang unit: "
            "train it in plain units, or its members apart"
        )
    if not 0 <= rank < plan.width:
        raise ValueError(f"rank is {rank}, but a gang of {plan.width} has ranks 0 to {plan.width - 1}")
    return rank_batch_size(spec.resolve_batch_size(config), plan.width)


class _Group:
    """A gang's store and process group, made for one unit and closed with it. A
    collective that fails or times out is kept as :attr:`failure`."""

    def __init__(self, plan: GangPlan, rank: int, device: torch.device, local_host: str | None) -> None:
        import torch.distributed as dist

        self.rank, self.plan = rank, plan
        self.device = device if device.type == "cuda" else torch.device("cpu")
        self.failure: GangError | None = None
        self._store: Any = None
        self._backend: Any = None
        try:
            self._store = _meet(plan, rank)
            self._backend = _backend(dist.PrefixStore("gang", self._store), rank, plan, device, local_host)
        except RuntimeError as err:  # torch's DistNetworkError and DistStoreError among them
            self.close()
            if isinstance(err, GangError | UnitAbandoned):
                raise
            raise GangError(
                f"rank {rank} of the gang over partitions {list(plan.partitions)} did not meet its peers at "
                f"{plan.host}:{plan.port} within the rendezvous timeout of {plan.timeouts.rendezvous:g} s "
                f"({_first_line(err)})"
            ) from None

    def allreduce(self, tensor: torch.Tensor, what: str) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        try:
            self._backend.allreduce([tensor]).wait()
        except RuntimeError as err:
            message = _first_line(err)
            cause = (
                f"no answer from a peer within the collective timeout of {self.plan.timeouts.collective:g} s"
                if "timed out" in message.lower()
                else "a peer closed its connection (it died, or failed: see its own error)"
            )
            self.failure = GangError(
                f"rank {self.rank} of the gang over partitions {list(self.plan.partitions)} failed {what}: "
                f"{cause} ({message})"
            )
            raise self.failure from None

    def close(self) -> None:
        """Close the connections to the peers and the store (its port with it)."""
        backend, self._backend, self._store = self._backend, None, None
        if backend is not None:
            with contextlib.suppress(RuntimeError):  # one that failed may not shut down cleanly: dropped all the same
                backend.shutdown()


# Seconds between a waiting rank's looks at its peers, and at whether its unit is still wanted.
MEET_POLL = 0.05
_JOINED, _LEFT = "joined", "left"  # the store's keys: ranks that have joined; the rank that left before all had


def _meet(plan: GangPlan, rank: int) -> Any:
    """The gang's store (rank 0 hosts it) once every rank has joined it.

    A rank waits for its peers at most the rendezvous timeout, and while it waits it
    stops as a unit does when its result is no longer wanted (:func:`~.watch.check_deadline`
    raises :class:`UnitAbandoned`): a peer cancelled before it started never comes, and
    the ranks that did must not hold their workers until the timeout. One that leaves
    says so in the store, and the peers that wait there fail at once."""
    import torch.distributed as dist

    deadline = time.monotonic() + plan.timeouts.rendezvous
    _still_wanted(plan, rank, deadline)  # a rank stopped before it started joins nothing
    if rank != 0:  # the store's host may not listen yet: wait for it here, not in torch's noisy retries
        while not _listening(plan.host, plan.port):
            time.sleep(MEET_POLL)
            _still_wanted(plan, rank, deadline)
    remaining = datetime.timedelta(seconds=max(deadline - time.monotonic(), MEET_POLL))
    store = dist.TCPStore(plan.host, plan.port, plan.width, rank == 0, remaining, wait_for_workers=False)
    try:
        _wait_for_peers(store, plan, rank, deadline)
    except BaseException as err:
        # A host's store stops listening now, not when the garbage collector takes the
        # traceback: its frames no longer hold it.
        traceback.clear_frames(err.__traceback__)
        del store
        raise
    # NCCL's first collective exchanges its ID through the store: all have met, give it the whole timeout
    store.set_timeout(datetime.timedelta(seconds=plan.timeouts.rendezvous))
    return store


def _wait_for_peers(store: Any, plan: GangPlan, rank: int, deadline: float) -> None:
    """Join the count of ranks in ``store``, and wait until it reaches the gang's width."""
    joined = store.add(_JOINED, 1)
    pause = 0.001  # peers freed together meet within milliseconds: look again soon, then less often
    while joined < plan.width:
        if store.check([_LEFT]):
            raise GangError(
                f"rank {rank} of the gang over partitions {list(plan.partitions)} did not meet its peers: rank "
                f"{store.get(_LEFT).decode()} left before they all had met (its unit was stopped)"
            )
        try:
            _still_wanted(plan, rank, deadline)
        except (UnitAbandoned, GangError):
            if _leave(store, plan, rank):
                raise
            return  # all had met meanwhile, and wait for it now: it goes on, to stop at its first check
        time.sleep(pause)
        pause = min(2 * pause, MEET_POLL)
        joined = store.add(_JOINED, 0)


def _leave(store: Any, plan: GangPlan, rank: int) -> bool:
    """Leave the store before all ranks have met: the count is set, in one step with
    reading it, below any that the ranks can reach, then the peers waiting there read
    why. False if all had met (the peers are past waiting, and this rank goes on)."""
    joined = store.add(_JOINED, 0)
    while joined < plan.width:
        dropped = str(joined - plan.width - 1)
        now = store.compare_set(_JOINED, str(joined), dropped)
        if now.decode() == dropped:
            with contextlib.suppress(RuntimeError):  # the host gone: its peers find that out themselves
                store.set(_LEFT, str(rank))
            return True
        joined = int(now)  # a peer joined or left meanwhile
    return False


def _still_wanted(plan: GangPlan, rank: int, deadline: float) -> None:
    """Raise :class:`UnitAbandoned` if this rank's unit is no longer wanted,
    :class:`GangError` once the rendezvous timeout is past."""
    check_deadline(None)
    if time.monotonic() > deadline:
        raise GangError(
            f"rank {rank} of the gang over partitions {list(plan.partitions)} did not meet its peers at "
            f"{plan.host}:{plan.port} within the rendezvous timeout of {plan.timeouts.rendezvous:g} s"
        )


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections at ``host:port`` now."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return False
    return True


def _backend(store: Any, rank: int, plan: GangPlan, device: torch.device, local_host: str | None) -> Any:
    """The process group of the gang: NCCL for CUDA tensors, gloo for the CPU's."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=plan.timeouts.collective)
    if device.type == "cuda":  # not tested here (no GPUs): NCCL's watchdog handles its timeouts
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            raise GangError("a gang on CUDA needs NCCL, which this build of torch lacks")
        options = nccl.Options()
        options._timeout = timeout
        return nccl(store, rank, plan.width, options)
    gloo: Any = dist.ProcessGroupGloo  # its _Options are not in torch's type stubs
    options = gloo._Options()
    options._timeout = timeout
    options._devices = [gloo.create_device(hostname=local_host) if local_host else gloo.create_default_device()]
    return gloo(store, rank, plan.width, options)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


@dataclass(frozen=True)
class _SpanProgress(UnitProgress):
    """A gang unit's place in the schedule's span: it trains ``width`` of the epoch's
    partitions at once (width 1: a plain unit's, to the bit)."""

    width: int = 1

    def at(self, batch: int, batches: int) -> float:
        within = (self.step + self.width * (batch + 1) / max(batches, 1)) / self.partitions
        return (self.epoch + within) / self.epochs


class _GangSync:
    """Keeps one rank's pass in step with the gang's (the loop's :class:`~.loop.PassSync`).

    ``lengths``: every rank's rows, agreed on at the start, so that each rank knows
    every step's rows without asking (and its weight, ``own rows / all rows``, is 1.0
    exactly in a gang of one)."""

    def __init__(self, group: _Group, rank: int, lengths: list[int], batch_size: int, accumulate: int) -> None:
        self.group, self.rank, self.lengths = group, rank, lengths
        self.batch_size, self.accumulate = batch_size, accumulate
        self.steps = max(-(-n // batch_size) for n in lengths)
        self.fed = 0  # batches handed to the loop
        self.summed_at = 0  # batches handed when the gradients were last summed
        self.sums = 0  # gradient sums so far
        self._buckets: list[_Bucket] | None = None

    @classmethod
    def agree(cls, group: _Group, rank: int, width: int, rows: int, batch_size: int, accumulate: int) -> _GangSync:
        """The sync of rank ``rank``, once the ranks have told each other their rows."""
        lengths = torch.zeros(width, dtype=torch.int64, device=group.device)
        lengths[rank] = rows
        group.allreduce(lengths, "to agree on the number of steps")
        return cls(group, rank, [int(n) for n in lengths.tolist()], batch_size, accumulate)

    def rows(self, rank: int, batch: int) -> int:
        """The rows rank ``rank`` trains in its batch ``batch`` (0 past its rows)."""
        return min(self.batch_size, max(0, self.lengths[rank] - batch * self.batch_size))

    def spanning(self, progress: UnitProgress | None) -> UnitProgress | None:
        if progress is None:
            return None
        return _SpanProgress(progress.epoch, progress.step, progress.partitions, progress.epochs, len(self.lengths))

    def padded(self, source: Iterable[tuple[Any, Any, int]]) -> Iterator[tuple[Any, Any, int]]:
        for x, y, n in source:
            if n != self.rows(self.rank, self.fed):
                raise RuntimeError(
                    f"batch {self.fed} of rank {self.rank} has {n} rows, where the gang counts on "
                    f"{self.rows(self.rank, self.fed)}"
                )
            yield self._handed(x, y, n)
        while self.fed < self.steps:
            yield self._handed(None, None, 0)

    def _handed(self, x: Any, y: Any, n: int) -> tuple[Any, Any, int]:
        # A step skipped on one rank (step_loss returning None) would pair its collectives
        # with the wrong ones of its peers: it fails here, before its next collective.
        if self.sums != self.fed // self.accumulate:
            raise RuntimeError(
                f"rank {self.rank} of a gang stepped {self.sums} times in {self.fed} batches, but the ranks of a "
                f"gang step together, every {self.accumulate} batches: a gang unit cannot skip a step "
                "(did step_loss return None?)"
            )
        self.fed += 1
        return x, y, n

    def reduce(self, model: torch.nn.Module) -> None:
        held = range(self.summed_at, self.fed)  # the batches whose gradients this step sums
        own = sum(self.rows(self.rank, b) for b in held)
        total = sum(self.rows(r, b) for r in range(len(self.lengths)) for b in held)
        self.summed_at, self.sums = self.fed, self.sums + 1
        weight = own / total if total else 0.0
        if self._buckets is None:
            self._buckets = _buckets([p for p in model.parameters() if p.requires_grad])
        for bucket in self._buckets:
            bucket.sum(weight, self.group)

    def finish(self, state: State) -> None:
        if self.sums != -(-self.steps // self.accumulate):
            raise RuntimeError(f"rank {self.rank} of a gang stepped {self.sums} times in its {self.steps} batches")
        totals = torch.tensor([state["loss_sum"], state["samples"]], dtype=torch.float64, device=self.group.device)
        self.group.allreduce(totals, "to sum the loss")
        loss_sum, samples = totals.tolist()
        own_batches = -(-self.lengths[self.rank] // self.batch_size)
        state["loss_sum"], state["samples"] = loss_sum, int(samples)
        state["steps"] += self.steps - own_batches  # the loop counted this rank's own batches


def _buckets(params: list[torch.nn.Parameter]) -> list[_Bucket]:
    """The parameters in buckets of one dtype and device, in parameter order, each of
    about :data:`BUCKET_BYTES` (a larger parameter alone)."""
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = out[-1] if out else None
        if last is None or (last[0].dtype, last[0].device) != (p.dtype, p.device) or size + nbytes > BUCKET_BYTES:
            out.append([p])
            size = nbytes
        else:
            last.append(p)
            size += nbytes
    return [_Bucket(b) for b in out]


class _Bucket:
    """Parameters whose weighted gradients are summed in one collective: one flat
    buffer of their gradients in parameter order, then a flag for each (whether a rank
    had its gradient), so that a parameter no rank's loss reached keeps ``grad`` None,
    as in a plain step."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.flat = torch.zeros(sum(self.sizes) + len(params), dtype=params[0].dtype, device=params[0].device)

    def sum(self, weight: float, group: _Group) -> None:
        """Each gradient becomes the sum over the ranks of ``weight`` times theirs."""
        flat, flags_at = self.flat, sum(self.sizes)
        flat.zero_()
        offset = 0
        for i, (p, n) in enumerate(zip(self.params, self.sizes, strict=True)):
            # weight 0: a rank past its rows; what its grads hold (the last step's) does not count
            if weight and p.grad is not None:
                torch.mul(p.grad.reshape(-1), weight, out=flat[offset : offset + n])
                flat[flags_at + i] = 1
            offset += n
        group.allreduce(flat, "to sum the gradients")
        flags = flat[flags_at:].tolist()
        offset = 0
        for p, n, flag in zip(self.params, self.sizes, flags, strict=True):
            if flag == 0:
                p.grad = None
            else:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(flat[offset : offset + n].view_as(p))
            offset += n
