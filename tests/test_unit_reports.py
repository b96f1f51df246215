"""Reports inside epochs (``Session(report_every="unit")``): a report after every
unit, so that a pruner can stop a model in its first epoch, with the weights of
epoch reports alone."""

from __future__ import annotations

import optuna
import pytest

from cerebro_automl import EpochReport, PartitionedDataset, Session, UnitReport
from cerebro_automl.adapters.hyperband import asha
from cerebro_automl.adapters.optuna import optimize
from cerebro_automl.callbacks import Callback

from conftest import make_arrays, same_states
from models import make_spec

CONFIGS = [{"lr": 0.01, "width": 8}, {"lr": 0.05, "width": 16}]


@pytest.fixture(autouse=True)
def quiet_optuna():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def _data(partitions: int = 3) -> PartitionedDataset:
    X, y, Xv, yv = make_arrays()
    return PartitionedDataset.from_arrays(X, y, num_partitions=partitions, valid=(Xv, yv))


def _train(report_every: str, **kwargs):
    """Every report of CONFIGS trained 2 epochs, and their final weights."""
    with Session(make_spec(), _data(), seed=3, report_every=report_every, progress=False, **kwargs) as s:
        ids = [s.add(c, epochs=2) for c in CONFIGS]
        reports = list(s.reports())
        return reports, [s.model(i).state()["model"] for i in ids], s.history


def _without_seconds(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith("_seconds")}


def test_a_unit_report_follows_every_unit_and_the_weights_stay_those_of_epoch_reports():
    reports, weights, history = _train("unit", executor="local", n_workers=2)
    plain, plain_weights, plain_history = _train("epoch", executor="local", n_workers=2)
    assert same_states(weights, plain_weights)
    points = [(r.epoch, r.unit if isinstance(r, UnitReport) else None) for r in reports if r.model_id == 0
              and isinstance(r, (EpochReport, UnitReport))]
    assert points == [(1, 1), (1, 2), (1, None), (2, 1), (2, 2), (2, None)]
    units = [r for r in reports if isinstance(r, UnitReport)]
    assert [r.step for r in units if r.model_id == 0] == [1, 2, 4, 5]
    assert all(r.units == 3 and "val_loss" in r.metrics and r.config == CONFIGS[r.model_id] for r in units)
    # Units inside an epoch see different states: their values differ from the epoch's.
    assert len({r.metrics["val_loss"] for r in units if r.model_id == 0}) == 4
    epochs = {(r.model_id, r.epoch): _without_seconds(r.metrics) for r in reports if isinstance(r, EpochReport)}
    assert epochs == {(r.model_id, r.epoch): _without_seconds(r.metrics) for r in plain if isinstance(r, EpochReport)}
    assert len(history) == len(plain_history) == 4  # the history holds epochs


def test_dask_workers_evaluate_inside_epochs_with_the_same_bits(cluster):
    reports, weights, _ = _train("unit", client=cluster)
    _, reference, _ = _train("epoch", executor="local")
    assert same_states(weights, reference)
    assert sum(isinstance(r, UnitReport) for r in reports) == 2 * 2 * 2


def test_callbacks_hear_each_unit_report():
    heard = []

    class Units(Callback):
        def on_unit_end(self, view, report):
            heard.append((report.model_id, report.epoch, report.unit, view.model(report.model_id).epochs))

    with Session(make_spec(), _data(), executor="local", report_every="unit", callbacks=[Units()]) as s:
        s.add(CONFIGS[0], epochs=1)
        s.run()
    assert heard == [(0, 1, 1, 0), (0, 1, 2, 0)]


def test_report_every_names_its_values():
    with pytest.raises(ValueError, match=r"report_every is 'batch', but must be one of \('epoch', 'unit'\)"):
        Session(make_spec(), _data(), executor="local", report_every="batch")


def test_a_tuner_that_decides_at_epochs_refuses_unit_reports():
    with pytest.raises(ValueError, match="report_every is 'unit', but this tuner decides only when epochs end"):
        asha(make_spec(), _data(), lambda rng: {"lr": 0.01, "width": 8}, min_epochs=1, max_epochs=3,
             max_trials=3, executor="local", report_every="unit")


def test_a_resume_replays_the_reports_inside_epochs_and_trains_nothing(tmp_path):
    spec, data = make_spec(), _data()
    with Session(spec, data, executor="local", report_every="unit", checkpoint_dir=str(tmp_path)) as s:
        s.add(CONFIGS[0], epochs=2)
        first = [r for r in s.reports() if isinstance(r, (EpochReport, UnitReport))]
    with Session(spec, data, executor="local", report_every="unit", checkpoint_dir=str(tmp_path),
                 resume=True) as s:
        s.add(CONFIGS[0], epochs=2)
        again = [r for r in s.reports() if isinstance(r, (EpochReport, UnitReport))]
        assert s.scheduler.units_trained == 0
    assert again == first


def _space(trial):
    return {"lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True), "width": trial.suggest_int("width", 4, 32)}


def _study(**kwargs):
    study = optuna.create_study(
        study_name="units", direction="maximize", sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
    )
    optimize(study, make_spec(), _data(), _space, n_trials=8, epochs=2, metric="val_accuracy",
             report_every="unit", reproducible=True, progress=False, **kwargs)
    return [(t.number, t.state, t.params, t.intermediate_values) for t in study.trials]


def test_optuna_prunes_inside_the_first_epoch_and_the_study_is_reproducible(cluster):
    trials = _study(executor="local", n_workers=2)
    pruned_early = [n for n, state, _, values in trials if state == optuna.trial.TrialState.PRUNED and max(values) < 3]
    assert pruned_early, trials  # pruned after a unit of the first epoch (steps count units: 3 an epoch)
    complete = [values for _, state, _, values in trials if state == optuna.trial.TrialState.COMPLETE]
    assert complete and all(sorted(values) == list(range(1, 7)) for values in complete)
    assert _study(client=cluster) == trials


def _rows(study):
    return [(t.number, t.state.name, t.params, t.intermediate_values, t.value) for t in study.trials]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kill", ["pruner:20", "told:3"])
def test_a_killed_reproducible_search_with_unit_reports_resumes_to_the_same_study(tmp_path, kill):
    """SIGKILL the driver of a reproducible search with reports inside epochs, then
    optimize again (on 2 workers, where it had 1): the study is the uninterrupted one,
    its steps counting units."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import optuna_resume_driver as driver

    (tmp_path / "whole").mkdir()
    uninterrupted = _rows(driver.run(tmp_path / "whole", report_every="unit"))
    assert any(max(values) % 3 for _, state, _, values, _ in uninterrupted if state == "PRUNED")  # inside epochs
    folder = tmp_path / "run"
    folder.mkdir()
    here = Path(__file__).parent
    proc = subprocess.run([sys.executable, str(here / "optuna_resume_driver.py"), str(folder), kill, "unit"],
                          env=dict(os.environ, PYTHONPATH=str(here)), timeout=240)
    assert proc.returncode == -signal.SIGKILL
    left = driver.open_study(folder)
    assert any(t.state == optuna.trial.TrialState.RUNNING for t in left.trials)
    assert _rows(left) != uninterrupted
    assert _rows(driver.run(folder, n_workers=2, report_every="unit")) == uninterrupted


def test_a_study_is_continued_only_with_the_steps_it_counts(tmp_path):
    """A study run with epoch reports, optimized again with unit reports (or the other
    way), would read its steps wrongly: refused, naming both counts."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db", study_name="s", direction="maximize")
    optimize(study, make_spec(), _data(), _space, n_trials=2, epochs=1, metric="val_accuracy",
             executor="local", progress=False)
    assert study.user_attrs["cerebro_steps_per_epoch"] == 1
    with pytest.raises(ValueError, match=r"the study's steps count 1 report\(s\) an epoch, but this call makes 3"):
        optimize(study, make_spec(), _data(), _space, n_trials=4, epochs=1, metric="val_accuracy",
                 executor="local", progress=False, report_every="unit")
    assert len(study.trials) == 2


@pytest.mark.parametrize("tuner", ["grid_search", "pbt", "fmin"])
def test_every_tuner_that_decides_at_epochs_refuses_unit_reports(tuner):
    from cerebro_automl.adapters import hyperopt, pbt, search

    data, spec = _data(), make_spec()
    calls = {
        "grid_search": lambda: search.grid_search(spec, data, {"lr": [0.01], "width": [8]}, epochs=1,
                                                  executor="local", report_every="unit"),
        "pbt": lambda: pbt.pbt(spec, data, lambda rng: {"lr": 0.01, "width": 8}, population=2, epochs=2,
                               interval=1, mutations={"lr": (1e-4, 3e-2)}, executor="local", report_every="unit"),
        "fmin": lambda: hyperopt.fmin(spec, data, _hyperopt_space(), max_evals=2, epochs=1,
                                      executor="local", report_every="unit"),
    }
    with pytest.raises(ValueError, match="report_every is 'unit', but this tuner decides only when epochs end"):
        calls[tuner]()


def _hyperopt_space():
    from hyperopt import hp

    return {"lr": hp.loguniform("lr", -7, -1), "width": 8}


def test_fused_models_report_inside_epochs_with_the_bits_of_epoch_reports():
    def run(every):
        with Session(make_spec(), _data(), executor="local", seed=3, fuse=2, report_every=every) as s:
            ids = [s.add(c, epochs=2) for c in CONFIGS]
            reports = list(s.reports())
            return reports, [s.model(i).state()["model"] for i in ids]

    reports, weights = run("unit")
    _, plain = run("epoch")
    assert same_states(weights, plain)
    assert sorted((r.model_id, r.epoch, r.unit) for r in reports if isinstance(r, UnitReport)) == [
        (m, e, u) for m in (0, 1) for e in (1, 2) for u in (1, 2)
    ]
