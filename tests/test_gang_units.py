"""Gang units (issue 47): one model trained data-parallel over k partitions at once,
on the workers that hold them, gradients summed every step with gloo.

On a LocalCluster of 4 single-threaded worker processes, 4 partitions of unequal
sizes, one per worker. The reference a gang must equal is plain torch: the same
steps on the union of the ranks' batches, one big batch a step.
"""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import torch
from torch import nn

from cerebro_automl.data import TensorShard
from cerebro_automl.data.partition import PartitionData
from cerebro_automl.executors.dask.gang import GangUnit, submit_gang
from cerebro_automl.training import UnitError, build_model, train_unit, unit_seed
from cerebro_automl.training.schedulers import UnitProgress, WarmupDecay
from cerebro_automl.training.gang import (
    GangError,
    _GangSync,
    GangPlan,
    GangTimeouts,
    RankSummary,
    free_port,
    train_gang_rank,
    weights_digest,
)

from conftest import make_arrays
from models import make_spec, model_fn

pytestmark = pytest.mark.cluster
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers get this module's model code by value

SIZES = (44, 38, 30, 20)  # rows of partitions 0-3: unequal, with partial last batches
BATCH = 16
CONFIG = {"lr": 0.05, "width": 8, "dropout": 0.0}  # no dropout: the reference draws no masks
TIMEOUTS = GangTimeouts(rendezvous=30.0, collective=10.0)
PATIENT = GangTimeouts(rendezvous=30.0, collective=40.0)  # a peer that waited it out would take >= 40 s


def sgd_fn(config, params):
    return torch.optim.SGD(params, lr=config["lr"], momentum=0.9)


class Faulty(nn.Module):
    """A linear model that fails in its third batch over rows marked with x[:, 0] > 100:
    ``fault`` is "raise", "hang" (sleeps 6 s, then goes on) or "exit" (ends its process)."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault, self.calls = fault, 0
        self.layer = nn.Linear(8, 3)

    def forward(self, x):
        self.calls += 1
        if self.calls == 3 and bool((x[:, 0] > 100).any()):
            if self.fault == "raise":
                raise ValueError("injected fault in the third batch")
            if self.fault == "hang":
                time.sleep(6.0)
            if self.fault == "exit":
                import os

                os._exit(1)
        return self.layer(x.clamp(max=10.0))


class PartlyTrained(nn.Module):
    """A frozen layer, a trained one, and a parameter no loss reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.head = nn.Linear(8, 8), nn.Linear(8, 3)
        self.frozen.requires_grad_(False)
        self.unused = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        return self.head(torch.relu(self.frozen(x)))


def faulty_model_fn(config):
    if config.get("fault"):
        return Faulty(config["fault"])
    if config.get("partly"):
        return PartlyTrained()
    model = model_fn(config)
    if config.get("delay"):  # slower, to the same bits
        model.register_forward_pre_hook(lambda module, args: time.sleep(config["delay"]))
    return model


def _spec(**overrides):
    return make_spec(model_fn=faulty_model_fn, optimizer_fn=sgd_fn, batch_size=BATCH, **overrides)


def _partitions(marked: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    X, y, _, _ = make_arrays(rows=sum(SIZES), valid_rows=1)
    X, y = torch.from_numpy(X), torch.from_numpy(y)
    out, start = [], 0
    for i, n in enumerate(SIZES):
        x = X[start : start + n].clone()
        if i == marked:
            x[:, 0] = 1000.0  # the rows a Faulty model fails on
        out.append((x, y[start : start + n]))
        start += n
    return out


@pytest.fixture(scope="module")
def four():
    """A client of a LocalCluster of 4 single-threaded worker processes."""
    from distributed import Client

    from cerebro_automl.executors.dask import start_local_cluster

    with start_local_cluster(4) as local, Client(local) as client:
        client.wait_for_workers(4)
        yield client


def _workers(client) -> list[str]:
    client.wait_for_workers(4, timeout=60)
    return sorted(client.scheduler_info()["workers"])


def _place(client, workers, marked: int | None = None) -> list:
    """Partition i on workers[i], as the executor holds it: a future of its PartitionData."""
    parts = [PartitionData(TensorShard(x, y), None) for x, y in _partitions(marked)]
    return [client.scatter(p, workers=[w], hash=False) for p, w in zip(parts, workers)]


def _gang(client, shards, workers, parts, *, config=CONFIG, state=None, epoch=0, timeouts=TIMEOUTS, spec=None):
    """The futures of one gang unit over partitions ``parts``, rank r on workers[parts[r]]."""
    unit = GangUnit(seed=7, epoch=epoch, step=0, epoch_end=True, budget=2, partitions=4)
    ranks = [(p, workers[p]) for p in parts]
    return submit_gang(client, spec or _spec(), config, state, ranks, [shards[p] for p in parts], unit,
                       timeouts=timeouts, digest=True)


def _run_gang(client, shards, workers, parts, epochs=2, **kw):
    """Two gang units in a row (epochs 0 and 1): rank 0's last state and every rank's
    weight digest after each unit."""
    state, digests = None, []
    for epoch in range(epochs):
        futures = _gang(client, shards, workers, parts, state=state, epoch=epoch, **kw)
        state, *summaries = client.gather(futures)
        digests.append([weights_digest(state["model"]), *(s.weights for s in summaries)])
    return state, digests


def _reference(parts, epochs=2, *, weighted=True, clip=None) -> dict:
    """Plain torch: the model's initial weights, then per step one batch made of every
    rank's batch (the ranks' shuffles seeded as plain units over their partitions)."""
    torch.set_num_threads(1)
    data = _partitions()
    k = len(parts)
    rows = BATCH // k
    model = build_model(_spec(), CONFIG, None, 7)
    optimizer = sgd_fn(CONFIG, model.parameters())
    for epoch in range(epochs):
        orders = [torch.randperm(len(data[p][0]), generator=torch.Generator().manual_seed(unit_seed(7, epoch, p)))
                  for p in parts]
        for step in range(max(-(-len(o) // rows) for o in orders)):
            batches = [(data[p][0][o[step * rows:(step + 1) * rows]], data[p][1][o[step * rows:(step + 1) * rows]])
                       for p, o in zip(parts, orders)]
            optimizer.zero_grad()
            if weighted:  # one batch of every rank's rows
                x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
                nn.functional.cross_entropy(model(x), y).backward()
            else:  # what a gang that averages the ranks' gradients computes: a check that weighting matters
                losses = [nn.functional.cross_entropy(model(x), y) for x, y in batches if len(y)]
                (sum(losses) / k).backward()
            if clip is not None:  # the gang's gradients, clipped
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


# ---------------------------------------------------------------- width 1


WIDTH_ONE_SPECS = {  # Adam, dropout
    "clipped": dict(gradient_clip_val=1.0),
    "accumulated": dict(accumulate_grad_batches=2),  # 3 batches: the second step is a pass's tail
    "scheduled": dict(lr_schedule=WarmupDecay(warmup=0.3, decay="cosine")),
}


@pytest.mark.parametrize("options", WIDTH_ONE_SPECS.values(), ids=WIDTH_ONE_SPECS.keys())
def test_a_gang_of_one_is_the_plain_unit_to_the_bit(options):
    """Width 1 runs the gang's whole path (store, gloo group, buckets, sums), in this
    process, and gives train_unit's bits: weights, optimizer state, loss and samples."""
    spec = make_spec(batch_size=BATCH, **options)
    x, y = _partitions()[1]
    shard = TensorShard(x, y)
    config = {"lr": 1e-2, "width": 8}
    plain, gang = None, None
    for epoch in range(2):
        args = dict(seed=3, epoch=epoch, step=1, epoch_end=True, threads=1, budget=2, partitions=4)
        plain = train_unit(spec, config, plain, shard, partition=1, **args)
        plan = GangPlan((1,), "127.0.0.1", free_port(), TIMEOUTS)
        gang = train_gang_rank(spec, config, gang, shard, rank=0, plan=plan, local_host="127.0.0.1", **args)
    assert weights_digest(gang["model"]) == weights_digest(plain["model"])
    assert weights_digest(gang["optimizer"]["state"][0]) == weights_digest(plain["optimizer"]["state"][0])
    for key in ("loss_sum", "samples"):
        assert gang["progress"][key] == plain["progress"][key]
    assert gang["steps"] == plain["steps"] == 2 * 3


def test_a_gang_unit_spans_its_partitions_of_the_schedule():
    """A gang over partitions 1 and 2 of 4 ends where a plain unit over partition 2
    ends, and is halfway there when half its steps ran."""
    sync = _GangSync(None, 0, [40, 40], 8, 1)  # no group: spanning asks none
    gang = sync.spanning(UnitProgress(epoch=1, step=1, partitions=4, epochs=3))
    assert gang.at(4, 5) == UnitProgress(epoch=1, step=2, partitions=4, epochs=3).at(9, 10)
    assert gang.at(1, 4) == UnitProgress(epoch=1, step=2, partitions=4, epochs=3).at(-1, 10)


# ---------------------------------------------------------------- k ranks on a cluster


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("parts", "clip"), [((0, 1), 0.3), ((0, 1, 2, 3), None)], ids=["width2-clipped", "width4"])
def test_gangs_repeat_to_the_bit_and_take_one_big_batch_a_step(four, parts, clip):
    workers = _workers(four)
    shards = _place(four, workers)
    spec = _spec(gradient_clip_val=clip)
    first, digests = _run_gang(four, shards, workers, parts, spec=spec)
    again, digests_again = _run_gang(four, shards, workers, parts, spec=spec)
    assert digests == digests_again  # run to run, every rank, every unit
    assert all(len(set(d)) == 1 for d in digests)  # every rank holds rank 0's weights
    assert _close(first["model"], _reference(parts, clip=clip))
    assert not _close(first["model"], _reference(parts, weighted=False, clip=clip))  # the test can tell
    if clip is not None:
        assert not _close(first["model"], _reference(parts))  # clipping changed the steps
    rows = sum(SIZES[p] for p in parts)
    assert first["progress"]["samples"] == rows and first["samples"] == rows
    assert first["steps"] == 2 * max(-(-SIZES[p] // (BATCH // len(parts))) for p in parts)


@pytest.mark.timeout(120)
def test_a_rank_whose_rows_run_out_steps_on_with_the_others(four):
    """Partitions 0 and 3 (44 and 20 rows, 8 a step): rank 1 runs out after 3 of 6 steps."""
    workers = _workers(four)
    shards = _place(four, workers)
    futures = _gang(four, shards, workers, (0, 3))
    state, summary = four.gather(futures)
    assert isinstance(summary, RankSummary) and (summary.rows, summary.steps) == (20, 6)
    assert summary.weights == weights_digest(state["model"])
    assert _close(state["model"], _reference((0, 3), epochs=1))
    assert state["samples"] == 64 and state["steps"] == 6


@pytest.mark.timeout(120)
def test_frozen_and_unreached_parameters_are_not_summed(four):
    """A frozen layer is not reduced (it stays out of the hopping state), and a parameter
    no rank's loss reaches keeps no gradient, as in a plain step: SGD keeps no momentum
    for it."""
    workers = _workers(four)
    shards = _place(four, workers)
    state, summary = four.gather(_gang(four, shards, workers, (0, 1), config={**CONFIG, "partly": True}))
    assert summary.weights == weights_digest(state["model"])
    assert sorted(state["model"]) == ["head.bias", "head.weight", "unused"]  # the frozen base does not hop
    x, y = _partitions()[0]
    plain = train_unit(_spec(), {**CONFIG, "partly": True}, None, TensorShard(x, y), seed=7, epoch=0, partition=0,
                       step=0, epoch_end=True, threads=1)
    assert len(state["optimizer"]["state"]) == 2  # the head's weight and bias
    assert state["optimizer"]["state"].keys() == plain["optimizer"]["state"].keys()


@pytest.mark.timeout(120)
def test_two_gangs_at_once_on_disjoint_workers(four):
    """Two models' gangs over workers 0, 1 and 3, 2 give alone and together the same
    bits; together, their ranks run at the same time (the task stream says)."""
    from distributed import get_task_stream

    workers = _workers(four)
    shards = _place(four, workers)
    a, b = CONFIG, {"lr": 0.02, "width": 16, "dropout": 0.0}
    alone = [*four.gather(_gang(four, shards, workers, (0, 1), config=a)),
             *four.gather(_gang(four, shards, workers, (3, 2), config=b))]
    slow_a, slow_b = {**a, "delay": 0.05}, {**b, "delay": 0.05}  # 6 steps: 0.3 s a unit at least
    with get_task_stream(four) as stream:
        together = four.gather([*_gang(four, shards, workers, (0, 1), config=slow_a),
                                *_gang(four, shards, workers, (3, 2), config=slow_b)])
    digests = [[weights_digest(r[0]["model"]), r[1].weights, weights_digest(r[2]["model"]), r[3].weights]
               for r in (alone, together)]
    assert digests[0] == digests[1]
    assert digests[0][0] == digests[0][1] != digests[0][2] == digests[0][3]
    spans = [(s["startstops"][-1]["start"], s["startstops"][-1]["stop"]) for s in stream.data
             if s["key"].startswith("cerebro-train-gang")]
    assert len(spans) == 4 and max(start for start, _ in spans) < min(stop for _, stop in spans)


# ---------------------------------------------------------------- failures


def _outcomes(client, futures, deadline: float) -> list[tuple[BaseException | None, float]]:
    """Each future's error (None: it finished) and the seconds it took to end, waiting
    at most until ``deadline``."""
    from distributed import wait

    started = time.monotonic()
    out: list = [None] * len(futures)
    pending = set(range(len(futures)))
    while pending and time.monotonic() < deadline:
        wait([futures[i] for i in pending], timeout=max(0.1, deadline - time.monotonic()), return_when="FIRST_COMPLETED")
        for i in [i for i in pending if futures[i].done()]:
            pending.discard(i)
            out[i] = (futures[i].exception(), time.monotonic() - started)
    assert not pending, f"ranks {sorted(pending)} did not end by the deadline"
    return out


def _runs_normally_on(client, workers, parts):
    """A gang over ``parts`` finishes, with every rank in agreement: the workers were freed."""
    shards = _place(client, workers)
    state, *summaries = client.gather(_gang(client, shards, workers, parts))
    assert all(s.weights == weights_digest(state["model"]) for s in summaries)


@pytest.mark.timeout(120)
def test_a_rank_that_raises_fails_its_peers_at_once(four):
    workers = _workers(four)
    shards = _place(four, workers, marked=1)
    futures = _gang(four, shards, workers, (0, 1), config={**CONFIG, "fault": "raise"}, timeouts=PATIENT)
    (peer, peer_s), (own, _) = _outcomes(four, futures, time.monotonic() + 80)
    assert isinstance(own, UnitError) and "injected fault" in str(own)
    assert isinstance(peer, GangError) and "closed its connection" in str(peer)
    assert peer_s < 20  # the failing rank closed its group: no wait for the timeout
    _runs_normally_on(four, workers, (0, 1))


@pytest.mark.timeout(120)
def test_a_hung_rank_fails_its_peers_at_the_collective_timeout(four):
    workers = _workers(four)
    shards = _place(four, workers, marked=3)
    short = GangTimeouts(rendezvous=30.0, collective=2.0)
    futures = _gang(four, shards, workers, (2, 3), config={**CONFIG, "fault": "hang"}, timeouts=short)
    (peer, peer_s), (hung, hung_s) = _outcomes(four, futures, time.monotonic() + 60)
    assert isinstance(peer, GangError) and "within the collective timeout of 2 s" in str(peer)
    assert peer_s < hung_s  # the peer did not wait for the hung rank
    assert isinstance(hung, GangError)  # woken, it finds its peer gone
    _runs_normally_on(four, workers, (2, 3))


@pytest.mark.timeout(60)
def test_a_rank_that_never_comes_fails_the_rendezvous():
    """Rank 0 of a gang of 2 alone, in this process: it fails within the rendezvous timeout."""
    plan = GangPlan((0, 1), "127.0.0.1", free_port(), GangTimeouts(rendezvous=2.0, collective=2.0))
    x, y = _partitions()[0]
    started = time.monotonic()
    with pytest.raises(GangError, match="did not meet its peers .* rendezvous timeout of 2 s"):
        train_gang_rank(_spec(), CONFIG, None, TensorShard(x, y), rank=0, plan=plan, local_host="127.0.0.1",
                        seed=7, epoch=0, step=0, epoch_end=True, threads=1)
    assert time.monotonic() - started < 10


def _waiting_rank(plan, rank, abandon_after: float | None):
    """Rank ``rank`` of ``plan``, in this thread: what it raised, and when (seconds)."""
    from cerebro_automl.training import abandon_when

    x, y = _partitions()[0]
    started = time.monotonic()
    check = (lambda: time.monotonic() > started + abandon_after) if abandon_after is not None else (lambda: False)
    try:
        with abandon_when(check):
            train_gang_rank(_spec(), CONFIG, None, TensorShard(x, y), rank=rank, plan=plan, local_host="127.0.0.1",
                            seed=7, epoch=0, step=0, epoch_end=True, threads=1)
    except Exception as err:  # noqa: BLE001: what it raised is the result
        return err, time.monotonic() - started
    return None, time.monotonic() - started


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [0, 1], ids=["host", "peer"])
def test_a_rank_waiting_for_its_peers_stops_when_its_unit_is_abandoned(rank):
    """Alone, with a rendezvous of 30 s: it stops within a poll of being abandoned, as a
    unit does after its batch, rather than hold its worker for the timeout."""
    from cerebro_automl.training import UnitAbandoned

    plan = GangPlan((0, 1), "127.0.0.1", free_port(), GangTimeouts(rendezvous=30.0))
    error, seconds = _waiting_rank(plan, rank, abandon_after=1.0)
    assert isinstance(error, UnitAbandoned) and 1.0 <= seconds < 5


@pytest.mark.timeout(60)
def test_a_rank_that_leaves_before_the_gang_meets_fails_its_waiting_peers_at_once():
    """Ranks 0 and 1 of 4 meet; ranks 2 and 3 never come; rank 1 is abandoned after 1 s: rank
    0 learns it from the store, and fails then, not at the 30 s timeout."""
    from concurrent.futures import ThreadPoolExecutor

    from cerebro_automl.training import UnitAbandoned

    plan = GangPlan((0, 1, 2, 3), "127.0.0.1", free_port(), GangTimeouts(rendezvous=30.0))
    with ThreadPoolExecutor(2) as pool:
        host = pool.submit(_waiting_rank, plan, 0, None)
        peer = pool.submit(_waiting_rank, plan, 1, 1.0)
        (host_error, host_s), (peer_error, _) = host.result(), peer.result()
    assert isinstance(peer_error, UnitAbandoned)
    assert isinstance(host_error, GangError) and "rank 1 left before they all had met" in str(host_error)
    assert host_s < 5


@pytest.mark.timeout(60)
def test_a_rank_stopped_as_the_last_peer_joins_goes_on_and_its_peers_fail_at_once():
    """Rank 1 of 3 is abandoned just after rank 2 has joined, before it reads the count:
    too late to leave (rank 2 is past waiting), it meets with the others, stops after
    its first batch and closes its group, and its peers fail then, not at the
    collective timeout (15 s)."""
    import datetime
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from cerebro_automl.training import UnitAbandoned, abandon_when

    plan = GangPlan((0, 1, 2), "127.0.0.1", free_port(), GangTimeouts(rendezvous=30.0, collective=15.0))
    x, y = _partitions()[0]
    spec = make_spec(model_fn=faulty_model_fn, optimizer_fn=sgd_fn, batch_size=12)

    def last_joined() -> bool:
        """Rank 1's check: False until ranks 0 and 1 have joined the store (rank 2 starts
        later); then, waiting in rank 1's loop, it holds rank 1 until rank 2 has joined,
        and says its unit is abandoned."""
        if not hasattr(last_joined, "store"):
            if not _listening_now(plan):
                return False
            last_joined.store = dist.TCPStore(plan.host, plan.port, 3, False, datetime.timedelta(seconds=10))
        if last_joined.store.add("joined", 0) < 2:
            return False
        while last_joined.store.add("joined", 0) < 3:
            time.sleep(0.01)
        return True

    def rank(r: int):
        started = time.monotonic()
        try:
            with abandon_when(last_joined if r == 1 else (lambda: False)):
                train_gang_rank(spec, CONFIG, None, TensorShard(x, y), rank=r, plan=plan, local_host="127.0.0.1",
                                seed=7, epoch=0, step=0, epoch_end=True, threads=1)
        except Exception as err:  # noqa: BLE001: what it raised is the result
            return err, time.monotonic() - started
        return None, time.monotonic() - started

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(rank, 0), pool.submit(rank, 1)]
        time.sleep(0.5)  # ranks 0 and 1 wait for rank 2
        futures.append(pool.submit(rank, 2))
        outcomes = [f.result() for f in futures]
    (host, host_s), (stopped, _), (last, last_s) = outcomes
    assert isinstance(stopped, UnitAbandoned), outcomes  # at its first check: no fault of its model
    assert isinstance(host, GangError) and isinstance(last, GangError), outcomes
    assert max(host_s, last_s) < 10, outcomes


def test_a_rank_leaves_only_before_all_have_met_and_never_moves_a_full_count():
    """Leaving sets the count below any the ranks can reach, in one step with reading
    it; once all have joined it changes nothing, so no other rank's leave can then
    undo the meeting the others are past."""
    import datetime

    import torch.distributed as dist

    from cerebro_automl.training.gang import _leave

    plan = GangPlan((0, 1, 2), "127.0.0.1", free_port())
    store = dist.TCPStore(plan.host, plan.port, 3, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    store.add("joined", 2)
    assert _leave(store, plan, rank=1) and store.add("joined", 0) == -2 and store.get("left") == b"1"
    store.add("joined", 1)  # a late rank joins: still no meeting
    assert store.add("joined", 0) < 3
    full = GangPlan((0, 1), "127.0.0.1", free_port())
    store = dist.TCPStore(full.host, full.port, 2, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    store.add("joined", 2)
    assert not _leave(store, full, rank=0) and not _leave(store, full, rank=1)
    assert store.add("joined", 0) == 2 and not store.check(["left"])


def _listening_now(plan) -> bool:
    import socket

    try:
        socket.create_connection((plan.host, plan.port), timeout=1.0).close()
    except OSError:
        return False
    return True


def test_requests_no_gang_can_carry_out_are_refused_before_the_ranks_meet():
    x, y = _partitions()[0]
    args = dict(seed=7, epoch=0, step=0, epoch_end=True, threads=1, local_host="127.0.0.1")
    plan = GangPlan((0, 1, 2), "127.0.0.1", free_port(), GangTimeouts(rendezvous=1.0))
    with pytest.raises(ValueError, match="batch size is 16, which a gang of 3 ranks cannot split"):
        train_gang_rank(_spec(), CONFIG, None, TensorShard(x, y), rank=0, plan=plan, **args)
    from cerebro_automl.fusion import Member, group_config

    group = group_config([Member(0, CONFIG, 1), Member(1, {**CONFIG, "lr": 0.1}, 2)])
    with pytest.raises(ValueError, match="fusion group .* cannot train as a gang unit"):
        train_gang_rank(_spec(), group, None, TensorShard(x, y), rank=0, plan=plan, **args)
    with pytest.raises(ValueError, match="distinct workers"):
        submit_gang(None, _spec(), CONFIG, None, [(0, "w"), (1, "w")], [None, None],
                    GangUnit(seed=7, epoch=0, step=0, epoch_end=True))


def _hold_until(name: str) -> None:
    """Hold this worker until the Dask event ``name`` is set (30 s at most)."""
    from distributed import Event

    Event(name).wait(timeout=30)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("queued", [1, 0], ids=["peer-queued", "host-queued"])
def test_a_stopped_gang_whose_rank_never_started_frees_its_workers_at_once(four, queued):
    """One rank queues behind another task on its worker, so the other waits for it. The
    executor stops the unit (rank 0 cancelled, and the other ranks with it):
    the waiting rank's worker is free within seconds, not at the 30 s rendezvous
    timeout, and the queued rank never runs."""
    from cerebro_automl.executors.dask.gang import GangRanks

    workers = _workers(four)
    shards = _place(four, workers)
    from distributed import Event

    release = Event(f"gang-test-{queued}", client=four)
    blocker = four.submit(_hold_until, release.name, workers=[workers[queued]], pure=False)
    futures = lead, peer = _gang(four, shards, workers, (0, 1))
    waiting = 1 - queued
    deadline = time.monotonic() + 20
    while not four.processing(workers=[workers[waiting]])[workers[waiting]] and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the waiting rank has started, and waits
    stopped = time.monotonic()
    ranks = GangRanks(cancel=lambda future: future.cancel())
    ranks.add(lead, [(peer, workers[1])])
    lead.cancel()
    ranks.stop([lead])
    four.submit(time.monotonic, workers=[workers[waiting]], pure=False).result(timeout=60)
    free_after = time.monotonic() - stopped
    release.set()
    blocker.result(timeout=30)
    assert free_after < 5, f"the waiting rank held its worker {free_after:.1f} s after the unit was stopped"
    assert all(f.cancelled() for f in futures)


@pytest.mark.timeout(120)
def test_a_killed_rank_fails_its_peers_and_frees_them(four):
    """Rank 1's worker process ends in the third batch; rank 0 fails with a peer error,
    its worker trains on; the nanny restarts the other (the last test of the module)."""
    workers = _workers(four)
    shards = _place(four, workers, marked=1)
    futures = _gang(four, shards, workers, (0, 1), config={**CONFIG, "fault": "exit"}, timeouts=PATIENT)
    [(peer, peer_s)] = _outcomes(four, futures[:1], time.monotonic() + 80)
    assert isinstance(peer, GangError) and "closed its connection" in str(peer)
    assert peer_s < 20  # its connections closed with its process: no wait for the timeout
    futures[1].cancel()  # pinned to a worker that is gone: it would wait for it forever
    restarted = [w for w in _workers(four) if w != workers[0]]
    _runs_normally_on(four, [workers[0], *restarted], (0, 1))
