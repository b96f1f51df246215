"""Batched layers: a model whose forward makes only calls with a batched form runs
for k members without vmap, with what vmap gives, and anything else keeps going
through vmap."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from cerebro_automl.fusion.batched import BatchedLayers
from cerebro_automl.fusion.stacked import StackedModels


def _members(build, k=3):
    models = []
    for seed in range(k):
        torch.manual_seed(seed)
        models.append(build())
    return models


def _through_vmap(stacked, x):
    return stacked.call(lambda model, x: model(x), x)


def _mlp(dropout=0.25):
    return nn.Sequential(
        nn.Linear(6, 16), nn.GELU(), nn.Dropout(dropout),
        nn.Sequential(nn.Linear(16, 16, bias=False), nn.ReLU(inplace=True)),
        nn.Identity(), nn.Linear(16, 4),
    )  # fmt: skip


def _cnn2d(dropout=0.25):  # bench_gpu's model, smaller, with a dropout between convolutions
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(dropout),
        nn.Conv2d(4, 6, 3, padding="same", bias=False), nn.GELU(), nn.AvgPool2d(2),
        nn.Flatten(), nn.Linear(6 * 2 * 2, 8), nn.ReLU(), nn.Linear(8, 3),
    )  # fmt: skip


def _cnn1d():  # a linear layer first, then convolutions over its output's rows
    return nn.Sequential(
        nn.Linear(10, 10), nn.Tanh(), nn.Conv1d(4, 5, 3, stride=2), nn.AdaptiveMaxPool1d(2),
        nn.Conv1d(5, 2, 1, dilation=1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(4, 2),
    )  # fmt: skip


def _wide_cnn2d():  # sums long enough that another order rounds otherwise
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip


def _layer_norms():  # affine with and without bias, none, and one over two dimensions
    model = nn.Sequential(
        nn.LayerNorm(6), nn.Linear(6, 8), nn.LayerNorm(8, bias=False), nn.ReLU(),
        nn.LayerNorm(8, elementwise_affine=False), nn.Linear(8, 6), nn.LayerNorm((3, 6)), nn.Linear(6, 2),
    )  # fmt: skip
    with torch.no_grad():  # not the initial 1 and 0, which any order of the scale and shift keeps exact
        for name, p in model.named_parameters():
            if name.split(".")[0] in ("0", "2", "6"):
                p.uniform_(-2, 2)
    return model


def _conv_then_norm():  # a LayerNorm over the positions of a convolution's output
    return nn.Sequential(
        nn.Conv1d(2, 3, 3), nn.LayerNorm(8, elementwise_affine=False), nn.ReLU(), nn.Conv1d(3, 3, 1),
        nn.LayerNorm(8), nn.Flatten(), nn.Linear(24, 2),
    )  # fmt: skip


def _flat_images():  # images flattened before the first layer: MNIST's classic MLP
    return nn.Sequential(nn.Flatten(), nn.ReLU(), nn.Linear(12, 4), nn.Dropout(0.5), nn.Linear(4, 2))


class _MyLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x)


class _ConvNet(nn.Module):  # examples/mnist1d_models.py's CNN: a class, and a shape op before the layers
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv1d(1, 4, 5, padding=2), nn.ReLU(), nn.Conv1d(4, 4, 3, padding=1, stride=2))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(4 * 5, 3))

    def forward(self, x):
        return self.head(self.features(x.unsqueeze(1)))


class _Residual(nn.Module):  # a shortcut, a weight used in arithmetic, sizes, view and squeeze
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding="same", dilation=2)
        self.scale = nn.Parameter(torch.rand(2, 1, 1) + 0.5)
        self.fc = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        h = torch.relu(self.conv(x) * self.scale + x)
        h = nn.functional.max_pool2d(h, 2)
        return self.fc(h.view(h.size(0), -1)).unsqueeze(-1).squeeze(-1) / 2


def _odd_convolutions():  # an even kernel's "same" padding (one more after), strides and dilations per dimension
    return nn.Sequential(
        nn.Conv2d(2, 3, (4, 3), padding="same"), nn.ReLU(), nn.Conv2d(3, 3, 3, stride=(2, 1), dilation=(1, 2)),
        nn.Flatten(), nn.Linear(3 * 3 * 2, 2),
    )  # fmt: skip


class _ReluUsedTwice(nn.Module):  # the ReLU feeds a convolution and a sum
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv1d(2, 2, 3, padding=1), nn.Conv1d(2, 2, 3, padding=1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return (self.b(h) + h).flatten(1)


class _InplaceRelu(nn.Module):  # an in-place ReLU rectifies its input for the sum too
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv1d(2, 2, 3, padding=1), nn.Conv1d(2, 2, 3, padding=1)

    def forward(self, x):
        h = self.a(x)
        return (self.b(nn.functional.relu(h, inplace=True)) + h).flatten(1)


def _conv3d():
    return nn.Sequential(nn.Conv3d(1, 2, 2, stride=2, padding=1), nn.SiLU(), nn.Flatten(), nn.Linear(2 * 3 * 3 * 3, 2))


@pytest.mark.parametrize("build, shape", [
    (_mlp, (5, 6)), (_mlp, (5, 3, 6)), (_cnn2d, (5, 3, 8, 8)), (_cnn1d, (5, 4, 10)), (_wide_cnn2d, (64, 3, 16, 16)),
    (_flat_images, (5, 3, 4)), (_layer_norms, (64, 3, 6)), (_conv_then_norm, (5, 2, 10)),
    (lambda: nn.Sequential(_MyLinear(3, 2)), (5, 3)), (_Net, (5, 3)), (_ConvNet, (6, 10)), (_Residual, (5, 2, 8, 8)),
    (_odd_convolutions, (5, 2, 7, 6)), (_conv3d, (4, 1, 5, 5, 5)), (_ReluUsedTwice, (5, 2, 10)),
    (_InplaceRelu, (5, 2, 10)),
], ids=["mlp-rows", "mlp-rows-by-positions", "cnn2d", "linear-then-cnn1d", "wide-cnn2d", "flatten-first",
        "layer-norms", "conv-then-layer-norm", "a-subclass-of-linear", "a-module-of-its-own", "a-cnn-class",
        "a-shortcut", "odd-convolutions", "conv3d", "a-relu-used-twice", "an-in-place-relu"])
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # torch's, on the vmap side
def test_outputs_and_gradients_are_what_vmap_gives(build, shape):
    stacked = StackedModels(_members(build))
    x = torch.randn(shape)
    results = []
    for forward in (stacked.batched_forward, lambda x: _through_vmap(stacked, x)):
        for p in stacked.params.values():
            p.grad = None
        torch.manual_seed(7)  # the same dropout draws
        out = forward(x)
        out.pow(2).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in stacked.params.items()}))
    (out_b, grads_b), (out_v, grads_v) = results
    assert out_b.shape == out_v.shape and out_b.shape[:2] == (3, shape[0])
    # The same sums; a CPU's matrix kernels may add them in another order for another layout.
    torch.testing.assert_close(out_b, out_v)
    for name in grads_v:
        torch.testing.assert_close(grads_b[name], grads_v[name], msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("build, shape", [(lambda: _mlp(dropout=0.0), (5, 6)), (lambda: _cnn2d(dropout=0.0), (5, 3, 8, 8))],
                         ids=["mlp", "cnn2d"])
def test_each_member_computes_what_it_computes_alone(build, shape):
    models = _members(build)
    stacked = StackedModels(models)
    x = torch.randn(shape)
    out = stacked.batched_forward(x)
    for i, model in enumerate(models):
        torch.testing.assert_close(out[i], model(x))


@pytest.mark.parametrize("build, shape", [(_mlp, (5, 6)), (_cnn2d, (5, 3, 8, 8))], ids=["mlp", "cnn2d"])
def test_a_weights_gradient_comes_in_the_weights_own_layout(build, shape):
    stacked = StackedModels(_members(build))
    stacked.batched_forward(torch.randn(shape)).sum().backward()
    for name, p in stacked.params.items():
        assert p.grad.stride() == p.stride(), name


def test_a_frozen_layer_gets_no_gradient_and_the_others_do():
    models = _members(_mlp)
    for model in models:
        model[0].requires_grad_(False)
    stacked = StackedModels(models)
    stacked.batched_forward(torch.randn(5, 6)).sum().backward()
    assert stacked.params["0.weight"].grad is None and stacked.params["0.bias"].grad is None
    assert stacked.params["5.weight"].grad is not None


def test_a_flatten_keeps_the_members_dimension():
    def build():
        return nn.Sequential(nn.Linear(4, 3), nn.Flatten(), nn.Linear(6, 2))

    stacked = StackedModels(_members(build))
    x = torch.randn(5, 2, 4)
    assert torch.equal(stacked.batched_forward(x), _through_vmap(stacked, x))


def test_evaluation_mode_turns_dropout_off():
    models = [m.eval() for m in _members(lambda: _mlp(dropout=0.9))]
    x = torch.randn(5, 6)
    out = StackedModels(models).batched_forward(x)
    for i, model in enumerate(models):
        torch.testing.assert_close(out[i], model(x))


class _Forward(nn.Module):
    def __init__(self, forward):
        super().__init__()
        self.fc, self._forward = nn.Linear(5, 5), forward

    def forward(self, x):
        return self._forward(self, x)


def _hooked():
    model = nn.Sequential(nn.Linear(3, 2))
    model[0].register_forward_hook(lambda module, args, out: out * 0)
    return model


@pytest.mark.parametrize("build, shape", [
    (lambda: nn.Sequential(nn.Conv1d(2, 2, 3, groups=2)), (4, 2, 5)),
    (lambda: nn.Sequential(nn.Conv1d(1, 2, 3, padding=1, padding_mode="circular")), (4, 1, 5)),
    (lambda: nn.Sequential(nn.MaxPool1d(2, return_indices=True), _First(), nn.Flatten(), nn.Linear(3, 2)), (4, 1, 6)),
    (lambda: nn.Sequential(nn.SyncBatchNorm(1)), (4, 1, 5)),
    (_hooked, (4, 3)),
    (lambda: nn.Sequential(nn.Linear(3, 2), nn.RMSNorm(2)), (4, 3)),
    (lambda: _Forward(lambda self, x: self.fc(x) if x.sum() > 0 else x), (4, 5)),
    (lambda: _Forward(lambda self, x: (self.fc(x), x)), (4, 5)),
    (lambda: _Forward(lambda self, x: self.fc(x + torch.randn(5))), (4, 5)),
    (lambda: _Forward(lambda self, x: self.fc(x + torch.empty(5).fill_(1))), (4, 5)),
    (lambda: _Forward(lambda self, x: self.fc(x[torch.tensor([0, 1])])), (4, 5)),
    (lambda: _Forward(lambda self, x: self.fc(x) if x.is_cuda else x), (4, 5)),
], ids=["grouped-conv", "circular-padding", "pool-indices", "sync-batchnorm", "a-hook", "rmsnorm", "a-branch-on-values",
        "two-outputs", "a-random-tensor-of-its-own", "an-uninitialized-tensor-of-its-own", "rows-picked-by-a-tensor",
        "a-branch-on-an-attribute"])
def test_a_model_with_a_call_without_a_batched_form_goes_through_vmap(build, shape):
    x = torch.randn(shape)
    assert BatchedLayers.of(build(), x) is None
    stacked = StackedModels(_members(build, k=2))
    assert stacked.batched_forward(x) is None
    _through_vmap(stacked, x)  # the model runs on inputs of this shape: it is the call that has no batched form


class _First(nn.Module):
    def forward(self, pair):
        return pair[0]


def test_under_autocast_the_members_go_through_vmap():
    stacked = StackedModels(_members(_mlp))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert stacked.batched_forward(torch.randn(5, 6)) is None
    assert stacked.batched_forward(torch.randn(5, 6)) is not None


@pytest.mark.parametrize("forward_fn, batched", [(None, True), (lambda model, x, y: (model(x), y), False)],
                         ids=["plain", "own-forward"])
def test_a_fused_unit_of_a_sequential_model_trains_and_evaluates_through_the_batched_layers(forward_fn, batched):
    import fusion_models as fm
    from torch.profiler import profile

    from cerebro_automl.data.shards import TensorShard
    from cerebro_automl.fusion import Member, group_config
    from cerebro_automl.training.groups import _fused_evaluation, train_group

    members = [Member(i, {"lr": lr}, 100 + i) for i, lr in enumerate((1e-2, 3e-2))]
    shard = TensorShard(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    spec = fm.spec(optimizer_fn=fm.sgd, forward_fn=forward_fn)
    with profile() as trace:
        state = train_group(spec, group_config(members), None, shard, device=torch.device("cpu"), epoch=0,
                            partition=0, step=0, epoch_end=True, deadline=None, fresh_hyperparameters=False)
        _fused_evaluation(spec, members, state["members"], shard)  # a GPU's evaluation of a fused group
    calls = {event.key: event.count for event in trace.key_averages()}
    assert state["unfused"] is None
    # 2 linear layers x (2 training batches + 1 evaluation batch)
    assert calls.get("BatchedLinear", 0) == (6 if batched else 0)


def test_a_relu_whose_one_use_is_a_convolution_runs_no_kernel_of_its_own():
    """On the CPU in training, the convolution cuts its windows from the ReLU's input,
    rectified; a ReLU that is also used elsewhere runs (the outputs and gradients of both
    models are vmap's: test_outputs_and_gradients_are_what_vmap_gives)."""
    from torch.profiler import profile

    for build, shape, relus in ((_ConvNet, (6, 10), 0), (_ReluUsedTwice, (6, 2, 10), 1), (_InplaceRelu, (6, 2, 10), 1)):
        stacked = StackedModels(_members(build))
        stacked.batched_forward(torch.randn(shape))  # recorded (on the meta device) at its first call
        with profile() as trace:
            stacked.batched_forward(torch.randn(shape))
        calls = {e.key: e.count for e in trace.key_averages()}
        assert calls.get("aten::relu", 0) + calls.get("aten::relu_", 0) == relus, build.__name__


def test_the_doctests_hold():
    import doctest

    from cerebro_automl.fusion import batched, signature, stacked

    from cerebro_automl.fusion import convolution, recording

    for module in (batched, stacked, signature, recording, convolution):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_tied_weights_are_one_tensor_in_the_batched_layers_too():
    def build():
        first, last = nn.Linear(4, 4), nn.Linear(4, 4)
        last.weight = first.weight
        return nn.Sequential(first, nn.Tanh(), last)

    stacked = StackedModels(_members(build))
    x = torch.randn(5, 4)
    grads = []
    for forward in (stacked.batched_forward, lambda x: _through_vmap(stacked, x)):
        for p in stacked.params.values():
            p.grad = None
        out = forward(x)
        out.pow(2).sum().backward()
        grads.append((out.detach(), {n: p.grad.clone() for n, p in stacked.params.items()}))
    assert set(grads[0][1]) == {"0.weight", "0.bias", "2.bias"}
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for name in grads[0][1]:
        torch.testing.assert_close(grads[0][1][name], grads[1][1][name], msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("build, shape", [(_cnn1d, (5, 4, 10)), (_odd_convolutions, (5, 2, 7, 6))],
                         ids=["linear-first", "convolution-first"])
def test_the_shared_batch_gets_the_members_summed_gradient(build, shape):
    stacked = StackedModels(_members(build))
    grads = []
    for forward in (stacked.batched_forward, lambda x: _through_vmap(stacked, x)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(3), requires_grad=True)
        torch.manual_seed(7)
        forward(x).pow(2).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_recording_a_forward_patches_nothing_other_threads_use():
    """Under torch.fx's tracing, any module called meanwhile (another thread's model)
    would meet a patched ``nn.Module.__call__``; recording leaves it alone."""
    other, seen = nn.Linear(2, 2), []

    def forward(self, x):
        seen.append(other(torch.ones(1, 2)).shape)  # a model training elsewhere in the process
        return self.fc(x)

    assert BatchedLayers.of(_Forward(forward), torch.ones(3, 5)) is not None
    assert seen == [torch.Size([1, 2])]


@pytest.mark.parametrize("build, shape", [(_ConvNet, (6, 10)), (_cnn1d, (5, 4, 10)), (_odd_convolutions, (5, 2, 7, 6))],
                         ids=["a-cnn-class", "linear-first", "odd-convolutions"])
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_without_autograd_the_outputs_are_what_vmap_gives_too(build, shape):
    """Evaluation takes other convolution kernels on the CPU than training."""
    stacked = StackedModels([m.eval() for m in _members(build)])
    x = torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(stacked.batched_forward(x), _through_vmap(stacked, x))


def test_a_weight_on_the_left_of_an_operator_is_a_members_own():
    def forward(self, x):
        return self.fc.bias - self.fc(x)

    stacked = StackedModels(_members(lambda: _Forward(forward)))
    x = torch.randn(4, 5)
    assert stacked.layers_for(x) is not None
    torch.testing.assert_close(stacked.batched_forward(x), _through_vmap(stacked, x))


def test_a_replay_leaves_no_reference_cycle_that_would_hold_its_activations():
    """No tensor is left in unreachable cycles by the replays. (The collector is asked
    what it found, not how much: other threads, Dask's among them, make cyclic
    garbage of their own at any time.)"""
    stacked = StackedModels(_members(_ConvNet))
    x = torch.randn(6, 10)
    stacked.batched_forward(x)  # the first call's one-time work
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds stays in gc.garbage, to be looked at
    gc.disable()
    try:
        with torch.no_grad():
            for _ in range(3):
                stacked.batched_forward(x)
        gc.collect()
        held = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not held


@pytest.mark.parametrize("layer", [nn.LeakyReLU(0.5, inplace=True), nn.Dropout(0.5, inplace=True)],
                         ids=["leaky-relu", "dropout"])
def test_an_in_place_layer_first_leaves_the_shared_batch_as_it_was(layer):
    """Alone, each member would get a batch of its own; fused, the members share one."""
    models = _members(lambda: nn.Sequential(copy.deepcopy(layer), nn.Linear(3, 2)))
    x = torch.randn(5, 3)
    before = x.clone()
    torch.manual_seed(0)
    out = StackedModels(models).batched_forward(x)
    assert torch.equal(x, before)
    for i, model in enumerate(models):
        torch.manual_seed(0)
        torch.testing.assert_close(out[i], model(x.clone()))


def test_a_linear_layers_gradients_round_alike_whatever_the_layout_of_the_gradient_it_gets():
    """The per-member cross-entropy hands back its gradient transposed ([k, classes, rows]
    in memory); the products must round as on the contiguous gradient a plain model's
    loss gives."""
    from cerebro_automl.fusion.products import BatchedLinear

    torch.manual_seed(0)
    x = torch.randn(8, 64, 128)
    weight, bias = torch.randn(8, 10, 128, requires_grad=True), torch.randn(8, 10, requires_grad=True)
    grad = torch.randn(8, 10, 64).transpose(1, 2)
    found = []
    for handed in (grad, grad.contiguous()):
        x_ = x.clone().requires_grad_()
        found.append(torch.autograd.grad(BatchedLinear.apply(x_, weight, bias), (x_, weight, bias), handed))
    for transposed, contiguous in zip(*found, strict=True):
        assert torch.equal(transposed, contiguous)
