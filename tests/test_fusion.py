"""Fused models: configurations of one architecture train as one batched model,
hop as one, and report, stop, fail, pause, fork and checkpoint one by one."""

from __future__ import annotations

import fusion_models as fm
import logging
import re

import pytest
import torch
from torch import nn
from conftest import same_states
from models import tied_model_fn

from cerebro_automl import EpochReport, ModelFailed, ModelPaused, PartitionedDataset, Session, TrainingSpec
from cerebro_automl.data.shards import TensorShard
from cerebro_automl.fusion import Member, group_config
from cerebro_automl.fusion.signature import Signatures
from cerebro_automl.training import train_unit
from cerebro_automl.training.groups import train_group
from cerebro_automl.training.schedulers import WarmupDecay


@pytest.fixture
def one_partition(arrays):
    """One partition: nothing splits a group for the workers' sake (see ``split``)."""
    from cerebro_automl import PartitionedDataset

    X, y, Xv, yv = arrays
    return PartitionedDataset.from_arrays(X, y, num_partitions=1, valid=(Xv, yv))


def _train(spec, data, configs=fm.CONFIGS, epochs=2, fuse=4, **kwargs):
    with Session(spec, data, seed=3, fuse=fuse, **kwargs) as s:
        ids = [s.add(c, epochs=epochs) for c in configs]
        history = s.run()
        states = {i: s.model(i).state()["model"] for i in ids if s.status(i) != "failed"}
        statuses = s.statuses()
        groups = {gid: [m.model_id for m in g.members] for gid, g in s._fusion.groups.items()}
    return history, states, statuses, groups


def _shard(rows=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=g)
    return TensorShard(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def _members(configs, base_seed=100):
    return [Member(i, c, base_seed + i) for i, c in enumerate(configs)]


# ------------------------------------------------------------------ the unit
def _epochs(spec, members, shard, epochs=2):
    """A group's state after ``epochs`` one-unit epochs over ``shard``."""
    state = None
    for epoch in range(epochs):
        state = train_group(spec, group_config(members), state, shard, device=torch.device("cpu"), epoch=epoch,
                            partition=0, step=0, epoch_end=True, deadline=None, fresh_hyperparameters=False,
                            budget=epochs, partitions=1)
    return state


@pytest.mark.parametrize("optimizer_fn", [fm.sgd, fm.adam, fm.adamw], ids=["sgd", "adam", "adamw"])
def test_a_fused_group_equals_its_members_trained_one_by_one_up_to_rounding(optimizer_fn):
    configs = [{"lr": lr, "weight_decay": wd, "momentum": m, "beta1": b, "gamma": g, "dropout": 0.0}
               for lr, wd, m, b, g in [(1e-2, 0.0, 0.9, 0.9, 0.5), (3e-2, 1e-2, 0.5, 0.8, 0.9),
                                       (1e-1, 1e-3, 0.0, 0.95, 0.1)]]
    members, shard = _members(configs), _shard()
    fused = _epochs(fm.spec(optimizer_fn=optimizer_fn, scheduler_fn=fm.halving), members, shard)
    apart = _epochs(fm.OwnHooksSpec(model_fn=fm.mlp, optimizer_fn=optimizer_fn, scheduler_fn=fm.halving,
                                    batch_size=32), members, shard)
    assert fused["unfused"] is None and not fused["failed"]
    assert apart["unfused"].startswith("the spec trains through OwnHooks")
    for m in members:
        a, b = fused["members"][m.model_id], apart["members"][m.model_id]
        assert a["model"].keys() == b["model"].keys()
        for name in a["model"]:
            torch.testing.assert_close(a["model"][name], b["model"][name], rtol=1e-4, atol=1e-5)
        # the optimizer's and schedulers' states in torch's own form: a member continues unfused
        assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
        assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
        for index, entry in a["optimizer"]["state"].items():
            assert entry.keys() == b["optimizer"]["state"][index].keys()
            for key, value in entry.items():
                torch.testing.assert_close(value, b["optimizer"]["state"][index][key], rtol=1e-4, atol=1e-5)
        assert a["scheduler"] == b["scheduler"]
        assert (a["samples"], a["steps"]) == (b["samples"], b["steps"]) == (len(shard), 2 * 8)
        assert a["progress"]["loss_sum"] == pytest.approx(b["progress"]["loss_sum"], rel=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "one-by-one"])
def test_a_group_units_members_carry_its_phase_seconds_as_a_plain_unit_does(fused):
    """The state moved in (the members built and stacked), training, and the state moved
    out: each member's ``progress["phase_seconds"]``, summed over the epoch's units, and
    within the seconds the unit took (one by one, each member's own pass's)."""
    configs = [{"lr": lr, "weight_decay": 0.0, "momentum": 0.9, "beta1": 0.9, "gamma": 0.5, "dropout": 0.0}
               for lr in (1e-2, 3e-2)]
    members, shard = _members(configs), _shard()
    spec = fm.spec() if fused else fm.OwnHooksSpec(model_fn=fm.mlp, optimizer_fn=fm.sgd, batch_size=32)
    state = None
    for step in range(2):  # two units of one epoch
        state = train_group(spec, group_config(members), state, shard, device=torch.device("cpu"), epoch=0,
                            partition=step, step=step, epoch_end=step == 1, deadline=None,
                            fresh_hyperparameters=False)  # fmt: skip
    assert (state["unfused"] is None) == fused and not state["failed"]
    for m in members:
        member = state["members"][m.model_id]
        phases, seconds = member["progress"]["phase_seconds"], member["progress"]["seconds"]
        assert set(phases) == {"transfer_in", "compute", "transfer_out"}, member["progress"]
        assert all(v >= 0 for v in phases.values()) and 0 < sum(phases.values()) <= seconds
        assert "phase_seconds" not in member  # only in its progress


def test_a_member_state_continues_in_the_one_loop_as_an_unfused_model_would():
    members, shard = _members([{"lr": 1e-2}, {"lr": 3e-2}]), _shard()
    spec = fm.spec(optimizer_fn=fm.sgd)
    state = _epochs(spec, members, shard, epochs=1)["members"][1]
    after = train_unit(spec, {"lr": 3e-2}, state, shard, seed=101, epoch=1, partition=0, step=0,
                       epoch_end=True, threads=1)
    assert after["steps"] == 16 and all(torch.isfinite(t).all() for t in after["model"].values())


def test_a_member_whose_loss_turns_non_finite_fails_alone_and_the_others_train_on():
    members, shard = _members([{"lr": 1e-2}, {"lr": float("inf")}, {"lr": 3e-2}]), _shard()
    state = _epochs(fm.spec(optimizer_fn=fm.sgd), members, shard)
    assert list(state["failed"]) == [1] and "NonFinite" in state["failed"][1]
    assert sorted(state["members"]) == [0, 2]
    alone = _epochs(fm.spec(optimizer_fn=fm.sgd), [members[0], members[2]], shard)
    for mid in (0, 2):  # the failed member changed nothing of the others'
        assert same_states([state["members"][mid]["model"]], [alone["members"][mid]["model"]])


def test_a_forward_that_branches_on_data_trains_one_by_one_with_the_reason():
    members, shard = _members([{"lr": 1e-2}, {"lr": 3e-2}]), _shard()
    state = _epochs(fm.spec(model_fn=fm.branchy, optimizer_fn=fm.sgd), members, shard)
    assert state["unfused"].startswith("ran fused, but")
    assert sorted(state["members"]) == [0, 1] and not state["failed"]


def test_batchnorm_running_statistics_are_each_members_own():
    members, shard = _members([{"lr": 1e-2}, {"lr": 1e-1}]), _shard()
    fused = _epochs(fm.spec(model_fn=fm.bn_mlp, optimizer_fn=fm.sgd), members, shard)
    apart = _epochs(fm.OwnHooksSpec(model_fn=fm.bn_mlp, optimizer_fn=fm.sgd, batch_size=32), members, shard)
    assert fused["unfused"] is None
    for mid in (0, 1):
        for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            torch.testing.assert_close(fused["members"][mid]["model"][name], apart["members"][mid]["model"][name],
                                       rtol=1e-4, atol=1e-5)
    assert not torch.equal(fused["members"][0]["model"]["1.running_mean"],
                           fused["members"][1]["model"]["1.running_mean"])


# ------------------------------------------------------------- signatures
def test_configs_fuse_only_when_their_models_are_built_alike():
    probe = Signatures(fm.spec())
    base = probe.of({"lr": 1e-3})
    assert probe.of({"lr": 1e-1, "beta1": 0.5}) == base  # optimizer values
    assert probe.of({"lr": 1e-3, "width": 32}) != base  # shapes
    assert probe.of({"lr": 1e-3, "dropout": 0.5}) != base  # a module's attribute
    restricted = Signatures(fm.spec(fuse_keys=("lr",)))
    assert restricted.of({"lr": 1e-3}) == restricted.of({"lr": 1e-1})
    assert restricted.of({"lr": 1e-3}) != restricted.of({"lr": 1e-3, "beta1": 0.5})


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's call
def test_huggingface_and_peft_models_fuse_by_the_values_of_their_configs():
    """A BERT built from its config, bare and under LoRA: the models hold dicts, sets
    and config objects made anew per build, which compare by value, so two learning
    rates share a signature, and another dropout or LoRA rank does not."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    def model_fn(config):
        bert = BertForSequenceClassification(BertConfig(
            vocab_size=200, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=8, hidden_dropout_prob=config.get("dropout", 0.1),
            attn_implementation=config.get("attention", "sdpa")))
        if "r" not in config:
            return bert
        return get_peft_model(bert, LoraConfig(r=config["r"], target_modules=["query", "value"],
                                               lora_dropout=config.get("lora_dropout", 0.0), task_type="SEQ_CLS"))

    probe = Signatures(fm.spec(model_fn=model_fn))
    assert probe.of({"lr": 1e-3}) == probe.of({"lr": 1e-2})
    assert probe.of({"lr": 1e-3}) != probe.of({"lr": 1e-3, "dropout": 0.3})
    assert probe.of({"lr": 1e-3}) != probe.of({"lr": 1e-3, "attention": "eager"})  # a private config field
    assert probe.of({"lr": 1e-3, "r": 4}) == probe.of({"lr": 1e-2, "r": 4})
    assert probe.of({"lr": 1e-3, "r": 4}) != probe.of({"lr": 1e-3, "r": 4, "lora_dropout": 0.2})
    # and a session trains LoRA members of one rank as one group
    from hf_models import tokens
    X, y = tokens(96)
    data = PartitionedDataset.from_arrays({k: v[:, :8] for k, v in X.items()}, y, num_partitions=2,
                                          valid_fraction=0.25)
    spec = TrainingSpec(model_fn=model_fn, optimizer_fn=lambda c, p: torch.optim.AdamW(p, lr=c["lr"]), batch_size=16)
    configs = [{"lr": lr, "r": 4} for lr in (1e-3, 3e-3, 1e-2, 3e-2)]
    history, _, statuses, groups = _train(spec, data, configs, epochs=1, fuse=2, executor="local")
    assert sorted(groups.values()) == [[0, 1], [2, 3]] and set(statuses.values()) == {"paused"}
    assert history.val_loss.notna().all()


# ------------------------------------------------------------- the session
def test_models_added_together_train_in_groups_and_report_one_by_one(data):
    history, states, statuses, groups = _train(fm.spec(), data, executor="local")
    assert sorted(groups.values()) == [[0, 1], [2, 3], [4, 5]]  # at least one group per partition (3)
    assert sorted(history.groupby("model_id").epoch.apply(list).items()) == [(i, [1, 2]) for i in range(6)]
    assert set(history["fuse"]) == {4} and set(statuses.values()) == {"paused"}
    assert history.val_loss.notna().all() and history.train_loss.notna().all()


def test_a_members_weights_are_the_same_bits_on_1_2_and_3_workers_and_either_executor(data, cluster):
    reference = _train(fm.spec(), data, executor="local")[1]
    for workers in (1, 2, 3):
        _, states, _, _ = _train(fm.spec(), data, n_workers=workers)
        assert same_states([states[i] for i in range(6)], [reference[i] for i in range(6)]), workers
    _, states, _, _ = _train(fm.spec(), data, client=cluster)
    assert same_states([states[i] for i in range(6)], [reference[i] for i in range(6)])


def test_the_first_groups_first_member_is_its_unfused_run_up_to_rounding(data):
    """Model 0 leads the first group: the group shuffles with its seed and, as the engine's
    first model, visits the partitions in its order; so only rounding differs."""
    _, fused, _, _ = _train(fm.spec(), data, executor="local")
    _, alone, _, _ = _train(fm.spec(), data, executor="local", fuse=1)
    for name in fused[0]:
        torch.testing.assert_close(fused[0][name], alone[0][name], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(fused[1]["0.weight"], alone[1]["0.weight"], atol=1e-5)  # another data order


def test_stopping_a_member_drops_its_slice_and_the_others_train_on(one_partition):
    with Session(fm.spec(), one_partition, seed=3, fuse=4, executor="local") as s:
        ids = [s.add(c, epochs=3) for c in fm.CONFIGS[:4]]
        for r in s.reports():
            if isinstance(r, EpochReport) and r.model_id == 1 and r.epoch == 1:
                s.stop(1)
        group = next(iter(s._fusion.groups.values()))
        assert sorted(s.executor.fetch_state(group.gid)["members"]) == [0, 2, 3]
        history, statuses = s.history, s.statuses()
    assert statuses == {0: "paused", 1: "stopped", 2: "paused", 3: "paused"}
    assert list(history[history.model_id == 1].epoch) == [1]
    assert all(list(history[history.model_id == i].epoch) == [1, 2, 3] for i in (0, 2, 3))
    assert ids == [0, 1, 2, 3]


def test_a_member_that_diverges_fails_alone(data, caplog):
    configs = [{"lr": 1e-2}, {"lr": 1e30}, {"lr": 3e-2}]
    with caplog.at_level(logging.WARNING, logger="cerebro_automl"):
        with Session(fm.spec(optimizer_fn=fm.sgd), data, seed=3, fuse=4, executor="local") as s:
            ids = [s.add(c, epochs=2) for c in configs]
            outcomes = list(s.reports())
            statuses = s.statuses()
            best = s.best("val_accuracy", "max")
            assert best.model_id in (0, 2) and best.build()(torch.zeros(1, 8)).shape == (1, 3)
    failed = [o for o in outcomes if isinstance(o, ModelFailed)]
    assert [f.model_id for f in failed] == [1] and "NonFinite" in failed[0].error
    assert re.search(r"(at epoch 1, partition \d, sample \d+|over partition \d in epoch 1)", failed[0].error), failed
    assert statuses == {0: "paused", 1: "failed", 2: "paused"} and ids == [0, 1, 2]
    assert sum(isinstance(o, EpochReport) and o.model_id in (0, 2) for o in outcomes) == 4


def test_a_group_that_cannot_fuse_says_why_once_and_trains_one_by_one(one_partition, caplog):
    with caplog.at_level(logging.WARNING, logger="cerebro_automl"):
        history, _, statuses, _ = _train(fm.spec(model_fn=fm.branchy, optimizer_fn=fm.sgd), one_partition,
                                         configs=fm.CONFIGS[:3], executor="local")
    lines = [r.getMessage() for r in caplog.records if "trains unfused" in r.getMessage()]
    assert len(lines) == 1 and "ran fused, but" in lines[0]
    assert set(statuses.values()) == {"paused"} and len(history) == 6


def test_extended_members_leave_at_the_pause_and_train_on_in_a_new_group(one_partition):
    with Session(fm.spec(), one_partition, seed=3, fuse=4, executor="local") as s:
        ids = [s.add(c, epochs=1) for c in fm.CONFIGS[:4]]
        paused = [o.model_id for o in s.reports() if isinstance(o, ModelPaused)]
        assert paused == ids
        s.extend(0, 2)
        s.extend(2, 2)
        s.stop(1)
        outcomes = list(s.reports())
        statuses, history = s.statuses(), s.history
        groups = {gid: [m.model_id for m in g.members] for gid, g in s._fusion.groups.items()}
    assert statuses == {0: "paused", 1: "stopped", 2: "paused", 3: "paused"}
    assert [(o.model_id, o.epoch) for o in outcomes if isinstance(o, EpochReport)] == [(0, 2), (2, 2), (0, 3), (2, 3)]
    assert sorted(groups.values()) == [[0, 2], [3]]  # the first group keeps 3, paused; 0 and 2 train together
    assert list(history[history.model_id == 0].epoch) == [1, 2, 3]


def test_a_fork_of_a_member_starts_from_its_state_and_trains_alone(data):
    with Session(fm.spec(), data, seed=3, fuse=4, executor="local") as s:
        ids = [s.add(c, epochs=2) for c in fm.CONFIGS[:3]]
        s.run()
        parent = s.model(1).state()
        child = s.add({"lr": 5e-3}, epochs=3, init_from=(1, 2))
        s.run()
        row = s.history[s.history.model_id == child].iloc[0]
        assert (row.parent, row.parent_epoch, row.epoch) == (1, 2, 3)
        assert s._fusion.group(child) is None and ids == [0, 1, 2]
        assert parent["model"].keys() == s.model(child).state()["model"].keys()


def test_each_member_is_checkpointed_and_a_resumed_session_continues_it(data, tmp_path):
    configs = fm.CONFIGS[:3]
    with Session(fm.spec(), data, seed=3, fuse=4, executor="local", checkpoint_dir=str(tmp_path)) as s:
        for c in configs:
            s.add(c, epochs=2)
        s.run()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["model-0", "model-1", "model-2"]
    with Session(fm.spec(), data, seed=3, fuse=4, executor="local", checkpoint_dir=str(tmp_path), resume=True) as s:
        for c in configs:
            s.add(c, epochs=3)
        history = s.run()
    # each continued after its epoch-2 checkpoint, epochs 1-2 replayed from the journal
    assert sorted(history.epoch.unique()) == [1, 2, 3]
    assert len(history) == 9 and history.val_loss.notna().all() and s.scheduler.units_trained == 3 * 3


def test_bad_fusion_input_is_refused_before_any_work(data):
    with pytest.raises(ValueError, match="fuse is 0, but must be an int >= 1"):
        Session(fm.spec(), data, fuse=0, executor="local")
    with Session(fm.spec(), data, fuse=2, executor="local") as s:
        with pytest.raises(ValueError, match="reserved for fusion groups"):
            s.add({"lr": 1e-3, "__cerebro_fusion_group__": 1}, epochs=1)
    with pytest.raises(TypeError, match="fuse_keys is 'lr', but must be a tuple"):
        fm.spec(fuse_keys="lr")


# --------------------------------------------------------------- the tuners
def test_grid_search_and_hyperband_pass_fuse_through(data):
    from cerebro_automl.adapters.hyperband import hyperband
    from cerebro_automl.adapters.search import grid_search

    grid = grid_search(fm.spec(), data, {"lr": fm.LRS}, epochs=2, executor="local", fuse=4)
    assert set(grid.history["fuse"]) == {4} and len(grid.history) == 12
    rng_configs = hyperband(fm.spec(), data, lambda rng: {"lr": float(10 ** rng.uniform(-3, -1))},
                            max_epochs=3, eta=3, executor="local", fuse=4)
    history = rng_configs.history
    assert set(history["fuse"]) == {4} and history.groupby("model_id").epoch.max().max() == 3


def _fused_study(data, **session_kwargs):
    import optuna

    from cerebro_automl.adapters.optuna import optimize

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2))
    with Session(fm.spec(), data, seed=5, fuse=4, **session_kwargs) as s:
        optimize(study, fm.spec(), data, lambda t: {"lr": t.suggest_float("lr", 1e-3, 3e-1, log=True)},
                 n_trials=12, epochs=3, metric="val_loss", session=s, seed=5, reproducible=True, parallelism=4)
        grouped = sum(len(g.members) > 1 or g.gid in s._fusion.groups for g in s._fusion.groups.values())
        weights = s.model(study.best_trial.number).state()["model"]
    trials = [(t.number, t.state.name, t.params, t.intermediate_values, t.value) for t in study.trials]
    return trials, weights, grouped


def test_a_reproducible_optuna_search_with_fusion_is_the_same_on_any_workers(data, cluster):
    one = _fused_study(data, executor="local", n_workers=1)
    assert one[2] >= 1  # the first asks trained as a group
    three = _fused_study(data, executor="local", n_workers=3)
    dask = _fused_study(data, client=cluster)
    assert three[0] == one[0] and dask[0] == one[0]
    assert same_states([three[1], dask[1]], [one[1], one[1]])


def test_stacked_convolutions_compute_what_each_member_computes_alone():
    """Fused convolutions (grouped convolutions under vmap) compute each member's own."""
    from cerebro_automl.fusion import StackedModels

    torch.manual_seed(0)
    members = [nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 4, 3), nn.Flatten())
               for _ in range(3)]
    x = torch.randn(5, 1, 12)
    out = StackedModels(members).call(lambda model, batch: model(batch), x)
    for i, member in enumerate(members):
        torch.testing.assert_close(out[i], member(x), rtol=1e-5, atol=1e-6)


def test_an_optimizer_option_that_cannot_vary_splits_the_group():
    def nesterov(config, params):
        return torch.optim.SGD(params, lr=config["lr"], momentum=0.9, nesterov=config["nesterov"])

    probe = Signatures(fm.spec(optimizer_fn=nesterov))
    assert probe.of({"lr": 1e-3, "nesterov": True}) == probe.of({"lr": 1e-1, "nesterov": True})
    assert probe.of({"lr": 1e-3, "nesterov": True}) != probe.of({"lr": 1e-3, "nesterov": False})


def test_a_checkpoint_written_fused_is_not_resumed_unfused(data, tmp_path):
    with Session(fm.spec(), data, seed=3, fuse=4, executor="local", checkpoint_dir=str(tmp_path)) as s:
        for c in fm.CONFIGS[:2]:
            s.add(c, epochs=1)
        s.run()
    with Session(fm.spec(), data, seed=3, executor="local", checkpoint_dir=str(tmp_path), resume=True) as s:
        with pytest.raises(ValueError, match=r"'fuse': \(4, 1\)"):
            s.add(fm.CONFIGS[0], epochs=2)


def test_asha_and_pbt_run_fused(data):
    from cerebro_automl.adapters.hyperband import asha
    from cerebro_automl.adapters.pbt import pbt

    sampler = lambda rng: {"lr": float(10 ** rng.uniform(-3, -1))}  # noqa: E731
    result = asha(fm.spec(), data, sampler, min_epochs=1, max_epochs=3, eta=2, max_trials=8, parallelism=4,
                  executor="local", fuse=4)
    assert set(result.history["fuse"]) == {4} and result.history.groupby("model_id").epoch.max().max() == 3
    population = pbt(fm.spec(), data, sampler, population=4, epochs=3, interval=1,
                     mutations={"lr": (1e-3, 1e-1)}, executor="local", fuse=4)
    history = population.history
    assert set(history["fuse"]) == {4} and history.epoch.max() == 3


def test_a_batched_evaluation_equals_each_members_own_up_to_rounding():
    """The batched pass (a GPU's) and the members' own passes (the CPU's) give the same figures."""
    from cerebro_automl.training import evaluate_unit, epoch_metrics
    from cerebro_automl.training.groups import _fused_evaluation

    members, shard = _members([{"lr": 1e-2}, {"lr": 3e-2}, {"lr": 1e-1}]), _shard()
    spec = fm.spec(optimizer_fn=fm.sgd, metrics={"accuracy": fm.accuracy, "one": lambda out, y: 1.0})
    state = _epochs(spec, members, shard, epochs=1)
    apart = epoch_metrics([evaluate_unit(spec, group_config(members), state, _shard(seed=1), seed=0, threads=1)])
    batched = _fused_evaluation(spec, members, state["members"], _shard(seed=1))
    assert sorted(batched) == sorted(apart["members"]) == [0, 1, 2]
    for mid, result in batched.items():
        own = apart["members"][mid]
        assert result.loss_sum / result.samples == pytest.approx(own["val_loss"], rel=1e-5)
        assert result.metric_sums["accuracy"] / result.samples == pytest.approx(own["val_accuracy"], rel=1e-5)
        assert result.metric_sums["one"] / result.samples == own["val_one"] == 1.0
        assert result.seconds > 0 and own["val_seconds"] > 0
    # On the CPU a fused group's members are evaluated as each would be alone: the same figures, bit for bit.
    alone = epoch_metrics([evaluate_unit(spec, group_config(members), dict(state, unfused="one by one"),
                                         _shard(seed=1), seed=0, threads=1)])
    for mid, own in apart["members"].items():
        assert {n: v for n, v in own.items() if n != "val_seconds"} == {
            n: v for n, v in alone["members"][mid].items() if n != "val_seconds"}


def test_a_stopped_member_cannot_be_extended_as_a_stopped_model_cannot(one_partition):
    with Session(fm.spec(), one_partition, seed=3, fuse=4, executor="local") as s:
        for c in fm.CONFIGS[:3]:
            s.add(c, epochs=1)
        s.stop(2)  # pending: stopped before it started
        s.run()
        s.stop(1)  # a member of a paused group
        for model_id in (1, 2):
            with pytest.raises(ValueError, match=f"model {model_id} is stopped and cannot be extended"):
                s.extend(model_id, 1)
        assert s.statuses() == {0: "paused", 1: "stopped", 2: "stopped"}


def test_stacked_models_with_tied_weights_use_the_one_tensor_under_both_names():
    """A member whose two layers share one weight (a tied embedding and output, say):
    functional_call must give both names the member's one tensor."""
    from cerebro_automl.fusion import StackedModels

    torch.manual_seed(0)
    members = [tied_model_fn({}) for _ in range(3)]
    x = torch.randn(5, 8)
    out = StackedModels(members).call(lambda model, batch: model(batch), x)
    for i, member in enumerate(members):
        torch.testing.assert_close(out[i], member(x), rtol=1e-5, atol=1e-6)


def test_a_model_with_tied_weights_trains_fused_as_one_by_one_and_keeps_its_ties():
    members, shard = _members([{"lr": 1e-2}, {"lr": 3e-2}]), _shard()
    fused = _epochs(fm.spec(model_fn=tied_model_fn, optimizer_fn=fm.sgd), members, shard)
    apart = _epochs(fm.OwnHooksSpec(model_fn=tied_model_fn, optimizer_fn=fm.sgd, batch_size=32), members, shard)
    assert fused["unfused"] is None and not fused["failed"]
    for mid in (0, 1):
        weights = fused["members"][mid]["model"]
        assert weights.keys() == apart["members"][mid]["model"].keys()  # both names, as state_dict gives them
        assert torch.equal(weights["encode.weight"], weights["decode.weight"])
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, apart["members"][mid]["model"][name], rtol=1e-4, atol=1e-5)
        model = tied_model_fn({})
        model.load_state_dict(weights)
        assert model.decode.weight is model.encode.weight


@pytest.mark.parametrize(
    "targets",
    [
        pytest.param(torch.randint(0, 4, (3, 6)), id="classes"),
        pytest.param(torch.tensor([[0, -100, 2, 1, -100, 3]] * 3), id="ignore_index"),
        pytest.param(torch.softmax(torch.randn(3, 6, 4), -1), id="probabilities"),
        pytest.param(torch.randint(0, 4, (3, 6, 2)), id="per-position"),
    ],
)
def test_the_default_loss_for_every_member_at_once_is_each_members_own(targets):
    from cerebro_automl.training.groups import cross_entropy_per_member

    torch.manual_seed(1)
    shape = (3, 6, 4, 2) if targets.dim() == 3 and not targets.is_floating_point() else (3, 6, 4)
    outputs = torch.randn(shape, requires_grad=True)
    got = cross_entropy_per_member(outputs, targets)
    want = torch.stack([torch.nn.functional.cross_entropy(o, t) for o, t in zip(outputs, targets, strict=True)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    weights = torch.randn(3)  # each member's loss weighs on its own outputs only
    (got_grad,) = torch.autograd.grad((got * weights).sum(), outputs)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), outputs)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-6, atol=1e-7)


def _smoothed_loss(out, y):
    return nn.functional.cross_entropy(out, y, label_smoothing=0.1)


def _forward_doubled(model, x, y):
    return model(x) * 2, y


@pytest.mark.parametrize("overrides", [
    {"loss_fn": _smoothed_loss},  # batched layers, the loss under vmap
    {"forward_fn": _forward_doubled},  # the whole forward under vmap
], ids=["own-loss", "own-forward"])
def test_a_group_with_its_own_loss_or_forward_equals_one_by_one_up_to_rounding(overrides):
    members, shard = _members([{"lr": 1e-2, "dropout": 0.0}, {"lr": 3e-2, "dropout": 0.0}]), _shard()
    fused = _epochs(fm.spec(optimizer_fn=fm.sgd, **overrides), members, shard)
    apart = _epochs(fm.OwnHooksSpec(model_fn=fm.mlp, optimizer_fn=fm.sgd, batch_size=32, **overrides), members, shard)
    assert fused["unfused"] is None and apart["unfused"] is not None
    for m in members:
        a, b = fused["members"][m.model_id], apart["members"][m.model_id]
        for name in a["model"]:
            torch.testing.assert_close(a["model"][name], b["model"][name], rtol=1e-4, atol=1e-5)
        assert a["progress"]["loss_sum"] == pytest.approx(b["progress"]["loss_sum"], rel=1e-5)


@pytest.mark.parametrize("options", [
    {"gradient_clip_val": 0.05},
    {"accumulate_grad_batches": 3},  # 8 batches: the pass ends within a step's batches
    {"lr_schedule": WarmupDecay(warmup=0.25)},
    {"scheduler_fn": fm.per_step_linear},
], ids=["clip", "accumulate", "lr_schedule", "per-step-scheduler"])
def test_a_fused_group_steps_as_each_members_own_pass_with_the_specs_stepping_options(options):
    """Clipping (each member's own norm), accumulation, the spec's lr_schedule and per-step
    schedulers shape a fused member's steps as they shape its own pass's."""
    configs = [{"lr": lr, "dropout": 0.0} for lr in (1e-2, 3e-2, 1e-1)]
    members, shard = _members(configs), _shard()
    fused = _epochs(fm.spec(optimizer_fn=fm.adamw, **options), members, shard)
    apart = _epochs(fm.OwnHooksSpec(model_fn=fm.mlp, optimizer_fn=fm.adamw, batch_size=32, **options), members, shard)
    plain = _epochs(fm.spec(optimizer_fn=fm.adamw), members, shard)
    assert fused["unfused"] is None and not fused["failed"]
    for m in members:
        a, b = fused["members"][m.model_id], apart["members"][m.model_id]
        for name in a["model"]:
            torch.testing.assert_close(a["model"][name], b["model"][name], rtol=1e-5, atol=1e-6)
        assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
        assert a["scheduler"] == b["scheduler"]
        assert a["progress"]["loss_sum"] == pytest.approx(b["progress"]["loss_sum"], rel=1e-6)
        # the option changed the training: a fused step that ignored it would differ above
        assert not torch.allclose(a["model"]["0.weight"], plain["members"][m.model_id]["model"]["0.weight"])


def test_a_model_left_alone_by_its_signature_says_why(one_partition, caplog):
    with caplog.at_level(logging.INFO, logger="cerebro_automl"):
        with Session(fm.spec(), one_partition, seed=3, fuse=4, executor="local") as s:
            for width in (8, 16):  # built otherwise: each its own signature
                s.add({"lr": 1e-2, "width": width}, epochs=1)
            s.run()
    said = [r.getMessage() for r in caplog.records if "trains alone" in r.getMessage()]
    assert len(said) == 1 and "no other model waiting with it has its fusion signature" in said[0], said


def test_a_member_that_ended_in_its_group_says_why_it_holds_no_state(one_partition):
    with Session(fm.spec(optimizer_fn=fm.sgd), one_partition, seed=3, fuse=4, executor="local") as s:
        for c in [{"lr": 1e-2}, {"lr": 1e30}, {"lr": 3e-2}]:
            s.add(c, epochs=2)
        for r in s.reports():
            if isinstance(r, EpochReport) and r.model_id == 2 and r.epoch == 1:
                s.stop(2)
        for model_id, status in ((1, "failed"), (2, "stopped")):
            with pytest.raises(ValueError, match=f"model {model_id} holds no trained state: it {status} in its fusion"):
                s.model(model_id).state()
        assert s.model(0).state()["model"]


def test_a_state_saved_without_an_lr_schedule_continues_under_one_from_the_configs_lr():
    """A state from a run without the schedule has no initial_lr (the schedule's base):
    its members take the config's learning rate as the base, fused and one by one."""
    members, shard = _members([{"lr": lr, "dropout": 0.0} for lr in (1e-2, 3e-2)]), _shard()
    before = _epochs(fm.spec(optimizer_fn=fm.adamw), members, shard, epochs=1)
    for spec in (fm.spec(optimizer_fn=fm.adamw, lr_schedule=WarmupDecay(warmup=0.0)),
                 fm.OwnHooksSpec(model_fn=fm.mlp, optimizer_fn=fm.adamw, batch_size=32,
                                 lr_schedule=WarmupDecay(warmup=0.0))):
        after = train_group(spec, group_config(members), before, shard, device=torch.device("cpu"), epoch=1,
                            partition=0, step=0, epoch_end=True, deadline=None, fresh_hyperparameters=False,
                            budget=2, partitions=1)
        assert not after["failed"] and sorted(after["members"]) == [0, 1], after["failed"]
        for m in members:  # linear decay to 0 at the budget's end, from the config's lr
            group = after["members"][m.model_id]["optimizer"]["param_groups"][0]
            assert group["initial_lr"] == m.config["lr"] and group["lr"] == pytest.approx(0.0, abs=1e-12)
