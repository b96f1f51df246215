"""The fused optimizer against torch's own: k members step together with their own
hyperparameters, and each must follow, step by step, the same member trained alone
with its torch optimizer (``foreach=False``), state_dict included.

On the CPU the fused arithmetic is torch's operation for operation, so parameters and
state are compared bitwise; ``assert_close`` is the check on other devices, whose
kernels may round a division or a multiply-add differently."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping

import pytest
import torch
from torch import nn

from cerebro_automl.fusion import optim
from cerebro_automl.fusion.optim import FusedOptimizer, Unfusable

K = 3
Build = Callable[[int, Iterable[nn.Parameter]], torch.optim.Optimizer]


def _sgd(*options: dict) -> Build:
    return lambda i, params: torch.optim.SGD(params, foreach=False, **options[i])


def _adam(*options: dict) -> Build:
    return lambda i, params: torch.optim.Adam(params, foreach=False, **options[i])


def _adamw(*options: dict) -> Build:
    return lambda i, params: torch.optim.AdamW(params, foreach=False, **options[i])


CASES: dict[str, Build] = {
    "sgd-plain": _sgd(dict(lr=0.1), dict(lr=0.05), dict(lr=0.3)),
    "sgd-weight-decay": _sgd(dict(lr=0.1, weight_decay=1e-2), dict(lr=0.05), dict(lr=0.2, weight_decay=0.3)),
    "sgd-momentum": _sgd(
        dict(lr=0.1, momentum=0.9),
        dict(lr=0.05, momentum=0.5, dampening=0.1, weight_decay=1e-2),
        dict(lr=0.2, momentum=0.99, dampening=0.5, weight_decay=5e-4),
    ),
    "sgd-some-momentum": _sgd(dict(lr=0.1), dict(lr=0.05, momentum=0.9, dampening=0.3), dict(lr=0.2, momentum=0.8)),
    "sgd-nesterov": _sgd(
        dict(lr=0.1, momentum=0.9, nesterov=True),
        dict(lr=0.05, momentum=0.5, nesterov=True, weight_decay=1e-2),
        dict(lr=0.02, momentum=0.99, nesterov=True),
    ),
    "adam": _adam(
        dict(lr=1e-3),
        dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6),
        dict(lr=3e-3, betas=(0.95, 0.9999), eps=1e-10),
    ),
    "adam-weight-decay": _adam(
        dict(lr=1e-3, weight_decay=1e-2),
        dict(lr=1e-2, betas=(0.8, 0.99)),
        dict(lr=3e-3, weight_decay=0.5, eps=1e-4),
    ),
    "adamw": _adamw(
        dict(lr=1e-3),
        dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.0),
        dict(lr=3e-2, betas=(0.5, 0.9), eps=1e-6, weight_decay=0.3),
    ),
}
STATEFUL = ["sgd-momentum", "sgd-some-momentum", "sgd-nesterov", "adam", "adam-weight-decay", "adamw"]


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


class Pair:
    """K members trained two ways: fused, and each alone with its own torch optimizer."""

    def __init__(self, build: Build, models: list[nn.Module] | None = None) -> None:
        self.build = build
        self.models = models or [_mlp(i) for i in range(K)]
        self.refs = [copy.deepcopy(m) for m in self.models]
        self.ref_opts = [build(i, m.parameters()) for i, m in enumerate(self.refs)]
        self.member_opts = [build(i, m.parameters()) for i, m in enumerate(self.models)]
        self.stacked: dict[str, torch.Tensor] = {}
        self.fused: FusedOptimizer | None = None
        self.gen = torch.Generator().manual_seed(1234)

    def fuse(self) -> FusedOptimizer:
        self.stacked, _ = torch.func.stack_module_state(self.models)
        members = [(dict(m.named_parameters()), o) for m, o in zip(self.models, self.member_opts, strict=True)]
        self.fused = FusedOptimizer.from_members(self.stacked, members)
        return self.fused

    def grads(self, scale: float = 1.0) -> dict[str, torch.Tensor]:
        return {n: torch.randn(t.shape, generator=self.gen) * scale for n, t in self.stacked.items()}

    def step(self, grads: Mapping[str, torch.Tensor | None], active: list[bool] | None = None) -> None:
        """The same gradients to the fused members and to the references; the references of
        members that are not active do not step."""
        assert self.fused is not None
        self.fused.zero_grad()
        for name, grad in grads.items():
            self.stacked[name].grad = None if grad is None else grad.clone()
        self.fused.step(None if active is None else torch.tensor(active))
        for i, (ref, opt) in enumerate(zip(self.refs, self.ref_opts, strict=True)):
            if active is not None and not active[i]:
                continue
            opt.zero_grad()
            for name, param in ref.named_parameters():
                grad = grads[name]
                param.grad = None if grad is None else grad[i].clone()
            opt.step()

    def check(self, exact: bool = True) -> None:
        """Parameters, then the written-back state, against the references."""
        assert self.fused is not None
        for i, ref in enumerate(self.refs):
            for name, param in ref.named_parameters():
                _same(self.stacked[name][i].detach(), param.detach(), exact, f"member {i} {name}")
        self.fused.write_back()
        for i, (mine, theirs) in enumerate(zip(self.member_opts, self.ref_opts, strict=True)):
            _same_state_dict(mine.state_dict(), theirs.state_dict(), exact, f"member {i}")


def _same(got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> None:
    assert got.dtype == want.dtype and got.device == want.device and got.shape == want.shape, what
    if exact:
        assert torch.equal(got, want), f"{what}: not bitwise equal, max diff {(got - want).abs().max().item()}"
    else:
        torch.testing.assert_close(got, want, msg=what)


def _same_state_dict(got: dict, want: dict, exact: bool, what: str) -> None:
    assert got["param_groups"] == want["param_groups"], what
    assert got["state"].keys() == want["state"].keys(), f"{what}: state of {got['state'].keys()}"
    for index, state in want["state"].items():
        assert list(got["state"][index]) == list(state), f"{what} parameter {index}: {list(got['state'][index])}"
        for key, value in state.items():
            _same(got["state"][index][key], value, exact, f"{what} parameter {index} {key}")


# --- the arithmetic ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_every_step_matches_each_member_alone(case: str) -> None:
    pair = Pair(CASES[case])
    pair.fuse()
    for _ in range(8):
        pair.step(pair.grads())
        pair.check()


def _wide(seed: int) -> nn.Module:
    """With pieces of 1024 elements: a 60 x 50 weight steps in parts of each member's row
    (the last one ragged), a 50 x 15 one in pieces of one member's row."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(60, 50), nn.Tanh(), nn.Linear(50, 15))


@pytest.mark.parametrize("case", ["adam", "adam-weight-decay", "adamw"])
def test_a_large_parameter_stepped_in_pieces_matches_each_member_alone(case: str, monkeypatch) -> None:
    """On the CPU a stacked parameter of more than ``_PIECE`` elements steps piece by
    piece (there 262,144; here 1,024, a power of two too), to the same bits."""
    monkeypatch.setattr(optim, "_PIECE", 1024)
    pair = Pair(CASES[case], [_wide(i) for i in range(K)])
    pair.fuse()
    for _ in range(3):
        pair.step(pair.grads())
        pair.check()
    pair.step(pair.grads(), active=[True, False, True])
    pair.check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine")
def test_matches_within_tolerance_on_a_gpu_too() -> None:
    for case in ("sgd-nesterov", "adam-weight-decay", "adamw"):
        pair = Pair(CASES[case], [_mlp(i).cuda() for i in range(K)])
        pair.fuse()
        for _ in range(5):
            pair.step({n: g.cuda() for n, g in pair.grads().items()})
            pair.check(exact=False)


def test_write_back_is_torchs_format() -> None:
    pair = Pair(CASES["sgd-some-momentum"])
    pair.fuse()
    pair.step(pair.grads())
    pair.fused.write_back()  # type: ignore[union-attr]
    assert pair.member_opts[0].state_dict()["state"] == {}  # momentum 0: no buffer
    assert set(pair.member_opts[1].state_dict()["state"][0]) == {"momentum_buffer"}
    adam = Pair(CASES["adamw"])
    adam.fuse()
    adam.fused.write_back()  # type: ignore[union-attr]
    assert adam.member_opts[0].state_dict()["state"] == {}  # no state before the first step
    adam.step(adam.grads())
    adam.fused.write_back()  # type: ignore[union-attr]
    step = adam.member_opts[2].state_dict()["state"][1]["step"]
    assert step.dtype == torch.float32 and step.dim() == 0 and step.device.type == "cpu" and step.item() == 1


# --- state that exists before fusing, and after -------------------------------------------------------


@pytest.mark.parametrize("case", STATEFUL)
def test_continues_from_loaded_state_at_different_steps(case: str) -> None:
    """Member i's optimizer is loaded from a reference that took i steps alone (member 0 has
    no state at all), then the fused members and the references go on together."""
    pair = Pair(CASES[case])
    gen = torch.Generator().manual_seed(7)
    for i, (ref, opt) in enumerate(zip(pair.refs, pair.ref_opts, strict=True)):
        for _ in range(i):
            opt.zero_grad()
            for param in ref.parameters():
                param.grad = torch.randn(param.shape, generator=gen)
            opt.step()
        pair.models[i].load_state_dict(ref.state_dict())
        pair.member_opts[i].load_state_dict(opt.state_dict())
    pair.fuse()
    for _ in range(5):
        pair.step(pair.grads())
        pair.check()


@pytest.mark.parametrize("case", ["sgd-momentum", "adam", "adamw"])
def test_a_member_continues_unfused_after_write_back(case: str) -> None:
    pair = Pair(CASES[case])
    pair.fuse()
    for _ in range(3):
        pair.step(pair.grads())
    pair.fused.write_back()  # type: ignore[union-attr]
    with torch.no_grad():
        for i, model in enumerate(pair.models):
            for name, param in model.named_parameters():
                param.copy_(pair.stacked[name][i])
    for _ in range(3):
        grads = pair.grads()
        for i in range(K):
            for (name, param), ref_param in zip(
                pair.models[i].named_parameters(), pair.refs[i].parameters(), strict=True
            ):
                param.grad, ref_param.grad = grads[name][i].clone(), grads[name][i].clone()
            pair.member_opts[i].step()
            pair.ref_opts[i].step()
    for model, ref in zip(pair.models, pair.refs, strict=True):
        for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(param, ref_param)
    for opt, ref_opt in zip(pair.member_opts, pair.ref_opts, strict=True):
        _same_state_dict(opt.state_dict(), ref_opt.state_dict(), True, "after unfused steps")


# --- active members and missing gradients ----------------------------------------------------------------


@pytest.mark.parametrize("case", ["sgd-momentum", "sgd-some-momentum", "adam-weight-decay", "adamw"])
def test_an_inactive_member_is_left_exactly_unchanged(case: str) -> None:
    pair = Pair(CASES[case])
    pair.fuse()
    for _ in range(2):  # on the first step (SGD: no buffer yet), then with state
        before = {n: t[1].detach().clone() for n, t in pair.stacked.items()}
        grads = pair.grads()
        for grad in grads.values():
            grad[1] = float("nan")  # the member whose loss went NaN
        pair.step(grads, active=[True, False, True])
        for name, value in before.items():
            assert torch.equal(pair.stacked[name][1], value), name
        pair.check()  # member 1's reference did not step, its state is unchanged too
        pair.step(pair.grads())
        pair.check()
    pair.step(pair.grads(), active=[False, False, False])
    pair.check()
    pair.step(pair.grads(), active=[True, True, True])
    pair.check()


@pytest.mark.parametrize("case", ["sgd-momentum", "adam", "adamw"])
def test_a_parameter_without_grad_is_skipped_as_torch_skips_it(case: str) -> None:
    pair = Pair(CASES[case])
    pair.fuse()
    pair.step(pair.grads())
    for _ in range(2):
        grads: dict[str, torch.Tensor | None] = dict(pair.grads())
        grads["2.bias"] = None
        pair.step(grads)
        pair.check()
    pair.step(pair.grads())
    pair.check()  # Adam: 2.bias is two steps behind the others


def test_zero_grad_sets_the_stacked_grads_to_none() -> None:
    pair = Pair(CASES["adam"])
    fused = pair.fuse()
    pair.step(pair.grads())
    fused.zero_grad()
    assert all(t.grad is None for t in pair.stacked.values())
    snapshot = {n: t.detach().clone() for n, t in pair.stacked.items()}
    fused.step()
    assert all(torch.equal(pair.stacked[n], v) for n, v in snapshot.items())


def test_active_must_be_one_bool_per_member() -> None:
    pair = Pair(CASES["sgd-plain"])
    fused = pair.fuse()
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        fused.step(torch.tensor([True, False]))
    with pytest.raises(ValueError, match="bool"):
        fused.step(torch.tensor([1, 0, 1]))


# --- schedulers ------------------------------------------------------------------------------------------

# A member optimizer's own step() never runs while it trains fused, so its scheduler warns.
scheduler_warning = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")


@scheduler_warning
@pytest.mark.parametrize("case", ["sgd-momentum", "adamw"])
def test_set_lrs_picks_up_each_members_scheduler(case: str) -> None:
    pair = Pair(CASES[case])
    gammas = [0.5, 0.9, 0.1]
    schedulers = [
        torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=g)
        for opts in (pair.member_opts, pair.ref_opts)
        for opt, g in zip(opts, gammas, strict=True)
    ]
    pair.fuse()
    for _ in range(6):
        pair.step(pair.grads())
        for scheduler in schedulers:
            scheduler.step()
        pair.fused.set_lrs()  # type: ignore[union-attr]
        pair.check()
    assert pair.member_opts[2].param_groups[0]["lr"] < 0.2 * 0.1**2


@scheduler_warning
def test_set_lrs_follows_a_cycled_momentum_too() -> None:
    """OneCycleLR cycles SGD's momentum along with the learning rate."""
    pair = Pair(CASES["sgd-momentum"])
    schedulers = [
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=10)
        for opts in (pair.member_opts, pair.ref_opts)
        for opt in opts
    ]
    pair.fuse()  # after the schedulers, which set the first learning rate and momentum
    for _ in range(6):
        pair.step(pair.grads())
        for scheduler in schedulers:
            scheduler.step()
        pair.fused.set_lrs()  # type: ignore[union-attr]
        pair.check()


def test_momentum_switched_off_and_on_keeps_the_buffer_as_torch_does() -> None:
    pair = Pair(CASES["sgd-momentum"])
    pair.fuse()
    pair.step(pair.grads())
    for momentum in (0.0, 0.0, 0.7, 0.7):
        for opt in (pair.member_opts[1], pair.ref_opts[1]):
            opt.param_groups[0]["momentum"] = momentum
        pair.fused.set_lrs()  # type: ignore[union-attr]
        pair.step(pair.grads())
        pair.check()


# --- what cannot fuse ------------------------------------------------------------------------------------


def _unfusable(builds: list[Build]) -> str:
    models = [_mlp(i) for i in range(len(builds))]
    opts = [build(i, m.parameters()) for i, (build, m) in enumerate(zip(builds, models, strict=True))]
    stacked, _ = torch.func.stack_module_state(models)
    with pytest.raises(Unfusable) as caught:
        FusedOptimizer.from_members(
            stacked, [(dict(m.named_parameters()), o) for m, o in zip(models, opts, strict=True)]
        )
    return str(caught.value)


def test_mixed_optimizer_types_do_not_fuse() -> None:
    sgd, adam = _sgd(*[dict(lr=0.1)] * 3), _adam(*[dict(lr=0.1)] * 3)
    assert "member 0's optimizer is SGD and member 1's is Adam" in _unfusable([sgd, adam])
    assert "AdamW" in _unfusable([_adam(*[{}] * 2), _adamw(*[{}] * 2)])
    rmsprop: Build = lambda i, params: torch.optim.RMSprop(params)  # noqa: E731
    assert "torch.optim.rmsprop.RMSprop" in _unfusable([rmsprop, rmsprop])


def test_two_param_groups_do_not_fuse() -> None:
    def two_groups(i: int, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        own = list(params)
        groups: list[dict] = [{"params": own[:2]}, {"params": own[2:], "lr": 0.01}]
        return torch.optim.SGD(groups, lr=0.1)

    assert "member 0's optimizer has 2 param groups" in _unfusable([two_groups, two_groups])


def test_unsupported_options_do_not_fuse() -> None:
    message = _unfusable([_adam(*[dict(amsgrad=True)] * 2)] * 2)
    assert "member 0's amsgrad=True is not supported" in message
    message = _unfusable([_sgd(*[dict(lr=0.1, maximize=True)] * 2)] * 2)
    assert "maximize=True" in message
    nesterov = _sgd(dict(lr=0.1, momentum=0.9, nesterov=True), dict(lr=0.1, momentum=0.9))
    assert "nesterov differs between members (member 0: True, member 1: False)" in _unfusable([nesterov] * 2)


def test_a_tensor_hyperparameter_does_not_fuse() -> None:
    build = _sgd(dict(lr=0.1), dict(lr=torch.tensor(0.05)))
    assert "member 1's lr is a tensor (tensor(0.0500))" in _unfusable([build] * 2)


def test_an_optimizer_over_other_parameters_does_not_fuse() -> None:
    def first_layer_only(i: int, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(list(params)[:2], lr=0.1)

    message = _unfusable([first_layer_only] * 2)
    assert "member 0's optimizer holds 2 trainable parameters, not exactly its 4" in message
    assert "'2.weight'" in message


def test_an_optimizer_that_also_holds_frozen_parameters_fuses() -> None:
    """``SGD(model.parameters())`` over a frozen layer: torch's step skips what gets no
    gradient, so the fused step steps the trainable ones alone."""
    from cerebro_automl.fusion import StackedModels

    models = [_mlp(i) for i in range(2)]
    for m in models:
        m[0].requires_grad_(False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    stacked = StackedModels(models)
    trainable = [{n: p for n, p in m.named_parameters() if p.requires_grad} for m in models]
    fused = FusedOptimizer.from_members(stacked.trainable(), list(zip(trainable, opts, strict=True)))
    assert sorted(stacked.trainable()) == sorted(trainable[0]) and "0.weight" not in trainable[0]
    assert fused is not None


def test_state_the_fused_optimizer_cannot_represent_does_not_fuse() -> None:
    def with_stray_state(i: int, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        opt = torch.optim.Adam(params)
        opt.state[opt.param_groups[0]["params"][0]] = {"exp_avg": torch.zeros(6, 4)}
        return opt

    message = _unfusable([with_stray_state] * 2)
    assert "member 0's Adam state for '0.weight' has keys ['exp_avg']" in message
