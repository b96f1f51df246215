"""The Optuna adapter: real studies, samplers, pruners and storages."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
import torch

from cerebro_automl import Session
from cerebro_automl.adapters.optuna import optimize
from cerebro_automl.checkpoint import latest_checkpoint

from models import make_spec, slow_model_fn

TS = optuna.trial.TrialState


@pytest.fixture(autouse=True)
def quiet_optuna():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
            "width": trial.suggest_int("width", 4, 24)}


def _optimize(study, spec, data, **kw):
    args = dict(n_trials=10, epochs=4, metric="val_loss", executor="local", n_workers=2)
    args.update(kw)
    return optimize(study, spec, data, space, **args)


def _states(study):
    return Counter(t.state for t in study.trials)


def test_trials_report_every_epoch_and_complete(spec, data):
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
    _optimize(study, spec, data, n_trials=6, epochs=3)
    assert _states(study) == {TS.COMPLETE: 6}
    for t in study.trials:
        assert sorted(t.intermediate_values) == [1, 2, 3]
        assert t.value == t.intermediate_values[3]
        assert t.user_attrs["cerebro_config"] == t.params
        assert [h["epoch"] for h in t.user_attrs["cerebro_history"]] == [1, 2, 3]


def test_hopper_holds_parallelism_trials(spec, data):
    running = []

    class Probe(optuna.samplers.RandomSampler):
        def sample_independent(self, study, trial, name, distribution):
            running.append(len(study.get_trials(deepcopy=False, states=(TS.RUNNING,))))
            return super().sample_independent(study, trial, name, distribution)

    study = optuna.create_study(sampler=Probe(seed=0))
    _optimize(study, spec, data, n_trials=8, epochs=2, parallelism=3)
    assert max(running) == 3 and len(study.trials) == 8


@pytest.mark.parametrize("pruner", [
    optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
    optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
    optuna.pruners.HyperbandPruner(min_resource=1, max_resource=4, reduction_factor=2),
], ids=["median", "successive-halving", "hyperband"])
def test_pruning_happens_between_epochs_and_frees_slots(spec, data, pruner):
    # HyperbandPruner picks a trial's bracket from a hash of the study's name, and an
    # unnamed study gets a random one: name it, or the brackets change from run to run.
    study = optuna.create_study(study_name="pruning-frees-slots", pruner=pruner,
                                sampler=optuna.samplers.RandomSampler(seed=1))
    _optimize(study, spec, data, n_trials=12, epochs=4, parallelism=3)
    states = _states(study)
    assert states[TS.PRUNED] >= 1, states
    assert sum(states.values()) == 12  # every freed slot went to a new trial
    for t in study.trials:
        if t.state == TS.PRUNED:
            assert max(t.intermediate_values) < 4  # stopped between epochs, not at the end


def test_nop_pruner_prunes_nothing(spec, data):
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    _optimize(study, spec, data, n_trials=4, epochs=2)
    assert _states(study) == {TS.COMPLETE: 4}


@pytest.mark.parametrize("sampler", [
    optuna.samplers.TPESampler(seed=0), optuna.samplers.RandomSampler(seed=0),
    optuna.samplers.CmaEsSampler(seed=0),
    optuna.samplers.GridSampler({"lr": [1e-3, 1e-2], "width": [4, 8]}),
], ids=["tpe", "random", "cmaes", "grid"])
def test_any_sampler_drives_the_search(spec, data, sampler):
    study = optuna.create_study(sampler=sampler, direction="maximize")
    _optimize(study, spec, data, n_trials=4, epochs=1, metric="val_accuracy")
    assert _states(study) == {TS.COMPLETE: 4} and 0 <= study.best_value <= 1


def test_enqueued_trials_train_first(spec, data):
    study = optuna.create_study()
    study.enqueue_trial({"lr": 0.0123, "width": 7})
    _optimize(study, spec, data, n_trials=3, epochs=1)
    assert study.trials[0].params == {"lr": 0.0123, "width": 7}
    assert study.trials[0].state == TS.COMPLETE


def test_failed_trial_is_told_fail_with_the_error(data):
    def model_fn(config):
        if config["width"] == 5:
            raise RuntimeError("width 5 breaks the model")
        return torch.nn.Linear(8, 3)

    study = optuna.create_study(sampler=optuna.samplers.GridSampler({"lr": [1e-2], "width": [5, 6]}))
    _optimize(study, make_spec(model_fn=model_fn), data, n_trials=2, epochs=1)
    failed = [t for t in study.trials if t.state == TS.FAIL]
    assert len(failed) == 1 and "width 5 breaks the model" in failed[0].user_attrs["cerebro_error"]
    assert len([t for t in study.trials if t.state == TS.COMPLETE]) == 1


def test_unknown_metric_fails_before_any_trial(spec, data):
    study = optuna.create_study()
    with pytest.raises(ValueError, match="metric is 'val_f1'"):
        _optimize(study, spec, data, metric="val_f1")
    assert study.trials == []


def test_multi_objective_studies_are_refused(spec, data):
    study = optuna.create_study(directions=["minimize", "maximize"])
    with pytest.raises(ValueError, match="2 objectives"):
        _optimize(study, spec, data)


def test_hyperband_needs_explicit_resources(spec, data):
    study = optuna.create_study(pruner=optuna.pruners.HyperbandPruner())
    with pytest.raises(ValueError, match="min_resource and max_resource"):
        _optimize(study, spec, data)


def test_timeout_stops_new_trials_and_lets_running_ones_finish(spec, data):
    study = optuna.create_study()
    _optimize(study, spec, data, n_trials=1000, epochs=1, timeout=1.0, parallelism=2)
    assert 0 < len(study.trials) < 1000
    assert all(t.state == TS.COMPLETE for t in study.trials)


def test_callbacks_see_every_finished_trial(spec, data):
    seen = []
    study = optuna.create_study()
    _optimize(study, spec, data, n_trials=3, epochs=1, callbacks=[lambda s, t: seen.append(t.number)])
    assert sorted(seen) == [0, 1, 2]


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_persistent_storages_and_n_trials_across_calls(spec, data, tmp_path, kind):
    if kind == "sqlite":
        storage = f"sqlite:///{tmp_path / 'study.db'}"
    else:
        storage = optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(tmp_path / "journal.log")))
    study = optuna.create_study(study_name="s", storage=storage)
    _optimize(study, spec, data, n_trials=3, epochs=1)
    again = optuna.load_study(study_name="s", storage=storage)
    _optimize(again, spec, data, n_trials=5, epochs=1)  # 5 in all, not 3 + 5
    assert len(optuna.load_study(study_name="s", storage=storage).trials) == 5


def test_visualizations_render(spec, data):
    study = optuna.create_study(pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1))
    _optimize(study, spec, data, n_trials=6, epochs=3)
    for plot in (optuna.visualization.plot_intermediate_values,
                 optuna.visualization.plot_optimization_history):
        figure = plot(study)
        assert len(figure.data) >= 1 and figure.to_json()


def test_optimize_on_a_dask_cluster(spec, data, cluster):
    study = optuna.create_study(pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1))
    optimize(study, spec, data, space, n_trials=6, epochs=2, metric="val_loss", client=cluster)
    assert len(study.trials) == 6 and all(t.state in (TS.COMPLETE, TS.PRUNED) for t in study.trials)


def test_an_open_session_can_be_reused(spec, data):
    with Session(spec, data, executor="local") as s:
        result = optimize(optuna.create_study(), spec, data, space, n_trials=2, epochs=1,
                          metric="val_loss", session=s)
        assert len(s.history) == 2 and len(result.study.trials) == 2


def test_the_result_hands_back_the_best_trials_model(spec, data):
    study = optuna.create_study()
    result = optimize(study, spec, data, space, n_trials=3, epochs=2, metric="val_loss", executor="local")
    assert result.study is study and result.best_trial.number == study.best_trial.number
    model = result.best_model()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in result.best_state["model"].items())
    assert result.history.model_id.nunique() == 3
    # a resumed study whose best trial this call did not train: the result says so
    again = optimize(study, spec, data, space, n_trials=3, epochs=2, metric="val_loss", executor="local")
    with pytest.raises(ValueError, match="trained by an earlier call"):
        again.best_model()


def test_a_resumed_study_hands_back_the_best_model_an_earlier_call_trained(spec, data, tmp_path):
    """The best trial completed before this call: its model comes from its final checkpoint."""
    study, checkpoints = optuna.create_study(), str(tmp_path / "ck")
    for params in ({"lr": 0.05, "width": 16}, {"lr": 0.01, "width": 8}):
        study.enqueue_trial(params)
    first = optimize(study, spec, data, space, n_trials=2, epochs=2, metric="val_loss", executor="local",
                     checkpoint_dir=checkpoints)
    study.enqueue_trial({"lr": 1e-4, "width": 4})  # barely trains in 2 epochs: not the best
    again = optimize(study, spec, data, space, n_trials=1, epochs=2, metric="val_loss", executor="local",
                     checkpoint_dir=checkpoints)
    assert again.best_trial.number == first.best_trial.number and again.best_model_id is None
    assert again.best_config == first.best_config and again.best_seed == first.best_seed
    state = again.best_model().state_dict()
    assert all(torch.equal(state[k], v) for k, v in first.best_state["model"].items())
    # a checkpoint another run wrote under that name is refused, and the result says why
    study.enqueue_trial({"lr": 1e-4, "width": 4})
    elsewhere = optimize(study, spec, data, space, n_trials=1, epochs=2, metric="val_loss", executor="local",
                         checkpoint_dir=checkpoints, seed=1)
    with pytest.raises(ValueError, match=r"its checkpoint 'trial-\d+' after epoch 2 was written for config .* and "
                                         r"seed 0, not .* and 1"):
        elsewhere.best_model()


def _journal_study(path: Path) -> optuna.Study:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    return optuna.create_study(storage=storage, study_name="resume", load_if_exists=True)


def _left_running(study: optuna.Study, params: dict, config: dict, history: list[dict]) -> int:
    """A trial as a driver that died leaves it: RUNNING, with the attrs and epoch values
    the adapter writes (the config, the history, each epoch's value reported)."""
    study.enqueue_trial(params)
    trial = study.ask()
    assert space(trial) == params
    trial.set_user_attr("cerebro_config", config)
    trial.set_user_attr("cerebro_history", history)
    for h in history:
        trial.report(h["val_loss"], step=h["epoch"])
    return trial.number


def test_a_trial_whose_last_epoch_reached_the_study_is_completed_on_resume_without_training(spec, data, tmp_path):
    """The driver died between a trial's last report and its tell: on resume the trial
    is told COMPLETE with its last value, and nothing trains (it was failed and trained
    again from scratch, as if it had no checkpoint)."""
    study = _journal_study(tmp_path / "journal.log")
    params = {"lr": 0.01, "width": 8}
    number = _left_running(study, params, params, [{"epoch": 1, "val_loss": 0.5}, {"epoch": 2, "val_loss": 0.4}])
    with Session(spec, data, executor="local", n_workers=2, checkpoint_dir=str(tmp_path / "ck")) as s:
        optimize(study, spec, data, space, n_trials=1, epochs=2, metric="val_loss", session=s)
        assert len(s.history) == 0  # nothing trained
    [trial] = study.trials
    assert (trial.number, trial.state, trial.value) == (number, TS.COMPLETE, 0.4)


@pytest.mark.parametrize("epochs", [2, 3])
def test_a_trial_checkpointed_past_its_last_report_trains_the_unreported_epochs_again(
        spec, data, tmp_path, epochs):
    """The driver died after a trial's checkpoints were written but before its reports
    after epoch 1 reached the study: on resume it continues from epoch 1's checkpoint,
    reports every later step, and completes with the value an uninterrupted run gave.
    (With 2 epochs it was failed and re-enqueued, the checkpoint after the last epoch
    counting as none; with 3 it continued from epoch 2's, and step 2 never reached the
    study or its pruner.)"""
    checkpoints = str(tmp_path / "ck")
    whole = optuna.create_study()
    optimize(whole, spec, data, space, n_trials=1, epochs=epochs, metric="val_loss", executor="local",
             n_workers=2, checkpoint_dir=checkpoints)
    [done] = whole.trials
    assert latest_checkpoint(checkpoints, "trial-0")[1]["epoch"] == epochs
    study = _journal_study(tmp_path / "journal.log")
    _left_running(study, done.params, done.user_attrs["cerebro_config"], done.user_attrs["cerebro_history"][:1])
    with Session(spec, data, executor="local", n_workers=2, checkpoint_dir=checkpoints) as s:
        optimize(study, spec, data, space, n_trials=1, epochs=epochs, metric="val_loss", session=s)
        assert [row["epoch"] for row in s.history.to_dict("records")] == list(range(2, epochs + 1))
    [trial] = study.trials
    assert (trial.state, trial.value) == (TS.COMPLETE, done.value)
    assert trial.intermediate_values == done.intermediate_values


def test_a_study_interrupted_under_one_reproducible_setting_is_not_resumed_under_the_other(spec, data, tmp_path):
    """Its RUNNING trials resume by that setting's journal: under the other, a reproducible
    study's trials were failed, re-enqueued and trained again, and its best trial changed."""
    study = _journal_study(tmp_path / "journal.log")
    study.set_user_attr("cerebro_reproducible", True)
    params = {"lr": 0.01, "width": 8}
    _left_running(study, params, params, [{"epoch": 1, "val_loss": 0.5}])
    with Session(spec, data, executor="local", n_workers=2, checkpoint_dir=str(tmp_path / "ck")) as s:
        with pytest.raises(ValueError, match=r"the study's interrupted trials were run with reproducible=True, but "
                                             r"this call has reproducible=False"):
            optimize(study, spec, data, space, n_trials=2, epochs=1, metric="val_loss", session=s)
        assert len(s.history) == 0
    [trial] = study.trials
    assert trial.state == TS.RUNNING  # left for the call with the setting it was run with
    finished = optuna.create_study()
    finished.set_user_attr("cerebro_reproducible", True)  # nothing interrupted: the setting may change
    optimize(finished, spec, data, space, n_trials=1, epochs=1, metric="val_loss", executor="local")
    assert finished.user_attrs["cerebro_reproducible"] is False and finished.trials[0].state == TS.COMPLETE


def test_a_trial_is_not_resumed_from_a_checkpoint_another_run_left(spec, data, tmp_path):
    """The checkpoint_dir holds a trial-0 of another study, trained with other params:
    resuming this study's RUNNING trial 0 from it is refused with a clear error before
    anything trains (it continued silently with the other study's config and weights)."""
    checkpoints = str(tmp_path / "ck")
    other = optuna.create_study()
    optimize(other, spec, data, space, n_trials=1, epochs=3, metric="val_loss", executor="local",
             n_workers=2, checkpoint_dir=checkpoints)
    [theirs] = other.trials
    mine = {"lr": theirs.params["lr"], "width": 4 + (theirs.params["width"] - 3) % 21}  # another width
    study = _journal_study(tmp_path / "journal.log")
    _left_running(study, mine, mine, [{"epoch": 1, "val_loss": 0.5}])
    with Session(spec, data, executor="local", n_workers=2, checkpoint_dir=checkpoints) as s:
        with pytest.raises(ValueError, match=r"checkpoint 'trial-0' in .* \(after epoch 1\) was written "
                                             r"by another run .*'config'"):
            optimize(study, spec, data, space, n_trials=1, epochs=3, metric="val_loss", session=s)
        assert len(s.history) == 0


def _kill_driver_midway(folder: Path, driver) -> dict[int, dict]:
    """Run the driver in a process and SIGKILL it once two trials completed and a RUNNING
    one reported an epoch with its checkpoint on disk; the trials it left RUNNING, with
    their reported values."""
    folder.mkdir()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "optuna_driver.py"), str(folder)], env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            time.sleep(0.2)
            if not (folder / "journal.log").exists():
                continue
            trials = driver.open_study(folder).trials
            done = [t for t in trials if t.state == TS.COMPLETE]
            # midway: reported an epoch, and its checkpoint is on disk (a background thread
            # writes checkpoints, so a report can come first; the resume without one is
            # checked below too)
            midway = [t for t in trials if t.state == TS.RUNNING and t.intermediate_values
                      and latest_checkpoint(folder / "checkpoints", f"trial-{t.number}") is not None]
            if len(done) >= 2 and midway:
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    before = driver.open_study(folder).trials
    return {t.number: dict(t.intermediate_values) for t in before if t.state == TS.RUNNING}


@pytest.mark.timeout(300)
def test_a_killed_driver_resumes_from_checkpoints(tmp_path):
    """SIGKILL the driver mid-run; optimize again: RUNNING trials continue from their
    checkpoints or are failed and re-enqueued, and n_trials counts across both runs."""
    sys.path.insert(0, str(Path(__file__).parent))
    import optuna_driver as driver

    # The trial seen midway can complete between that look and the kill, leaving only
    # trials without a checkpoint: then the kill is tried again, in a fresh study.
    for attempt in range(3):
        folder = tmp_path / f"attempt-{attempt}"
        interrupted = _kill_driver_midway(folder, driver)
        assert interrupted, "the driver finished before it could be killed"
        checkpointed = {n for n, values in interrupted.items()
                        if values and latest_checkpoint(folder / "checkpoints", f"trial-{n}") is not None}
        if checkpointed:
            break
    else:
        pytest.fail(f"in 3 runs no trial left RUNNING had a checkpoint: {interrupted}")

    study = driver.run(folder)
    after = {t.number: t for t in study.trials}
    assert not [t for t in study.trials if t.state == TS.RUNNING]
    counted = [t for t in study.trials if not t.user_attrs.get("cerebro_interrupted")]
    assert len(counted) == driver.N_TRIALS  # no trial counted twice
    # A trial with a checkpoint continues (the median pruner may then prune it), never re-enqueued.
    assert all(after[n].state in (TS.COMPLETE, TS.PRUNED) for n in checkpointed), \
        [(n, interrupted[n], after[n].state.name) for n in checkpointed]
    resumed = [n for n in checkpointed if after[n].state == TS.COMPLETE]
    assert resumed or all(after[n].state == TS.PRUNED for n in checkpointed)
    for n in resumed:  # the values it had are kept, and the rest follow
        assert sorted(after[n].intermediate_values) == list(range(1, driver.EPOCHS + 1))
        for step, value in interrupted[n].items():
            assert after[n].intermediate_values[step] == value
    for n, values in interrupted.items():
        if after[n].state == TS.FAIL:
            assert after[n].user_attrs["cerebro_interrupted"]
            assert any(t.params == after[n].params and t.number > n for t in study.trials)
    # a resumed trial's result equals training it uninterrupted (same config and offset)
    for n in resumed[:1]:
        with Session(make_spec(model_fn=slow_model_fn), driver.data(), executor="local") as s:
            s.add(after[n].user_attrs["cerebro_config"], epochs=driver.EPOCHS,
                  offset=after[n].user_attrs["cerebro_offset"])
            h = s.run()
        assert h.val_loss.tolist() == [after[n].intermediate_values[e] for e in range(1, driver.EPOCHS + 1)]


def test_a_trial_left_running_before_its_model_was_added_is_failed_and_asked_again(data, tmp_path):
    """A driver killed between ask() and adding the trial's model leaves a RUNNING
    trial with no config. The next optimize fails it as interrupted and asks its
    params again, so the study ends with no trial RUNNING and none counted twice."""
    from cerebro_automl.adapters.optuna import ASKED_ATTR

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "j.log")))
    study = optuna.create_study(storage=storage, sampler=optuna.samplers.RandomSampler(seed=0))
    orphan = study.ask()
    orphan.set_user_attr(ASKED_ATTR, True)  # what the killed driver had done
    orphan.suggest_float("lr", 1e-3, 1e-1, log=True)
    _optimize(study, make_spec(), data, n_trials=3, epochs=1, checkpoint_dir=str(tmp_path / "ckpt"))
    states = Counter(t.state for t in study.trials)
    assert states[optuna.trial.TrialState.RUNNING] == 0
    assert study.trials[orphan.number].user_attrs.get("cerebro_interrupted")
    assert states[optuna.trial.TrialState.COMPLETE] + states[optuna.trial.TrialState.PRUNED] == 3
    lr = study.trials[orphan.number].params["lr"]
    assert any(t.params.get("lr") == lr for t in study.trials if t.number != orphan.number)  # asked again


def test_a_call_whose_n_trials_the_study_already_holds_says_so(spec, data, caplog):
    """n_trials counts the study's trials (so that the same call run again resumes): a
    second call with the same n_trials trains nothing, and the log says why."""
    study = optuna.create_study(study_name="counted")
    _optimize(study, spec, data, n_trials=2, epochs=1)
    with caplog.at_level("WARNING", logger="cerebro_automl"):
        _optimize(study, spec, data, n_trials=2, epochs=1)
    assert len(study.trials) == 2
    assert "study 'counted' already holds 2 trials and n_trials is 2" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="cerebro_automl"):
        _optimize(study, spec, data, n_trials=3, epochs=1)
    assert len(study.trials) == 3 and "already holds" not in caplog.text


class _CtrlCInAsk(optuna.samplers.TPESampler):
    """A real SIGINT that lands inside ``study.ask()``, once its trial exists in storage."""

    def __init__(self, at: int, **kw):
        super().__init__(**kw)
        self.at, self.sent = at, False

    def before_trial(self, study, trial):
        super().before_trial(study, trial)
        if trial.number == self.at and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)


def test_a_ctrl_c_inside_ask_leaves_no_trial_a_resume_cannot_claim(spec, data, tmp_path):
    """The interrupt waits until the trial is asked, marked and started, so the resume
    continues it, and with reproducible=True gives the study the uninterrupted one got."""
    def study_of(name, sampler):
        return optuna.create_study(storage=f"sqlite:///{tmp_path}/{name}.db", study_name="s", load_if_exists=True,
                                   sampler=sampler)

    def search(study, name):
        _optimize(study, spec, data, n_trials=5, epochs=2, parallelism=2, checkpoint_dir=str(tmp_path / name),
                  reproducible=True)
        return [(t.number, t.state, t.value, t.params) for t in study.trials]

    whole = search(study_of("whole", optuna.samplers.TPESampler(seed=0)), "whole")
    cut = study_of("cut", _CtrlCInAsk(at=3, seed=0))
    with pytest.raises(KeyboardInterrupt):
        search(cut, "cut")
    running = [t for t in cut.trials if t.state == TS.RUNNING]
    assert running and all(t.user_attrs.get("cerebro_asked") for t in running)
    assert search(study_of("cut", optuna.samplers.TPESampler(seed=0)), "cut") == whole


def test_a_search_space_changed_between_calls_on_one_study_is_named(spec, data, caplog):
    """Optuna lets a study's space change; the call says so, once per parameter, where
    before nothing told that one study now mixed two spaces."""
    def wider(trial):
        return {"lr": trial.suggest_float("lr", 1e-3, 1.0, log=True), "width": trial.suggest_int("width", 4, 24)}

    study = optuna.create_study()
    with caplog.at_level(logging.WARNING, logger="cerebro_automl"):
        optimize(study, spec, data, space, n_trials=2, epochs=1, metric="val_loss", executor="local")
        optimize(study, spec, data, space, n_trials=3, epochs=1, metric="val_loss", executor="local")
        assert "search space changed" not in caplog.text
        optimize(study, spec, data, wider, n_trials=5, epochs=1, metric="val_loss", executor="local")
    assert caplog.text.count("the search space changed") == 1, caplog.text
    assert "trial 3 asks 'lr' from FloatDistribution(high=1.0" in caplog.text


def test_a_range_that_depends_on_another_parameter_is_not_taken_for_a_changed_space(spec, data, caplog):
    """Define-by-run: a parameter's bounds follow another's, so its distribution differs
    from trial to trial within one space; that is not a change of space."""
    def nested(trial):
        lr = trial.suggest_float("lr", 1e-3, 1e-1, log=True)
        return {"lr": lr, "width": trial.suggest_int("width", 4, 4 + int(1000 * lr))}

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))  # first 3 widths: 3 ranges
    with caplog.at_level(logging.WARNING, logger="cerebro_automl"):
        optimize(study, spec, data, nested, n_trials=3, epochs=1, metric="val_loss", executor="local")
        optimize(study, spec, data, nested, n_trials=5, epochs=1, metric="val_loss", executor="local")
    assert len({str(t.distributions["width"]) for t in study.trials[:3]}) > 1
    assert "search space changed" not in caplog.text


def test_a_ctrl_c_while_a_batch_of_reports_is_handled_acts_after_its_tells(spec, data):
    """The pruner's answer reaches the storage before the Ctrl-C acts: it was raised
    inside the pruner (or a storage write), leaving the trial RUNNING though pruned."""
    class InterruptedPruner(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C now
            return True

    study = optuna.create_study(pruner=InterruptedPruner())
    with pytest.raises(KeyboardInterrupt):
        optimize(study, spec, data, space, n_trials=1, epochs=3, metric="val_loss", executor="local")
    [trial] = study.trials
    assert trial.state == TS.PRUNED and trial.intermediate_values == {1: trial.intermediate_values[1]}
