"""LightningModules, unmodified, on MOP: steps, logging, optimizers, counters, hooks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("lightning")
from lightning.pytorch.demos.boring_classes import BoringModel, DemoModel, ManualOptimBoringModel  # noqa: E402

from cerebro_automl import PartitionedDataset, Session  # noqa: E402
from cerebro_automl.adapters.lightning import LightningSpec  # noqa: E402

from conftest import make_arrays  # noqa: E402
from lightning_modules import LitFineTune, LitTwin, MeanLogger, PLClassifier, classifier  # noqa: E402

PARTITIONS, BATCH = 3, 32


def _data():
    X, y, Xv, yv = make_arrays()
    return PartitionedDataset.from_arrays(X, y, num_partitions=PARTITIONS, valid=(Xv, yv))


def _train(spec, configs, epochs=3, **session):
    session = {"executor": "local", **session}
    with Session(spec, _data(), **session) as s:
        ids = [s.add(c, epochs=epochs) for c in configs]
        history = s.run().sort_values(["model_id", "epoch"], kind="stable").reset_index(drop=True)
        errors = [s.model(i).error for i in ids]
        states = [s.model(i).state() if error is None else None for i, error in zip(ids, errors)]
    return history, states, errors


def _batches_per_epoch():
    X = make_arrays()[0]
    rows = [len(p) for p in np.array_split(np.arange(len(X)), PARTITIONS)]
    return sum(math.ceil(r / BATCH) for r in rows)


def test_logged_validation_values_equal_the_full_validation_set():
    spec = LightningSpec(classifier, batch_size=BATCH, eval_batch_size=50)  # 4 batches per shard
    history, states, _ = _train(spec, [{"lr": 0.05}], epochs=2)
    module = classifier({"lr": 0.05})
    module.load_state_dict(states[0]["model"])
    module.eval()
    _, _, Xv, yv = make_arrays()
    with torch.no_grad():
        logits = module(torch.from_numpy(Xv))
    last = history.iloc[-1]
    assert last["val_loss"] == pytest.approx(float(F.cross_entropy(logits, torch.from_numpy(yv))), rel=1e-5)
    assert last["val_acc"] == pytest.approx(float((logits.argmax(-1) == torch.from_numpy(yv)).float().mean()),
                                            rel=1e-6)
    assert {"train_loss", "val_loss", "val_acc"} <= set(history.columns)


def test_epoch_counters_and_epoch_hooks_follow_the_model_across_partitions():
    history, states, _ = _train(LightningSpec(classifier, batch_size=BATCH), [{"lr": 0.01}], epochs=3,
                                n_workers=2)
    model = states[0]["model"]
    per_epoch = _batches_per_epoch()
    assert int(model["epoch_starts"]) == 3 and int(model["epoch_ends"]) == 3  # not 3 x partitions
    assert int(model["seen_epoch"]) == 2                 # 0-based, the model's own epoch
    assert int(model["seen_step"]) == 3 * per_epoch - 1  # optimizer steps before the last one
    assert int(model["seen_batch_idx"]) == per_epoch - 1  # batch_idx counts across the epoch
    assert states[0]["steps"] == 3 * per_epoch


@pytest.mark.parametrize("form, expected_lr", [
    ("optimizer", lambda lr, steps, epochs: lr),
    ("list", lambda lr, steps, epochs: lr),
    ("tuple", lambda lr, steps, epochs: lr * 0.5 ** epochs),            # StepLR per epoch
    ("dict_epoch", lambda lr, steps, epochs: lr * 0.5 ** (epochs // 2)),  # frequency 2
    ("dict_step", None),                                                # checked below
    ("plateau", lambda lr, steps, epochs: lr * 0.1 ** epochs),          # threshold 10: never "better"
])
def test_every_configure_optimizers_form_trains_and_its_scheduler_state_hops(form, expected_lr):
    lr, epochs = 0.04, 3
    _, states, errors = _train(LightningSpec(classifier, batch_size=BATCH), [{"lr": lr, "form": form}],
                               epochs=epochs, n_workers=2)
    assert errors == [None]
    got = states[0]["optimizer"]["param_groups"][0]["lr"]
    if form == "dict_step":  # StepLR(gamma 0.9) every 3rd batch of each epoch (Lightning's batch_idx rule)
        steps = sum((_batches_per_epoch()) // 3 for _ in range(epochs))
        assert got == pytest.approx(lr * 0.9 ** steps)
    else:
        assert got == pytest.approx(expected_lr(lr, states[0]["steps"], epochs))
    assert states[0]["optimizer"]["state"]  # momentum buffers hopped too


@pytest.mark.parametrize("form, message", [
    ("two_optimizers", r"configure_optimizers returned 2 optimizers, but automatic optimization trains "
                       r"with exactly one"),
    ("first_layer_only", r"configure_optimizers\(\) built, for config \{'lr': 0.01, 'form': 'first_layer_only'\}, "
                         r"an optimizer that holds 2 of the model's 4 trainable parameters \(it lacks "
                         r"'net.3.weight', 'net.3.bias'\); .*\(build it from self.parameters\(\)"),
])
def test_unsupported_optimizer_set_ups_are_refused_at_add(form, message):
    with Session(LightningSpec(classifier, batch_size=BATCH), _data(), executor="local") as s:
        with pytest.raises(ValueError, match=message):
            s.add({"lr": 0.01, "form": form}, epochs=1)


def test_a_plateau_on_a_validation_value_fails_that_model_with_the_reason():
    _, _, errors = _train(LightningSpec(classifier, batch_size=BATCH),
                          [{"lr": 0.01, "form": "plateau_on_val"}, {"lr": 0.01}], epochs=2)
    assert "lr_scheduler monitors 'val_loss'" in errors[0] and "monitor a value logged in training_step" in errors[0]
    assert errors[1] is None


def test_manual_optimization_is_refused_with_the_reason():
    spec = LightningSpec(lambda config: ManualOptimBoringModel(), batch_size=8, collate=lambda x, y: x)
    X = np.random.default_rng(0).normal(size=(64, 32)).astype(np.float32)
    data = PartitionedDataset.from_arrays(X, np.zeros(64, dtype=np.int64), num_partitions=2)
    with Session(spec, data, executor="local") as s:
        with pytest.raises(ValueError, match=r"ManualOptimBoringModel sets automatic_optimization = False, "
                                             r"but cerebro_automl drives automatic optimization only"):
            s.add({}, epochs=1)


def _random_inputs(features: int, rows: int = 96):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(rows, features)).astype(np.float32)
    Xv = rng.normal(size=(32, features)).astype(np.float32)
    zeros = np.zeros(rows, dtype=np.int64)
    return PartitionedDataset.from_arrays(X, zeros, num_partitions=2, valid=(Xv, np.zeros(32, dtype=np.int64)))


@pytest.mark.parametrize("module_cls", [BoringModel, DemoModel], ids=["BoringModel", "DemoModel"])
def test_modules_shipped_inside_lightning_train(module_cls):
    """BoringModel: a dict with "loss", ([optimizer], [StepLR]); DemoModel: a bare tensor, one optimizer."""
    spec = LightningSpec(lambda config: module_cls(), batch_size=16, collate=lambda x, y: x)
    with Session(spec, _random_inputs(32), executor="local", n_workers=2) as s:
        mid = s.add({}, epochs=2)
        history = s.run()
        state = s.model(mid).state()
        assert s.model(mid).error is None
    assert list(history.epoch) == [1, 2] and history.train_loss.notna().all()
    before = module_cls().state_dict()
    assert any(not torch.equal(before[k], state["model"][k]) for k in before)  # it trained


def test_both_lightning_packages_give_the_same_bits():
    configs = [{"lr": 0.02, "width": 8}]
    a = _train(LightningSpec(lambda c: PLClassifier(c["lr"], c["width"]), batch_size=BATCH), configs)
    b = _train(LightningSpec(lambda c: LitTwin(c["lr"], c["width"]), batch_size=BATCH), configs)
    assert all(torch.equal(a[1][0]["model"][k], b[1][0]["model"][k]) for k in a[1][0]["model"])
    assert list(a[0].val_loss) == list(b[0].val_loss)


def test_bitwise_identical_across_worker_counts(cluster):
    from distributed import Client, LocalCluster
    spec = LightningSpec(classifier, batch_size=BATCH)
    configs = [{"lr": lr, "form": "tuple"} for lr in (0.01, 0.05)]
    local = _train(spec, configs, epochs=2, executor="local")
    two = _train(spec, configs, epochs=2, executor="dask", client=cluster)
    with LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=None) as c3, Client(c3) as client3:
        three = _train(spec, configs, epochs=2, executor="dask", client=client3)
    for other in (two, three):
        for mine, theirs in zip(local[1], other[1]):
            assert all(torch.equal(mine["model"][k], theirs["model"][k]) for k in mine["model"])
        assert list(local[0].val_acc) == list(other[0].val_acc)


def test_a_log_reduction_other_than_mean_fails_the_model_with_the_reason():
    spec = LightningSpec(lambda c: MeanLogger(c["lr"]), batch_size=BATCH)
    _, _, errors = _train(spec, [{"lr": 0.01}], epochs=1)
    assert "reduce_fx='max'" in errors[0] and "only 'mean' is supported" in errors[0]


def test_bad_module_fn_results_are_refused_at_add():
    spec = LightningSpec(lambda c: torch.nn.Linear(8, 3), batch_size=BATCH)
    with Session(spec, _data(), executor="local") as s:
        with pytest.raises(TypeError, match=r"module_fn returned Linear, but must return a LightningModule"):
            s.add({}, epochs=1)
    with pytest.raises(TypeError, match=r"module_fn is 3, but must be callable"):
        LightningSpec(3)


def test_tuners_take_a_lightning_spec():
    import optuna

    from cerebro_automl.adapters.optuna import optimize
    from cerebro_automl.adapters.search import grid_search

    spec = LightningSpec(classifier, batch_size=BATCH)
    result = grid_search(spec, _data(), {"lr": [0.01, 0.05]}, epochs=2, metric="val_acc", mode="max",
                         executor="local")
    assert 0 <= result.best_value <= 1 and result.best_config["lr"] in (0.01, 0.05)
    study = optuna.create_study(direction="maximize",
                                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1))
    optimize(study, spec, _data(), lambda t: {"lr": t.suggest_float("lr", 1e-3, 1e-1, log=True)},
             n_trials=4, epochs=2, metric="val_acc", executor="local")
    assert len(study.trials) == 4 and study.best_value > 0.3
    with pytest.raises(ValueError, match=r"metric is 'val_f1', but model \d's epoch 1 reported only \['train_loss', "
                                         r".*'val_acc'") as raised:  # at the first epoch, not after all of them
        grid_search(spec, _data(), {"lr": [0.01, 0.05]}, epochs=3, metric="val_f1", executor="local")
    assert len(raised.value.history) < 6, raised.value.history
    with pytest.raises(ValueError, match=r"metric is 'val_f1', but the epoch reported only \["):
        optimize(optuna.create_study(), spec, _data(), lambda t: {"lr": 0.01}, n_trials=1, epochs=1,
                 metric="val_f1", executor="local")
    declared = LightningSpec(classifier, batch_size=BATCH, logged=["val_loss", "val_acc"])
    with pytest.raises(ValueError, match=r"metric is 'val_f1', but the spec produces only"):
        grid_search(declared, _data(), {"lr": [0.01]}, epochs=1, metric="val_f1", executor="local")


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_precision_runs_the_steps_under_autocast_as_the_trainer_does(precision):
    mixed = LightningSpec(classifier, batch_size=BATCH, precision=precision)
    one, states, errors = _train(mixed, [{"lr": 0.05}], epochs=2)
    two, states_two, _ = _train(mixed, [{"lr": 0.05}], epochs=2, n_workers=2)
    _, fp32, _ = _train(LightningSpec(classifier, batch_size=BATCH), [{"lr": 0.05}], epochs=2)
    assert errors == [None] and one["val_acc"].notna().all()
    assert all(torch.equal(states[0]["model"][k], states_two[0]["model"][k]) for k in states[0]["model"])
    assert not all(torch.equal(states[0]["model"][k], fp32[0]["model"][k]) for k in fp32[0]["model"])
    assert ("scaler" in states[0]) == (precision == "16-mixed")  # the GradScaler's state hops too


def test_a_bad_precision_is_refused_naming_it():
    with pytest.raises(ValueError, match="precision is '64', but must be one of"):
        LightningSpec(classifier, precision="64")


# ------------------------------------------------ one loop for both kinds of spec
def _unit(spec, config, state=None, **kw):
    from cerebro_automl.data import TensorShard
    from cerebro_automl.training import train_unit

    X, y, _, _ = make_arrays(rows=96)
    args = dict(seed=7, epoch=0, partition=0, step=0, epoch_end=True, threads=1)
    return train_unit(spec, config, state, TensorShard(torch.from_numpy(X), torch.from_numpy(y)), **{**args, **kw})


class _NanLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.net(x) * float("nan")


def test_a_nan_loss_raises_the_same_error_on_both_paths():
    from lightning_modules import LitClassifier
    from models import make_spec

    from cerebro_automl.training import UnitError

    class LitNan(LitClassifier):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * float("nan")

    expected = "NonFiniteLossError: loss is nan at epoch 3, partition 1, sample 0"
    for spec, config in ((make_spec(model_fn=lambda c: _NanLoss()), {"lr": 0.1}),
                         (LightningSpec(lambda c: LitNan(c["lr"]), batch_size=BATCH), {"lr": 0.1})):
        with pytest.raises(UnitError) as failed:
            _unit(spec, config, epoch=2, partition=1)
        assert str(failed.value).startswith(expected), (type(spec).__name__, str(failed.value))


def test_both_paths_save_the_lr_scheduler_state_in_one_form():
    from models import make_spec, step_scheduler

    plain, lit = make_spec(), LightningSpec(classifier, batch_size=BATCH)
    config = {"lr": 0.1, "width": 16}
    # no scheduler: None on both paths
    assert _unit(plain, config)["scheduler"] is None
    assert _unit(lit, {**config, "form": "optimizer"})["scheduler"] is None
    # one StepLR(step_size=1, gamma=0.5), stepped at the epoch's end: its state_dict on both
    a = _unit(make_spec(scheduler_fn=step_scheduler), config)["scheduler"]
    b = _unit(lit, {**config, "form": "tuple"})["scheduler"]
    assert isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
    assert (a["last_epoch"], a["_last_lr"], b["last_epoch"], b["_last_lr"]) == (1, [0.05], 1, [0.05])
    # a state saved with a list of scheduler states resumes as well
    state = _unit(lit, {**config, "form": "tuple"})
    state["scheduler"] = [state["scheduler"]]
    resumed = _unit(lit, {**config, "form": "tuple"}, state, epoch=1)
    assert resumed["scheduler"]["last_epoch"] == 2 and resumed["scheduler"]["_last_lr"] == [0.025]


def test_a_lightning_module_with_a_frozen_trunk_hops_only_its_head_with_the_same_bits():
    configs = [{"lr": 0.01, "width": 8}, {"lr": 0.003, "width": 16}]
    module = lambda c: LitFineTune(**c)  # noqa: E731
    whole, whole_states, _ = _train(LightningSpec(module, batch_size=BATCH, frozen_base=False), configs, epochs=2)
    kept, states, _ = _train(LightningSpec(module, batch_size=BATCH), configs, epochs=2)
    assert whole.val_loss.tolist() == kept.val_loss.tolist()
    for state, full in zip(states, whole_states):
        assert set(state["model"]) == {k for k in full["model"] if not k.startswith("trunk.")}
        assert all(torch.equal(t, full["model"][k]) for k, t in state["model"].items())
