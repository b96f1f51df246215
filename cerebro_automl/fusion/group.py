"""A fusion group's config: the members' configs and seeds under one reserved key,
so that the engine and the executors carry a group as one model, unchanged.

Example:
    >>> cfg = group_config([Member(3, {"lr": 0.1}, 11), Member(4, {"lr": 0.2}, 12)])
    >>> is_group(cfg), [m.model_id for m in group_members(cfg)], group_seed(cfg)
    (True, [3, 4], 11)
    >>> [m.model_id for m in group_members(without(cfg, {3}))]
    [4]
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["FUSED_KEY", "Member", "group_config", "group_members", "group_seed", "is_group", "without"]

#: the reserved config key of a group (a user config may not use it)
FUSED_KEY = "__cerebro_fusion_group__"


@dataclass(frozen=True)
class Member:
    """One configuration of a group: its model id in the session, its config, its model seed."""

    model_id: int
    config: Mapping[str, Any]
    seed: int


def group_config(members: Sequence[Member], seed: int | None = None) -> dict[str, Any]:
    """The config the engine and the executors carry for a group of ``members``.

    ``seed`` (default: the first member's seed) orders the group's data and seeds its
    in-model randomness.
    """
    if not members:
        raise ValueError("a fusion group needs at least one member")
    return {
        FUSED_KEY: {
            "seed": members[0].seed if seed is None else seed,
            "members": [[m.model_id, dict(m.config), m.seed] for m in members],
        }
    }


def is_group(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` is a fusion group's config."""
    return FUSED_KEY in config


def group_members(config: Mapping[str, Any]) -> list[Member]:
    """The members of a group's config, in the group's order."""
    return [Member(int(i), c, int(s)) for i, c, s in config[FUSED_KEY]["members"]]


def group_seed(config: Mapping[str, Any]) -> int:
    """The seed of the group's data order and in-model randomness."""
    return int(config[FUSED_KEY]["seed"])


def without(config: Mapping[str, Any], model_ids: Collection[int]) -> dict[str, Any]:
    """The group's config less the members ``model_ids`` (its seed kept)."""
    group = config[FUSED_KEY]
    kept = [m for m in group["members"] if m[0] not in model_ids]
    return {FUSED_KEY: {"seed": group["seed"], "members": kept}}
