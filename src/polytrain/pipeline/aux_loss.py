"""The mixtures' load-balancing loss in a pipeline. The loss is computed on the last stage, from its outputs and
the targets, but every stage's mixtures of experts add their part of the balance loss (models/moe.py). Each
stage's output carries that part into the backward, as Megatron's `MoEAuxLossAutoScaler` does: the forward hands
the output on unchanged, and the backward adds the gradient of the part, divided and scaled as the loss is
(`Pipeline.microbatch_loss`), to what flows through the stage. The step's figures then sum the parts over the
pipeline's ranks, so that a pipeline trains, and reports, what one device does."""

from __future__ import annotations

from typing import Callable, Dict, List

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

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
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.device.type != "meta"
        and not isinstance(tensor, FakeTensor)
    )


class StageBalance:
    """Forward hooks on a rank's stage modules that take each stage's mixtures' balance loss per sequence (B,)
    after its forward: its sum over the whole model's `count` weighted mixtures is this stage's part of the mean
    one device takes (`balance_loss`). `weigh(part, stage, index)` sums it over the sequences as the objective
    does (each by its trained tokens where labels may be masked: the `index`-th micro-batch of the step's, which
    a stage runs in order); in training, `scale(weighed)` (the loss's own division and scaling) joins the
    backward. The step's figures keep the part (summed over the sequences) and the weighed part (the loss's)."""

    def __init__(
        self,
        stages: List[nn.Module],
        *,
        count: int,
        weigh: Callable[[torch.Tensor, nn.Module, int], torch.Tensor],
        scale: Callable[[torch.Tensor], torch.Tensor],
    ):
        self.count, self.weigh, self.scale = count, weigh, scale
        # each forward's (part, weighed part), summed over its sequences
        self.figures: List[torch.Tensor] = []
        self.forwards: Dict[int, int] = {}  # stage module id -> training forwards in this step
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
        training = module.training and torch.is_grad_enabled()
        index = self.forwards.get(id(module), 0)
        weighed = self.weigh(part, module, index) if training else part.sum()
        self.figures.append(torch.stack([part.detach().sum(), weighed.detach()]))
        if not training:
            return output
        self.forwards[id(module)] = index + 1
        if not output.requires_grad:  # a stage with nothing to train: its part counts in the figures only
            return output
        return _CarriesLoss.apply(output, self.scale(weighed))

    def taken(self) -> torch.Tensor:
        """(the part, the weighed part) summed since the last call (a step's, an evaluation batch's), and forget
        them and the count of forwards."""
        kept, self.figures, self.forwards = self.figures, [], {}
        return torch.stack(kept).sum(dim=0).double() if kept else torch.zeros(2, dtype=torch.float64)
