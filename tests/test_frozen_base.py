"""The frozen base: a model's frozen parameters stay on the worker; a unit moves, and a
checkpoint holds, only what trains. The bits are those of the whole model hopping."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import frozen_models as fm
from cerebro_automl import PartitionedDataset, Session
from cerebro_automl.training import clear_models, kept_models
from conftest import make_arrays

X, y, Xv, yv = make_arrays(rows=600, valid_rows=150)


def _data(partitions: int = 3):
    return PartitionedDataset.from_arrays(X, y, num_partitions=partitions, valid=(Xv, yv))


def _run(spec, configs=fm.CONFIGS, epochs=2, **kwargs):
    """(val_loss by model and epoch, final states, best model built) of a search."""
    kwargs.setdefault("executor", "local")
    with Session(spec, _data(kwargs.pop("partitions", 3)), seed=1, **kwargs) as s:
        ids = [s.add(c, epochs=epochs) for c in configs]
        s.run()
        h = s.history.sort_values(["model_id", "epoch"])
        states = [s.model(i).state() for i in ids]
        return list(zip(h.model_id, h.epoch, h.val_loss)), states, s.best("val_loss").build()


def _trainable_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def test_only_what_trains_hops_and_the_bits_are_the_whole_models():
    whole_losses, whole_states, whole_best = _run(fm.make_spec(frozen_base=False))
    losses, states, best = _run(fm.make_spec())
    assert losses == whole_losses  # val_loss bit for bit
    model = fm.model_fn(fm.CONFIGS[0])
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    for state, whole in zip(states, whole_states):
        assert "base" in state and "base" not in whole
        assert frozen.isdisjoint(state["model"]) and frozen <= set(whole["model"])
        # what hops is what the whole model trained, bit for bit (BatchNorm's statistics included)
        assert all(torch.equal(t, whole["model"][k]) for k, t in state["model"].items())
        assert set(state["model"]) == set(whole["model"]) - frozen
    # build() gives the whole model: the frozen base from a build here, the rest trained
    assert type(best) is fm.FineTuned
    assert best.state_dict().keys() == whole_best.state_dict().keys()
    assert all(torch.equal(v, whole_best.state_dict()[k]) for k, v in best.state_dict().items())


def test_model_fn_runs_once_per_worker_and_config_and_configs_share_one_base():
    spec = fm.make_spec()
    fm.BUILDS["count"] = 0
    base = fm.model_fn(fm.CONFIGS[0])
    frozen_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if not p.requires_grad)
    with Session(spec, _data(), seed=1, executor="local") as s:
        for c in fm.CONFIGS:
            s.add(c, epochs=3)  # 4 configs x 3 epochs x 3 partitions = 36 units, and their evaluations
        s.run()
        kept, builds, held = kept_models(spec)
        assert kept == len(fm.CONFIGS)
        assert builds == len(fm.CONFIGS) and fm.BUILDS["count"] == 1 + len(fm.CONFIGS)  # (1: base, above)
        assert held == frozen_bytes  # four configs, one copy of their base
        # a config that picks other frozen weights is another base, held beside the first
        s.add({**fm.CONFIGS[0], "base_seed": 5}, epochs=1)
        s.run()
        assert kept_models(spec)[2] == 2 * frozen_bytes
    assert kept_models(spec) == (0, 0, 0)  # the session's end frees them


def test_a_checkpoint_holds_what_trains_and_resume_continues_it(tmp_path):
    spec = fm.make_spec()
    config = fm.CONFIGS[0]
    with Session(spec, _data(), seed=1, executor="local", checkpoint_dir=str(tmp_path)) as s:
        s.add(config, epochs=2)
        s.run()
        straight = s.model(0).state()
    files = sorted(Path(tmp_path).rglob("epoch-*.pt"))
    assert files
    model = fm.model_fn(config)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # AdamW keeps two moments per trainable parameter; the rest is metadata
    limit = 3 * _trainable_bytes(model) + buffers + 16_384
    whole = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for f in files:
        assert os.path.getsize(f) <= limit < whole
    clear_models()  # a new driver: the workers build the base again
    with Session(spec, _data(), seed=1, executor="local", checkpoint_dir=str(tmp_path), resume=True) as s:
        s.add(config, epochs=3)
        s.run()
        resumed = s.model(0).state()
        # epochs 1 and 2 came from the checkpoint, their reports from the journal
        assert s.history.epoch.tolist() == [1, 2, 3] and s.scheduler.units_trained == 3
        build = s.model(0).build()
    assert "base" in resumed and not torch.equal(resumed["model"]["head.0.weight"], straight["model"]["head.0.weight"])
    assert torch.equal(build.trunk[0].weight, model.trunk[0].weight)


def test_forks_and_a_config_that_unfreezes_more_start_from_the_parent():
    spec = fm.make_spec()
    with Session(spec, _data(), seed=1, executor="local") as s:
        parent = s.add(fm.CONFIGS[0], epochs=1)
        s.run()
        before = s.model(parent).state()["model"]
        same = s.add({**fm.CONFIGS[0], "lr": 0.0}, epochs=2, init_from=(parent, 1))
        wider = s.add({**fm.CONFIGS[0], "unfreeze": True}, epochs=2, init_from=(parent, 1))
        s.run()
        after = s.model(same).state()["model"]
        assert all(torch.equal(after[k], v) for k, v in before.items() if "running" not in k and "batches" not in k)
        unfrozen = s.model(wider).state()["model"]
        assert "trunk.2.weight" in unfrozen  # the newly trainable layer started from the base and hops now
        assert not torch.equal(unfrozen["trunk.2.weight"], fm.model_fn(fm.CONFIGS[0]).trunk[2].weight)


@pytest.mark.cluster
def test_weights_are_the_same_on_1_2_and_3_workers_and_either_executor():
    spec = fm.make_spec()
    reference, states, _ = _run(spec)
    for n in (1, 2, 3):
        losses, got, _ = _run(spec, executor="dask", n_workers=n)
        assert losses == reference
        for a, b in zip(got, states):
            assert a["model"].keys() == b["model"].keys()
            assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.cluster
def test_a_worker_whose_base_differs_fails_that_model_naming_the_worker_and_the_tensor():
    spec = fm.make_spec(model_fn=fm.per_process_model_fn)
    with Session(spec, _data(2), seed=1, n_workers=2) as s:
        bad = s.add(fm.CONFIGS[0], epochs=1)
        reports = list(s.reports())
        assert s.status(bad) == "failed"
    error = s.model(bad).error if hasattr(s, "model") else None
    failed = [r for r in reports if type(r).__name__ == "ModelFailed"]
    text = failed[0].error if failed else error
    assert "BaseMismatchError" in text and "worker tcp://" in text and "'trunk.0.bias'" in text, text


def _kept_on_worker() -> int:
    from cerebro_automl.training import base

    return sum(len(models.entries) for _, models in base._BY_SPEC.values())


@pytest.mark.cluster
def test_a_cluster_that_outlives_the_session_drops_its_kept_modules(cluster):
    with Session(fm.make_spec(), _data(), seed=1, client=cluster) as s:
        s.add(fm.CONFIGS[0], epochs=1)
        s.run()
        assert sum(cluster.run(_kept_on_worker).values()) >= 1
    assert sum(cluster.run(_kept_on_worker).values()) == 0


def test_with_fuse_members_with_a_frozen_base_train_fused_and_hop_only_what_trains(caplog):
    """Each group's members share the worker's one copy of the base (stacked once, its
    layers run once for all of them); the losses are those of the same groups with the
    whole models hopping (every weight stacked) up to float rounding, and a member's
    state holds what trains and the base's record, as alone."""
    from cerebro_automl.fusion import StackedModels

    stacked: list[StackedModels] = []
    real_init = StackedModels.__init__

    def spy(self, models):
        real_init(self, models)
        stacked.append(self)

    caplog.set_level("INFO", logger="cerebro_automl")
    with pytest.MonkeyPatch.context() as patch:  # the local executor trains in this process
        patch.setattr(StackedModels, "__init__", spy)
        losses, states, _ = _run(fm.make_spec(), fuse=4, partitions=1)  # 1 partition: groups of 2
        whole_losses, whole_states, _ = _run(fm.make_spec(frozen_base=False), fuse=4, partitions=1)
    assert "trains unfused" not in caplog.text
    base_groups = [s for s in stacked if s.shared]
    assert len(base_groups) == len(stacked) // 2 > 0
    assert all(s.k == 2 and "trunk.0.weight" in s.shared and "trunk.0.weight" not in s.params for s in base_groups)
    assert [row[:2] for row in losses] == [row[:2] for row in whole_losses]
    np.testing.assert_allclose([row[2] for row in losses], [row[2] for row in whole_losses], rtol=1e-5)
    for state, whole in zip(states, whole_states, strict=True):
        assert "base" in state and "base" not in whole
        assert "trunk.0.weight" in whole["model"] and set(state["model"]) < set(whole["model"])
        for name, tensor in state["model"].items():  # the head and BatchNorm's statistics
            torch.testing.assert_close(tensor, whole["model"][name], rtol=1e-4, atol=1e-6)


def test_members_of_one_config_with_a_frozen_base_train_one_by_one_with_their_own_weights():
    """Two members of one config (and so one seed) check out the one module the worker
    keeps for it: the group trains them one after the other, each from its own state."""
    from cerebro_automl.data import TensorShard
    from cerebro_automl.fusion import Member, group_config
    from cerebro_automl.training import train_group

    spec, config = fm.make_spec(), fm.CONFIGS[0]
    members = [Member(0, config, 7), Member(1, config, 7)]
    shard = TensorShard(torch.as_tensor(X[:96]), torch.as_tensor(y[:96]))

    def unit(state, epoch):
        return train_group(spec, group_config(members), state, shard, device=torch.device("cpu"), epoch=epoch,
                           partition=0, step=0, epoch_end=True, deadline=None, fresh_hyperparameters=False)  # fmt: skip

    first = unit(None, 0)
    with torch.no_grad():  # member 1's weights go their own way
        for tensor in first["members"][1]["model"].values():
            if tensor.is_floating_point():
                tensor.add_(0.5)
    second = unit(first, 1)
    assert second["unfused"] and "one config and seed" in second["unfused"]
    for i in (0, 1):
        alone = train_group(spec, group_config([members[i]]), {"members": {i: first["members"][i]}}, shard,
                            device=torch.device("cpu"), epoch=1, partition=0, step=0, epoch_end=True, deadline=None,
                            fresh_hyperparameters=False)["members"][i]  # fmt: skip
        for name, tensor in second["members"][i]["model"].items():
            torch.testing.assert_close(tensor, alone["model"][name], msg=lambda m, n=name, i=i: f"member {i} {n}: {m}")
