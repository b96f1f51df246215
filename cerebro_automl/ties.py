"""Tied weights: one parameter or buffer that a model holds under several names (a
language model's input embedding and output layer, say).

``load_state_dict(..., assign=True)`` and ``.to("meta")`` give each name a tensor
of its own, which unties them; :func:`tie` ties them again.

>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
>>> model[1].weight = model[0].weight
>>> aliases = tied_names(model)
>>> aliases
{'1.weight': '0.weight'}
>>> untied = model.to("meta")
>>> untied[1].weight is untied[0].weight
False
>>> tie(untied, aliases)[1].weight is untied[0].weight
True
"""

from __future__ import annotations

import torch

__all__ = ["tied_names", "tie"]


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Each further name of a parameter or buffer held under several -> its first name
    (the one ``named_parameters()`` and ``named_buffers()`` give)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return aliases


def tie(model: torch.nn.Module, aliases: dict[str, str]) -> torch.nn.Module:
    """Make every alias of ``aliases`` (from :func:`tied_names`) hold its first name's
    tensor again; returns ``model``."""
    for alias, name in aliases.items():
        owner, _, attr = alias.rpartition(".")
        module = model.get_submodule(owner)
        if attr in module._parameters:
            module._parameters[attr] = model.get_parameter(name)
        else:
            module._buffers[attr] = model.get_buffer(name)
    return model
