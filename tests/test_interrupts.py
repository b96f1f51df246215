"""Ctrl-C at the worst moment: just after the Dask executor has taken finished units
off its pending list, before the engine hears of them. The interrupt reaches the
user, and the session, run again, loses nothing: every model finishes with the
weights of a run never interrupted."""

from __future__ import annotations

import os
import time
import signal

import pytest
import torch

from cerebro_automl import PartitionedDataset, Session
from cerebro_automl.session.interrupts import deferred

from conftest import make_arrays
from models import CONFIGS, make_spec


def _data():
    X, y, Xv, yv = make_arrays()
    return PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))


def _interrupt_after_first_completion(reporter) -> None:
    """SIGINT to this process right after the reporter turns the first finished unit
    into a completion (taken off its pending list, not yet returned)."""
    original = reporter._complete
    fired = []

    def complete(future, task):
        out = original(future, task)
        if task.kind == "train" and not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return out

    reporter._complete = complete


def slowed(model, delay: float | None):
    """``model``, sleeping ``delay`` seconds before each forward (each batch)."""
    if delay:
        model.register_forward_pre_hook(lambda module, args: time.sleep(delay))
    return model


def run_until_interrupted(session) -> float:
    """Ctrl-C once the session's first unit completes; the seconds ``run()`` took to stop."""
    _interrupt_after_first_completion(session.executor._reporter)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        session.run()
    return time.monotonic() - started


def seconds_until_every_worker_runs(client, since: float) -> float:
    """The seconds from ``since`` until each of ``client``'s workers has run a task of ours:
    how long a closed session's units held them."""
    workers = sorted(client.scheduler_info()["workers"])
    client.gather([client.submit(time.monotonic, workers=[w], pure=False) for w in workers])
    return time.monotonic() - since


@pytest.mark.cluster
def test_an_interrupt_while_completions_are_handed_over_loses_none():
    with Session(make_spec(), _data(), seed=3, n_workers=2, executor="local") as s:
        ids = [s.add(c, epochs=2) for c in CONFIGS]
        s.run()
        straight = {i: s.model(i).state()["model"] for i in ids}
    with Session(make_spec(), _data(), seed=3, n_workers=2, no_worker_timeout=20) as s:
        ids = [s.add(c, epochs=2) for c in CONFIGS]
        _interrupt_after_first_completion(s.executor._reporter)
        with pytest.raises(KeyboardInterrupt):
            s.run()
        s.run()  # fails with StalledError when the interrupt lost a completion
        assert all(s.status(i) == "paused" for i in ids)
        for i in ids:
            for name, tensor in s.model(i).state()["model"].items():
                assert torch.equal(tensor, straight[i][name]), (i, name)


def test_deferred_raises_the_interrupt_once_the_block_ends():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("after the signal")
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_leaves_a_deferred_block_at_once():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("after the first")
            os.kill(os.getpid(), signal.SIGINT)
            done.append("after the second")
    assert done == ["after the first"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_is_deferred_and_raised_as_terminated_while_a_session_holds_it():
    from cerebro_automl.session.interrupts import Terminated, terminate_as_interrupt

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (a session left open elsewhere holds it)
    restore = terminate_as_interrupt()
    try:
        done = []
        with pytest.raises(Terminated):
            with deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("after the signal")
        assert done == ["after the signal"]
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_handler_of_the_users_own_is_left_alone():
    from cerebro_automl.session.interrupts import terminate_as_interrupt

    mine = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: mine.append(signum))
    try:
        restore = terminate_as_interrupt()
        with deferred():
            os.kill(os.getpid(), signal.SIGTERM)
        restore()
        assert mine == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_that_came_during_a_failing_block_is_not_lost():
    from cerebro_automl.session.interrupts import Terminated, terminate_as_interrupt

    restore = terminate_as_interrupt()
    try:
        with pytest.raises(Terminated) as caught:
            with deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                raise ValueError("the block's own error")
        assert isinstance(caught.value.__context__, ValueError)
    finally:
        restore()



def _slow_model_fn(config):
    from models import model_fn

    return slowed(model_fn(config), config["delay"])


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_session_closed_mid_unit_frees_a_shared_clusters_workers_at_once():
    """Ctrl-C once a fast model's first unit ends: the slow model's unit in flight, 10
    batches of 1 s, is stopped after its batch as the session closes, rather than run
    to its end on a cluster that another session is about to use."""
    from distributed import Client

    from cerebro_automl.executors.dask import start_local_cluster

    X, y, Xv, yv = make_arrays(rows=640, valid_rows=64)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    fast, slow = {**CONFIGS[0], "delay": 0.0}, {**CONFIGS[0], "delay": 1.0}
    with start_local_cluster(2) as local, Client(local) as client:
        client.wait_for_workers(2)
        with Session(make_spec(model_fn=_slow_model_fn, batch_size=32), data, seed=3, client=client,
                     progress=False) as s:
            s.add(fast, epochs=1)
            s.add(slow, epochs=1)
            interrupted = run_until_interrupted(s)
        free_after = seconds_until_every_worker_runs(client, time.monotonic())
    assert interrupted < 5, f"the fast model's first unit took {interrupted:.1f} s: the test proves nothing"
    assert free_after < 5, f"the workers ran the closed session's unit on for {free_after:.1f} s (10 s if not stopped)"
