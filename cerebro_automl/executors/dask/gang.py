"""Gang units on Dask: the k rank tasks of one model's gang unit, each pinned to the
worker that holds its rank's partition (no data moves), meeting at a store on rank
0's worker (see :mod:`cerebro_automl.training.gang`).

A rank task holds its worker's task lock, as a unit does, and announces its model
while it runs. Rank 0's future holds the new state; the others' a
:class:`~cerebro_automl.training.gang.RankSummary`. A rank that fails in its own
model code raises :class:`~cerebro_automl.training.UnitError`; its peers raise
:class:`~cerebro_automl.training.gang.GangError` (so does every rank when they
cannot meet), which is no fault of the model.

>>> unit = GangUnit(seed=1, epoch=0, step=0, epoch_end=False, budget=3, partitions=4)  # doctest: +SKIP
>>> ranks = [(0, "tcp://10.0.0.1:4001"), (1, "tcp://10.0.0.2:4001")]  # (partition, worker)  # doctest: +SKIP
>>> state, summary = submit_gang(client, spec, config, state, ranks, [shard0, shard1], unit)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...training.gang import GangPlan, GangTimeouts, RankSummary, free_port, train_gang_rank
from .partitions import SCATTER_TIMEOUT
from .tasks import running_unit
from .wire import RUNNER, Pickled, is_future, portable

if TYPE_CHECKING:
    from ...data.partition import PartitionData
    from ...training import TrainingSpec
    from ...training.transfer import State

__all__ = ["GangUnit", "RankCall", "GangRanks", "reserve_port", "gang_calls", "submit_gang", "gang_rank_task"]


@dataclass(frozen=True)
class GangUnit:
    """Where a gang unit stands in its model's training, and how it trains: the
    arguments :func:`~cerebro_automl.training.train_unit` takes besides the data.
    ``step``: the epoch's partitions trained before it; ``partitions``: the data's."""

    seed: int
    epoch: int
    step: int
    epoch_end: bool
    budget: int | None = None
    partitions: int | None = None
    threads: int = 1
    unit_timeout: float | None = None
    fresh_hyperparameters: bool = False
    deterministic: bool = True


@dataclass(frozen=True)
class RankCall:
    """One rank's task: :func:`gang_rank_task` with ``args`` (futures among them), pinned
    to ``worker``."""

    rank: int
    worker: str
    args: tuple


def reserve_port(client: Any, worker: str) -> tuple[str, int]:
    """``(host, port)`` for a gang's store on ``worker``: the host Dask reaches it at,
    and a port free there now (asked on the worker's event loop, beside its tasks)."""
    answers = client.run(_free_port_here, workers=[worker])
    host, port = answers[worker]
    return host, port


def _free_port_here(dask_worker: Any = None) -> tuple[str, int]:
    from distributed.comm import get_address_host

    return get_address_host(dask_worker.address), free_port()


def gang_calls(
    client: Any,
    spec: TrainingSpec | Pickled,
    config: Mapping[str, Any] | Pickled,
    state: Any,
    ranks: Sequence[tuple[int, str]],
    shards: Sequence[Any],
    unit: GangUnit,
    *,
    timeouts: GangTimeouts | None = None,
    topic: str | None = None,
    model_id: int | None = None,
    digest: bool = False,
) -> list[RankCall]:
    """The rank tasks of one gang unit, ready to submit (for an executor that keeps
    its own books of what it submits; :func:`submit_gang` submits them).

    ``ranks``: ``(partition, worker)`` of each rank, rank 0 first: its worker hosts
    the store, and its task returns the state. ``shards``: each rank's partition as
    the executor holds it (the future of its ``PartitionData`` on that worker).
    ``state``: the state the unit starts from (a future, the driver's copy, which is
    sent to rank 0's worker once, or None). ``topic``, ``model_id``: what the tasks
    announce (see :mod:`.tasks`); ``digest``: the other ranks return the digest of
    their weights.
    """
    _check_ranks(ranks, shards)
    host, port = reserve_port(client, ranks[0][1])
    plan = GangPlan(tuple(p for p, _ in ranks), host, port, timeouts or GangTimeouts())
    spec = spec if isinstance(spec, Pickled) else Pickled(spec, cached=True)
    config = config if isinstance(config, Pickled) else Pickled(dict(config))
    if state is not None and not is_future(state):  # once to rank 0's worker, not k times through the scheduler
        [state] = client.scatter([state], workers=[ranks[0][1]], hash=False, timeout=SCATTER_TIMEOUT)
    extra = (dataclasses.asdict(unit), topic, model_id, digest)
    return [
        RankCall(rank, worker, (spec, config, state, shard, plan, rank, *extra))
        for rank, ((_, worker), shard) in enumerate(zip(ranks, shards, strict=True))
    ]


def submit_gang(
    client: Any,
    spec: TrainingSpec | Pickled,
    config: Mapping[str, Any] | Pickled,
    state: Any,
    ranks: Sequence[tuple[int, str]],
    shards: Sequence[Any],
    unit: GangUnit,
    *,
    timeouts: GangTimeouts | None = None,
    topic: str | None = None,
    model_id: int | None = None,
    digest: bool = False,
    key: str | None = None,
) -> list[Any]:
    """Submit the k rank tasks of one gang unit (see :func:`gang_calls`), each pinned to
    its worker; their futures, by rank: rank 0's holds the new state, the others' a
    :class:`~cerebro_automl.training.gang.RankSummary`. ``key`` names the tasks
    (``cerebro-train-<key>-r<rank>``; default: a random one)."""
    calls = gang_calls(
        client,
        spec,
        config,
        state,
        ranks,
        shards,
        unit,
        timeouts=timeouts,
        topic=topic,
        model_id=model_id,
        digest=digest,
    )
    name = key or f"gang-{uuid.uuid4().hex[:8]}"
    return [
        client.submit(
            RUNNER,
            *portable(gang_rank_task, call.args, {}),
            key=f"cerebro-train-{name}-r{call.rank}",
            pure=False,
            workers=[call.worker],
            allow_other_workers=False,
        )
        for call in calls
    ]


def _check_ranks(ranks: Sequence[tuple[int, str]], shards: Sequence[Any]) -> None:
    if not ranks:
        raise ValueError("a gang unit needs at least one rank, but ranks is empty")
    if len(shards) != len(ranks):
        raise ValueError(f"a gang of {len(ranks)} ranks needs a shard for each, but {len(shards)} were given")
    workers = [w for _, w in ranks]
    for worker in set(workers):
        if workers.count(worker) > 1:
            raise ValueError(
                f"worker {worker} holds ranks {[r for r, w in enumerate(workers) if w == worker]} of one gang, but "
                "a gang's ranks must run on distinct workers: a worker runs one task at a time, so its second "
                "rank would wait for the first, which waits for it"
            )


def gang_rank_task(
    spec: TrainingSpec,
    config: Mapping[str, Any],
    state: State | None,
    partition: PartitionData,
    plan: GangPlan,
    rank: int,
    unit: Mapping[str, Any],
    topic: str | None = None,
    model_id: int | None = None,
    digest: bool = False,
) -> State | RankSummary:
    """One rank of a gang unit on the worker holding ``partition``: under the task lock,
    reporting its progress and stopping when abandoned, as a unit does."""
    from distributed import get_worker
    from distributed.comm import get_address_host

    with running_unit(topic, model_id):
        return train_gang_rank(
            spec,
            config,
            state,
            partition.train,
            rank=rank,
            plan=plan,
            local_host=get_address_host(get_worker().address),
            digest=digest,
            **unit,
        )


# How long rank 0's GangError waits for a peer's own error to reach the driver.
PEER_ERROR_WAIT = 5.0


class GangRanks:
    """The futures of the gang units' ranks other than 0, by rank 0's future (which the
    executor's books track as the model's unit): kept while that unit is in flight,
    stopped with it, and asked why it failed."""

    def __init__(self, cancel: Callable[[Any], None]) -> None:
        self._cancel = cancel  # the executor's, which sends it again a moment later
        self._ranks: dict[Any, list[tuple[Any, str]]] = {}  # rank 0's future -> (future, worker)

    def __bool__(self) -> bool:
        return bool(self._ranks)

    def add(self, lead: Any, ranks: list[tuple[Any, str]]) -> None:
        self._ranks[lead] = ranks

    def stop(self, leads: Sequence[Any]) -> None:
        """Cancel the other ranks of these units. A rank already running stops after its
        batch, or at once while it waits for its peers (see
        :func:`~cerebro_automl.training.gang.train_gang_rank`), as rank 0 does when its
        unit is stopped; one in a collective fails at once when a peer closes the group."""
        for lead in leads:
            for future, _ in self._ranks.pop(lead, []):
                self._cancel(future)

    def stop_all(self) -> None:
        """Cancel the other ranks of every gang unit still known here."""
        self.stop(list(self._ranks))

    def prune(self, in_flight: Any) -> None:
        """Forget the ranks of units no longer in flight (they ended with rank 0)."""
        for lead in [lead for lead in self._ranks if lead not in in_flight]:
            for future, _ in self._ranks.pop(lead):
                future.release()

    def cause(self, lead: Any, error: BaseException) -> BaseException:
        """Why rank 0 failed: a peer's own error (its model code) rather than the
        :class:`~cerebro_automl.training.gang.GangError` that peer's failure caused."""
        from distributed import wait

        from ...training import UnitError
        from ...training.gang import GangError

        ranks = [f for f, _ in self._ranks.get(lead, [])]
        if not isinstance(error, GangError) or not ranks:
            return error
        with contextlib.suppress(Exception):  # a rank still runs: it says no more
            wait(ranks, timeout=PEER_ERROR_WAIT)
        for future in ranks:
            if future.status == "error":
                peer = future.exception()
                if isinstance(peer, UnitError):  # the model's own code, not the cluster
                    return peer
        return error
