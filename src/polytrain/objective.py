"""What training minimises and what it reports, as sums over samples so ranks and micro-batches add up.

The loss is a *per-sample mean*: a step minimises the mean over the whole global batch, whichever way the
batch is cut across ranks or micro-batches. Every part therefore reports its loss as a sum over its samples
(its mean times its sample count); the strategy divides by the global batch size, and the trainer reduces
sums and counts, never means of means. Metrics follow the same rule: `fn(outputs, targets)` returns one value
per sample (shape (n,)) or the batch mean (a scalar); polytrain sums them over samples, ranks and steps and
reports sum / count.

Without `loss=` the objective is classification: cross-entropy on class scores, with accuracy; or, for text
(`kind="language"`, chosen by the dataset), next-token cross-entropy: outputs (N, T, vocab) and targets (N, T),
each sample's loss the mean over its T tokens, so that the mean over samples is exactly the mean per token.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .errors import UserError

Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KINDS = ("classification", "language")


class Objective:
    def __init__(self, loss: Optional[Callable] = None, metrics: Optional[Dict[str, Metric]] = None, *,
                 label_smoothing: float = 0.0, kind: str = "classification"):
        if loss is not None and not callable(loss):
            raise UserError(f"loss= must be a callable loss(outputs, targets) -> scalar, got {type(loss).__name__}")
        metrics = dict(metrics or {})
        for name, fn in metrics.items():
            if not isinstance(name, str) or not name.isidentifier() or not callable(fn):
                raise UserError(f"metrics= must map names (letters, digits, _) to callables fn(outputs, targets); "
                                f"got {name!r}: {type(fn).__name__}")
        if kind not in KINDS:
            raise UserError(f"unknown objective kind {kind!r}; choose one of {', '.join(KINDS)}")
        self.loss = loss
        self.label_smoothing = label_smoothing
        self.language = loss is None and kind == "language"      # next-token cross-entropy, no accuracy
        self.classification = loss is None and not self.language
        if self.classification and "acc" in metrics:
            raise UserError("metrics= names 'acc', which classification already reports; choose another name")
        self.metrics = metrics
        self.names: Tuple[str, ...] = (("acc",) if self.classification else ()) + tuple(metrics)

    def describe_loss(self) -> str:
        if self.language:
            return "next-token cross-entropy"
        return "cross-entropy" if self.loss is None else getattr(self.loss, "__name__", type(self.loss).__name__)

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor, *, training: bool = True) -> torch.Tensor:
        """The loss summed over the samples of `outputs` (differentiable)."""
        if self.language:                 # each sample's mean over its tokens, summed over the samples
            tokens = max(1, targets.shape[-1]) if targets.dim() > 1 else 1
            return F.cross_entropy(outputs.float().flatten(0, -2), targets.flatten(), reduction="sum",
                                   label_smoothing=self.label_smoothing if training else 0.0) / tokens
        if self.loss is None:
            return F.cross_entropy(outputs.float(), targets, reduction="sum",
                                   label_smoothing=self.label_smoothing if training else 0.0)
        count = outputs.shape[0]
        if count == 0:                    # a rank with no samples in a short last batch still takes part
            return outputs.float().sum() * 0.0
        value = self.loss(outputs, targets)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise UserError(f"loss= returned {got}; it must return one number, the mean over the batch "
                            f"(e.g. reduction='mean')")
        return value.float() * count

    @torch.no_grad()
    def metric_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One sum over this batch's samples per metric name, as a float tensor on the outputs' device."""
        outputs = outputs.detach()
        sums = []
        if self.classification:
            sums.append((outputs.argmax(1) == targets).sum().float())
        for name, fn in self.metrics.items():
            sums.append(per_sample_sum(name, fn(outputs, targets), outputs.shape[0], outputs.device))
        if not sums:
            return torch.zeros(0, device=outputs.device)
        return torch.stack(sums)


def per_sample_sum(name: str, value, count: int, device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value, dtype=torch.float32, device=device)
    if value.dim() == 0:
        return value.float() * count if count else torch.zeros((), device=device)
    if value.shape == (count,):
        return value.float().sum()
    raise UserError(f"metric {name!r} returned shape {tuple(value.shape)} for {count} samples; return one value "
                    f"per sample, shape ({count},), or the batch mean (a scalar)")

