"""Fused training: configurations of one architecture train as one batched model.

* ``group``: a group's config (its members' configs and seeds) and its seed;
* ``stacked``: k members' weights stacked, called on one batch through ``vmap``;
* ``batched``: the same call without ``vmap``, for Sequential models of known layers;
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
