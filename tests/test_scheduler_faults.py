"""Pure tests of the scheduler's fault decisions (no Dask, no torch): work lost
with its worker counts against its model, cancellations are retried, failed
loads are retried then abort, lost states roll back, a resumed state's worker
is known. ``validate()`` runs after every step (the Driver does it)."""

from __future__ import annotations

import random

import pytest

from cerebro_automl.protocol import (Abort, BudgetExtended, Evaluate, EvaluationCancelled, EvaluationDone,
                                     Executing, ModelStatus, ModelsAdded, NewModel, PartitionLost,
                                     PartitionPlaced, Place, PlaceFailed, Rollback, StatesLost, Train,
                                     UnitCancelled, UnitDone, WorkerAdded, WorkerLost)
from cerebro_automl.engine import Scheduler

from test_scheduler import Driver, Flight, new_models


def _flights(d: Driver, kind: type, **match) -> list[Flight]:
    return [f for f in d.inflight if isinstance(f.ins, kind)
            and all(getattr(f.ins, k) == v for k, v in match.items())]


def _lose(d: Driver, worker: str, executing: Executing | None) -> list:
    """Driver.lose_worker, with what the worker was executing."""
    d.forget_worker(worker)
    return d.send(WorkerLost(worker, executing))


def _cancel(d: Driver, f: Flight, reason: str = "scheduler-connection-lost") -> list:
    """The executor saw the instruction's future cancelled."""
    d.inflight.remove(f)
    ins = f.ins
    if isinstance(ins, Train):
        d._unbusy(f)
        return d.send(UnitCancelled(ins.model_id, ins.partition, ins.worker, reason))
    if isinstance(ins, Evaluate):
        return d.send(EvaluationCancelled(ins.model_id, ins.epoch, reason))
    return d.send(PlaceFailed(ins.partition, ins.worker, f"cancelled ({reason})"))


# ------------------------------------------------------------ work that kills its worker
@pytest.mark.parametrize("retries", [0, 1, 3])
def test_a_model_whose_units_kill_their_worker_fails_alone_after_max_unit_retries(retries):
    """Each unit of model 0 kills its worker (a nanny brings a new one): after
    max_unit_retries + 1 deaths in a row it fails, saying so; the others finish."""
    d = Driver(3, 3, rng_seed=1)
    d.s.settings.max_unit_retries = retries
    d.start()
    d.send(new_models(2, n=4))
    spawned = iter(range(100))
    deaths = 0

    def kill_with_model_0(d: Driver) -> None:
        nonlocal deaths
        for f in _flights(d, Train, model_id=0):
            deaths += 1
            _lose(d, f.ins.worker, Executing(model_id=0))
            d.add_worker(f"n{next(spawned)}")

    d.run(hook=kill_with_model_0)
    assert deaths == retries + 1
    [fail] = d.fails
    assert fail.model_id == 0 and d.s.models[0].status is ModelStatus.FAILED
    assert fail.error.startswith("WorkerDied: its worker died each of the "
                                 f"{retries + 1} times in a row it ran this model's work")
    assert f"max_unit_retries={retries}" in fail.error
    for m in (1, 2, 3):
        d.check_completed(m, 2)


def test_the_work_executing_is_blamed_not_the_unit_sent_to_the_worker():
    """A worker dies while it executes model 1's evaluation; the train unit of model 0
    queued there is retried without counting against model 0."""
    d = Driver(2, 2)
    d.start()
    d.send(new_models(2, n=2))
    d.run_until(lambda d: bool(_flights(d, Train, model_id=0)))
    w = _flights(d, Train, model_id=0)[0].ins.worker
    _lose(d, w, Executing(model_id=1))
    assert d.s.models[0].retries == []
    assert d.s.models[1].retries == [f"worker {w} died while running it"]


def test_unknown_executing_blames_the_train_unit_sent_there():
    d = Driver(2, 2)
    d.start()
    d.send(new_models(2, n=2))
    d.run_until(lambda d: bool(_flights(d, Train, model_id=1)))
    w = _flights(d, Train, model_id=1)[0].ins.worker
    _lose(d, w, None)
    assert len(d.s.models[1].retries) == 1 and d.s.models[0].retries == []
    _lose(d, sorted(d.live)[0], Executing())  # known idle: nobody is blamed
    assert len(d.s.models[1].retries) == 1 and d.s.models[0].retries == []


@pytest.mark.parametrize("seed", range(20))
def test_losses_with_successes_between_them_never_fail_a_model(seed):
    """The count is of losses in a row: a model whose work is lost now and then,
    with completed units between, finishes (random kills of healthy workers)."""
    rng = random.Random(seed)
    d = Driver(3, 3, rng_seed=seed, order=rng.choice(("fixed", "dynamic")))
    d.s.settings.max_unit_retries = 1
    d.start()
    d.send(new_models(3, n=5))
    spawned = iter(range(1000))
    kills = 0

    def kill_now_and_then(d: Driver) -> None:
        nonlocal kills
        for f in _flights(d, Train):
            # a model whose last run was lost is spared until it completes some work
            if rng.random() < 0.05 and not d.s.models[f.ins.model_id].retries:
                kills += 1
                _lose(d, f.ins.worker, Executing(model_id=f.ins.model_id))
                d.add_worker(f"n{next(spawned)}")
                return

    d.run(hook=kill_now_and_then)
    assert kills and not d.fails
    for m in range(5):
        d.check_completed(m, 3)


# ----------------------------------------------------------------- cancellations
def test_a_cancelled_unit_runs_again_from_the_state_it_started_from():
    d = Driver(2, 2)
    d.start()
    d.send(new_models(1, n=1))
    d.run_until(lambda d: len(d.kept[0]) == 1 and bool(_flights(d, Train, model_id=0)))
    [f] = _flights(d, Train, model_id=0)
    out = _cancel(d, f)
    assert out == [f.ins]  # the same unit again, no rollback
    assert d.s.models[0].retries == [f"its unit on {f.ins.worker} was cancelled "
                                     "(scheduler-connection-lost)"]
    d.run()
    d.check_completed(0, 1)
    assert d.s.models[0].retries == []


def test_a_unit_cancelled_more_than_max_unit_retries_times_in_a_row_fails_its_model():
    d = Driver(2, 2)
    d.s.settings.max_unit_retries = 2
    d.start()
    d.send(new_models(1, n=2))
    for _ in range(3):
        d.run_until(lambda d: bool(_flights(d, Train, model_id=0)))
        _cancel(d, _flights(d, Train, model_id=0)[0], "user")
    [fail] = d.fails
    assert fail.model_id == 0 and "its work was lost 3 times in a row" in fail.error
    d.run()
    d.check_completed(1, 1)


def test_a_cancelled_evaluation_is_issued_again():
    d = Driver(2, 2)
    d.start()
    d.send(new_models(1, n=1))
    d.run_until(lambda d: bool(_flights(d, Evaluate)))
    [f] = _flights(d, Evaluate)
    assert _cancel(d, f) == [f.ins]
    [again] = _flights(d, Evaluate)
    assert _cancel(d, again) == [f.ins]
    assert len(d.s.models[0].retries) == 2
    d.run()
    d.check_completed(0, 1)


def test_a_partition_cancelled_on_a_live_worker_is_placed_again_and_evaluations_repeat():
    d = Driver(2, 2)
    d.start()
    d.send(new_models(1, n=1))
    d.run_until(lambda d: bool(_flights(d, Evaluate)))
    [w] = d.held[1]
    d.held[1].clear()
    out = d.send(PartitionLost(1, w))
    assert out == [Place(1, w)]
    [old] = _flights(d, Evaluate)
    d.inflight.remove(old)
    assert d.send(EvaluationCancelled(0, 1, "lost dependencies")) == []  # re-issued once placed
    assert d.send(PartitionLost(1, w)) == []  # stale: it is being placed
    [place] = _flights(d, Place)
    [again] = d.complete(place)
    assert (type(again), again.model_id, again.epoch) == (Evaluate, 0, 1)
    d.run()
    d.check_completed(0, 1)
    assert d.s.models[0].retries == []


@pytest.mark.parametrize("seed", range(60))
def test_random_cancellations_and_lost_partitions_still_complete(seed):
    """Units, evaluations and loads cancelled at random, partition data and states
    lost on live workers: every model completes exactly as in a quiet run."""
    rng = random.Random(seed)
    P, W, n = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 6)
    replicas = rng.randint(1, W)
    speculate = replicas > 1 and rng.random() < 0.5
    d = Driver(P, W, rng_seed=seed, order=rng.choice(("fixed", "dynamic")), checkpoint=True,
               replicas=replicas, speculate=speculate, timed=speculate)
    d.s.settings.max_unit_retries = 10**6
    d.s.settings.max_place_retries = 10**6
    d.start()
    d.send(new_models(2, n))

    def disturb(d: Driver) -> None:
        x = rng.random()
        if x < 0.05 and d.inflight:
            _cancel(d, rng.choice(d.inflight))
        elif x < 0.07 and any(d.held.values()):
            p, w = rng.choice(sorted((p, w) for p, ws in d.held.items() for w in ws))
            d.held[p].discard(w)
            d.send(PartitionLost(p, w))
            for f in _flights(d, Train, partition=p, worker=w) + \
                    [f for f in _flights(d, Evaluate) if f.ins.workers[p] == w]:
                _cancel(d, f, "lost dependencies")
        elif x < 0.09:
            m = rng.randrange(n)
            if m not in d.dead:
                d.send(StatesLost(m, newest=True, epochs=(1,) if rng.random() < 0.5 else ()))

    d.run(hook=disturb)
    assert not d.fails
    for m in range(n):
        d.check_completed(m, 2)


# ------------------------------------------------------------------ failed loads
def test_a_load_that_found_the_data_breaking_a_rule_aborts_at_once():
    d = Driver(2, 3)
    d.start()
    f = _flights(d, Place, partition=0)[0]
    d.inflight.remove(f)
    [abort] = d.send(PlaceFailed(0, f.ins.worker, "DataError: partition 0 validation: X is nan in row 3", lasting=True))
    assert isinstance(abort, Abort) and abort.error == (
        f"partition 0 failed to load, and would on every try: on {f.ins.worker}: DataError: partition 0 "
        "validation: X is nan in row 3")


def test_a_failed_load_is_retried_elsewhere_with_backoff_then_aborts():
    d = Driver(2, 3)
    d.s.settings.max_place_retries = 2
    out = d.start()
    f = _flights(d, Place, partition=0)[0]
    d.inflight.remove(f)
    out = d.send(PlaceFailed(0, f.ins.worker, "OSError: no such file"))
    [again] = out
    assert again.partition == 0 and again.worker != f.ins.worker and again.attempt == 1
    d.inflight.remove(_flights(d, Place, partition=0)[0])
    assert d.send(PlaceFailed(0, f.ins.worker, "stale")) == []  # not where it is being placed
    out = d.send(PlaceFailed(0, again.worker, "OSError: no such file"))
    assert [i.attempt for i in out] == [2]
    d.inflight.remove(_flights(d, Place, partition=0)[0])
    [abort] = d.send(PlaceFailed(0, out[0].worker, "OSError: no such file"))
    assert isinstance(abort, Abort) and abort.partition == 0
    assert abort.error.startswith("partition 0 failed to load 3 times in a row; the last time")
    assert abort.error.endswith("OSError: no such file")
    with pytest.raises(RuntimeError, match="stopped after an Abort: partition 0"):
        d.s.handle(WorkerAdded("late"))


def test_a_successful_load_resets_the_count():
    d = Driver(1, 2)
    d.s.settings.max_place_retries = 1
    d.start()
    for _ in range(3):
        [f] = _flights(d, Place, partition=0)
        d.inflight.remove(f)
        [again] = d.send(PlaceFailed(0, f.ins.worker, "flaky"))
        d.complete(_flights(d, Place, partition=0)[0])
        assert d.s.place_failures == {}
        d.held[0].discard(again.worker)
        d.send(PartitionLost(0, again.worker))
    assert not any(isinstance(i, Abort) for i in d.s.handle(WorkerAdded("w9")))


def test_a_worker_dying_while_it_loads_a_partition_counts_as_a_failed_load():
    d = Driver(1, 3)
    d.s.settings.max_place_retries = 1
    d.start()
    [f] = _flights(d, Place)
    out = _lose(d, f.ins.worker, Executing(partition=0))
    [again] = out
    assert again.attempt == 1 and d.s.place_failures[0][0].endswith(
        "died while loading it (out of memory? cache='disk' keeps a partition on the worker's disk, and more "
        "partitions make each smaller)")
    out = _lose(d, again.worker, Executing(partition=0))
    assert [type(i) for i in out] == [Abort]


# ----------------------------------------------------------------- lost states
def test_a_lost_newest_state_rolls_back_to_the_epoch_start():
    d = Driver(3, 3)
    d.start()
    d.send(new_models(2, n=1))
    d.run_until(lambda d: len(d.kept[0]) == 4)  # epoch 1 done, one unit into epoch 2
    assert Rollback(0, 1) in d.send(StatesLost(0, newest=True))
    d.run()
    d.check_completed(0, 2)


def test_lost_newest_and_epoch_start_states_replay_from_the_initial_weights():
    d = Driver(3, 3)
    d.start()
    d.send(new_models(2, n=1))
    d.run_until(lambda d: len(d.kept[0]) == 4)
    assert d.send(StatesLost(0, newest=False, epochs=(1,))) == []
    assert Rollback(0, 0) in d.send(StatesLost(0, newest=True))
    d.run()
    d.check_completed(0, 2)


def _resumed(d: Driver, state_worker: str | None) -> list:
    return d.send(ModelsAdded((NewModel(0, 3, start_epoch=2, state_worker=state_worker),)))


def test_a_resumed_state_lost_with_its_worker_rolls_back_to_the_drivers_copy():
    d = Driver(2, 2)
    d.start()
    d.lockstep_round()
    _resumed(d, "w1")
    assert d.s.models[0].state_worker == "w1"
    out = _lose(d, "w1", Executing())
    assert Rollback(0, 2, durable=True) in out
    d.run()
    assert [r.epoch for r in d.reports_of(0)] == [3]
    assert [u.epoch for u in d.kept[0]] == [2, 2]  # epoch 3 trained once, from the copy


def test_a_resumed_state_on_a_worker_the_scheduler_does_not_know_uses_the_drivers_copy():
    d = Driver(2, 2)
    d.start()
    assert _resumed(d, "gone") == [Rollback(0, 2, durable=True)]
    d.run()
    assert [r.epoch for r in d.reports_of(0)] == [3]


def test_a_resumed_model_whose_later_epoch_start_is_lost_replays_from_the_drivers_copy():
    d = Driver(2, 2)
    d.start()
    _resumed(d, "w0")
    d.send(ModelsAdded((NewModel(1, 1),)))
    d.run_until(lambda d: d.s.models[0].epochs_done == 3 and d.s.models[0].status is ModelStatus.PAUSED)
    d.send(BudgetExtended(0, 1))
    d.run_until(lambda d: len(_flights(d, Train, model_id=0)) == 1 and d.s.models[0].visited)
    out = d.send(StatesLost(0, newest=True, epochs=(3,)))
    assert Rollback(0, 2, durable=True) in out
    d.run()
    assert [r.epoch for r in d.reports_of(0)] == [3, 4]


# -------------------------------------------------------------- stalls, arguments
def test_waiting_for_names_why_nothing_runs():
    d = Driver(2, 1)
    d.start()
    d.send(new_models(1, n=1))
    assert d.s.waiting_for() is None
    _lose(d, "w0", None)
    assert d.s.waiting_for() == "no worker is alive"
    d.add_worker("w1")
    assert d.s.waiting_for() is None


@pytest.mark.parametrize("kwargs, text", [
    (dict(max_unit_retries=-1), "max_unit_retries is -1, but must be an int >= 0"),
    (dict(max_unit_retries=1.5), "max_unit_retries is 1.5"),
    (dict(max_place_retries=True), "max_place_retries is True"),
])
def test_bad_retry_limits_raise(kwargs, text):
    with pytest.raises(ValueError, match=text):
        Scheduler(2, **kwargs)


def test_events_of_the_fault_protocol_are_ignored_when_stale():
    d = Driver(2, 2)
    d.start()
    d.send(new_models(1, n=1))
    assert d.send(UnitCancelled(0, 0, "w0", "x")) == []          # no such unit in flight
    assert d.send(EvaluationCancelled(0, 1, "x")) == []          # not evaluating
    assert d.send(PartitionLost(0, "w9")) == []                  # not there
    d.run()
    assert d.send(StatesLost(0, newest=False, epochs=(1,))) == []
    assert d.s.models[0].status is ModelStatus.PAUSED
    assert PartitionPlaced and UnitDone and EvaluationDone  # the protocol's names stay importable
