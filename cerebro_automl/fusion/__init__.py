"""Fused training: configurations of one architecture train as one batched model.

* ``group``: a group's config (its members' configs and seeds) and its seed;
* ``stacked``: k members' weights stacked, called on one batch through ``vmap``;
* ``batched``: the same call without ``vmap``, for models of known layers, replaying
  the calls ``recording`` saw the forward make; ``layouts`` says where the members are
  in a value, and ``convolution``, ``dims``, ``attention`` and ``products`` hold the
  batched forms of convolutions, of calls that name dimensions, of attention and of
  matrix products;
* ``optim``: SGD, Adam and AdamW stepping every member with its own hyperparameters;
* ``signature``: which configurations may share a group.
"""

from .group import FUSED_KEY, Member, group_config, group_members, group_seed, is_group, without
from .optim import FusedOptimizer, Unfusable
from .stacked import StackedModels

__all__ = [
    "FUSED_KEY",
    "Member",
    "group_config",
    "group_members",
    "group_seed",
    "is_group",
    "without",
    "FusedOptimizer",
    "Unfusable",
    "StackedModels",
]
