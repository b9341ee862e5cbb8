"""Data parallelism: the model replicated on every rank, gradients all-reduced by DistributedDataParallel."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .base import Distributed


def default_strides_where_alike(model: nn.Module) -> None:
    """Channels-last parameters whose memory order is the default one too (a convolution over one input
    channel: the strides differ only in a dimension of size 1) get the default strides: cuDNN returns their
    gradients so, and DDP's gradient buckets, which follow each parameter's strides, would otherwise warn on
    every step. The same values in the same memory order: nothing computes differently."""
    for parameter in model.parameters():
        if parameter.dim() == 4 and parameter.is_contiguous():
            plain = parameter.data.clone(memory_format=torch.contiguous_format)
            if plain.stride() != parameter.stride():
                parameter.data = plain


class DataParallel(Distributed):
    name = "data"
    normalises_global_batch = True

    def wrap(self, model: nn.Module) -> nn.Module:
        if not dist.is_initialized():
            raise RuntimeError(
                "the data strategy needs an initialised process group; start it with --devices N"
            )
        self.materialise(model)  # DDP starts from rank 0's values: every rank holds them all anyway
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # gradient_as_bucket_view=True measured no gain on CPU and, with channels-last weights, makes DDP copy
        # every mismatched gradient (its "grad strides do not match bucket view strides" warning on GPUs).
        if self.device.type == "cuda":
            default_strides_where_alike(model)
        self.replicated = DistributedDataParallel(model, device_ids=device_ids)
        return self.replicated

    def gradient_sync(self, *, last: bool):
        """DDP all-reduces in the last pass of an accumulated step only."""
        return contextlib.nullcontext() if last else self.replicated.no_sync()
