"""Workers die mid-run (SIGKILL, real processes): the run completes, every model
reaches its budget, and with order="fixed" the weights are bitwise those of a
fault-free run."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from distributed import Client

from cerebro_automl import EpochReport, PartitionedDataset, Session
from cerebro_automl.executors.dask import start_local_cluster

from conftest import cli_cluster, cli_env, make_arrays
from models import CONFIGS, make_spec

EPOCHS = 3
pytestmark = pytest.mark.cluster


def _data():
    X, y, Xv, yv = make_arrays(rows=6000, valid_rows=600)
    return PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))


def _fault_free():
    with Session(make_spec(), _data(), executor="local", seed=3) as s:
        ids = [s.add(c, epochs=EPOCHS) for c in CONFIGS]
        s.run()
        return [s.model(i).state()["model"] for i in ids]


def _run_and_kill(client: Client, victim_pid: int):
    """Run CONFIGS, SIGKILL ``victim_pid`` at the first epoch report; return the final
    states and the partitions each worker holds at the end (before the session closes)."""
    with Session(make_spec(), _data(), client=client, seed=3) as s:
        ids = [s.add(c, epochs=EPOCHS) for c in CONFIGS]
        killed = False
        for r in s.reports():
            if not killed and isinstance(r, EpochReport):
                os.kill(victim_pid, signal.SIGKILL)
                killed = True
        assert killed
        assert [s.status(i) for i in ids] == ["paused"] * len(ids)
        assert all(s.model(i).epochs == EPOCHS for i in ids)
        return [s.model(i).state()["model"] for i in ids], _placed_partitions(client)


def _same(a, b) -> bool:
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def _placed_partitions(client: Client) -> dict[str, int]:
    def count(dask_worker):
        return sum(1 for key in dask_worker.data if str(key).startswith("cerebro-place-"))
    return client.run(count)


@pytest.mark.timeout(240)
def test_a_local_cluster_worker_killed_mid_run_is_restarted_and_nothing_is_lost():
    reference = _fault_free()
    with start_local_cluster(2) as cluster, Client(cluster) as client:
        victim_address, victim_pid = sorted(client.run(os.getpid).items())[1]
        states, _ = _run_and_kill(client, victim_pid)
        client.wait_for_workers(2, timeout=60)  # the nanny brought a new worker
        assert victim_address not in client.scheduler_info()["workers"]
    assert _same(states, reference)


@pytest.mark.timeout(240)
def test_a_no_nanny_worker_killed_for_good_leaves_the_run_to_the_survivor(tmp_path):
    reference = _fault_free()
    env = cli_env()
    with cli_cluster(tmp_path, [env, env], ("--no-nanny",)) as address, Client(address) as client:
        client.wait_for_workers(2, timeout=60)
        pids = client.run(os.getpid)
        victim_address = sorted(pids)[1]
        with_victim, placed = _run_and_kill(client, pids[victim_address])
        survivors = list(client.scheduler_info()["workers"])
        assert survivors == [sorted(pids)[0]]
        # the survivor reloaded the dead worker's partition from its source
        assert placed == {survivors[0]: 2}
    assert _same(with_victim, reference)


def _slow_model(config):
    import time as _time

    class Slow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 3)

        def forward(self, x):
            if config["width"] == 13:
                _time.sleep(0.5)  # every batch: a unit far past the timeout
            return self.layer(x)
    return Slow()


@pytest.mark.timeout(240)
def test_a_unit_past_unit_timeout_fails_only_its_model():
    configs = [{"lr": 1e-2, "width": 13}, {"lr": 1e-2, "width": 8}, {"lr": 1e-3, "width": 8}]
    with start_local_cluster(2) as local, Client(local) as client:
        with Session(make_spec(model_fn=_slow_model), _data(), client=client, unit_timeout=8) as s:
            ids = [s.add(c, epochs=2) for c in configs]
            s.run()
            assert s.status(ids[0]) == "failed"
            assert s.model(ids[0]).error.startswith("UnitTimeout: the unit ran") and "past its unit_timeout" in s.model(ids[0]).error
            assert [s.status(i) for i in ids[1:]] == ["paused", "paused"]
            assert all(s.model(i).epochs == 2 for i in ids[1:])
    with Session(make_spec(model_fn=_slow_model), _data(), executor="local", unit_timeout=3) as s:
        ids = [s.add(c, epochs=1) for c in configs]
        s.run()
        assert [s.status(i) for i in ids] == ["failed", "paused", "paused"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_2000_tiny_models_run_to_the_end_with_bounded_driver_memory_and_no_keys_left():
    import psutil

    X, y, Xv, yv = make_arrays(rows=200, valid_rows=100)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    configs = [{"lr": 1e-3 * (1 + i % 10), "width": 4 + i % 7, "dropout": i / 20000} for i in range(2000)]
    process = psutil.Process()
    with start_local_cluster(2) as cluster, Client(cluster) as client:
        with Session(make_spec(batch_size=100), data, client=client) as s:
            before = process.memory_info().rss
            ids = [s.add(c, epochs=3) for c in configs]
            history = s.run()
            growth = process.memory_info().rss - before
            assert len(history) == 2000 * 3
            assert all(s.status(i) == "paused" and s.model(i).epochs == 3 for i in ids)
            # states stay on the workers: the driver holds futures, not tensors
            assert not any(isinstance(r.current, dict) for r in s.executor.states.records().values())
        print(f"driver RSS growth for 2000 models: {growth / 2**20:.0f} MB")
        assert growth < 400 * 2**20  # the in-process Dask scheduler's bookkeeping included
        deadline = time.time() + 30
        while time.time() < deadline and client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)):
            time.sleep(0.5)  # released keys are forgotten asynchronously
        assert client.run_on_scheduler(lambda dask_scheduler: sorted(map(str, dask_scheduler.tasks))) == []


def test_work_sent_to_a_worker_already_seen_lost_is_reported_back_not_sent(cluster):
    # One poll can return completions followed by the WorkerLost they preceded. The
    # session hands them to the scheduler in that order, so a completion handled first
    # may send a Train (or an Evaluate reading every partition) to the worker the
    # executor has already forgotten. Such work is not submitted (it would wait for the
    # worker forever); the next poll reports how it ended, and a scheduler that has
    # seen the WorkerLost by then finds each report stale.
    from cerebro_automl.executors.dask import DaskExecutor
    from cerebro_automl.protocol import (Evaluate, PartitionLost, PartitionPlaced, Place, PlaceFailed, Train,
                                         UnitCancelled, WorkerLost)
    from cerebro_automl.engine import Scheduler

    executor = DaskExecutor(cluster)
    try:
        executor.bind(make_spec(), _data().resolve(2), threads=1)
        workers = executor.workers()
        for p, w in enumerate(workers):
            executor.execute(Place(p, w))
        deadline = time.monotonic() + 60
        while executor.busy() and time.monotonic() < deadline:
            executor.poll(1.0)
        assert not executor.busy()
        executor.add_model(0, CONFIGS[0], seed=1)

        [lost] = executor._reporter.lose(workers[1])  # what a poll does when it sees the loss
        assert type(lost.event).__name__ == "WorkerLost"
        executor.execute(Train(0, 1, workers[1], epoch=0, step=0, epoch_end=False))
        executor.execute(Evaluate(0, 0, tuple(workers)))
        executor.execute(Place(1, workers[1]))
        assert executor.states.record(0).current is None and not executor._pending
        reported = [c.event for c in executor.poll(0.1)]
        gone = f"its worker {workers[1]} was lost"
        assert reported == [UnitCancelled(0, 1, workers[1], gone), PartitionLost(1, workers[1]),
                            PlaceFailed(1, workers[1], gone)]
        # A scheduler told of the loss first decides that each of them is stale.
        scheduler = Scheduler(2, workers)
        scheduler.start()
        for p, w in enumerate(workers):
            scheduler.handle(PartitionPlaced(p, w))
        scheduler.handle(WorkerLost(workers[1]))
        assert [scheduler.handle(e) for e in reported] == [[], [], []]
        scheduler.validate()

        executor.execute(Train(0, 0, workers[0], epoch=0, step=0, epoch_end=False))  # live: runs
        assert executor.busy()
        deadline = time.monotonic() + 60
        done = []
        while executor.busy() and time.monotonic() < deadline:
            done += executor.poll(1.0)
        # The worker was only declared lost: the executor sees it again, and work flows.
        names = [type(c.event).__name__ for c in done]
        if "WorkerAdded" not in names:  # seen only by a poll that found nothing finished
            names += [type(c.event).__name__ for c in executor.poll(0.1)]
        assert sorted(names) == ["UnitDone", "WorkerAdded"]
        executor.execute(Place(1, workers[1]))
        assert executor.busy()
    finally:
        executor.close()
