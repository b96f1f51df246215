"""Training: :class:`TrainingSpec`, the one unit loop every spec trains through,
and what a unit needs around it.

Modules:

* ``spec``: TrainingSpec, what to train, and its checks on a config; ``contract``:
  RunSpec, what the loop's modules read of a spec (so that they need not name it);
* ``loop``: THE training loop and the validation pass, with the hooks a spec fills;
* ``plain``: the hooks of a plain TrainingSpec (``optimizer_fn``, ``loss_fn``, ``metrics``);
* ``units``: ``train_unit`` and ``evaluate_unit``, what executors run on workers;
* ``groups``: a fusion group's units: its members trained as one batched model;
* ``schedulers``: when LR schedulers step, and the form of their saved state;
* ``restore``: a model and optimizer rebuilt from a state; a state's layout checks;
* ``base``: the frozen base: a model's frozen tensors kept on the worker, shared
  and digested; only what trains hops; ``stepping``: batches to optimizer steps
  (accumulation, clipping, the scheduled learning rate);
* ``seeding``: model and unit seeds; ``devices``: device choice, deterministic
  kernels, the phase clock; ``gpus``: one GPU per worker process; ``precision``: autocast and GradScaler;
  ``batches``: a shard's batches on the device; ``transfer``: states to the host;
* ``metrics``: validation sums and epoch metrics; ``errors``: what a unit raises;
  ``watch``: deadlines, abandoned units and progress reports.

>>> from cerebro_automl.training import TrainingSpec, train_unit
"""

from .base import BaseMismatchError, checkout_model, clear_models, hopping_weights, kept_models, whole_model
from .batches import batches, shard_on_device
from .devices import CUBLAS_WORKSPACE, PhaseClock, describe_device, deterministic_algorithms, gpu_of, pick_device
from .errors import NonFiniteLossError, UnitAbandoned, UnitError, UnitTimeout
from .groups import evaluate_group, group_figures, train_group
from .loop import EvalHooks, PassLoss, TrainHooks, evaluate_pass, losses_checked, train_pass
from .metrics import EvalResult, accuracy, epoch_metrics, logged_means
from .precision import PRECISIONS, autocast, grad_scaler
from .restore import build_model, layout_mismatch, restore_optimizer, weights_layout
from .schedulers import SchedulerConfig, saved_scheduler_states, scheduler_state, step_schedulers
from .seeding import canonical_config, model_seed, seed_torch, unit_generators, unit_seed
from .spec import TrainingSpec
from .transfer import State, clone_tensors, to_floats, to_host
from .units import evaluate_unit, train_unit
from .watch import abandon_when, check_deadline, progress_to

__all__ = [
    # what to train
    "TrainingSpec",
    "accuracy",
    "PRECISIONS",
    # units and their results
    "train_unit",
    "evaluate_unit",
    "train_group",
    "evaluate_group",
    "group_figures",
    "EvalResult",
    "epoch_metrics",
    "logged_means",
    "UnitError",
    "UnitTimeout",
    "UnitAbandoned",
    "NonFiniteLossError",
    "abandon_when",
    "progress_to",
    "check_deadline",
    # the one loop and its hooks
    "train_pass",
    "evaluate_pass",
    "TrainHooks",
    "EvalHooks",
    "PassLoss",
    "losses_checked",
    "SchedulerConfig",
    "step_schedulers",
    "scheduler_state",
    "saved_scheduler_states",
    # seeds, devices, precision, states
    "model_seed",
    "unit_seed",
    "canonical_config",
    "seed_torch",
    "unit_generators",
    "pick_device",
    "describe_device",
    "gpu_of",
    "deterministic_algorithms",
    "PhaseClock",
    "CUBLAS_WORKSPACE",
    "autocast",
    "grad_scaler",
    "batches",
    "shard_on_device",
    "State",
    "build_model",
    "whole_model",
    "checkout_model",
    "hopping_weights",
    "kept_models",
    "clear_models",
    "BaseMismatchError",
    "restore_optimizer",
    "weights_layout",
    "layout_mismatch",
    "clone_tensors",
    "to_host",
    "to_floats",
]
