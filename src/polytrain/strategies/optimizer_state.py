"""Optimizer state of a model whose parameters are spread over ranks (pipeline stages, parameter servers),
in the numbering `torch.optim` gives the whole model on one device, so that any strategy can resume it.

Each rank's optimizer covers some of the model's parameters: `global_index[j]` is the position, in
`model.parameters()` order, of the rank's j-th parameter.
"""
from __future__ import annotations

import torch


def to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(item) for item in value)
    return value


def numbered_part(optimizer, global_index) -> dict:
    """This rank's per-parameter optimizer state, keyed by position in the whole model, on the CPU."""
    return {global_index[i]: to_cpu(state) for i, state in optimizer.state_dict()["state"].items()}


def whole_state(optimizer, parts, *, parameters: int) -> dict:
    """The whole model's optimizer state dict from every rank's `numbered_part` (hyper-parameters from this
    rank's optimizer: the same on every rank)."""
    group = {key: value for key, value in optimizer.state_dict()["param_groups"][0].items() if key != "params"}
    state = dict(sorted((key, value) for part in parts for key, value in part.items()))
    return {"state": state, "param_groups": [dict(group, params=list(range(parameters)))]}


def load_part(optimizer, saved: dict, global_index) -> None:
    """Load this rank's share of a whole-model optimizer state dict."""
    group = dict(saved["param_groups"][0], params=list(range(len(optimizer.param_groups[0]["params"]))))
    local = {i: saved["state"][g] for i, g in enumerate(global_index) if g in saved["state"]}
    optimizer.load_state_dict({"state": local, "param_groups": [group]})
