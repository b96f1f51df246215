"""The fine-tuning recipe in a plain TrainingSpec: gradient clipping and accumulation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cerebro_automl import PartitionedDataset, Session, TrainingSpec
from conftest import make_arrays

X, y, Xv, yv = make_arrays(rows=128, valid_rows=32)


def _linear(config):
    return nn.Linear(8, 3)


def _final_weights(partitions=1, epochs=1, **spec_options):
    spec = TrainingSpec(model_fn=_linear, optimizer_fn=lambda c, p: torch.optim.SGD(p, lr=c["lr"]),
                        **{"batch_size": 16, **spec_options})
    data = PartitionedDataset.from_arrays(X, y, num_partitions=partitions, valid=(Xv, yv))
    with Session(spec, data, executor="local", seed=0) as s:
        s.add({"lr": 0.5}, epochs=epochs)
        s.run()
        return s.model(0).state()["model"], s.model(0).build()


def test_accumulating_two_batches_steps_as_one_batch_twice_the_size():
    accumulated, _ = _final_weights(batch_size=16, accumulate_grad_batches=2)
    doubled, _ = _final_weights(batch_size=32)
    plain, _ = _final_weights(batch_size=16)
    for k in doubled:
        torch.testing.assert_close(accumulated[k], doubled[k], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(plain["weight"], doubled["weight"])


def test_a_unit_that_ends_within_a_group_steps_on_what_it_has():
    # 128 rows in 2 partitions: 4 batches of 16 a unit, groups of 3 -> a step after 3, then after 1
    ends_early, _ = _final_weights(partitions=2, batch_size=16, accumulate_grad_batches=3)
    whole_groups, _ = _final_weights(partitions=2, batch_size=16, accumulate_grad_batches=4)
    assert not torch.equal(ends_early["weight"], whole_groups["weight"])
    assert all(torch.isfinite(t).all() for t in ends_early.values())


def test_clipping_bounds_every_steps_gradient_norm():
    with torch.random.fork_rng():  # the seeded initial weights: the session's first unit builds the same
        from cerebro_automl.training import model_seed, seed_torch

        seed_torch(model_seed(0, {"lr": 0.5}))
        start = _linear({})
    _, clipped = _final_weights(batch_size=128, gradient_clip_val=0.01)  # one batch, one step
    moved = torch.cat([(p - q).detach().reshape(-1) for p, q in zip(clipped.parameters(), start.parameters())])
    assert float(moved.norm()) == pytest.approx(0.5 * 0.01, rel=1e-4)


@pytest.mark.parametrize("options, message", [
    ({"gradient_clip_val": 0}, "gradient_clip_val is 0, but must be a finite positive number or None"),
    ({"gradient_clip_val": "1"}, "gradient_clip_val is '1', but must be a finite positive number or None"),
    ({"gradient_clip_val": float("inf")}, "gradient_clip_val is inf, but must be a finite positive number or None"),
    ({"accumulate_grad_batches": 0}, "accumulate_grad_batches is 0, but must be an int >= 1"),
    ({"frozen_base": "yes"}, "frozen_base is 'yes', but must be True or False"),
])
def test_bad_recipe_options_are_refused_naming_the_value(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        TrainingSpec(model_fn=_linear, optimizer_fn=lambda c, p: torch.optim.SGD(p, lr=0.1), **options)


from cerebro_automl.training.schedulers import WarmupDecay  # noqa: E402


def _scheduled(schedule, epochs_plan, partitions=2, **spec_options):
    """The final state of one model trained ``epochs_plan`` epochs ([2, 2]: 2, then extended by 2)."""
    spec = TrainingSpec(model_fn=_linear, optimizer_fn=lambda c, p: torch.optim.SGD(p, lr=c["lr"], momentum=0.9),
                        batch_size=16, lr_schedule=schedule, **spec_options)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=partitions, valid=(Xv, yv))
    with Session(spec, data, executor="local", seed=0) as s:
        s.add({"lr": 0.2, "epochs": sum(epochs_plan)}, epochs=epochs_plan[0])
        s.run()
        for more in epochs_plan[1:]:
            s.extend(0, epochs=more)
            s.run()
        return s.model(0).state()


def test_a_warmup_decay_schedule_reaches_its_final_rate_at_the_budgets_end():
    state = _scheduled(WarmupDecay(warmup=0.25, decay="linear", final=0.1), [2])
    group = state["optimizer"]["param_groups"][0]
    assert group["initial_lr"] == 0.2 and group["lr"] == pytest.approx(0.2 * 0.1)
    halfway = _scheduled(WarmupDecay(warmup=0.25, decay="cosine", epochs=4), [2])
    # after 2 of 4 epochs: (0.5 - 0.25) / 0.75 of the cosine decay
    expected = 0.5 * (1 + __import__("math").cos(__import__("math").pi / 3))
    assert halfway["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.2 * expected)


def test_a_promoted_model_continues_its_schedule_bit_for_bit():
    schedule = WarmupDecay(warmup=0.1, decay="linear", epochs="epochs")  # the horizon: a config key
    straight = _scheduled(schedule, [4])
    promoted = _scheduled(schedule, [1, 1, 2])
    assert all(torch.equal(straight["model"][k], promoted["model"][k]) for k in straight["model"])


def test_a_step_scheduler_from_scheduler_fn_steps_after_every_optimizer_step():
    def scheduler_fn(config, optimizer):
        return {"scheduler": torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.5, total_iters=100), "interval": "step"}

    spec = TrainingSpec(model_fn=_linear, optimizer_fn=lambda c, p: torch.optim.SGD(p, lr=c["lr"]),
                        batch_size=16, scheduler_fn=scheduler_fn)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    with Session(spec, data, executor="local", seed=0) as s:
        s.add({"lr": 0.1}, epochs=1)
        s.run()
        state = s.model(0).state()
    assert state["scheduler"]["last_epoch"] == 128 // 16  # 8 optimizer steps over the epoch's two units


def test_lr_schedule_and_scheduler_fn_together_are_refused():
    with pytest.raises(ValueError, match="lr_schedule and scheduler_fn are both set"):
        TrainingSpec(model_fn=_linear, optimizer_fn=lambda c, p: torch.optim.SGD(p, lr=0.1),
                     lr_schedule=WarmupDecay(), scheduler_fn=lambda c, o: None)
    with pytest.raises(ValueError, match="warmup is 1.5, but must be a fraction of the budget in"):
        WarmupDecay(warmup=1.5)


def test_a_schedule_multiplier_refuses_negative_progress():
    from cerebro_automl.training.schedulers import WarmupDecay

    with pytest.raises(ValueError, match=r"progress is -1, but must be a fraction of the budget >= 0"):
        WarmupDecay().multiplier(-1)
