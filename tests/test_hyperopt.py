"""The hyperopt adapter: real hyperopt algorithms and Trials, real training."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

hyperopt = pytest.importorskip("hyperopt")
from hyperopt import JOB_STATE_DONE, JOB_STATE_ERROR, JOB_STATE_NEW, JOB_STATE_RUNNING, Trials, hp  # noqa: E402

from cerebro_automl import PartitionedDataset, Session  # noqa: E402
from cerebro_automl.adapters.hyperopt import MedianStoppingRule, fmin  # noqa: E402

from conftest import make_arrays  # noqa: E402
from models import make_spec  # noqa: E402

SPACE = {"lr": hp.loguniform("lr", math.log(1e-3), math.log(1e-1)),
         "width": hp.choice("width", [4, 8, 16])}


def _data():
    X, y, Xv, yv = make_arrays()
    return PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))


def _fmin(trials, **kwargs):
    arguments = dict(max_evals=8, epochs=2, trials=trials, rstate=np.random.default_rng(0),
                     executor="local", n_workers=2)
    arguments.update(kwargs)
    spec = arguments.pop("spec", make_spec())
    space = arguments.pop("space", SPACE)
    return fmin(spec, _data(), space, **arguments)


def _points(trials):
    return [{k: v[0] for k, v in t["misc"]["vals"].items() if v} for t in trials.trials]


def test_documents_move_new_running_done_with_times_and_history():
    seen = {"new_at_insert": 0, "running_when_reported": 0}
    trials = Trials()

    def watching_algo(new_ids, domain, trials_, seed):
        # every earlier document has left NEW by the time the next is asked
        assert all(t["state"] != JOB_STATE_NEW for t in trials_._dynamic_trials)
        docs = hyperopt.rand.suggest(new_ids, domain, trials_, seed)
        seen["new_at_insert"] += all(d["state"] == JOB_STATE_NEW for d in docs)
        return docs

    def watching_rule(epoch, loss, others):
        running = [t for t in trials.trials if t["state"] == JOB_STATE_RUNNING]
        seen["running_when_reported"] += bool(running) and all(t["book_time"] for t in running)
        return False

    best = _fmin(trials, algo=watching_algo, prune=watching_rule, epochs=3)
    assert seen["new_at_insert"] == 8 and seen["running_when_reported"] > 0
    assert len(trials.trials) == 8
    for t in trials.trials:
        result = t["result"]
        assert t["state"] == JOB_STATE_DONE and result["status"] == "ok"
        assert t["book_time"] <= t["refresh_time"]
        assert [h["epoch"] for h in result["history"]] == [1, 2, 3] and result["epochs"] == 3
        assert result["loss"] == result["history"][-1]["val_loss"]
        assert {"val_loss", "val_accuracy", "train_loss"} <= set(result["history"][0])
    assert best == trials.argmin


def test_hyperopts_own_tools_work_on_the_result(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from hyperopt.plotting import main_plot_history

    trials = Trials()
    best = _fmin(trials, algo=hyperopt.tpe.suggest)
    config = hyperopt.space_eval(SPACE, best)
    assert config == trials.best_trial["result"]["config"]
    assert config["width"] in (4, 8, 16) and 1e-3 <= config["lr"] <= 1e-1
    losses = trials.losses()
    assert len(losses) == 8 and min(losses) == trials.best_trial["result"]["loss"]
    main_plot_history(trials, do_show=False)
    plt.savefig(tmp_path / "history.png")
    plt.close("all")
    assert (tmp_path / "history.png").stat().st_size > 1000


def test_same_seed_parallelism_one_is_hyperopts_own_fmin():
    """With parallelism=1 the adapter asks exactly as hyperopt.fmin does: the
    same TPE points and the same losses, trial by trial."""
    algo = functools.partial(hyperopt.tpe.suggest, n_startup_jobs=3)
    spec, data = make_spec(), _data()

    calls = []

    def objective(config):  # the same training, one model at a time
        with Session(spec, data, executor="local", seed=0) as s:
            s.add(config, epochs=2, offset=len(calls))  # the k-th model's partition order
            calls.append(config)
            return float(s.run()["val_loss"].iloc[-1])

    reference = Trials()
    hyperopt.fmin(objective, SPACE, algo=algo, max_evals=7, trials=reference,
                  rstate=np.random.default_rng(4), show_progressbar=False)
    ours, again = Trials(), Trials()
    for trials in (ours, again):
        _fmin(trials, algo=algo, max_evals=7, parallelism=1, rstate=np.random.default_rng(4), seed=0)
    assert _points(ours) == _points(reference) == _points(again)
    assert ours.losses() == pytest.approx(reference.losses(), rel=0, abs=0)
    assert ours.losses() == again.losses()


def test_nested_choices_reach_model_fn_as_nested_configs():
    def model_fn(config):
        arch = config["arch"]
        if arch["kind"] == "linear":
            return torch.nn.Linear(8, 3)
        return torch.nn.Sequential(torch.nn.Linear(8, arch["width"]), torch.nn.ReLU(),
                                   torch.nn.Linear(arch["width"], 3))

    space = {"lr": hp.loguniform("lr", -6, -2),
             "arch": hp.choice("arch", [{"kind": "linear"},
                                        {"kind": "mlp", "width": hp.quniform("width", 4, 32, 4)}])}

    def optimizer_fn(config, params):
        return torch.optim.Adam(params, lr=config["lr"])

    spec = make_spec(model_fn=lambda c: model_fn({**c, "arch": {**c["arch"], **(
        {"width": int(c["arch"]["width"])} if "width" in c["arch"] else {})}}), optimizer_fn=optimizer_fn)
    trials = Trials()
    best = _fmin(trials, spec=spec, space=space, algo=hyperopt.rand.suggest, max_evals=8)
    kinds = {t["result"]["config"]["arch"]["kind"] for t in trials.trials}
    assert kinds == {"linear", "mlp"}
    assert hyperopt.space_eval(space, best) == trials.best_trial["result"]["config"]


def _unlucky(config):
    if config["width"] == 4:
        raise RuntimeError("width 4 is unlucky")
    return torch.nn.Linear(8, 3)


def test_a_failing_configuration_is_an_error_document_and_the_search_goes_on():
    trials = Trials()
    _fmin(trials, spec=make_spec(model_fn=_unlucky), algo=hyperopt.rand.suggest, max_evals=10)
    errors = [t for t in trials._dynamic_trials if t["state"] == JOB_STATE_ERROR]
    done = [t for t in trials._dynamic_trials if t["state"] == JOB_STATE_DONE]
    assert errors and done and len(errors) + len(done) == 10
    assert trials.count_by_state_unsynced(JOB_STATE_ERROR) == len(errors)
    for t in errors:
        assert t["misc"]["error"] == ("RuntimeError", "width 4 is unlucky")
        assert "unlucky" in t["result"]["error"] and t["result"]["config"]["width"] == 4
    assert all(t["result"]["config"]["width"] != 4 for t in done)
    assert len(trials.trials) == len(done)  # hyperopt leaves ERROR documents out


def test_median_rule_prunes_between_epochs_and_freed_slots_get_new_trials():
    trials = Trials()
    rule = MedianStoppingRule(warmup_epochs=0, min_trials=2)
    _fmin(trials, algo=hyperopt.rand.suggest, max_evals=12, epochs=4, parallelism=4, prune=rule)
    pruned = [t for t in trials.trials if t["result"]["pruned"]]
    assert len(trials.trials) == 12 and pruned
    for t in pruned:
        result = t["result"]
        assert t["state"] == JOB_STATE_DONE and result["status"] == "fail"
        assert 1 <= result["epochs"] < 4 and result["loss"] == result["history"][-1]["val_loss"]
    assert not trials.best_trial["result"]["pruned"] and trials.best_trial["result"]["epochs"] == 4
    # a freed slot went to a trial booked after the pruned one ended
    first_prune = min(t["refresh_time"] for t in pruned)
    assert any(t["book_time"] >= first_prune for t in trials.trials)


def test_median_rule_is_a_pure_policy():
    rule = MedianStoppingRule(warmup_epochs=1, min_trials=2)
    assert not rule(1, 9.0, [1.0, 2.0])          # warm-up
    assert not rule(2, 9.0, [1.0])               # too few others
    assert rule(2, 3.0, [1.0, 2.0]) and not rule(2, 1.5, [1.0, 2.0])
    assert rule(2, float("nan"), [1.0, 2.0])
    with pytest.raises(ValueError, match=r"min_trials is -1, but must be an int >= 0"):
        MedianStoppingRule(min_trials=-1)


def test_early_stop_fn_stops_the_search():
    from hyperopt.early_stop import no_progress_loss
    trials = Trials()
    _fmin(trials, algo=hyperopt.rand.suggest, max_evals=40, parallelism=1,
          early_stop_fn=no_progress_loss(2))
    assert 3 <= len(trials.trials) < 40


def test_fmin_continues_a_trials_object_up_to_max_evals():
    trials = Trials()
    _fmin(trials, algo=hyperopt.rand.suggest, max_evals=4)
    _fmin(trials, algo=hyperopt.rand.suggest, max_evals=7, rstate=np.random.default_rng(1))
    assert [t["tid"] for t in trials.trials] == list(range(7))
    assert all(t["state"] == JOB_STATE_DONE for t in trials.trials)


def test_an_interrupted_fmin_leaves_no_running_documents_and_a_second_call_finishes():
    trials = Trials()
    calls = {"n": 0}

    def interrupting_rule(epoch, loss, others):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return False

    with pytest.raises(KeyboardInterrupt):
        _fmin(trials, algo=hyperopt.rand.suggest, max_evals=6, epochs=3, prune=interrupting_rule)
    states = [t["state"] for t in trials._dynamic_trials]
    assert JOB_STATE_RUNNING not in states and JOB_STATE_NEW not in states and JOB_STATE_ERROR in states
    _fmin(trials, algo=hyperopt.rand.suggest, max_evals=6, epochs=3, rstate=np.random.default_rng(1))
    assert len(trials.trials) == 6 and all(t["result"]["status"] == "ok" for t in trials.trials)


def test_runs_on_a_dask_cluster(cluster):
    trials = Trials()
    best = fmin(make_spec(), _data(), SPACE, algo=hyperopt.tpe.suggest, max_evals=6, epochs=2,
                trials=trials, rstate=np.random.default_rng(0), client=cluster,
                prune=MedianStoppingRule())
    assert len(trials.trials) == 6 and set(best) == {"lr", "width"}
    assert all(t["state"] == JOB_STATE_DONE for t in trials.trials)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(max_evals=0), ValueError, r"max_evals is 0, but must be an int >= 1"),
    (dict(epochs=0), ValueError, r"epochs is 0, but must be an int >= 1"),
    (dict(loss="val_f1"), ValueError, r"metric is 'val_f1', but the spec produces only"),
    (dict(rstate=3), TypeError, r"rstate is 3, but must be a numpy.random.Generator"),
    (dict(trials=[]), TypeError, r"trials is list, but must be a hyperopt.Trials"),
    (dict(parallelism=0), ValueError, r"parallelism is 0, but must be an int >= 1"),
    (dict(timeout=-5), ValueError, r"timeout is -5, but must be a positive number"),
    (dict(prune="median"), TypeError, r"prune is 'median', but must be callable"),
], ids=["max_evals 0", "epochs 0", "unknown loss", "int rstate", "trials list", "parallelism 0",
        "negative timeout", "prune string"])
def test_bad_arguments_are_refused_before_any_trial(kwargs, error, message):
    trials = kwargs.pop("trials", Trials())
    with pytest.raises(error, match=message):
        _fmin(trials, **kwargs)
    if isinstance(trials, Trials):
        assert len(trials._dynamic_trials) == 0


def test_a_space_that_is_not_a_config_dict_is_refused():
    with pytest.raises(TypeError, match=r"space evaluates to \[.*\], but must evaluate to a config dict"):
        _fmin(Trials(), space=[hp.uniform("lr", 0, 1)])


def test_return_argmin_false_hands_back_the_best_trials_model():
    trials = Trials()
    result = fmin(make_spec(), _data(), SPACE, algo=hyperopt.rand.suggest, max_evals=3, epochs=2, trials=trials,
                  rstate=np.random.default_rng(0), executor="local", return_argmin=False)
    assert result.trials is trials and result.argmin == trials.argmin
    best = min(trials.trials, key=lambda t: t["result"]["loss"])
    assert result.best_model_id == int(result.history[result.history.name == f"hyperopt-{best['tid']}"].model_id.iloc[0])
    model = result.best_model()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in result.best_state["model"].items())


def test_trials_passed_in_again_hand_back_the_best_model_an_earlier_call_trained(tmp_path):
    """The best trial was trained by the first call: the second reads it from its final checkpoint."""
    trials, checkpoints = Trials(), str(tmp_path / "ck")
    common = dict(algo=hyperopt.rand.suggest, epochs=2, trials=trials, executor="local", return_argmin=False,
                  checkpoint_dir=checkpoints)
    first = fmin(make_spec(), _data(), SPACE, max_evals=3, rstate=np.random.default_rng(0), **common)
    again = fmin(make_spec(), _data(), SPACE, max_evals=4, rstate=np.random.default_rng(1), **common)
    best = min(trials.trials, key=lambda t: t["result"]["loss"])
    assert best["tid"] < 3 and again.best_model_id is None and again.best_config == first.best_config
    state = again.best_model().state_dict()
    assert all(torch.equal(state[k], v) for k, v in first.best_state["model"].items())
