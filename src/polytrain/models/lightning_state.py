"""What a LightningModule reads of its loop and gives it: the stand-in for Lightning's Trainer (`self.trainer`,
`self.global_step`, `self.current_epoch`, `self.optimizers()`, `self.lr_schedulers()`) and the epoch means of
what it passed to `self.log`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.optim import lr_scheduler

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


ANSWERS = (
    "global_step, current_epoch, max_epochs, max_steps, estimated_stepping_batches, num_training_batches, "
    "global_rank, world_size, is_global_zero, should_stop, callback_metrics, optimizers, "
    "lr_scheduler_configs and strategy"
)


class Unscheduled(lr_scheduler.LRScheduler):
    """No schedule: every group keeps the learning rate it has, also one the module sets itself (a warm-up
    written in training_step, a decay in on_train_epoch_start), as Lightning leaves an optimizer without one."""

    def get_lr(self):
        return [group["lr"] for group in self.optimizer.param_groups]


@dataclass
class SchedulerConfig:
    """One entry of `trainer.lr_scheduler_configs`, with the fields of Lightning's LRSchedulerConfig."""

    scheduler: object
    interval: str = "epoch"
    frequency: int = 1
    name: Optional[str] = None
    reduce_on_plateau: bool = False
    monitor: Optional[str] = None
    strict: bool = True


class LoopState:
    """What a LightningModule reads of its trainer (`self.trainer`, `self.global_step`, `self.current_epoch`):
    the numbers of the run, set before `configure_optimizers` and advanced as training goes; the optimizer and
    scheduler the strategy built, from the start of training (`self.optimizers()`, `self.lr_schedulers()`)."""

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
        self.optimizers = []  # the optimizer this rank steps (empty in configure_optimizers, as in Lightning)
        self.lr_scheduler_configs = []  # the module's scheduler (none where it gave none)
        self.root_device = torch.device("cpu")
        self.strategy = StrategyStandIn(self)

    def start(self, strategy) -> None:
        """The optimizer and scheduler `strategy` built, and its device: what the module reads from here on."""
        self.optimizers = [strategy.optimizer]
        scheduler = strategy.scheduler
        self.lr_scheduler_configs = (
            []
            if scheduler is None or isinstance(scheduler, Unscheduled)
            else [
                SchedulerConfig(
                    scheduler,
                    interval="step" if strategy.schedule_per_step else "epoch",
                    reduce_on_plateau=isinstance(scheduler, lr_scheduler.ReduceLROnPlateau),
                    monitor="val_loss" if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau) else None,
                )
            ]
        )
        self.root_device = strategy.device

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"polytrain's stand-in for Lightning's Trainer has no {name!r}; it answers {ANSWERS}"
        )


class StrategyStandIn:
    """What a module reads of `self.trainer.strategy`: the optimizers (Lightning's own `self.optimizers()`
    reads them here), the device and the ranks."""

    def __init__(self, loop: LoopState):
        self.loop = loop

    @property
    def optimizers(self) -> list:
        return self.loop.optimizers

    @property
    def _lightning_optimizers(self) -> list:
        return self.loop.optimizers

    @property
    def lr_scheduler_configs(self) -> list:
        return self.loop.lr_scheduler_configs

    @property
    def root_device(self) -> torch.device:
        return self.loop.root_device

    @property
    def global_rank(self) -> int:
        return self.loop.global_rank

    @property
    def local_rank(self) -> int:
        return self.loop.local_rank

    @property
    def world_size(self) -> int:
        return self.loop.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.loop.is_global_zero

    def __getattr__(self, name):
        if name.startswith("__") or name == "loop":
            raise AttributeError(name)
        raise AttributeError(
            f"polytrain's stand-in for Lightning's Trainer.strategy has no {name!r}; it answers optimizers, "
            f"lr_scheduler_configs, root_device, global_rank, local_rank, world_size and is_global_zero"
        )


class Optimizers:
    """`self.optimizers()` of a module that is not a Lightning class: the optimizer (a list where several)."""

    def __init__(self, loop: LoopState):
        self.loop = loop

    def __call__(self, use_pl_optimizer: bool = True):
        return self.loop.optimizers[0] if len(self.loop.optimizers) == 1 else self.loop.optimizers


class Schedulers:
    """`self.lr_schedulers()` of a module that is not a Lightning class: the scheduler, or None."""

    def __init__(self, loop: LoopState):
        self.loop = loop

    def __call__(self):
        schedulers = [config.scheduler for config in self.loop.lr_scheduler_configs]
        return None if not schedulers else schedulers[0] if len(schedulers) == 1 else schedulers


def attach(module: nn.Module, state: LoopState) -> None:
    """`module.trainer` is `state`, and `module.global_step` and `current_epoch` read it (Lightning's own
    modules read them through `self._trainer`; others get plain attributes, updated here, and
    `optimizers()` and `lr_schedulers()` where their class has none)."""
    if isinstance(getattr(type(module), "global_step", None), property):
        module.__dict__["_trainer"] = state
        return
    module.__dict__.update(trainer=state, global_step=state.global_step, current_epoch=state.current_epoch)
    for name, method in (("optimizers", Optimizers), ("lr_schedulers", Schedulers)):
        if not hasattr(type(module), name):
            module.__dict__[name] = method(state)
