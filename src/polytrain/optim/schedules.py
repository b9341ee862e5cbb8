"""Learning-rate schedules: polytrain's warm-up schedules per optimizer step, or any torch.optim.lr_scheduler."""

from __future__ import annotations

import math
from functools import partial
from typing import Optional

from torch.optim import lr_scheduler

from .optimizers import SCHEDULERS, SCHEDULES, resolve


def length_free(schedule: str) -> bool:
    """Whether a schedule's steps so far stay the same when the run gets longer: constant, and torch's
    lr_scheduler classes (their arguments are their own, not the run's length); polytrain's cosine and onecycle
    are laid out over --epochs."""
    return schedule == "constant" or schedule.lower() not in SCHEDULES


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


def make_scheduler(
    optimizer, *, kind="onecycle", total_steps: int = 1, warmup_steps: int = 0, options: Optional[dict] = None
):
    """polytrain's schedule `kind` over `total_steps` (after `warmup_steps`), a torch.optim.lr_scheduler class
    (by name or object, with `options`), or what a factory fn(optimizer) returns (a Lightning-style
    {"scheduler": s, "interval": ...} gives s)."""
    if kind in SCHEDULES:
        factor = partial(lr_factor, total_steps=total_steps, warmup_steps=warmup_steps, kind=kind)
        return lr_scheduler.LambdaLR(optimizer, factor)
    made = (resolve(kind, SCHEDULERS, "--schedule") if isinstance(kind, str) else kind)(
        optimizer, **(options or {})
    )
    return made["scheduler"] if isinstance(made, dict) else made


def step_per_epoch(scheduler, record: dict) -> None:
    """One epoch's step of a per-epoch schedule; ReduceLROnPlateau reads the epoch's validation loss."""
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        scheduler.step(record["val_loss"])
    else:
        scheduler.step()
