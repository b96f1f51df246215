"""The real tuners in virtual time: a SimulatedSession runs ASHA and Optuna studies
at scale, and shows that reproducible=True decides the same on any worker count."""

from __future__ import annotations

import optuna
import pytest

from cerebro_automl.adapters.hyperband import asha, hyperband
from cerebro_automl.adapters.optuna import optimize
from cerebro_automl.simulate import SimulatedSession


@pytest.fixture(autouse=True)
def quiet_optuna():
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def sampler(rng):
    return {"lr": float(10 ** rng.uniform(-4, -1)), "width": int(rng.choice([32, 64, 128]))}


def _asha(workers, reproducible):
    sim = SimulatedSession(workers=workers, partitions=8, seed=1)
    result = asha(sim.spec, sim.data, sampler, min_epochs=1, max_epochs=9, eta=3, max_trials=60,
                  parallelism=12, session=sim, reproducible=reproducible)
    return [(d.rung, d.promoted) for d in result.decisions], sim


def test_asha_in_canonical_order_promotes_the_same_on_3_and_8_simulated_workers():
    three, sim3 = _asha(3, True)
    eight, sim8 = _asha(8, True)
    assert three == eight and len(three) > 5
    assert sim8.now < sim3.now  # more workers, less virtual time
    assert _asha(3, False)[0] != _asha(8, False)[0]  # without it, timing decides


def test_cyclic_order_keeps_the_workers_of_the_same_asha_search_busier_than_fixed_order():
    """ASHA pauses and adds models one at a time, so models in many epochs train at
    once: each epoch's own permutation (fixed order) sets them on rings of their own,
    which meet at random; one ring for every epoch (cyclic order) does not."""
    runs = {}
    for order in ("fixed", "cyclic"):
        sim = SimulatedSession(workers=8, seed=0, order=order)
        result = asha(sim.spec, sim.data, lambda rng: {"lr": float(rng.uniform(0, 1))}, min_epochs=1,
                      max_epochs=9, eta=3, max_trials=64, session=sim, reproducible=True)
        runs[order] = [(d.rung, d.promoted) for d in result.decisions], sim.timeline().utilization_total, sim.now
    assert runs["cyclic"][0] == runs["fixed"][0]  # the same search
    assert runs["cyclic"][1] > runs["fixed"][1] + 0.03  # 0.70 against 0.65
    assert runs["cyclic"][2] < runs["fixed"][2]


def _optuna(workers, reproducible):
    sim = SimulatedSession(workers=workers, partitions=8, seed=1)
    study = optuna.create_study(pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3))

    def space(trial):
        return {"lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
                "width": trial.suggest_categorical("width", [32, 64, 128])}

    optimize(study, sim.spec, sim.data, space, n_trials=40, epochs=9, metric="val_loss", session=sim,
             parallelism=12, reproducible=reproducible)
    return [(t.params, t.state.name, t.intermediate_values) for t in study.trials]


def test_an_optuna_study_in_canonical_order_is_the_same_on_3_and_8_simulated_workers():
    assert _optuna(3, True) == _optuna(8, True)
    assert _optuna(3, False) != _optuna(8, False)


def test_the_timeline_accounts_for_every_busy_second():
    sim = SimulatedSession(workers=4, seed=0, unit_cost=lambda c: 1.0)
    hyperband(sim.spec, sim.data, sampler, max_epochs=9, eta=3, session=sim)
    timeline = sim.timeline(bins=5)
    assert timeline.makespan == sim.now > 0
    assert sum(timeline.utilization) / 5 == pytest.approx(timeline.utilization_total)
    assert 0 < timeline.utilization_total <= 1 and 0 <= timeline.tail_share <= 1
    units = int(sim.history.groupby("model_id").epoch.max().sum()) * 4  # epochs x partitions, 1 s each
    assert timeline.utilization_total * 4 * sim.now == pytest.approx(units)


def test_a_simulated_session_starts_models_fresh_only():
    sim = SimulatedSession(workers=2)
    with pytest.raises(ValueError, match=r"\['resume'\] given, but a simulated session starts every model fresh"):
        sim.add({"lr": 0.1}, epochs=1, resume=(1, {}))


def test_grid_search_reads_reports_one_by_one_from_a_simulated_session():
    from cerebro_automl.adapters.search import grid_search

    sim = SimulatedSession(workers=2, seed=0)
    result = grid_search(sim.spec, sim.data, {"lr": [0.1, 0.01, 0.001]}, epochs=2, session=sim)
    assert len(sim.history) == 6 and result.best_config["lr"] in (0.1, 0.01, 0.001)


def test_bad_simulator_arguments_name_themselves():
    with pytest.raises(ValueError, match=r"workers is 0, but must be an int >= 1"):
        SimulatedSession(0)
    with pytest.raises(ValueError, match=r"partitions is 0, but must be an int >= 1"):
        SimulatedSession(2, partitions=0)
    with pytest.raises(ValueError, match=r"bins is 0, but must be an int >= 1"):
        SimulatedSession(2).timeline(0)
