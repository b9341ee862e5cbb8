"""Optimizer state of a model whose parameters are spread over ranks (pipeline stages, parameter servers) or
grouped (parameter groups), in the numbering every strategy shares, so that any strategy can resume it.

A parameter's number is its position in the whole model's `model.parameters()` order: `state` is keyed by
it and each of `param_groups` lists the numbers of its parameters (one group: `params` is 0..n-1, as
`torch.optim` numbers one device's optimizer). `position_of` maps `id(parameter)` of a rank's parameters to
their numbers; a rank's zero-size placeholders are in no map and counted nowhere.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..optim import make_recipe

SPEED = ("foreach", "fused")  # how a rank runs its update, not what it computes: kept on loading


def to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(item) for item in value)
    return value


def positions(parameters, numbers=None) -> dict:
    """id(parameter) -> its number: `numbers[j]` for the j-th (default: j, the whole model in order)."""
    parameters = list(parameters)
    return {id(p): (numbers[j] if numbers is not None else j) for j, p in enumerate(parameters)}


def numbered_part(optimizer, position_of: dict) -> dict:
    """This rank's per-parameter state keyed by number, on the CPU, and the numbers in each of its groups."""
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    state = optimizer.state_dict()["state"]
    return {
        "state": {
            position_of[id(flat[i])]: to_cpu(value)
            for i, value in state.items()
            if id(flat[i]) in position_of
        },
        "groups": [
            [position_of[id(p)] for p in group["params"] if id(p) in position_of]
            for group in optimizer.param_groups
        ],
    }


def whole_state(optimizer, parts) -> dict:
    """The whole model's optimizer state dict from every rank's `numbered_part` (empty parts skipped); the
    groups' options from this rank's optimizer (every rank has the same groups, in the same order)."""
    parts = [part for part in parts if part]
    options = [
        {key: value for key, value in group.items() if key != "params"}
        for group in optimizer.state_dict()["param_groups"]
    ]
    state = dict(sorted((key, value) for part in parts for key, value in part["state"].items()))
    return {
        "state": state,
        "param_groups": [
            dict(group, params=sorted(n for part in parts for n in part["groups"][g]))
            for g, group in enumerate(options)
        ],
    }


def load_part(optimizer, saved: dict, position_of: dict) -> None:
    """Load this rank's share of a whole-model optimizer state dict (`whole_state`'s form)."""
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"it has {len(groups)} parameter group(s), this run {len(optimizer.param_groups)} "
            f"(--no-decay-norms-and-biases, --freeze or param_groups= differ)"
        )
    local_state, local_groups, index = {}, [], 0
    for g, (mine, theirs) in enumerate(zip(optimizer.param_groups, groups)):
        listed, first = set(theirs["params"]), index
        for parameter in mine["params"]:
            number = position_of.get(id(parameter))
            if number is not None and number not in listed:
                raise ValueError(f"parameter {number} is in group {g} here but not in the checkpoint's")
            if number is not None and number in saved["state"]:
                local_state[index] = saved["state"][number]
            index += 1
        local_groups.append(dict(theirs, params=list(range(first, index)), **keep_speed(mine)))
    optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})


def keep_speed(group: dict) -> dict:
    """This rank's kernel choices of a group (fused on a GPU, foreach on a CPU), whatever the saver used."""
    return {key: group[key] for key in SPEED if key in group}


def state_slots(cls, kwargs: Optional[dict] = None) -> int:
    """How many tensors of state the optimizer keeps per parameter tensor (SGD with momentum 1, Adam 2),
    counted on a probe; 2 where it cannot be built here."""
    probe = nn.Parameter(torch.zeros(3))
    probe.grad = torch.ones(3)
    try:
        optimizer = cls([probe], **{k: v for k, v in (kwargs or {}).items() if k not in ("fused", "foreach")})
        optimizer.step()
    except Exception:  # a class or factory of the user's that this probe cannot drive
        return 2
    return sum(
        1
        for value in optimizer.state[probe].values()
        if isinstance(value, torch.Tensor) and value.shape == probe.shape
    )


def state_slots_of(config) -> int:
    """`state_slots` of the optimizer `config` names (2 for one given from Python)."""
    recipe = make_recipe(config, objects_follow=True)
    return state_slots(recipe.optimizer, recipe.options) if isinstance(recipe.optimizer, type) else 2
