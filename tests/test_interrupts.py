"""Ctrl-C at the worst moment: just after the Dask executor has taken finished units
off its pending list, before the engine hears of them. The interrupt reaches the
user, and the session, run again, loses nothing: every model finishes with the
weights of a run never interrupted."""

from __future__ import annotations

import os
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
