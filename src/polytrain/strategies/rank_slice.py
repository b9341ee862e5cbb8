"""A tensor plan tried on one rank's slice in the launching process: a model whose forward cannot run on the
widths a rank holds (nanoGPT's `self.c_attn(x).split(self.n_embd, dim=2)` expects all of q, k and v, where a
rank holds a T-th of each) is one line before any worker starts, not a traceback from every worker."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..errors import ConfigError, first_line
from ..parallel.tensor_plan import TensorPlan, is_conv1d


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[rows])
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows])
    linear.out_features = len(rows)


def rank_zero_slice(model: nn.Module, plan: TensorPlan, devices: int) -> nn.Module:
    """A copy of `model` with rank 0's share (of `devices` tensor ranks) of every layer `plan` splits: a colwise Linear's first T-th of the
    rows of each of its parts, a rowwise Linear's first T-th of the columns (its partial sums have the whole
    output's shape). Vocabularies are left whole: their outputs are whole on every rank."""
    probe = copy.deepcopy(model)
    for name, style, parts in plan.styles:
        module = probe.get_submodule(name)
        if name in plan.vocabulary:
            continue
        if is_conv1d(module):
            inputs, outputs = module.weight.shape
            if style == "colwise":
                module.weight = nn.Parameter(module.weight.detach()[:, : outputs // devices])
                module.bias = nn.Parameter(module.bias.detach()[: outputs // devices])
                module.nf = outputs // devices
            elif style == "rowwise":
                module.weight = nn.Parameter(module.weight.detach()[: inputs // devices])
            continue
        if not isinstance(module, nn.Linear):
            continue
        if style == "colwise":
            part = module.out_features // parts
            mine = part // devices
            _keep_rows(module, torch.cat([torch.arange(p * part, p * part + mine) for p in range(parts)]))
        elif style == "rowwise":
            module.weight = nn.Parameter(module.weight.detach()[:, : module.in_features // devices])
            module.in_features //= devices
    return probe


def check_rank_slice(model: nn.Module, plan: TensorPlan, devices: int, sample) -> None:
    """Run rank 0's slice (of `devices` tensor ranks) of `model` on `sample` (two samples, as the data give them); one line if it fails."""
    from ..data.order import map_tree
    from ..models import call_model

    named = [f"{name} ({style})" for name, style, _ in plan.styles if style != "replicate"]
    split = ", ".join(named[:2]) + (f" and {len(named) - 2} more" if len(named) > 2 else "")
    probe = rank_zero_slice(model, plan, devices).eval()
    first = next(probe.parameters(), None)
    if first is not None:
        sample = map_tree(lambda t: t.to(first.device), sample)
    try:
        with torch.no_grad():
            call_model(probe, sample)
    except Exception as error:  # the user's forward on a rank's widths: say what failed, in one line
        raise ConfigError(
            f"tensor_plan: {type(model).__name__}'s forward fails on the share each of the "
            f"{devices} ranks holds of {split} ({type(error).__name__}: {first_line(error)}); "
            f"compute widths from the layer's output, not the model's width: q, k, v = "
            f"self.c_attn(x).chunk(3, dim=-1), then view(B, T, -1, head_dim) so each rank runs its "
            f"heads"
        ) from None
