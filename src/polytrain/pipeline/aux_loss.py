"""The mixtures' load-balancing loss in a pipeline. The loss is computed on the last stage, from its outputs and
the targets, but every stage's mixtures of experts add their part of the balance loss (models/moe.py). Each
stage's output carries that part into the backward, as Megatron's `MoEAuxLossAutoScaler` does: the forward hands
the output on unchanged, and the backward adds the gradient of the part, divided and scaled as the loss is
(`Pipeline.microbatch_loss`), to what flows through the stage. The step's figures then sum the parts over the
pipeline's ranks, so that a pipeline trains, and reports, what one device does."""

from __future__ import annotations

from typing import Callable, List

import torch
import torch.nn as nn

from ..models.moe import mixtures


class _CarriesLoss(torch.autograd.Function):
    """`output` unchanged forward; backward, the gradient of `output` and 1 for `loss` (a scalar whose own graph
    reaches the stage's parameters)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=ctx.loss_device)


def _is_real(tensor) -> bool:
    """A tensor with values (not on the meta device, nor a fake tensor of the shape inference)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return (
        isinstance(tensor, torch.Tensor)
        and tensor.device.type != "meta"
        and not isinstance(tensor, FakeTensor)
    )


class StageBalance:
    """Forward hooks on a rank's stage modules that take each stage's mixtures' balance loss per sequence (B,)
    after its forward: its sum over the whole model's `count` weighted mixtures is this stage's part of the mean
    one device takes (`balance_loss`). In training it joins the backward as `weigh(part)`, the loss's own division
    and scaling; its value (summed over the sequences) is kept for the step's figures either way."""

    def __init__(self, stages: List[nn.Module], *, count: int, weigh: Callable[[torch.Tensor], torch.Tensor]):
        self.count, self.weigh = count, weigh
        self.figures: List[torch.Tensor] = []  # each forward's part, summed over its sequences (detached)
        self.handles = [stage.register_forward_hook(self._hook) for stage in stages]

    def _hook(self, module: nn.Module, args, output):
        parts = []
        for mixture in mixtures(module):
            if mixture.balance is not None:
                parts.append(mixture.balance)
                mixture.balance = None
        if not parts or not _is_real(output) or not _is_real(parts[0]):
            return output
        part = torch.stack(parts).sum(dim=0) / self.count  # (B,)
        self.figures.append(part.detach().sum())
        if not (module.training and torch.is_grad_enabled() and output.requires_grad):
            return output
        return _CarriesLoss.apply(output, self.weigh(part.sum()))

    def taken(self) -> torch.Tensor:
        """The sum of the parts since the last call (a step's, an evaluation batch's), and forget them."""
        kept, self.figures = self.figures, []
        return torch.stack(kept).sum().double() if kept else torch.zeros((), dtype=torch.float64)
