"""Frozen features: computed once per partition where it lives, never trained, never
hopping; the trained heads equal, bit for bit, the same models with the backbone
inside model_fn, on any number of workers and on either executor."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import feature_models as fm
from cerebro_automl import FrozenFeatures, Session, TrainingSpec
from cerebro_automl.features import backbone, staged_outputs
from conftest import same_states


def _train(spec, configs=fm.CONFIGS, epochs=2, data=None, **kwargs):
    with Session(spec, data if data is not None else fm.image_data(), seed=3, **kwargs) as s:
        ids = [s.add(c, epochs=epochs) for c in configs]
        history = s.run()
        errors = [s.model(i).error for i in ids]
        states = [s.model(i).state()["model"] if errors[n] is None else None for n, i in enumerate(ids)]
    return history, states, errors


def _full_spec():
    return TrainingSpec(model_fn=fm.full_model_fn, optimizer_fn=fm.optimizer_fn,
                        metrics=fm.make_spec().metrics, batch_size=16)


def test_heads_equal_the_backbone_inside_model_fn_bit_for_bit():
    history, heads, _ = _train(fm.make_spec(), executor="local")
    slow_history, full, _ = _train(_full_spec(), executor="local")
    for head, model in zip(heads, full):
        assert head.keys() == {k[2:] for k in model if k.startswith("2.")}  # only the head hops
        assert all(torch.equal(head[k], model["2." + k]) for k in head)
    assert list(history.val_loss) == list(slow_history.val_loss)
    assert list(history.val_accuracy) == list(slow_history.val_accuracy)


def test_each_shard_passes_through_the_backbone_once_whatever_the_configs_and_epochs():
    data = fm.image_data(rows=480, partitions=3)
    spec = fm.make_spec()
    fm.ROWS_SEEN[0] = 0
    _train(spec, epochs=3, data=data, executor="local")
    probe_rows = 6  # the size prediction runs one row of each train and validation shard
    assert fm.ROWS_SEEN[0] == 480 + probe_rows


def test_the_backbone_stays_in_eval_mode_and_its_batchnorm_statistics_never_move():
    spec = fm.make_spec()
    module = backbone(spec.features, torch.device("cpu"))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    _train(spec, executor="local")
    assert backbone(spec.features, torch.device("cpu")) is module  # built once
    assert not module.training and not any(m.training for m in module.modules())
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_bitwise_identical_on_1_2_and_3_workers_and_both_executors(cluster):
    from distributed import Client, LocalCluster

    spec = fm.make_spec()
    _, local, _ = _train(spec, executor="local")
    _, two, _ = _train(spec, client=cluster)
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None) as c1, Client(c1) as one_client:
        _, one, _ = _train(spec, client=one_client)
    with LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=None) as c3, Client(c3) as three_client:
        _, three, _ = _train(spec, client=three_client)
    assert same_states(local, two) and same_states(local, one) and same_states(local, three)


def test_replicas_compute_the_features_again_where_each_copy_lives(cluster):
    spec = fm.make_spec()
    _, local, _ = _train(spec, executor="local")
    _, replicated, errors = _train(spec, client=cluster, replicas=2)
    assert errors == [None] * 4 and same_states(local, replicated)


def test_staged_pass_stops_after_the_deepest_layer_and_copies_outputs_before_in_place_ops():
    torch.manual_seed(0)  # weights that give a negative output, whatever ran before in the process
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 2),
                              torch.nn.Sequential())
    calls = []
    net[2].register_forward_hook(lambda *a: calls.append("top"))
    x = torch.tensor([[1.0, -2.0, 3.0]])
    out = staged_outputs(net, x, {"linear": "0", "relu": "1"})
    assert torch.equal(out["linear"], net[0](x))  # ReLU(inplace=True) ran after, on the original
    assert (out["linear"] < 0).any() and calls == []


@pytest.mark.parametrize("options", [{"cache": "disk"}, {"dtype": torch.float16}, {"cache": "auto", "max_memory": 0}])
def test_disk_and_half_precision_features_train(tmp_path, options):
    spec = fm.make_spec(scratch=str(tmp_path), **options)
    history, heads, errors = _train(spec, executor="local")
    assert errors == [None] * 4 and history.val_loss.notna().all()
    if options.get("cache") in ("disk", "auto"):
        _, reference, _ = _train(fm.make_spec(), executor="local")
        assert same_states(heads, reference)  # on disk: the same numbers


def test_features_that_must_stay_in_memory_and_do_not_fit_fail_naming_size_and_budget():
    spec = fm.make_spec(cache="memory", max_memory=1000)
    _, _, errors = _train(spec, executor="local")
    assert all("but max_memory is 1000 B and cache='memory' keeps them in memory only" in e for e in errors)
    assert all("MemoryError: the features of one partition take" in e for e in errors)
    # the remedies are the ones the spec does not use yet: it pools already
    assert all("store them as float16" in e and "pool them" not in e for e in errors)


def test_bad_input_is_refused_before_any_training():
    spec = fm.make_spec()
    with Session(spec, fm.image_data(), executor="local") as s:
        with pytest.raises(ValueError, match=r"config\['layer'\] is 'b9', but must name one of the frozen layers"):
            s.add({"layer": "b9", "width": 4, "lr": 0.1}, epochs=1)
        with pytest.raises(ValueError, match="lacks key 'layer', which picks the frozen layer"):
            s.add({"width": 4, "lr": 0.1}, epochs=1)
    trainable = TrainingSpec(model_fn=fm.head_fn, optimizer_fn=fm.optimizer_fn,
                             features=FrozenFeatures(fm.trainable_backbone_fn, layers=fm.LAYERS))
    with Session(trainable, fm.image_data(), executor="local") as s:
        with pytest.raises(ValueError, match=r"parameters \['blocks.0.0.weight'.*require gradients"):
            s.add(fm.CONFIGS[0], epochs=1)
    missing = TrainingSpec(model_fn=fm.head_fn, optimizer_fn=fm.optimizer_fn,
                           features=FrozenFeatures(fm.backbone_fn, layers={"b1": "blocks.7"}))
    with Session(missing, fm.image_data(), executor="local") as s:
        with pytest.raises(ValueError, match=r"layers\['b1'\] is 'blocks.7', but the backbone has no such submodule"):
            s.add({"layer": "b1", "width": 4, "lr": 0.1}, epochs=1)
    with pytest.raises(ValueError, match="train_transform is set together with features"):
        TrainingSpec(model_fn=fm.head_fn, optimizer_fn=fm.optimizer_fn, features=spec.features,
                     train_transform=lambda x, y, g: (x, y))
    with pytest.raises(ValueError, match="pool is 'mean', but must be one of"):
        FrozenFeatures(fm.backbone_fn, layers=fm.LAYERS, pool="mean")
    with pytest.raises(ValueError, match="layers is {}, but must be a non-empty dict"):
        FrozenFeatures(fm.backbone_fn, layers={})
    with pytest.raises(TypeError, match=r"backbone_fn is .*, but must be a function that builds the backbone"):
        FrozenFeatures(torch.nn.Identity(), layers=fm.LAYERS)  # a module itself, not its builder


def test_optuna_suggests_the_layer(tmp_path):
    optuna = pytest.importorskip("optuna")
    from cerebro_automl.adapters.optuna import optimize

    def space(trial):
        return {"layer": trial.suggest_categorical("layer", ["b1", "b2", "b3"]),
                "width": trial.suggest_categorical("width", [4, 8]), "lr": 0.05}

    storage = f"sqlite:///{os.path.join(tmp_path, 'study.db')}"
    study = optuna.create_study(storage=storage, sampler=optuna.samplers.RandomSampler(seed=0))
    optimize(study, fm.make_spec(), fm.image_data(), space, n_trials=4, epochs=2, metric="val_loss",
             executor="local")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 4 and {t.params["layer"] for t in done} <= {"b1", "b2", "b3"}


def test_asha_and_hyperband_drive_it_unchanged():
    from cerebro_automl.adapters.hyperband import asha, hyperband

    def sampler(rng):
        return {"layer": str(rng.choice(["b1", "b2", "b3"])), "width": int(rng.choice([4, 8])), "lr": 0.05}

    hb = hyperband(fm.make_spec(), fm.image_data(), sampler, max_epochs=3, eta=3, executor="local")
    ashed = asha(fm.make_spec(), fm.image_data(), sampler, min_epochs=1, max_epochs=3, max_trials=6,
                 executor="local")
    for result in (hb, ashed):
        assert result.best_config["layer"] in {"b1", "b2", "b3"} and result.best_value < 2


def test_hyperopt_and_pbt_drive_it_unchanged():
    hyperopt = pytest.importorskip("hyperopt")
    from cerebro_automl.adapters.hyperopt import fmin
    from cerebro_automl.adapters.pbt import pbt

    space = {"layer": hyperopt.hp.choice("layer", ["b1", "b2", "b3"]), "width": 8,
             "lr": hyperopt.hp.loguniform("lr", -4, -1)}
    trials = hyperopt.Trials()
    fmin(fm.make_spec(), fm.image_data(), space, max_evals=4, epochs=1, trials=trials, executor="local",
         rstate=np.random.default_rng(0))
    assert [t["result"]["status"] for t in trials.trials] == ["ok"] * 4

    def sampler(rng):
        return {"layer": str(rng.choice(["b1", "b3"])), "width": 8, "lr": float(rng.uniform(0.01, 0.1))}

    result = pbt(fm.make_spec(), fm.image_data(), sampler, population=4, epochs=4, interval=2,
                 mutations={"lr": (1e-3, 1.0)}, executor="local")
    assert result.best_config["layer"] in {"b1", "b3"} and not result.history.val_loss.isna().any()
