"""reproducible=True: the same search (every trial's params, intermediate values,
value and state, and the best model's weights) whatever the worker count, the
executor, timing or faults."""

from __future__ import annotations

import hashlib

import optuna
import pytest
import torch

from cerebro_automl import Session
from cerebro_automl.adapters.canonical import CanonicalOrder
from cerebro_automl.adapters.optuna import optimize

from models import make_spec

TS = optuna.trial.TrialState


@pytest.fixture(autouse=True)
def quiet_optuna():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 3e-1, log=True),
            "width": trial.suggest_int("width", 4, 24)}


def _digest(states: list[dict]) -> str:
    h = hashlib.sha256()
    for state in states:
        for name, tensor in sorted(state.items()):
            h.update(name.encode())
            h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def optuna_search(data, reproducible=True, **session_kwargs):
    """The study's trials as plain values, and the best trial's weights' digest."""
    study = optuna.create_study(pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2))
    with Session(make_spec(), data, seed=5, **session_kwargs) as s:
        optimize(study, make_spec(), data, space, n_trials=14, epochs=4, metric="val_loss", session=s,
                 seed=5, reproducible=reproducible, parallelism=4)
        best = s.model(study.best_trial.number)  # in canonical order, model ids follow trial numbers
        assert best.name == f"trial-{study.best_trial.number}"
        weights = _digest([best.state()["model"]])
    trials = [(t.number, t.state.name, t.params, t.intermediate_values, t.value) for t in study.trials]
    return trials, weights


def test_optuna_study_is_the_same_on_1_and_3_local_workers_and_2_dask_workers(data, cluster):
    one = optuna_search(data, executor="local", n_workers=1)
    assert {state for _, state, *_ in one[0]} == {"COMPLETE", "PRUNED"}  # the pruner decided something
    assert optuna_search(data, executor="local", n_workers=3) == one
    assert optuna_search(data, client=cluster) == one


def test_without_reproducible_the_worker_count_changes_the_study(data):
    """The check above can fail: the same search without canonical order differs."""
    assert optuna_search(data, reproducible=False, executor="local", n_workers=1) != \
        optuna_search(data, reproducible=False, executor="local", n_workers=3)


def test_reproducible_refuses_a_timeout(data, spec):
    with pytest.raises(ValueError, match="timeout is 5 with reproducible=True"):
        optimize(optuna.create_study(), spec, data, space, n_trials=2, epochs=1, metric="val_loss",
                 timeout=5, reproducible=True, executor="local")


@pytest.mark.parametrize("tuner", ["optimize", "asha", "grid_search"])
def test_reproducible_refuses_dynamic_order_before_any_work(data, spec, tuner):
    from cerebro_automl.adapters.hyperband import asha
    from cerebro_automl.adapters.search import grid_search

    calls = {
        "optimize": lambda **kw: optimize(optuna.create_study(), spec, data, space, n_trials=2, epochs=1,
                                          metric="val_loss", **kw),
        "asha": lambda **kw: asha(spec, data, lambda rng: {"lr": 1e-2, "width": 8}, min_epochs=1, max_epochs=3, eta=3,
                                  max_trials=9, **kw),
        "grid_search": lambda **kw: grid_search(spec, data, {"lr": [1e-2], "width": [8]}, epochs=1, **kw),
    }
    with pytest.raises(ValueError, match="order is 'dynamic' with reproducible=True"):
        calls[tuner](reproducible=True, order="dynamic", executor="local")
    with Session(spec, data, executor="local", order="dynamic") as session:  # an open session's order too
        with pytest.raises(ValueError, match="order is 'dynamic' with reproducible=True"):
            calls[tuner](reproducible=True, session=session)
        assert session.history.empty


def test_canonical_order_holds_a_report_until_every_earlier_one_arrived():
    order = CanonicalOrder(epoch_of=lambda r: r[1], failed=lambda r: r[1] is None)
    order.started(0, budget=3)
    order.started(1, budget=1)
    order.arrived(0, (0, 1))
    assert order.release() is None  # model 1's epoch 1 is due at the same time
    order.arrived(1, (1, 1))
    assert order.release() is None  # its last epoch waits for its pause
    order.arrived(1, ("paused", 1), closing=True)
    assert order.release() == (1, [(0, 1), (1, 1), ("paused", 1)])
    order.started(2, budget=1)  # started at time 1: its epoch 1 is due at 2, with model 0's epoch 2
    order.arrived(2, (2, None))
    assert order.release() is None
    order.arrived(0, (0, 2))
    assert order.release() == (2, [(0, 2), (2, None)])
    order.ended(0)
    order.arrived(0, (0, 3))  # stopped: dropped
    assert order.release() is None and not order.waiting()


def asha_search(data, reproducible=True, **session_kwargs):
    from cerebro_automl.adapters.hyperband import asha

    def sampler(rng):
        return {"lr": float(10 ** rng.uniform(-3, -0.5)), "width": int(rng.integers(4, 24))}

    result = asha(make_spec(), data, sampler, min_epochs=1, max_epochs=4, eta=2, max_trials=12, parallelism=4,
                  seed=2, reproducible=reproducible, **session_kwargs)
    decisions = [(d.rung, d.epochs, sorted(d.values.items()), d.promoted) for d in result.decisions]
    return decisions, result.best_model_id, _digest([result.best_state["model"]])


def test_asha_promotions_are_the_same_on_1_and_3_local_workers_and_2_dask_workers(data, cluster):
    one = asha_search(data, executor="local", n_workers=1)
    assert len(one[0]) >= 3  # it promoted
    assert asha_search(data, executor="local", n_workers=3) == one
    assert asha_search(data, client=cluster) == one
    assert asha_search(data, reproducible=False, executor="local", n_workers=3) != one


def test_asha_in_cyclic_order_is_the_same_on_1_and_3_workers_and_other_than_in_fixed_order(data):
    one = asha_search(data, executor="local", n_workers=1, order="cyclic")
    assert asha_search(data, executor="local", n_workers=3, order="cyclic") == one
    # past its first epoch a model visits other partitions first: other weights
    assert asha_search(data, executor="local", n_workers=1)[2] != one[2]


def hyperopt_search(data, reproducible=True, **session_kwargs):
    hyperopt = pytest.importorskip("hyperopt")
    from cerebro_automl.adapters.hyperopt import MedianStoppingRule, fmin

    space = {"lr": hyperopt.hp.loguniform("lr", -7, -1), "width": hyperopt.hp.choice("width", [4, 8, 16, 24])}
    trials = hyperopt.Trials()
    fmin(make_spec(), data, space, algo=hyperopt.tpe.suggest, max_evals=12, epochs=3, trials=trials,
         parallelism=4, prune=MedianStoppingRule(), seed=4, reproducible=reproducible, **session_kwargs)
    return [(t["tid"], t["misc"]["vals"], t["result"].get("loss"), t["result"]["status"], t["result"].get("pruned"))
            for t in trials.trials]


def test_hyperopt_trials_are_the_same_on_1_and_3_local_workers_and_2_dask_workers(data, cluster):
    one = hyperopt_search(data, executor="local", n_workers=1)
    assert any(pruned for *_, pruned in one)  # the rule pruned something
    assert hyperopt_search(data, executor="local", n_workers=3) == one
    assert hyperopt_search(data, client=cluster) == one


def test_optuna_study_is_the_same_when_a_worker_is_killed_mid_search(data, tmp_path):
    import os
    import signal

    from distributed import Client

    from conftest import cli_cluster, cli_env

    reference = optuna_search(data, executor="local", n_workers=2)
    env = cli_env()
    with cli_cluster(tmp_path, [env, env], ("--no-nanny",)) as address, Client(address) as client:
        client.wait_for_workers(2, timeout=60)
        pids = list(client.run(os.getpid).values())
        killed = []

        def kill_once(study, trial):
            if len(study.trials) >= 6 and not killed:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(trial.number)

        study = optuna.create_study(pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2))
        with Session(make_spec(), data, seed=5, client=client) as s:
            optimize(study, make_spec(), data, space, n_trials=14, epochs=4, metric="val_loss", session=s,
                     seed=5, reproducible=True, parallelism=4, callbacks=[kill_once])
            weights = _digest([s.model(study.best_trial.number).state()["model"]])
            assert killed and len(s.workers()) == 1
    trials = [(t.number, t.state.name, t.params, t.intermediate_values, t.value) for t in study.trials]
    assert (trials, weights) == reference


def test_reproducible_refuses_an_unnamed_study_with_hyperband_pruning(data, spec):
    study = optuna.create_study(pruner=optuna.pruners.HyperbandPruner(min_resource=1, max_resource=2))
    with pytest.raises(ValueError, match="HyperbandPruner assigns trials to brackets by hashing the study's name"):
        optimize(study, spec, data, space, n_trials=2, epochs=2, metric="val_loss", reproducible=True,
                 executor="local")


def test_a_model_failing_mid_search_fails_at_the_same_point_of_the_canonical_order(data, cluster):
    from models import fails_later_model_fn

    spec = make_spec(model_fn=fails_later_model_fn)

    def failing_space(trial):
        return {"lr": trial.suggest_float("lr", 1e-3, 3e-1, log=True),
                "width": trial.suggest_categorical("width", [13, 8, 16])}

    def search(**session_kwargs):
        study = optuna.create_study(
            pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2))
        optimize(study, spec, data, failing_space, n_trials=12, epochs=3, metric="val_loss", seed=2,
                 reproducible=True, parallelism=4, **session_kwargs)
        return [(t.number, t.state.name, t.params, t.intermediate_values, t.value) for t in study.trials]

    one = search(executor="local", n_workers=1)
    assert any(state == "FAIL" and 1 in values for _, state, _, values, _ in one)  # failed in epoch 2
    assert search(executor="local", n_workers=3) == one
    assert search(client=cluster) == one


# ------------------------------------------------------------------ a killed driver resumes
def _study_rows(study):
    return [(t.number, t.state.name, t.params, t.intermediate_values, t.value) for t in study.trials]


def _kill_driver_at(folder, kill):
    """Run the resume driver in a process that SIGKILLs itself at ``kill``; the study it
    left behind."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import optuna_resume_driver as driver

    folder.mkdir()
    here = Path(__file__).parent
    proc = subprocess.run([sys.executable, str(here / "optuna_resume_driver.py"), str(folder), kill],
                          env=dict(os.environ, PYTHONPATH=str(here)), timeout=240)
    assert proc.returncode == -signal.SIGKILL, f"the driver was to die at {kill}, but exited with {proc.returncode}"
    return driver.open_study(folder)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    import optuna_resume_driver as driver

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return _study_rows(driver.run(tmp_path_factory.mktemp("uninterrupted")))


# Kill points (see optuna_resume_driver.py; the uninterrupted search prunes 9 of 12 trials):
#   pruner:11 - at logical time 4, after trial 4's prune was decided and before trial 6's:
#               trial 0's last epoch is in the study, not told
#   told:4    - at time 3, after trial 5 was pruned and before the fill asked trial 6
#   asked:9   - at time 5, trial 9 asked, its params not drawn
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kill, drop_checkpoints", [("pruner:11", False), ("told:4", True), ("asked:9", False)])
def test_a_killed_driver_resumes_to_the_same_study(uninterrupted, tmp_path, kill, drop_checkpoints):
    """SIGKILL the driver of a reproducible search mid-search, then optimize again with
    the same study, checkpoint_dir and reproducible=True (on 2 workers, where the driver
    had 1): every trial's number, state, params, intermediate values and value are those
    of the uninterrupted search. Without checkpoints, the trials left RUNNING train
    again from epoch 0 as the same trials."""
    import shutil

    import optuna_resume_driver as driver

    left = _kill_driver_at(tmp_path / "run", kill)
    running = [t for t in left.trials if t.state == TS.RUNNING]
    assert running and len(left.trials) < driver.N_TRIALS  # killed mid-search
    assert _study_rows(left) != uninterrupted
    if drop_checkpoints:
        shutil.rmtree(tmp_path / "run" / "checkpoints")
    resumed = driver.run(tmp_path / "run", n_workers=2)
    assert _study_rows(resumed) == uninterrupted


@pytest.mark.timeout(600)
def test_without_the_journal_a_resumed_study_differs(uninterrupted, tmp_path, monkeypatch):
    """The check above can fail: resumed as without reproducible=True (trials without a
    checkpoint failed and re-enqueued, a trial whose last epoch reached the study told at
    once, logical time from 0, prunes asked again), the study differs."""
    import optuna_resume_driver as driver

    from cerebro_automl.adapters.optuna import _OptunaRun

    _kill_driver_at(tmp_path / "run", "pruner:11")
    monkeypatch.setattr(_OptunaRun, "resume_in_order", _OptunaRun.resume_plain)
    assert _study_rows(driver.run(tmp_path / "run", n_workers=2)) != uninterrupted


def test_asha_and_hyperopt_decide_the_same_when_a_worker_is_killed_mid_search(data, tmp_path):
    import os
    import signal

    from distributed import Client

    from cerebro_automl.callbacks import Callback
    from conftest import cli_cluster, cli_env

    reference = (asha_search(data, executor="local", n_workers=2), hyperopt_search(data, executor="local"))
    env = cli_env()
    results = []
    for search in (asha_search, hyperopt_search):
        (tmp_path / search.__name__).mkdir()
        with cli_cluster(tmp_path / search.__name__, [env, env], ("--no-nanny",)) as address, \
                Client(address) as client:
            client.wait_for_workers(2, timeout=60)
            pid = next(iter(client.run(os.getpid).values()))

            class KillOnce(Callback):
                epochs = 0

                def on_epoch_end(self, view, report):
                    KillOnce.epochs += 1
                    if KillOnce.epochs == 8:
                        os.kill(pid, signal.SIGKILL)

            results.append(search(data, client=client, session_callbacks=[KillOnce()]))
            assert KillOnce.epochs > 8 and len(client.scheduler_info()["workers"]) == 1
    assert tuple(results) == reference
