"""Normalizations in the batched calls: BatchNorm (one ``F.batch_norm`` for every member,
HFTA's way) and GroupNorm compute what each member computes alone, outputs, gradients
and running statistics, and a ResNet-shaped model trains fused without vmap."""

from __future__ import annotations

import fusion_models as fm
import pytest
import torch
from torch import nn

from cerebro_automl.data.shards import TensorShard
from cerebro_automl.fusion import Member, group_config
from cerebro_automl.fusion.batched import BatchedLayers
from cerebro_automl.fusion.stacked import StackedModels
from cerebro_automl.training import epoch_metrics, evaluate_unit
from cerebro_automl.training.groups import _fused_evaluation, train_group
from cerebro_automl.training.transfer import clone_tensors


def _members(build, k=3):
    models = []
    for seed in range(k):
        torch.manual_seed(seed)
        model = build().double()
        with torch.no_grad():  # not the initial 1 and 0, the same for every member
            for module in model.modules():
                if isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm)) and module.affine:
                    module.weight.uniform_(0.5, 1.5)
                    module.bias.uniform_(-0.5, 0.5)
        models.append(model)
    return models


class _Norm(nn.Module):
    """``before``, then the normalization ``norm``, then ``after``."""

    def __init__(self, before: list[nn.Module], norm: nn.Module, after: list[nn.Module]) -> None:
        super().__init__()
        self.before, self.norm, self.after = nn.Sequential(*before), norm, nn.Sequential(*after)

    def forward(self, x):
        return self.after(self.norm(self.before(x)))


def _bn1d_rows(**options):  # after a linear layer: the members in front
    return _Norm([nn.Linear(6, 8)], nn.BatchNorm1d(8, **options), [nn.ReLU(), nn.Linear(8, 2)])


def _bn1d_positions():  # after a 1-d convolution: channels last
    return _Norm([nn.Conv1d(2, 4, 3)], nn.BatchNorm1d(4), [nn.GELU(), nn.Flatten(), nn.Linear(4 * 8, 2)])


def _bn2d(**options):  # after a 2-d convolution: channels last, side by side in one copy
    return _Norm([nn.Conv2d(3, 4, 3, padding=1)], nn.BatchNorm2d(4, **options),
                 [nn.ReLU(), nn.Conv2d(4, 3, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2)])  # fmt: skip


def _bn2d_twice():  # the second BatchNorm takes the first's side-by-side channels as they are
    return _Norm([nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.MaxPool2d(2)], nn.BatchNorm2d(4, affine=False),
                 [nn.SiLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2)])  # fmt: skip


def _bn3d():
    return _Norm([nn.Conv3d(1, 2, 2)], nn.BatchNorm3d(2),
                 [nn.SiLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(2, 2)])  # fmt: skip


def _bn_first():  # on the shared batch itself
    return _Norm([], nn.BatchNorm2d(3), [nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(2 * 6 * 6, 2)])


def _group_norm(affine=True):
    after = [nn.GELU(), nn.Conv2d(4, 4, 3), nn.GroupNorm(4, 4), nn.Flatten(), nn.Linear(4 * 4 * 4, 2)]
    return _Norm([nn.Conv2d(3, 4, 3)], nn.GroupNorm(2, 4, affine=affine), after)


_MODELS = {
    "bn1d-rows": (_bn1d_rows, (5, 6)),
    "bn1d-positions": (_bn1d_positions, (5, 2, 10)),
    "bn2d": (_bn2d, (5, 3, 8, 8)),
    "bn2d-without-affine": (lambda: _bn2d(affine=False), (5, 3, 8, 8)),
    "bn2d-twice": (_bn2d_twice, (5, 3, 8, 8)),
    "bn3d": (_bn3d, (4, 1, 5, 5, 5)),
    "bn-on-the-shared-batch": (_bn_first, (5, 3, 8, 8)),
    "cumulative-average": (lambda: _bn2d(momentum=None), (5, 3, 8, 8)),
    "cumulative-average-rows": (lambda: _bn1d_rows(momentum=None), (5, 6)),
    "untracked": (lambda: _bn2d(track_running_stats=False), (5, 3, 8, 8)),
    "other-momentum-and-eps": (lambda: _bn1d_rows(momentum=0.3, eps=1e-3), (5, 6)),
    "group-norm": (_group_norm, (5, 3, 8, 8)),
    "group-norm-without-affine": (lambda: _group_norm(affine=False), (5, 3, 8, 8)),
    "resnet": (fm.SmallResNet, (6, 3, 8, 8)),
}


def _buffers(stacked: StackedModels, models: list[nn.Module]) -> None:
    """Each member's slice of the stacked buffers equals its own model's buffers."""
    for i, model in enumerate(models):
        for name, buffer in model.named_buffers():
            torch.testing.assert_close(stacked.buffers[name][i], buffer, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("name", list(_MODELS))
def test_training_steps_give_each_members_outputs_gradients_and_running_statistics(name):
    """In double precision, where another order of the same sums rounds far below the tolerance."""
    build, shape = _MODELS[name]
    models = _members(build)
    stacked = StackedModels(models)
    assert stacked.layers_for(torch.zeros(shape, dtype=torch.float64)) is not None  # the batched calls, not vmap
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randn(shape, generator=generator, dtype=torch.float64)
        for p in stacked.params.values():
            p.grad = None
        out = stacked.batched_forward(x)
        out.pow(2).sum().backward()
        for i, model in enumerate(models):
            model.zero_grad()
            own = model(x)
            own.pow(2).sum().backward()
            where = f"member {i}, step {step}"
            torch.testing.assert_close(out[i], own, msg=lambda m, where=where: f"{where}: {m}")
            for pname, p in model.named_parameters():
                torch.testing.assert_close(stacked.params[pname].grad[i], p.grad,
                                           msg=lambda m, at=f"{pname} of {where}": f"{at}: {m}")  # fmt: skip
        _buffers(stacked, models)


@pytest.mark.parametrize("name", list(_MODELS))
def test_evaluation_gives_each_members_outputs_with_its_running_statistics(name):
    build, shape = _MODELS[name]
    models = _members(build)
    x = torch.randn(shape, dtype=torch.float64)
    for model in models:  # running statistics of its own for each member
        model(torch.randn(shape, dtype=torch.float64) * 2 + 1)
        model.eval()
    stacked = StackedModels(models)
    assert stacked.layers_for(x) is not None
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            out = stacked.batched_forward(x)
        for i, model in enumerate(models):
            torch.testing.assert_close(out[i], model(x))
    _buffers(stacked, models)  # evaluation leaves them as they were


@pytest.mark.parametrize("name", ["bn2d", "resnet", "group-norm"])
def test_in_single_precision_the_outputs_and_gradients_are_what_vmap_gives(name):
    build, shape = _MODELS[name]
    models = [m.float() for m in _members(build)]
    stacked = StackedModels(models)
    x = torch.randn(shape)
    results = []
    for forward in (stacked.batched_forward, lambda x: stacked.call(lambda model, x: model(x), x)):
        for p in stacked.params.values():
            p.grad = None
        out = forward(x)
        out.pow(2).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in stacked.params.items()}))
    (out_b, grads_b), (out_v, grads_v) = results
    torch.testing.assert_close(out_b, out_v, rtol=1e-4, atol=1e-5)
    for pname in grads_v:  # BatchNorm's backward divides by the batch's spread: rounding grows
        torch.testing.assert_close(grads_b[pname], grads_v[pname], rtol=1e-3, atol=1e-4)


class _OwnBatchNorm(nn.BatchNorm1d):
    def forward(self, x):
        return super().forward(x) * 2


class _Counting(nn.Module):
    """Changes a buffer in place where the recording cannot see it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(x)


@pytest.mark.parametrize("build", [
    lambda: nn.Sequential(nn.Linear(3, 4), _OwnBatchNorm(4)),
    lambda: nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4)),
    _Counting,
], ids=["a-subclass-with-its-own-forward", "sync-batchnorm", "a-buffer-changed-in-place"])
def test_a_normalization_without_a_batched_form_goes_through_vmap(build):
    x = torch.randn(5, 3, dtype=torch.float64)
    assert BatchedLayers.of(build().double(), x) is None
    stacked = StackedModels(_members(build))
    assert stacked.batched_forward(x) is None
    stacked.call(lambda model, x: model(x), x)  # the model runs on such inputs: the call has no batched form


def test_recording_a_batchnorm_whole_leaves_its_forward_as_it_was():
    model = fm.SmallResNet()
    assert BatchedLayers.of(model, torch.zeros(_MODELS["resnet"][1])) is not None
    assert all("forward" not in vars(module) for module in model.modules())
    assert int(model.stem[1].num_batches_tracked) == 0


# --------------------------------------------------------------- a fused unit
def _images(rows=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorShard(torch.randn(rows, 3, 8, 8, generator=g), torch.randint(0, 3, (rows,), generator=g))


def _epochs(spec, members, shard, epochs=2):
    state = None
    for epoch in range(epochs):
        state = train_group(spec, group_config(members), state, shard, device=torch.device("cpu"), epoch=epoch,
                            partition=0, step=0, epoch_end=True, deadline=None, fresh_hyperparameters=False)
    return state


def test_a_resnet_shaped_group_trains_without_vmap_and_each_member_as_it_trains_alone(monkeypatch):
    members = [Member(i, {"lr": lr, "momentum": 0.9}, 100 + i) for i, lr in enumerate((1e-2, 3e-2, 1e-1))]
    shard = _images()
    apart = _epochs(fm.OwnHooksSpec(model_fn=fm.small_resnet, optimizer_fn=fm.sgd, batch_size=32), members, shard)

    def no_vmap(*args, **kwargs):
        raise AssertionError("the group went through vmap")

    monkeypatch.setattr(StackedModels, "call", no_vmap)
    spec = fm.spec(model_fn=fm.small_resnet, optimizer_fn=fm.sgd)
    fused = _epochs(spec, members, shard)
    assert fused["unfused"] is None and not fused["failed"]
    assert apart["unfused"] is not None
    for m in members:
        a, b = fused["members"][m.model_id], apart["members"][m.model_id]
        assert a["model"].keys() == b["model"].keys()
        for name in a["model"]:
            torch.testing.assert_close(a["model"][name], b["model"][name], rtol=1e-4, atol=1e-5,
                                       msg=lambda msg, name=name: f"{name}: {msg}")  # fmt: skip
        assert int(a["model"]["stem.1.num_batches_tracked"]) == 2 * 3  # 3 batches an epoch
        assert a["progress"]["loss_sum"] == pytest.approx(b["progress"]["loss_sum"], rel=1e-5)
    # the batched evaluation (a GPU's) gives each member's figures as its own pass does
    batched = _fused_evaluation(spec, members, fused["members"], _images(seed=1))
    alone = epoch_metrics([evaluate_unit(spec, group_config(members), dict(fused, unfused="one by one"),
                                         _images(seed=1), seed=0, threads=1)])["members"]  # fmt: skip
    for m in members:
        result, own = batched[m.model_id], alone[m.model_id]
        assert result.loss_sum / result.samples == pytest.approx(own["val_loss"], rel=1e-5)
        assert result.metric_sums["accuracy"] / result.samples == pytest.approx(own["val_accuracy"], rel=1e-5)


def _same_bits(a, b) -> bool:
    """Whether two nested states hold the same containers, values and tensor bits."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_bits, a, b))
    return a == b


@pytest.mark.parametrize("optimizer_fn", [fm.sgd, fm.adamw], ids=["sgd-momentum", "adamw"])
def test_a_fused_unit_leaves_the_state_it_starts_from_as_it_was(optimizer_fn):
    """The unit reads its members' states without copying them first (the fused pass
    stacks copies; the one-by-one pass clones a member before training it): the input,
    which may still be evaluated or rolled back to, keeps its bits."""
    members = [Member(i, {"lr": lr}, 100 + i) for i, lr in enumerate((1e-2, 3e-2))]
    spec = fm.spec(model_fn=fm.small_resnet, optimizer_fn=optimizer_fn, scheduler_fn=fm.halving)
    state = _epochs(spec, members, _images(), epochs=1)
    before = clone_tensors(state)
    after = train_group(spec, group_config(members), state, _images(seed=1), device=torch.device("cpu"), epoch=1,
                        partition=0, step=0, epoch_end=True, deadline=None, fresh_hyperparameters=False)  # fmt: skip
    assert after["unfused"] is None and not after["failed"]
    assert _same_bits(state, before)
    assert not _same_bits(after["members"], before["members"])


def _session_weights(data, model_fn=fm.small_resnet, **kwargs):
    from cerebro_automl import Session

    spec = fm.spec(model_fn=model_fn, optimizer_fn=fm.sgd)
    with Session(spec, data, seed=3, fuse=3, **kwargs) as s:
        ids = [s.add({"lr": lr}, epochs=1) for lr in (1e-2, 3e-2, 1e-1)]
        s.run()
        assert set(s.statuses().values()) == {"paused"}
        return [s.model(i).state()["model"] for i in ids]


@pytest.mark.parametrize("model_fn", [fm.small_resnet, fm.small_vit], ids=["resnet", "vit"])
def test_a_groups_weights_are_the_same_bits_on_1_and_2_workers(model_fn, caplog):
    """A ResNet (BatchNorm) and a ViT (attention, LayerNorm, a class token), both through the batched calls."""
    from conftest import same_states

    from cerebro_automl import PartitionedDataset

    g = torch.Generator().manual_seed(0)
    x, xv = torch.randn(192, 3, 8, 8, generator=g), torch.randn(32, 3, 8, 8, generator=g)
    y, yv = torch.randint(0, 3, (192,), generator=g), torch.randint(0, 3, (32,), generator=g)
    data = PartitionedDataset.from_arrays(x.numpy(), y.numpy(), num_partitions=2, valid=(xv.numpy(), yv.numpy()))
    caplog.set_level("INFO", logger="cerebro_automl")
    one = _session_weights(data, model_fn, n_workers=1)
    assert same_states(one, _session_weights(data, model_fn, n_workers=2))
    assert "unfused" not in caplog.text
    x = torch.zeros(64, 3, 8, 8)
    assert StackedModels([model_fn({}) for _ in range(2)]).layers_for(x) is not None
