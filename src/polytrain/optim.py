"""Optimizers from torch.optim and per-step learning-rate schedules."""
from __future__ import annotations

import math
from functools import partial

import torch


def make_optimizer(params, *, name: str, lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """SGD (with momentum), Adam or RMSprop, updating all tensors at once: one fused kernel on CUDA
    (SGD and Adam), multi-tensor `foreach` kernels otherwise, never a Python loop over parameters."""
    params = list(params)
    fused = all(p.is_cuda for p in params) and name in ("sgd", "adam")
    speed = {"fused": True} if fused else {"foreach": True}
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **speed)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, **speed)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=True)
    raise ValueError(f"unknown optimizer {name!r}")


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, kind: str) -> float:
    """The multiplier of the base learning rate before optimizer step `step` (0-based).

    Warm-up rises linearly to 1 over `warmup_steps`; then `constant` stays at 1, `cosine` follows half a
    cosine down to 0, and `onecycle` falls linearly to 0 at `total_steps`.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "onecycle":
        return max(0.0, 1.0 - progress)
    raise ValueError(f"unknown schedule {kind!r}")


def make_scheduler(optimizer, *, kind: str, total_steps: int, warmup_steps: int):
    factor = partial(lr_factor, total_steps=total_steps, warmup_steps=warmup_steps, kind=kind)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
