"""What a LightningModule reads of its loop and gives it: the stand-in for Lightning's Trainer (`self.trainer`,
`self.global_step`, `self.current_epoch`) and the epoch means of what it passed to `self.log`."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import UserError


class Logged:
    """What a module gave `self.log` in one loop (training or validation) since the last reset: per name, the
    sum of the values weighted by batch size and the sum of the weights (on the device: no copy per step)."""

    def __init__(self):
        self.sums = {}
        self.latest = {}  # this call's values, as given

    def add(self, name: str, value, options: dict, batch_size: int) -> None:
        reduce = options.get("reduce_fx", "mean")
        if not (reduce in ("mean", "avg") or reduce is torch.mean):
            raise UserError(
                f"self.log({name!r}, ..., reduce_fx={getattr(reduce, '__name__', reduce)!r}): polytrain "
                f"records the epoch's mean of each logged value (Lightning's default); log what the mean "
                f"should be taken of"
            )
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            number = value.detach().reshape(()).double()
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        else:
            raise UserError(
                f"self.log({name!r}, ...) was given {type(value).__name__}; polytrain records numbers and "
                f"one-element tensors (for a torchmetrics metric, log metric(preds, target))"
            )
        self.latest[name] = value
        weight = float(options.get("batch_size") or batch_size or 1)
        total, weights = self.sums.get(name, (0.0, 0.0))
        self.sums[name] = (total + number * weight, weights + weight)

    def reset(self) -> None:
        self.sums, self.latest = {}, {}

    def means(self, strategy) -> dict:
        """Each name's weighted mean over every rank (every rank calls it; rank 0's names are taken)."""
        names = strategy.broadcast_object(sorted(self.sums))
        if not names:
            return {}
        values = torch.zeros(2 * len(names), dtype=torch.float64, device=strategy.device)
        for i, name in enumerate(names):
            if name in self.sums:
                total, weights = self.sums[name]
                values[2 * i] = torch.as_tensor(total, dtype=torch.float64).to(strategy.device)
                values[2 * i + 1] = weights
        values = strategy.reduce(values).tolist()
        return {
            name: values[2 * i] / values[2 * i + 1] for i, name in enumerate(names) if values[2 * i + 1] > 0
        }


class LoopState:
    """What a LightningModule reads of its trainer (`self.trainer`, `self.global_step`, `self.current_epoch`):
    the numbers of the run, set before `configure_optimizers` and advanced as training goes."""

    def __init__(self):
        self.global_step = 0  # optimizer steps done
        self.current_epoch = 0  # the epoch in progress, from 0
        self.max_epochs = None
        self.max_steps = -1
        self.estimated_stepping_batches = None  # optimizer steps the run takes
        self.num_training_batches = None
        self.global_rank = self.local_rank = self.node_rank = 0
        self.world_size = self.num_devices = self.num_nodes = 1
        self.should_stop = False
        self.sanity_checking = False
        self.logger, self.loggers, self.progress_bar_callback = None, [], None
        self.callback_metrics = {}

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"polytrain's stand-in for Lightning's Trainer has no {name!r}; it answers global_step, "
            f"current_epoch, max_epochs, max_steps, estimated_stepping_batches, num_training_batches, "
            f"global_rank, world_size, is_global_zero, should_stop and callback_metrics"
        )


def attach(module: nn.Module, state: LoopState) -> None:
    """`module.trainer` is `state`, and `module.global_step` and `current_epoch` read it (Lightning's own
    modules read them through `self._trainer`; others get plain attributes, updated here)."""
    if isinstance(getattr(type(module), "global_step", None), property):
        module.__dict__["_trainer"] = state
    else:
        module.__dict__.update(
            trainer=state, global_step=state.global_step, current_epoch=state.current_epoch
        )
