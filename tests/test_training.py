"""Training units: determinism, isolation of failures, seeding, LR scheduling."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cerebro_automl.data import PartitionedDataset, TensorShard
from cerebro_automl.session import Session
from cerebro_automl.training import (UnitError, canonical_config, epoch_metrics, evaluate_unit,
                                     model_seed, train_unit, unit_seed)

from conftest import make_arrays
from models import make_spec, step_scheduler, tied_model_fn

CONFIG = {"lr": 1e-2, "width": 8}


def _shard(rows=100):
    X, y, _, _ = make_arrays(rows=rows)
    return TensorShard(torch.from_numpy(X), torch.from_numpy(y))


def _train(spec, state=None, **kw):
    args = dict(seed=7, epoch=0, partition=0, step=0, epoch_end=False, threads=1)
    args.update(kw)
    return train_unit(spec, CONFIG, state, _shard(), **args)


def _equal_states(a, b) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_a_unit_is_bitwise_deterministic(spec):
    first, second = _train(spec), _train(spec)
    assert _equal_states(first, second)
    timings = ("seconds", "phase_seconds")  # the clock's, not the unit's
    assert {k: v for k, v in first["progress"].items() if k not in timings} == \
        {k: v for k, v in second["progress"].items() if k not in timings}
    assert set(first["progress"]["phase_seconds"]) == {"transfer_in", "compute", "transfer_out"}


def test_a_unit_depends_on_its_seed_epoch_and_partition(spec):
    base = _train(spec)
    for changed in (dict(seed=8), dict(epoch=1), dict(partition=1)):
        assert not _equal_states(base, _train(spec, **changed)), changed


def test_a_unit_does_not_mutate_its_input_state(spec):
    state = _train(spec)
    before = {k: v.clone() for k, v in state["model"].items()}
    adam_before = [v["exp_avg"].clone() for v in state["optimizer"]["state"].values()]
    _train(spec, state, step=1)
    assert all(torch.equal(before[k], state["model"][k]) for k in before)
    assert all(torch.equal(a, v["exp_avg"]) for a, v in zip(adam_before, state["optimizer"]["state"].values()))


def test_state_is_plain_dicts_of_cpu_tensors(spec):
    state = _train(spec)
    assert type(state["model"]) is dict  # an OrderedDict would be pickled whole by Dask
    assert all(t.device.type == "cpu" for t in state["model"].values())


def test_progress_accumulates_within_an_epoch_and_resets_at_the_next(spec):
    s1 = _train(spec)
    s2 = _train(spec, s1, step=1, partition=1)
    assert s2["progress"]["samples"] == 200
    s3 = _train(spec, s2, epoch=1, step=0)
    assert s3["progress"]["samples"] == 100


def test_non_finite_loss_fails_the_unit_with_the_reason():
    spec = make_spec(loss_fn=lambda out, y: nn.functional.cross_entropy(out, y) * float("nan"))
    with pytest.raises(UnitError, match=r"loss is nan at epoch 1, partition 0, sample 0 \(NaN or infinity in "
                                        r"the inputs or labels, or a learning rate too large\)"):
        _train(spec)


def test_exception_in_model_fn_becomes_a_unit_error():
    def broken(config):
        raise RuntimeError("no such layer")
    with pytest.raises(UnitError, match="RuntimeError: no such layer"):
        _train(make_spec(model_fn=broken))


def test_threads_are_applied_inside_the_unit(spec):
    previous = torch.get_num_threads()
    try:
        _train(spec, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)


def test_unit_leaves_the_callers_rng_alone(spec):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    _train(spec)
    assert torch.equal(torch.rand(3), expected)


def test_model_seed_uses_the_canonical_config():
    assert model_seed(0, {"a": 1, "b": 2}) == model_seed(0, {"b": 2, "a": 1})
    assert model_seed(0, {"a": 1}) != model_seed(1, {"a": 1})
    assert model_seed(0, {"a": 1}) != model_seed(0, {"a": 2})
    assert unit_seed(5, 0, 1) != unit_seed(5, 1, 0)


def test_canonical_config_rejects_values_that_are_not_json():
    with pytest.raises(TypeError, match="object"):
        canonical_config({"lr": object()})
    import numpy as np
    assert canonical_config({"lr": np.float64(0.5)}) == '{"lr": 0.5}'


def test_sharded_validation_equals_the_full_validation_set(spec):
    state = _train(spec)
    X, y, _, _ = make_arrays(rows=90)
    x, t = torch.from_numpy(X), torch.from_numpy(y)
    whole = epoch_metrics([evaluate_unit(spec, CONFIG, state, TensorShard(x, t), seed=7, threads=1)])
    parts = epoch_metrics([evaluate_unit(spec, CONFIG, state, TensorShard(x[a:b], t[a:b]), seed=7, threads=1)
                           for a, b in ((0, 20), (20, 61), (61, 90))])
    for key in ("val_loss", "val_accuracy"):
        assert math.isclose(whole[key], parts[key], rel_tol=1e-6), key


def test_lr_scheduler_steps_once_per_epoch_not_per_unit(arrays):
    X, y, Xv, yv = arrays
    data = PartitionedDataset.from_arrays(X, y, num_partitions=3, valid=(Xv, yv))
    with Session(make_spec(scheduler_fn=step_scheduler), data, executor="local") as s:
        mid = s.add(CONFIG, epochs=2)
        s.run()
        lrs = [g["lr"] for g in s.model(mid).state()["optimizer"]["param_groups"]]
    assert lrs == [pytest.approx(CONFIG["lr"] * 0.25)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine")
def test_a_unit_trains_on_the_gpu_when_there_is_one():
    devices = []

    def loss_fn(out, y):
        devices.append(out.device.type)
        return nn.functional.cross_entropy(out, y)

    spec = make_spec(loss_fn=loss_fn)
    state = _train(spec)
    assert set(devices) == {"cuda"}
    assert state["model"]["0.weight"].device.type == "cpu"  # states travel on the CPU
    assert _equal_states(state, _train(spec))  # deterministic on the GPU too


def test_a_model_with_tied_weights_keeps_them_tied_from_unit_to_unit():
    """The state reloads on the meta device with assign=True, which gives each name a
    tensor of its own: the tie must be restored, or the optimizer sees one more
    parameter than it saved and the second unit fails."""
    spec = make_spec(model_fn=tied_model_fn)
    state = None
    for epoch in range(3):
        state = _train(spec, state, epoch=epoch, epoch_end=True)
    assert torch.equal(state["model"]["encode.weight"], state["model"]["decode.weight"])
    assert len(state["optimizer"]["param_groups"][0]["params"]) == len(list(tied_model_fn({}).parameters())) == 3


class _Positions(nn.Module):
    """A model with buffers its state dict leaves out, as BERT's position ids: one
    computed from the config, one drawn at build (so it depends on the seed)."""

    builds = 0  # normal builds (the meta device's are not counted)

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(4, width)
        self.register_buffer("positions", torch.arange(width), persistent=False)
        self.register_buffer("projection", torch.randn(width), persistent=False)
        if not self.linear.weight.is_meta:
            type(self).builds += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.projection + self.positions


def test_a_model_with_buffers_off_its_state_dict_builds_on_the_meta_device_after_its_first_unit():
    """Each unit builds its model holding the state's weights; buffers that the state
    dict leaves out come from one normal build of the config and seed, kept: a model
    whose init is expensive (a HuggingFace BERT) is not initialised again every unit."""
    from cerebro_automl.training import build_model

    spec = make_spec(model_fn=lambda c: _Positions(c["width"]))
    weights = dict(_Positions(8).state_dict())
    _Positions.builds = 0
    models = [build_model(spec, CONFIG, weights, seed) for seed in (1, 1, 1, 2)]
    assert _Positions.builds == 2  # once per seed
    torch.manual_seed(1)
    alone = _Positions(8)
    alone.load_state_dict(weights)
    for model in models[:3]:
        assert torch.equal(model.positions, alone.positions) and torch.equal(model.projection, alone.projection)
        assert torch.equal(model.linear.weight, alone.linear.weight) and not model.projection.is_meta
    assert models[0].projection is not models[1].projection  # each model its own copy
    assert not torch.equal(models[3].projection, alone.projection)


class _SharedMask(nn.Module):
    """One non-persistent buffer held by two blocks (a mask every block shares)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        mask = torch.arange(4.0)
        self.a.register_buffer("mask", mask, persistent=False)
        self.b.register_buffer("mask", mask, persistent=False)


class _WeightView(nn.Module):
    """A non-persistent buffer that views a weight: it must follow the loaded weight."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("transposed", self.linear.weight.t(), persistent=False)


class _RefreshedOnLoad(nn.Module):
    """A non-persistent buffer that a load hook computes from the loaded weights."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("norm", torch.zeros(()), persistent=False)
        self.register_load_state_dict_post_hook(_RefreshedOnLoad.refresh)

    @staticmethod
    def refresh(module: nn.Module, incompatible_keys) -> None:
        module.norm.copy_(module.linear.weight.detach().norm())


@pytest.mark.parametrize("cls", [_SharedMask, _WeightView, _RefreshedOnLoad])
def test_off_state_buffers_are_what_a_normal_build_then_load_gives(cls):
    """Shared, weight-viewing and load-refreshed buffers: the model each unit builds
    holds what a normal build that loads the weights holds, and no meta tensor."""
    from cerebro_automl.training import build_model, clear_models

    spec = make_spec(model_fn=lambda c: cls())
    torch.manual_seed(5)
    weights = {k: v * 3 for k, v in cls().state_dict().items()}  # not the seed's own weights
    for _ in range(2):  # the first build keeps the buffers, the second uses them
        model = build_model(spec, CONFIG, weights, 1)
        torch.manual_seed(1)
        alone = cls()
        alone.load_state_dict(weights)
        got = dict(model.named_buffers(remove_duplicate=False))
        want = dict(alone.named_buffers(remove_duplicate=False))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert not any(t.is_meta for t in (*model.parameters(), *got.values()))
    if cls is _SharedMask:
        assert model.a.mask is model.b.mask
    if cls is _WeightView:
        assert model.transposed._base is model.linear.weight
    from cerebro_automl.training.restore import _OFF_STATE

    kept = [key for key, (owner, _) in _OFF_STATE.items() if owner is spec]
    assert len(kept) == (cls is not _WeightView)  # a view is never kept: its model builds normally
    clear_models(spec)  # a session's end
    assert not any(owner is spec for owner, _ in _OFF_STATE.values())


def test_the_phase_clock_never_fails_a_unit_when_the_device_cannot_read_its_events():
    from cerebro_automl.training import PhaseClock

    class Unfinished:  # a CUDA event whose work has not completed: elapsed_time raises
        def synchronize(self):
            pass

        def elapsed_time(self, other):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")

    clock = PhaseClock(torch.device("cpu"))
    clock.cuda, clock.marks = True, [Unfinished(), Unfinished()]
    assert clock.seconds(("compute",)) == {}


def test_an_abandoned_unit_raises_unit_abandoned_which_the_dask_executor_counts_as_lost_work():
    """Not a UnitError, which would fail the model: Dask may release a running task for
    a moment (an input lost) and want it again, and the unit then runs again."""
    from cerebro_automl.executors.dask.failures import Origin, error_origin
    from cerebro_automl.training import UnitAbandoned, abandon_when

    with abandon_when(lambda: True), pytest.raises(UnitAbandoned):
        _train(make_spec(), None)
    assert error_origin(UnitAbandoned("stopped"), worker_alive=True) is Origin.KILLED


def test_accuracy_takes_class_indices_with_or_without_a_trailing_dimension_and_one_hot_rows():
    from cerebro_automl import accuracy

    out = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    labels = torch.tensor([1, 0, 0, 0])
    expected = 0.75
    assert float(accuracy(out, labels)) == expected
    assert float(accuracy(out, labels.view(-1, 1))) == expected  # compared row by row, not broadcast to 4x4
    assert float(accuracy(out, torch.nn.functional.one_hot(labels, 2).float())) == expected
    with pytest.raises(ValueError, match=r"accuracy got outputs of shape \(4, 2\) and targets of shape \(2, 2\), "
                                         r"but targets must be class indices of shape \(4,\)"):
        accuracy(out, labels.view(2, 2))
    with pytest.raises(ValueError, match=r"takes one score per class"):
        accuracy(out[:, :1], labels)
