"""A run counted in optimizer steps: the steps a run of fractional epochs takes (`planned_steps`, which the
schedules, Lightning's stand-in and the trainer share), where training stands (`Position`, which a checkpoint
records) and the words for people. Pure: it imports nothing of polytrain's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass
class Position:
    """Where training stands: the next step to run, and the running sums of the epoch in progress."""

    epoch: int = 0
    step: int = 0
    loss_sum: float = 0.0
    metrics: tuple = ()  # the objective's metric sums, in the order of its names
    count: float = 0.0
    seconds: float = 0.0
    loss_count: Optional[float] = None  # elements the loss sum covers ((sum, count) losses); None: count

    @classmethod
    def from_dict(cls, values: dict) -> "Position":
        values = dict(values)
        if "correct" in values:  # checkpoints written before metrics were generalised
            values["metrics"] = (values.pop("correct"),)
        values["metrics"] = tuple(values.get("metrics", ()))
        position = cls(**values)
        if position.loss_count is None:
            position.loss_count = position.count
        return position


def planned_steps(epochs: float, steps_per_epoch: int) -> int:
    """Optimizer steps a run of `epochs` takes in all: a fractional --epochs ends within its last epoch, after
    that epoch's first ceil(fraction x steps) steps."""
    return max(1, math.ceil(epochs * steps_per_epoch - 1e-9))


def describe_position(epoch: int, step: int, steps_per_epoch: int) -> str:
    """Where a run stands, for people: "in epoch 2 at step 13 of 63" or "after epoch 1"."""
    return f"in epoch {epoch + 1} at step {step} of {steps_per_epoch}" if step else f"after epoch {epoch}"
