"""Gang units meeting faults through the front door: ``Session(gang=True)`` on a real
LocalCluster of 4 worker processes under nannies (a killed worker is restarted),
4 partitions, real torch training (gloo).

- A lone model trains in gangs of 4 for 3 epochs; in its second epoch the worker
  of one rank dies mid-unit (another rank's, or rank 0's: the one that holds the
  store the ranks meet at and returns the state). The gang unit runs again; the
  model ends with 3 epochs, finite weights, one history row an epoch.
- Of two models in gangs of 2, one's own code raises on rank 1: that model fails
  with its own error (not the peers' GangError), the other trains on to the end.

A rank knows who it is from its Dask task's key (``cerebro-train-<unit>[-r<rank>]-...``,
see :func:`cerebro_automl.executors.dask.gang.submit_gang`): the fault strikes one
rank of one epoch's gang unit, once (a marker directory) or every time.
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import time

import cloudpickle
import pytest
import torch
from torch import nn

from cerebro_automl import PartitionedDataset, Session
from cerebro_automl.protocol import Train, TrainGang

from conftest import make_arrays
from models import make_spec, model_fn

pytestmark = pytest.mark.cluster
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers get this module's model code by value

# epoch, first partition, rank (rank 0's key has no -r)
_RANK_TASK = re.compile(r"^cerebro-train-m\d+-e(\d+)-p(\d+)(?:-r(\d+))?-")


def _rank_and_epoch() -> tuple[int, int] | None:
    """The gang rank and 0-based epoch of the task this thread runs; None outside a
    training task (a unit whose key says nothing, an evaluation)."""
    from distributed import get_worker

    try:
        key = get_worker().get_current_task()
    except Exception:  # not on a worker, or not in a task
        return None
    match = _RANK_TASK.match(str(key))
    return None if match is None else (int(match.group(3) or 0), int(match.group(1)))


class Sabotaged(nn.Module):
    """``model_fn(config)``, except that in its third training batch of epoch
    ``config["epoch"]``'s unit on rank ``config["rank"]`` it ends its own process
    (``fault`` "kill": SIGKILL, once, keyed by the ``marker`` directory) or raises
    (``fault`` "raise": every time)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.net = model_fn(config)
        self.fault, self.rank, self.epoch, self.marker = (config["fault"], config["rank"], config["epoch"],
                                                          config.get("marker"))
        self.calls = 0  # rebuilt for every unit: counts this unit's training batches

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == 3 and _rank_and_epoch() == (self.rank, self.epoch):
                if self.fault == "raise":
                    raise RuntimeError(f"injected fault on rank {self.rank}")
                if self.fault == "kill":
                    try:
                        os.mkdir(self.marker)  # atomic: the first such batch kills, never a retry
                    except FileExistsError:
                        pass
                    else:
                        os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)


def sabotaged_model_fn(config):
    return Sabotaged(config) if config.get("fault") else model_fn(config)


@pytest.fixture(scope="module")
def four():
    """A client of a LocalCluster of 4 single-threaded worker processes, each under a nanny."""
    from distributed import Client

    from cerebro_automl.executors.dask import start_local_cluster

    with start_local_cluster(4) as local, Client(local) as client:
        client.wait_for_workers(4)
        yield client


@pytest.fixture
def client(four):
    """The module's client, with its 4 workers back (a test before may have killed one)."""
    four.wait_for_workers(4, timeout=60)
    deadline = time.monotonic() + 60
    while len(four.scheduler_info()["workers"]) != 4 and time.monotonic() < deadline:
        time.sleep(0.2)  # a killed worker may linger until the scheduler notices
    assert len(four.scheduler_info()["workers"]) == 4
    return four


@pytest.fixture(scope="module")
def data4():
    X, y, Xv, yv = make_arrays(rows=640, valid_rows=160)
    return PartitionedDataset.from_arrays(X, y, num_partitions=4, valid=(Xv, yv))


BASE = {"lr": 0.05, "width": 16, "dropout": 0.0}


def recorded(s: Session) -> list:
    """Record the Train and TrainGang commands ``s`` sends, in order."""
    sent: list = []
    execute = s.executor.execute

    def recording(ins):
        if isinstance(ins, Train | TrainGang):
            sent.append(ins)
        return execute(ins)

    s.executor.execute = recording
    return sent


def epochs_of(history, model_id: int) -> list[int]:
    return history[history["model_id"] == model_id]["epoch"].tolist()


# ------------------------------------------------- a rank's worker dies mid-unit
class DriverStalled(AssertionError):
    """The session recovered, but slower than a recovery should take."""


# A recovery takes a few seconds here (a lost unit, a worker restarted, its partition
# placed again); a driver that waited out Dask's 30 s connect timeout on the dead worker
# (a message to the lost rank's worker before it is known lost) would take 30 s more.
RECOVERY_SECONDS = 25.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [pytest.param(2, id="rank2"), pytest.param(0, id="rank0")])
def test_a_gang_whose_rank_loses_its_worker_runs_again_and_the_model_ends_its_epochs(client, data4, tmp_path,
                                                                                     rank):
    marker = str(tmp_path / "killed")
    config = {**BASE, "fault": "kill", "rank": rank, "epoch": 1, "marker": marker}
    pids_before = client.run(os.getpid)
    # no_worker_timeout: a session in which nothing can run again fails in 20 s, not at the test's timeout.
    with Session(make_spec(model_fn=sabotaged_model_fn), data4, client=client, seed=5, gang=True,
                 no_worker_timeout=20) as s:
        sent = recorded(s)
        model = s.add(config, epochs=3)
        started = time.monotonic()
        s.run()
        elapsed = time.monotonic() - started
        status, error = s.status(model), s.model(model).error
        handle = s.model(model)
        state = handle.state()["model"] if status == "paused" else None
        history = s.history

    assert os.path.isdir(marker), "the fault never struck: the test proves nothing"
    assert status == "paused", error
    assert state is not None
    assert handle.epochs == 3 and epochs_of(history, model) == [1, 2, 3], history
    assert history["val_loss"].notna().all()
    assert all(torch.isfinite(t).all() for t in state.values())

    gangs = [g for g in sent if isinstance(g, TrainGang)]
    # Epoch 0 (the first): one gang unit of 4, before the fault.
    assert [len(g.partitions) for g in gangs if g.epoch == 0][:1] == [4], sent
    # The lost unit: epoch 1's first gang of 4, whose rank `rank` ran on the worker that died.
    lost = next(g for g in gangs if g.epoch == 1)
    assert len(lost.partitions) == 4
    dead = lost.workers[rank]
    assert dead in pids_before and dead not in client.run(os.getpid), "the worker of that rank did not die"
    # After the loss, epochs 1 and 2 (and epoch 0 again, if the state after it died
    # with the worker) train every partition: in a gang again, or, while the
    # restarted worker is not back (3 workers cannot hold a gang of 4), in plain units.
    after = sent[sent.index(lost) + 1:]
    for epoch in (1, 2):
        trained = {p for ins in after if ins.epoch == epoch
                   for p in (ins.partitions if isinstance(ins, TrainGang) else (ins.partition,))}
        assert trained == {0, 1, 2, 3}, (epoch, sent)
    if elapsed > RECOVERY_SECONDS:  # last: every other check holds
        raise DriverStalled(f"the search took {elapsed:.0f} s with one lost worker (at most {RECOVERY_SECONDS:.0f} s)")


# --------------------------------------------------- a rank's own code raises
@pytest.mark.timeout(150)
def test_a_model_whose_code_raises_on_one_rank_fails_and_its_companion_trains_on(client, data4):
    faulty = {**BASE, "fault": "raise", "rank": 1, "epoch": 0}
    healthy = {"lr": 0.02, "width": 8, "dropout": 0.0}
    with Session(make_spec(model_fn=sabotaged_model_fn), data4, client=client, seed=5, gang=True) as s:
        sent = recorded(s)
        bad, good = s.add(faulty, epochs=3), s.add(healthy, epochs=3)
        s.run()
        statuses = s.status(bad), s.status(good)
        bad_error = s.model(bad).error
        good_handle = s.model(good)
        good_state = good_handle.state()["model"] if statuses[1] == "paused" else {}
        history = s.history

    # The faulty model's first unit was a gang of two: its rank 1 raised.
    first = next(ins for ins in sent if ins.model_id == bad)
    assert isinstance(first, TrainGang) and len(first.partitions) == 2, sent
    assert statuses == ("failed", "paused"), (bad_error, good_handle.error)
    assert bad_error is not None and "injected fault on rank 1" in bad_error and "RuntimeError" in bad_error, bad_error
    assert "GangError" not in bad_error.splitlines()[0], bad_error  # the cause, not its peer's symptom
    # Tried once: a user's error is not retried as a lost peer would be.
    assert [ins for ins in sent if ins.model_id == bad and ins.epoch == 0][1:] == [], sent
    assert epochs_of(history, good) == [1, 2, 3] and good_handle.epochs == 3
    assert history[history["model_id"] == good]["val_loss"].map(math.isfinite).all()
    assert all(torch.isfinite(t).all() for t in good_state.values())
    # Alone after the failure, the healthy model trained in gangs of 4.
    assert 4 in {len(g.partitions) for g in sent if isinstance(g, TrainGang) and g.model_id == good}, sent


# ------------------------------------------- a session closed mid gang unit
def slow_model_fn(config):
    from test_interrupts import slowed

    return slowed(sabotaged_model_fn(config), config.get("delay"))


@pytest.mark.timeout(120)
def test_a_session_interrupted_mid_gang_unit_frees_its_ranks_workers_at_once(client, data4):
    """Ctrl-C once a fast model's first gang unit ends, while a slow model's gang unit
    (1 s a batch, 10 s or more in all) runs on the other two workers: the session's
    close stops every rank after its batch, so the shared cluster is free at once."""
    from test_interrupts import run_until_interrupted, seconds_until_every_worker_runs

    fast, slow = BASE, {**BASE, "lr": 0.02, "delay": 1.0}
    with Session(make_spec(model_fn=slow_model_fn), data4, client=client, seed=5, gang=True, progress=False) as s:
        sent = recorded(s)
        s.add(fast, epochs=1)
        slow_id = s.add(slow, epochs=1)
        interrupted = run_until_interrupted(s)
    free_after = seconds_until_every_worker_runs(client, time.monotonic())
    slow_gangs = [g for g in sent if isinstance(g, TrainGang) and g.model_id == slow_id]
    assert slow_gangs and len(slow_gangs[0].partitions) > 1, sent  # the slow model's unit was a gang's
    assert interrupted < 8, f"the fast model's first unit took {interrupted:.1f} s: the test proves nothing"
    assert free_after < 5, f"the slow gang's ranks held their workers {free_after:.1f} s after the session closed"


class SlowWhereMarked(nn.Module):
    """``model_fn(config)``, sleeping ``config["delay"]`` seconds a training batch in the
    gang unit whose first partition the file ``config["marker"]`` names, once it does."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.net = model_fn(config)
        self.marker, self.delay = config["marker"], config["delay"]

    def forward(self, x):
        if self.training and os.path.exists(self.marker):
            from distributed import get_worker

            match = _RANK_TASK.match(str(get_worker().get_current_task()))
            with open(self.marker) as marked:
                if match and match.group(2) == marked.read():
                    time.sleep(self.delay)
        return self.net(x)


def slow_where_marked_model_fn(config):
    return SlowWhereMarked(config) if "marker" in config else model_fn(config)


@pytest.mark.timeout(120)
def test_a_model_stopped_mid_gang_unit_frees_its_ranks_workers_while_the_search_goes_on(client, data4, tmp_path):
    """Two models in gangs of 2 on 4 partitions: each epoch, each trains one half, then
    the other. The slow model's second gang unit runs at 1 s a batch (10 s in all); the
    fast model's epoch ends meanwhile, and a pruner stops the slow model then. Its ranks
    stop after their batch, so the search ends, and every worker is free, at once (10 s
    later when units do not see their task cancelled)."""
    from test_interrupts import seconds_until_every_worker_runs

    from cerebro_automl import EpochReport

    marker = str(tmp_path / "slow")
    fast, slow = BASE, {**BASE, "lr": 0.02, "delay": 1.0, "marker": marker}
    X, y, _, _ = make_arrays(rows=640)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=4)  # no validation, which every worker would hold
    with Session(make_spec(model_fn=slow_where_marked_model_fn), data, client=client, seed=5, gang=True,
                 progress=False) as s:  # fmt: skip
        fast_id = s.add(fast, epochs=1)
        slow_id = s.add(slow, epochs=1)
        slow_gangs: list[TrainGang] = []
        execute = s.executor.execute

        def marking(ins):  # the slow model's second gang unit is the slow one
            if isinstance(ins, TrainGang) and ins.model_id == slow_id:
                slow_gangs.append(ins)
                if len(slow_gangs) == 2:
                    with open(marker, "w") as marked:
                        marked.write(str(ins.partitions[0]))
            return execute(ins)

        s.executor.execute = marking
        stopped = None
        for report in s.reports():
            if isinstance(report, EpochReport) and report.model_id == fast_id:
                assert os.path.exists(marker), "the fast model's epoch ended before the slow unit began"
                s.stop(slow_id)
                stopped = time.monotonic()
        history = s.history
    assert stopped is not None
    free_after = seconds_until_every_worker_runs(client, stopped)
    assert len(slow_gangs) == 2 and all(len(g.partitions) == 2 for g in slow_gangs), slow_gangs
    assert epochs_of(history, fast_id) == [1] and epochs_of(history, slow_id) == []
    assert free_after < 5, f"the stopped gang's ranks held their workers {free_after:.1f} s (about 10 s unstopped)"
