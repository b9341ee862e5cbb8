"""Layers that look at the whole batch behave as on one device when data-parallel ranks each hold a slice.

On one device a BatchNorm layer normalises over the whole batch and a Dropout layer draws one mask for it. Each
data-parallel rank sees only its slice, so by default BatchNorm would normalise over the slice and every rank
would draw its own masks: another model than the one written, and one that `verify` cannot equal. Here:

- **BatchNorm** (1d, 2d, 3d) in training gathers every rank's per-channel count, mean and variance
  (an all-gather that carries gradients back to every rank), combines them as
  the whole batch's (Chan's parallel formula: no cancellation) and normalises with those; running statistics
  are updated from them, so every rank keeps the one-device buffers. One small collective per layer and pass.
- **Dropout** draws the mask of the whole global batch and applies this rank's rows of it. Each layer draws
  from a generator of its own, seeded by its one-device name and one number drawn per step from torch's
  global generator (every rank seeds alike and resumes its generator's state, so every rank draws the same):
  a layer's mask depends neither on the other layers' draws nor on their order, so the stages of a pipeline,
  each holding some of the layers, draw what one device draws. The mask is drawn in the step's first pass and later passes of an
  accumulated step use their rows of it, so masks depend neither on the passes nor on the layout, and in the
  default memory format whatever the model's, so a channels-last replica (data) and a contiguous one (sharded)
  draw alike. One device draws its masks the same way (the reference every layout is compared with); they
  are Bernoulli(1 - p) masks scaled by 1 / (1 - p), as `F.dropout`'s.

Both change the layer's `forward` on the module object only: its parameters, buffers and names stay as they
are, and evaluation (running statistics, no dropout) is the layer's own.
"""

from __future__ import annotations

import zlib
from typing import List, Optional, Tuple

import torch
import torch.nn as nn


class GlobalRows:
    """Which rows of the step's global batch this rank's current pass holds (set by the strategy per pass)."""

    def __init__(self):
        self.start, self.stop, self.total, self.step = 0, 0, 0, 0
        self.key, self.keyed = 0, None  # the number that seeds the masks, and the step it was drawn for
        self.active = False  # only within a training step: elsewhere the layers are torch's own

    def set(self, start: int, stop: int, total: int, *, step: int) -> None:
        self.start, self.stop, self.total, self.step = start, stop, total, step
        self.active = True

    def step_key(self) -> int:
        """The step's number from torch's global generator: drawn by the first mask of each step (a model
        without Dropout draws nothing), the same on every rank that holds a Dropout layer."""
        if self.keyed != self.step:
            self.key, self.keyed = int(torch.randint(0, 2**62, (1,))), self.step
        return self.key


def slice_offsets(total: int, parts: int) -> List[Tuple[int, int]]:
    """(start, stop) of each of `parts` near-equal parts of `total` rows, as torch.tensor_split cuts them."""
    size, extra = divmod(total, parts)
    bounds, start = [], 0
    for part in range(parts):
        stop = start + size + (1 if part < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _batchnorm_forward(module: nn.modules.batchnorm._BatchNorm, group, x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as collectives

    # (named all_gather_tensor_autograd before torch 2.13)
    gather = (
        getattr(collectives, "all_gather_single_autograd", None) or collectives.all_gather_tensor_autograd
    )
    if not module.training:
        return type(module).forward(module, x)
    dims = [0] + list(range(2, x.dim()))
    count = x.new_full((1,), x.numel() // max(x.shape[1], 1))
    var, mean = torch.var_mean(x, dim=dims, correction=0)
    # every rank's (count, mean, variance); its backward sums each rank's gradients back (reduce-scatter)
    stats = torch.cat([count, mean, var]).unsqueeze(0)
    parts = gather(stats, gather_dim=0, group=group or dist.group.WORLD)
    channels = x.shape[1]
    counts, means, variances = parts[:, 0], parts[:, 1 : 1 + channels], parts[:, 1 + channels :]
    total = counts.sum()
    weights = (counts / total).unsqueeze(1)
    global_mean = (weights * means).sum(0)
    global_var = (weights * (variances + (means - global_mean) ** 2)).sum(0)
    if module.track_running_stats and module.running_mean is not None:
        with torch.no_grad():
            module.num_batches_tracked.add_(1)
            momentum = 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum
            unbiased = global_var * (total / (total - 1)) if float(total) > 1 else global_var
            module.running_mean.mul_(1 - momentum).add_(global_mean.detach(), alpha=momentum)
            module.running_var.mul_(1 - momentum).add_(unbiased.detach(), alpha=momentum)
    shape = [1, channels] + [1] * (x.dim() - 2)
    y = (x - global_mean.reshape(shape)) / torch.sqrt(global_var.reshape(shape) + module.eps)
    if module.affine:
        y = y * module.weight.reshape(shape) + module.bias.reshape(shape)
    return y


def _dropout_forward(
    module: nn.Dropout, name: str, rows: GlobalRows, cache: dict, x: torch.Tensor
) -> torch.Tensor:
    if not module.training or module.p == 0:
        return x
    if module.p == 1:
        return x * 0
    key = rows.step_key()
    if cache.get("step") != (rows.step, key) or cache.get("shape") != x.shape[1:]:
        generator = torch.Generator(device=x.device)
        generator.manual_seed((key * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        noise = x.new_empty((rows.total, *x.shape[1:])).bernoulli_(1 - module.p, generator=generator)
        noise.div_(1 - module.p)
        cache.update(step=(rows.step, key), shape=x.shape[1:], noise=noise)
    return x * cache["noise"][rows.start : rows.stop]


def whole_batch_layers(model: nn.Module, rows: GlobalRows, *, batchnorm: bool, group=None) -> List[str]:
    """Make `model`'s Dropout layers (and with `batchnorm` its BatchNorm layers, over the process `group`)
    compute over the global batch, in place; their names."""
    changed = []
    for name, module in model.named_modules():
        if (
            batchnorm
            and isinstance(module, nn.modules.batchnorm._BatchNorm)
            and not isinstance(module, nn.SyncBatchNorm)
        ):
            module.forward = _WholeBatch(module, name, rows, group=group)
            changed.append(name)
        elif type(module) is nn.Dropout:
            module.forward = _WholeBatch(module, name, rows)
            changed.append(name)
    return changed


class _WholeBatch:
    """A layer's forward over the global batch within polytrain's training steps, and its class's own elsewhere
    (an object holding the layer, not a closure: the model still deep-copies and pickles)."""

    def __init__(self, module: nn.Module, name: str, rows: GlobalRows, *, group=None):
        self.module, self.name, self.rows, self.group, self.cache = module, name, rows, group, {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rows.active:
            return type(self.module).forward(self.module, x)
        if isinstance(self.module, nn.modules.batchnorm._BatchNorm):
            return _batchnorm_forward(self.module, self.group, x)
        return _dropout_forward(self.module, self.name, self.rows, self.cache, x)


def uses_whole_batch(model: nn.Module) -> set:
    """The kinds of layer whose output depends on the whole batch or its random draws ("BatchNorm",
    "Dropout") that `model` holds."""
    kinds = set()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            kinds.add("BatchNorm")
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            kinds.add("Dropout")
    return kinds


def unmatched_dropout(model: nn.Module) -> Optional[str]:
    """The class name of a dropout layer drawn per rank (not made whole-batch here: Dropout2d, AlphaDropout,
    ...), if any."""
    for module in model.modules():
        if (
            isinstance(module, nn.modules.dropout._DropoutNd)
            and type(module) is not nn.Dropout
            and module.p > 0
        ):
            return type(module).__name__
    return None
