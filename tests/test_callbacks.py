"""Lifecycle callbacks on real sessions: the hooks, a raising callback, every tuner."""

from __future__ import annotations

import logging
import re

import numpy as np
import optuna
import pytest

from cerebro_automl import EpochReport, ModelFailed, ModelPaused, Session
from cerebro_automl.adapters.hyperband import asha, hyperband, successive_halving
from cerebro_automl.adapters.hyperopt import fmin
from cerebro_automl.adapters.optuna import optimize
from cerebro_automl.adapters.pbt import pbt
from cerebro_automl.adapters.search import grid_search, random_search
from cerebro_automl.callbacks import Callback, TensorBoard
from cerebro_automl.progress import model_counts
from cerebro_automl.reports import SessionView

LOCAL = dict(executor="local", n_workers=2)
BAD = {"lr": "not-a-number", "width": 8}  # fails in the optimizer: that model only


class Recorder(Callback):
    """Keeps every hook call, as (hook, model id or None, detail)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_session_start(self, view):
        self.calls.append(("start", None, view.num_workers))

    def on_model_added(self, view, model_id):
        self.calls.append(("added", model_id, view.model(model_id).config))

    def on_epoch_end(self, view, report):
        assert isinstance(report, EpochReport)
        self.calls.append(("epoch", report.model_id, (report.epoch, dict(report.metrics))))

    def on_model_paused(self, view, report):
        assert isinstance(report, ModelPaused)
        self.calls.append(("paused", report.model_id, report.epochs))

    def on_model_stopped(self, view, model_id):
        self.calls.append(("stopped", model_id, view.status(model_id)))

    def on_model_failed(self, view, report):
        assert isinstance(report, ModelFailed)
        self.calls.append(("failed", report.model_id, report.error.splitlines()[0]))

    def on_exception(self, view, error):
        self.calls.append(("exception", None, repr(error)))

    def on_session_end(self, view):
        self.calls.append(("end", None, dict(model_counts(view.statuses().values()))))

    def of(self, hook: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == hook]


class Broken(Callback):
    """Raises in every hook: it must be called once, reported and dropped."""

    def __init__(self) -> None:
        self.called = 0

    def _raise(self, *args):
        self.called += 1
        raise ValueError("broken callback")

    on_model_added = on_epoch_end = on_model_paused = on_session_end = _raise


def _metrics(history):
    """The history without wall-clock columns: what must not change."""
    drop = [c for c in history.columns if c.endswith("seconds")]
    return history.drop(columns=drop).sort_values(["model_id", "epoch"]).reset_index(drop=True)


def test_hooks_follow_the_session_in_order(spec, data):
    rec = Recorder()
    with Session(spec, data, callbacks=[rec], **LOCAL) as s:
        a = s.add({"lr": 0.01, "width": 8}, epochs=2)
        b = s.add({"lr": 0.05, "width": 8}, epochs=1)
        bad = s.add(BAD, epochs=2)
        for r in s.reports():
            if isinstance(r, ModelPaused) and r.model_id == b and r.epochs == 1:
                s.extend(b, 1)  # paused, then resumed: its epochs go on from 2
            elif isinstance(r, EpochReport) and r.model_id == a and r.epoch == 1:
                s.stop(a)
        history = s.history
    assert rec.calls[0] == ("start", None, 2)
    assert rec.of("added") == [("added", a, {"lr": 0.01, "width": 8}),
                               ("added", b, {"lr": 0.05, "width": 8}), ("added", bad, BAD)]
    epochs = [(m, e) for _, m, (e, _) in rec.of("epoch")]
    rows = history[history["error"].isna()] if "error" in history else history
    assert sorted(epochs) == sorted(zip(rows["model_id"], rows["epoch"]))
    for _, m, (e, metrics) in rec.of("epoch"):  # each report's metrics are the history's
        row = history[(history.model_id == m) & (history.epoch == e)].iloc[0]
        assert metrics == {k: row[k] for k in metrics}
    assert rec.of("paused") == [("paused", b, 1), ("paused", b, 2)]
    assert rec.of("stopped") == [("stopped", a, "stopped")]
    assert rec.of("failed") == [("failed", bad, "TypeError: '<=' not supported between instances "
                                                "of 'float' and 'str'")]
    assert rec.calls[-1] == ("end", None, {"running": 0, "paused": 1, "stopped": 1, "failed": 1})
    assert not rec.of("exception")
    # an epoch's hook comes before that model's pause, each pause after its last epoch
    order = [(h, m) for h, m, _ in rec.calls]
    assert order.index(("paused", b)) > order.index(("epoch", b))


def test_a_raising_callback_is_reported_disabled_and_changes_no_result(spec, data, caplog):
    """The issue's promise: a broken callback never stops training nor changes results."""
    space = {"lr": [0.01, 0.05, "not-a-number"], "width": [8, 16]}
    plain = grid_search(spec, data, space, epochs=2, metric="val_accuracy", mode="max", seed=3, **LOCAL)
    broken, rec = Broken(), Recorder()
    caplog.set_level(logging.ERROR, logger="cerebro_automl")
    result = grid_search(spec, data, space, epochs=2, metric="val_accuracy", mode="max", seed=3,
                         session_callbacks=[broken, rec], **LOCAL)
    assert broken.called == 1  # on_model_added of the first model, then never again
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert errors[0].getMessage() == ("callback Broken raised in on_model_added and is disabled for "
                                      "the rest of the session; training goes on")
    assert errors[0].exc_info[0] is ValueError and "broken callback" in caplog.text  # traceback kept
    assert "Traceback (most recent call last)" in caplog.text
    # the callback after it saw everything, and the results are the same bits
    assert len(rec.of("added")) == 6 and rec.calls[-1][0] == "end"
    assert _metrics(result.history).equals(_metrics(plain.history))
    assert (result.best_model_id, result.best_value) == (plain.best_model_id, plain.best_value)
    for key in result.best_state["model"]:
        assert result.best_state["model"][key].equal(plain.best_state["model"][key])


def test_a_callback_that_raises_at_session_start_is_dropped_before_any_model(spec, data, caplog):
    class FailsAtStart(Recorder):
        def on_session_start(self, session):
            raise RuntimeError("tracking server unreachable")

    cb = FailsAtStart()
    with Session(spec, data, callbacks=[cb], **LOCAL) as s:
        s.add({"lr": 0.01, "width": 8}, epochs=1)
        s.run()
    assert cb.calls == [] and "raised in on_session_start" in caplog.text


def test_hooks_get_a_read_only_view_of_a_consistent_session(spec, data):
    """Hooks run once the session has handled an event: the view shows the epoch's
    row and the model's status; it offers no way to change the session."""
    seen = []

    class Reads(Callback):
        # a hook that raises is only disabled: what it saw is checked after the run
        def on_session_start(self, view):
            with pytest.raises(AttributeError, match="read-only"):
                view.seed = 1
            seen.append(("start", type(view), view.seed, view.num_partitions, view.threads, view.order,
                         view.num_workers, len(view.workers()), view.executor_kind, view.checkpoint_dir,
                         view.closed, [n for n in ("add", "extend", "stop", "reports", "fetch_state",
                                                   "executor", "scheduler", "close") if hasattr(view, n)]))

        def on_epoch_end(self, view, report):
            h = view.history
            rows = h[(h.model_id == report.model_id) & (h.epoch == report.epoch)]
            model = view.model(report.model_id)
            seen.append((report.model_id, report.epoch, len(rows), model.epochs >= report.epoch,
                         view.status(report.model_id)))

        def on_session_end(self, view):
            best = view.best("val_loss")
            seen.append(("best", best.model_id, best.status, best.name))

    with Session(spec, data, seed=4, callbacks=[Reads()], **LOCAL) as s:
        ids = [s.add({"lr": lr, "width": 8}, epochs=2) for lr in (0.01, 0.05)]
        s.run()
        expected_best = s.best("val_loss").model_id
    assert seen[0] == ("start", SessionView, 4, 3, 1, "fixed", 2, 2, "LocalExecutor", None, False, [])
    epochs = [r for r in seen[1:] if r[0] != "best"]
    assert sorted((m, e) for m, e, *_ in epochs) == [(m, e) for m in ids for e in (1, 2)]
    assert all(n == 1 and reported for _, _, n, reported, _ in epochs)
    # the last epoch's hook runs after the pause that came with it
    assert {status for _, e, _, _, status in epochs if e == 2} == {"paused"}
    assert seen[-1] == ("best", expected_best, "paused", f"model-{expected_best}")


def test_an_exception_in_the_users_code_reaches_on_exception_then_the_end(spec, data):
    rec = Recorder()
    with pytest.raises(KeyError):
        with Session(spec, data, callbacks=[rec], **LOCAL) as s:
            s.add({"lr": 0.01, "width": 8}, epochs=1)
            raise KeyError("the tuner's bug")
    assert [c[0] for c in rec.calls] == ["start", "added", "exception", "end"]
    assert rec.calls[2][2] == "KeyError(\"the tuner's bug\")"


def _tuner_runs(spec, data, callbacks):
    """Each tuner, small, with the same session callbacks."""
    sampler = lambda rng: {"lr": float(10 ** rng.uniform(-3, -1)), "width": 8}  # noqa: E731
    return {
        "grid_search": lambda: grid_search(spec, data, {"lr": [0.01, 0.05], "width": [8]}, epochs=1,
                                           session_callbacks=callbacks(), **LOCAL),
        "random_search": lambda: random_search(spec, data, {"lr": [0.01, 0.05], "width": [8]},
                                               n_configs=2, epochs=1, session_callbacks=callbacks(),
                                               **LOCAL),
        "successive_halving": lambda: successive_halving(spec, data, sampler, min_epochs=1,
                                                         max_epochs=2, eta=2, n_configs=2,
                                                         session_callbacks=callbacks(), **LOCAL),
        "hyperband": lambda: hyperband(spec, data, sampler, max_epochs=2, eta=2,
                                       session_callbacks=callbacks(), **LOCAL),
        "asha": lambda: asha(spec, data, sampler, min_epochs=1, max_epochs=2, eta=2, max_trials=3,
                             session_callbacks=callbacks(), **LOCAL),
        "pbt": lambda: pbt(spec, data, lambda rng: {**sampler(rng), "dropout": 0.1}, population=2, epochs=2,
                           interval=1, mutations={"lr": "continuous"}, quantile=0.5,
                           session_callbacks=callbacks(), **LOCAL),
    }


@pytest.mark.parametrize("tuner", ["grid_search", "random_search", "successive_halving", "hyperband", "asha",
                                   "pbt"])
def test_every_search_tuner_passes_session_callbacks(spec, data, tuner):
    made: list[Recorder] = []

    def callbacks():
        made.append(Recorder())
        return made[-1:]

    result = _tuner_runs(spec, data, callbacks)[tuner]()
    [rec] = made
    assert rec.calls[0][0] == "start" and rec.calls[-1][0] == "end"
    assert [m for _, m, _ in rec.of("added")] == sorted(result.history["model_id"].unique())
    assert len(rec.of("epoch")) == len(result.history)


def test_optuna_takes_session_callbacks_and_keeps_its_own_callbacks(spec, data, tmp_path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0),
                                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1,
                                                                              reduction_factor=2))
    rec, finished = Recorder(), []
    optimize(study, spec, data, lambda t: {"lr": t.suggest_float("lr", 1e-3, 1e-1, log=True), "width": 8},
             n_trials=6, epochs=3, metric="val_loss",
             callbacks=[lambda study, trial: finished.append(trial.number)],  # Optuna's meaning
             session_callbacks=[rec, TensorBoard(tmp_path)], **LOCAL)
    assert sorted(finished) == list(range(6))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"trial-{t.number}" for t in study.trials)  # run folders by trial
    pruned = [t.number for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert len(rec.of("stopped")) == len(pruned)
    assert len(rec.of("epoch")) == sum(len(t.intermediate_values) for t in study.trials)


def test_hyperopt_takes_session_callbacks(spec, data):
    from hyperopt import Trials, hp, rand
    rec, trials = Recorder(), Trials()
    fmin(spec, data, {"lr": hp.loguniform("lr", -7, -2), "width": 8}, algo=rand.suggest, max_evals=3,
         epochs=2, trials=trials, rstate=np.random.default_rng(0), session_callbacks=[rec], **LOCAL)
    assert len(rec.of("added")) == 3 and len(rec.of("paused")) == 3 and len(rec.of("epoch")) == 6


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_callbacks_on_a_real_local_cluster(spec, data, cluster, tmp_path):
    rec = Recorder()
    with Session(spec, data, client=cluster, callbacks=[rec, TensorBoard(tmp_path)]) as s:
        ids = [s.add({"lr": lr, "width": 8}, epochs=2) for lr in (0.01, 0.05)] + [s.add(BAD, epochs=2)]
        history = s.run()
    assert rec.calls[0] == ("start", None, 2)
    assert len(rec.of("epoch")) == 4 and [m for _, m, _ in rec.of("failed")] == [ids[2]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-0", "model-1", "model-2"]
    assert len(history) == 5


def test_callback_arguments_are_checked(spec, data):
    with pytest.raises(TypeError, match=r"callbacks\[0\] is .*, but must be a cerebro_automl.callbacks."
                                        r"Callback \(a function callback\(study, trial\) is an Optuna"):
        Session(spec, data, callbacks=[lambda study, trial: None], **LOCAL)
    with pytest.raises(TypeError, match="callbacks is .*Recorder.*, but must be a list"):
        Session(spec, data, callbacks=Recorder(), **LOCAL)
    with pytest.raises(TypeError, match="tuners take the session's callbacks as session_callbacks"):
        grid_search(spec, data, {"lr": [0.01], "width": [8]}, epochs=1, callbacks=[Recorder()], **LOCAL)
    with Session(spec, data, **LOCAL) as s:
        with pytest.raises(ValueError, match="session_callbacks is given with an open session"):
            grid_search(spec, data, {"lr": [0.01], "width": [8]}, epochs=1, session=s,
                        session_callbacks=[Recorder()])


def test_the_progress_bar_counts_running_paused_and_failed_models(spec, data, capsys):
    with Session(spec, data, progress=True, **LOCAL) as s:
        s.add({"lr": 0.01, "width": 8}, epochs=2)
        s.add(BAD, epochs=2)
        s.run()
    err = capsys.readouterr().err
    assert re.search(r"\| \d+/6 \[.*, running=\d, paused=\d, failed=1\]", err), err  # total less the failed
    assert "cerebro: " in err and ("unit/s" in err or "s/unit" in err)


def test_a_callback_that_changes_a_report_changes_nothing_else(spec, data):
    """Callbacks observe: a report's dicts changed in place by one callback reach
    neither the tuner's loop, the next callback, nor the session's records."""
    seen = []

    class Careless(Callback):
        def on_epoch_end(self, session, report):
            report.metrics["val_loss"] = -1.0
            report.config["lr"] = 42.0

    class Watcher(Callback):
        def on_epoch_end(self, session, report):
            seen.append((report.metrics["val_loss"], report.config["lr"]))

    with Session(spec, data, executor="local", callbacks=[Careless(), Watcher()]) as s:
        s.add({"lr": 1e-2, "width": 8}, epochs=2)
        looped = [(r.metrics["val_loss"], r.config["lr"]) for r in s.reports() if isinstance(r, EpochReport)]
        assert s.model(0).metrics["val_loss"] == looped[-1][0] > 0 and s.model(0).config["lr"] == 1e-2
        assert list(s.history.val_loss) == [v for v, _ in looped]
    assert seen == looped and all(lr == 1e-2 for _, lr in looped)


def test_a_method_named_like_a_hook_that_is_none_is_named_when_the_session_takes_it(spec, data, caplog):
    class Typo(Callback):
        def on_epoch_ended(self, session, report):  # on_epoch_end
            raise AssertionError("never called")

        def on_improvement(self, value):  # a helper of its own: not a hook's misspelling
            pass

        @property
        def on_gpu(self):  # read only once the session runs: not while it takes the callback
            raise AssertionError("read")

    with caplog.at_level(logging.WARNING, logger="cerebro_automl"), \
            Session(spec, data, executor="local", callbacks=[Typo(), Callback()]) as s:
        s.add({"lr": 1e-2, "width": 8}, epochs=1)
        s.run()
    assert caplog.text.count("which no session calls") == 1
    assert re.search(r"callback \S*Typo defines \['on_epoch_ended'\], which no session calls: the hooks are "
                     r"\['on_epoch_end', ", caplog.text), caplog.text
