"""Replicated partitions on real Dask clusters (``Session(replicas=r)``): the
weights of r = 1 whichever holder runs a unit, copies spread evenly, a slow
worker passed over, a stalled unit overtaken by a speculative copy or a
restart, a killed worker's partitions still served, and workers that join
mid-run taking units."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from distributed import Client, get_task_stream

from cerebro_automl import EpochReport, PartitionedDataset, Session
from cerebro_automl.executors.dask import start_local_cluster
from cerebro_automl.protocol import Discard, Train, UnitProgress

from conftest import cli_cluster, cli_env, local_reference, make_arrays, same_states
from models import CONFIGS, held_loader, make_spec, paced_model_fn, slow_reload_loader

pytestmark = pytest.mark.cluster

SPEC = make_spec(model_fn=paced_model_fn)


def _data(partitions: int, rows: int = 3000) -> PartitionedDataset:
    X, y, Xv, yv = make_arrays(rows=rows, valid_rows=300)
    return PartitionedDataset.from_arrays(X, y, num_partitions=partitions, valid=(Xv, yv))


def _reference(configs, epochs, data, seed=3) -> list[dict]:
    return local_reference(SPEC, data, configs, epochs, seed)


_same = same_states


def _train_tasks(stream: list[dict]) -> list[tuple[str, str]]:
    """``(unit, worker)`` of every train task that ran: the unit is the key without
    its session suffix (a speculative copy has the unit of the run it races)."""
    out = []
    for task in stream:
        key = str(task["key"])
        if key.startswith("cerebro-train-"):
            out.append(("-".join(key.split("-")[2:5]), task["worker"]))
    return out


def _copies(session: Session) -> dict[int, set[str]]:
    """Each partition's holders in the executor (the copies that loaded)."""
    held: dict[int, set[str]] = {}
    for p, w in session.executor._partitions:
        held.setdefault(p, set()).add(w)
    return held


@pytest.mark.timeout(300)
def test_two_replicas_keep_the_weights_of_one_and_spread_the_copies_and_the_units():
    data = _data(partitions=3)
    reference = _reference(CONFIGS, 3, data)
    with start_local_cluster(3) as cluster, Client(cluster) as client:
        with Session(SPEC, data, client=client, seed=3, replicas=2) as s:
            ids = [s.add(c, epochs=3) for c in CONFIGS]
            with get_task_stream(client) as stream:
                s.run()
            assert _same([s.model(i).state()["model"] for i in ids], reference)
            held = _copies(s)
            assert sorted(len(h) for h in held.values()) == [2, 2, 2]
            per_worker = Counter(w for h in held.values() for w in h)
            assert sorted(per_worker.values()) == [2, 2, 2]  # r * P / p each
            units = _train_tasks(stream.data)
            assert len(units) == len(CONFIGS) * 3 * 3  # no copies without speculate
            assert len({w for _, w in units}) == 3


def test_replicas_on_the_local_executor_keep_the_bits():
    data = _data(partitions=3, rows=900)
    reference = _reference(CONFIGS[:2], 2, data)
    with Session(SPEC, data, executor="local", n_workers=3, seed=3, replicas=2) as s:
        ids = [s.add(c, epochs=2) for c in CONFIGS[:2]]
        s.run()
        assert _same([s.model(i).state()["model"] for i in ids], reference)


def _stall_once_every_model_reports(session: Session, ids: list[int], folder: Path, epoch: int = 2) -> None:
    """Run the session; once every model has reported ``epoch``, the next training batch
    anywhere stalls 8 s (``PacedLinear``). By then each model has the median of its unit
    times (MIN_TIMINGS units) that a straggler is judged against: a model without one
    is never copied or restarted, so a stall in a model that lags would test nothing."""
    reported = set()
    for r in session.reports():
        if isinstance(r, EpochReport) and r.epoch == epoch:
            reported.add(r.model_id)
            if reported == set(ids):
                assert all(session.scheduler.times.typical(i) is not None for i in ids)
                (folder / "stall").touch()


@pytest.mark.timeout(300)
def test_a_slow_worker_is_passed_over_and_a_stalled_unit_is_overtaken(tmp_path):
    """One worker much slower on every batch, and one unit that stalls 8 s: with two
    replicas the fast workers take most units, and the stalled unit is copied onto
    an idle holder or, with none idle, restarted on the first holder to free up.
    The weights stay those of r = 1."""
    configs = [{"lr": lr, "width": w} for lr in (1e-3, 3e-3, 1e-2) for w in (8, 16)]
    data = _data(partitions=3, rows=1500)
    reference = _reference(configs, 4, data)
    fast = dict(cli_env(), CEREBRO_TEST_SLOW="0.001", CEREBRO_TEST_STALL=str(tmp_path))
    slow = dict(fast, CEREBRO_TEST_SLOW="0.03")
    with cli_cluster(tmp_path, [fast, fast, slow], ("--no-nanny",)) as address, Client(address) as client:
        client.wait_for_workers(3, timeout=60)
        slow_worker = next(w for w, env in client.run(lambda: os.environ["CEREBRO_TEST_SLOW"]).items()
                           if env == "0.03")
        with Session(SPEC, data, client=client, seed=3, replicas=2, speculate=True, progress=True) as s:
            ids = [s.add(c, epochs=4) for c in configs]
            with get_task_stream(client) as stream:
                _stall_once_every_model_reports(s, ids, tmp_path)
            assert [s.status(i) for i in ids] == ["paused"] * len(ids)
            assert _same([s.model(i).state()["model"] for i in ids], reference)
            assert s.scheduler.copies_started + s.scheduler.restarts >= 1, \
                "the stalled unit was neither copied nor restarted"
            # the bar counts the units the models keep, not the runs that lost or were discarded
            assert s._bar.n == s._bar.total == len(ids) * 4 * 3, (s._bar.n, s._bar.total)
        assert (tmp_path / "stalled").exists()
        by_worker = Counter(w for _, w in _train_tasks(stream.data))
        assert by_worker[slow_worker] < min(n for w, n in by_worker.items() if w != slow_worker), by_worker


def _record_progress(session: Session) -> list[tuple[UnitProgress, bool]]:
    """Each UnitProgress the scheduler is sent, and whether it started a speculative
    copy or restarted a unit after it, in order (filled as the session runs)."""
    handle, events = session.scheduler.handle, []

    def recording(event):
        out = handle(event)
        if isinstance(event, UnitProgress):
            acted = any(isinstance(i, Train) and i.copy or isinstance(i, Discard) and i.restart for i in out)
            events.append((event, acted))
        return out
    session.scheduler.handle = recording
    return events


@pytest.mark.timeout(300)
def test_workers_report_how_far_their_units_have_come_and_a_stall_shows_in_it(tmp_path):
    """Units of about 0.3 s on two workers: the scheduler asks how far its running
    units have come, and the workers answer with rates that fit the units' length; a
    unit stalled 8 s is copied or restarted. The weights stay those of r = 1."""
    configs = CONFIGS[:2]
    data = _data(partitions=2, rows=640)  # 10 batches of 32 per unit, 30 ms each
    reference = _reference(configs, 4, data)
    env = dict(cli_env(), CEREBRO_TEST_SLOW="0.03", CEREBRO_TEST_STALL=str(tmp_path))
    with cli_cluster(tmp_path, [env, env], ("--no-nanny",)) as address, Client(address) as client:
        client.wait_for_workers(2, timeout=60)
        with Session(SPEC, data, client=client, seed=3, replicas=2, speculate=True) as s:
            progress = _record_progress(s)
            ids = [s.add(c, epochs=4) for c in configs]
            _stall_once_every_model_reports(s, ids, tmp_path)
            assert [s.status(i) for i in ids] == ["paused"] * len(ids)
            assert _same([s.model(i).state()["model"] for i in ids], reference)
    assert (tmp_path / "stalled").exists()
    assert progress, "no unit's progress was reported"
    for e, _ in progress:
        assert 0 <= e.fraction <= 1 and e.seconds >= 0, e
        # ~0.3 s per unit on pace; one stalled 8 s past its share done (at most 4 s in
        # here) projects to at most 4 / 0.3 s.
        if e.fraction >= 0.3 and 0.1 <= e.seconds < 4:
            assert 0.1 < e.seconds / e.fraction < 14, e
    # The stall is spotted from progress when it begins early in its unit, by the clock
    # (1.5x the unit's time and 0.5 s past it) when it begins after the last ask: both act on it.
    assert s.scheduler.copies_started + s.scheduler.restarts >= 1, "the stalled unit was not acted on"


def _compute_spans(stream: list[dict], prefix: str) -> list[tuple[str, str, float, float]]:
    """``(key, worker, start, stop)`` of the tasks whose key starts with ``prefix``."""
    return [(str(t["key"]), t["worker"], ss["start"], ss["stop"])
            for t in stream if str(t["key"]).startswith(prefix)
            for ss in t["startstops"] if ss["action"] == "compute"]


@pytest.mark.timeout(300)
def test_a_killed_worker_leaves_its_partitions_served_by_their_other_holders(tmp_path):
    """SIGKILL one of 3 workers mid-epoch with r = 2; the two copies it held reload on the
    survivors, 4 s each, one survivor at a time. From the task stream: while they
    reload, units of the lost partitions train on their other holders."""
    data = PartitionedDataset.from_loader(functools.partial(slow_reload_loader, str(tmp_path)), 3)
    reference = _reference(CONFIGS, 3, data)
    env = dict(cli_env(), CEREBRO_TEST_SLOW="0.02")  # units of ~0.3 s: the run outlasts the reloads
    with cli_cluster(tmp_path, [env, env, env], ("--no-nanny",)) as address, Client(address) as client:
        client.wait_for_workers(3, timeout=60)
        pids = client.run(os.getpid)
        victim = sorted(pids)[0]
        with Session(SPEC, data, client=client, seed=3, replicas=2, progress=True) as s:
            ids = [s.add(c, epochs=3) for c in CONFIGS]
            killed_at: list[float] = []
            lost: list[int] = []

            def kill() -> None:
                (tmp_path / "slow").touch()
                killed_at.append(time.time())
                os.kill(pids[victim], signal.SIGKILL)

            with get_task_stream(client) as stream:
                for r in s.reports():
                    if isinstance(r, EpochReport) and not killed_at and not lost:
                        lost = [p for p in range(3) if victim in s.scheduler.holders(p)]
                        threading.Timer(0.5, kill).start()  # mid-epoch, not at an evaluation
            assert [s.status(i) for i in ids] == ["paused"] * len(ids)
            assert _same([s.model(i).state()["model"] for i in ids], reference)
            held = _copies(s)  # every partition back to two holders, on the survivors
            assert all(len(h) == 2 and victim not in h for h in held.values()), held
            # units the victim's death threw away (rolled back) are not counted twice
            assert s._bar.n == s._bar.total == len(ids) * 3 * 3, (s._bar.n, s._bar.total)
    assert len(lost) == 2
    reloads = {int(key.split("-")[2][1:]): (w, start, stop)
               for key, w, start, stop in _compute_spans(stream.data, "cerebro-place-") if start > killed_at[0]}
    assert sorted(reloads) == lost, reloads
    assert all(stop - start >= 3.5 for _, start, stop in reloads.values())  # slow storage
    (_, _, first_stop), (_, second_start, _) = sorted(reloads.values(), key=lambda r: r[1])
    assert second_start >= first_stop - 0.1  # one survivor loads at a time
    # Units of the lost partitions trained on their other holders while they reloaded
    # (with one replica none could: each would wait for its partition's reload).
    during = [int(key.split("-")[4][1:]) for key, _, a, _ in _compute_spans(stream.data, "cerebro-train-")
              if any(start <= a < stop for _, start, stop in reloads.values())]
    assert set(during) & set(lost), during


@pytest.mark.timeout(300)
def test_workers_that_join_mid_run_take_units():
    data = _data(partitions=4)
    reference = _reference(CONFIGS, 4, data)
    with start_local_cluster(2) as cluster, Client(cluster) as client:
        first = set(client.scheduler_info()["workers"])
        with Session(SPEC, data, client=client, seed=3, replicas=2) as s:
            ids = [s.add(c, epochs=4) for c in CONFIGS]
            with get_task_stream(client) as stream:
                grown = False
                for r in s.reports():
                    if isinstance(r, EpochReport) and not grown:
                        cluster.scale(4)
                        # started processes take seconds to import torch; the run must not end first
                        client.wait_for_workers(4, timeout=120)
                        grown = True
            assert _same([s.model(i).state()["model"] for i in ids], reference)
            joined = {w for _, w in _train_tasks(stream.data)} - first
            assert joined, "the workers that joined ran no unit"


@pytest.mark.timeout(300)
def test_a_worker_that_joins_while_the_partitions_load_gets_copies_once_they_are_held(tmp_path):
    """Two workers load every partition (replicas=2, P = 3); a third joins while all
    those loads still run, so no copy is held that it could take. Once they end it
    gets its share and trains."""
    data = PartitionedDataset.from_loader(functools.partial(held_loader, str(tmp_path)), 3)
    reference = _reference(CONFIGS, 2, data)
    hold = tmp_path / "hold"
    hold.touch()
    with start_local_cluster(2) as cluster, Client(cluster) as client:
        first = set(client.scheduler_info()["workers"])
        with Session(SPEC, data, client=client, seed=3, replicas=2) as s:
            ids = [s.add(c, epochs=2) for c in CONFIGS]
            cluster.scale(3)
            client.wait_for_workers(3, timeout=120)
            [newcomer] = set(client.scheduler_info()["workers"]) - first

            def release_once_seen() -> None:  # the loads end once the scheduler knows the newcomer
                deadline = time.time() + 120
                while newcomer not in s.scheduler.workers() and time.time() < deadline:
                    time.sleep(0.05)
                hold.unlink()

            releaser = threading.Thread(target=release_once_seen, daemon=True)
            releaser.start()
            with get_task_stream(client) as stream:
                s.run()
            releaser.join()
            assert _same([s.model(i).state()["model"] for i in ids], reference)
            assert newcomer in {w for held in _copies(s).values() for w in held}
            assert newcomer in {w for _, w in _train_tasks(stream.data)}, "the worker that joined ran no unit"
