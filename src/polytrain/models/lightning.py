"""A LightningModule trained as it is: its `training_step`, `validation_step` and `configure_optimizers`.

Lightning is not needed: any `nn.Module` with `training_step(batch, batch_idx)` and `configure_optimizers()`
is taken for one (the documented subset). The steps run through the strategy's wrapper (DDP, FSDP2) by
redirecting the module's `forward` to the step for the call, as Lightning does, so the wrapper's hooks run.
`self.log(...)` inside the steps and the module's hooks is recorded: the epoch's mean of each name (weighted by
batch size, over all ranks, as Lightning's on_epoch=True) joins the epoch's record, metrics.jsonl and the loggers,
beside polytrain's own figures (a name the record already has, such as train_loss, keeps polytrain's exact
figure); a `validation_step` that returns nothing is read from what it logged as `val_loss` (or the one logged
name that ends in `loss`). A module without `validation_step` trains without validation and without `val=`, as
in Lightning. `self.global_step`, `self.current_epoch` and `self.trainer` (a stand-in answering `max_epochs`,
`estimated_stepping_batches`, `should_stop`, `optimizers`, `lr_scheduler_configs`, `strategy`, ...) advance as
in Lightning, and `self.optimizers()` and `self.lr_schedulers()` give the optimizer and scheduler the strategy
steps (a module that sets its learning rate itself keeps it: without a scheduler none is stepped); the hooks
`on_fit_start`, `on_train_start`, `on_train_epoch_start`, `on_validation_start`, `on_validation_epoch_start`,
`on_validation_epoch_end`, `on_validation_end`, `on_train_epoch_end`, `on_train_end` and `on_fit_end` are called
on the module being trained (the caller's own object on one device in this process, a copy in each worker
process), on every rank; a module that defines a hook polytrain does not call is refused.
`configure_optimizers` may return an optimizer, ([optimizers], [schedulers]) or Lightning's dict; polytrain
builds the same optimizer over the parameters its strategy trains (one optimizer: several need manual
optimisation, which is refused, as is `automatic_optimization = False`).
"""

from __future__ import annotations

import contextlib
import copy
import sys

import torch
import torch.nn as nn
from torch.optim import lr_scheduler

from ..callbacks import Callback
from ..data.order import rows
from ..errors import UserError
from ..optim.steps import planned_steps
from .lightning_state import Logged, LoopState, Unscheduled, attach

# the module's hooks polytrain calls, and those it does not (a module that defines one is refused)
TRAIN_HOOKS = (
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
)
VALIDATION_HOOKS = (
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_end",
)
NOT_CALLED = (
    "setup",
    "teardown",
    "configure_model",
    "configure_sharded_model",
    "prepare_data",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "optimizer_step",
    "optimizer_zero_grad",
    "backward",
    "lr_scheduler_step",
    "configure_gradient_clipping",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_before_batch_transfer",
    "on_after_batch_transfer",
    "transfer_batch_to_device",
    "on_validation_model_eval",
    "on_validation_model_train",
    "training_step_end",
    "validation_step_end",
    "training_epoch_end",
    "validation_epoch_end",
    "configure_callbacks",
)
# Lightning's self.log(name, value, ...) options after the value, in order
LOG_OPTIONS = (
    "prog_bar",
    "logger",
    "on_step",
    "on_epoch",
    "reduce_fx",
    "enable_graph",
    "sync_dist",
    "sync_dist_group",
    "add_dataloader_idx",
    "batch_size",
)


def is_lightning(model) -> bool:
    return (
        isinstance(model, nn.Module)
        and callable(getattr(model, "training_step", None))
        and callable(getattr(model, "configure_optimizers", None))
    )


def unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (`.module`) or torch.compile (`._orig_mod`)."""
    for attribute in ("module", "_orig_mod"):
        inner = getattr(model, attribute, None)
        if isinstance(inner, nn.Module) and is_lightning(inner):
            return inner
    return model


def defines(module, name: str) -> bool:
    """Whether the module's own class defines `name` (Lightning's base classes define every hook, doing nothing)."""
    owner = next((cls for cls in type(module).__mro__ if name in vars(cls)), None)
    return (
        owner is not None
        and owner not in (nn.Module, object)
        and not (owner.__module__ or "").startswith(("lightning.", "pytorch_lightning."))
    )


@contextlib.contextmanager
def logging_to(module: nn.Module, logged: "Logged", batch_size: int):
    """`module.log` and `module.log_dict` record into `logged` (each value weighted by `batch_size`), for a call."""

    def log(name, value, *args, **options):
        logged.add(name, value, dict(zip(LOG_OPTIONS, args), **options), batch_size)

    def log_dict(values, *args, **options):
        for name, value in values.items():
            log(name, value, *args, **options)

    saved = {key: module.__dict__[key] for key in ("log", "log_dict") if key in module.__dict__}
    module.log, module.log_dict = log, log_dict
    try:
        yield
    finally:
        for key in ("log", "log_dict"):
            module.__dict__.pop(key, None)
        module.__dict__.update(saved)


@contextlib.contextmanager
def redirected(module: nn.Module, method: str, logged: "Logged", batch_size: int):
    """`module.forward` is `module.<method>`, and `module.log`/`log_dict` record into `logged`, for a call."""
    saved = module.__dict__.get("forward")

    def step(*args, **kwargs):  # inside the step, self(...) is the module's own forward again
        module.__dict__.pop("forward", None)
        if saved is not None:
            module.forward = saved
        return getattr(module, method)(*args, **kwargs)

    module.forward = step
    try:
        with logging_to(module, logged, batch_size):
            yield
    finally:
        module.__dict__.pop("forward", None)
        if saved is not None:
            module.forward = saved


class LightningStep:
    """A step= for polytrain: the module's `training_step` or `validation_step` on the batch."""

    def __init__(self, method: str, loop: LoopState = None, *, validates: bool = True):
        self.method = method
        self.__name__ = method
        self.loop = loop or LoopState()
        self.validates = validates  # (training_step's) False: the module has no validation_step
        self.calls = 0  # batch_idx: batches handed to the step since the loop began
        self.logged = Logged()

    def __call__(self, model: nn.Module, batch):
        module = unwrapped(model)
        attach(module, self.loop)
        self.logged.latest = {}
        with redirected(module, self.method, self.logged, rows(batch)):
            value = model(batch, self.calls)
        self.calls += 1
        logged = self.logged.latest
        if value is None and self.method == "validation_step":
            losses = [name for name in logged if name.endswith("loss")]
            key = "val_loss" if "val_loss" in logged else losses[0] if len(losses) == 1 else None
            if key is None:
                raise UserError(
                    "validation_step returned nothing and logged no val_loss; return the loss or "
                    "self.log('val_loss', loss)"
                )
            value = logged[key]
        if value is None:
            raise UserError(
                f"{self.method} returned None (Lightning's way to skip a batch); return the loss: "
                f"polytrain takes every batch on every rank"
            )
        if isinstance(value, dict) and "loss" not in value:
            raise UserError(
                f"{self.method} returned a dict without 'loss' (keys {', '.join(map(str, value))}); "
                f"return the loss or a dict with 'loss'"
            )
        return value


class LightningLoop(Callback):
    """On every rank: the module's loop state (global_step, current_epoch, batch_idx), its own hooks, and the
    epoch means of what it logged, added to each record."""

    def __init__(self, train: LightningStep, val: LightningStep = None):
        self.train, self.val, self.state = train, val, train.loop
        self.train_hooks, self.val_hooks = Logged(), Logged()  # what the hooks logged: weight 1 per rank

    def _hook(self, trainer, name: str, logged: Logged) -> None:
        module = unwrapped(trainer.model)
        attach(module, self.state)
        method = getattr(module, name, None)
        if callable(method):
            with logging_to(module, logged, 1):
                method()
        if self.state.should_stop:  # self.trainer.should_stop = True, as in Lightning
            trainer.should_stop = True

    def on_fit_start(self, trainer):
        self.state.global_step, self.state.current_epoch = trainer.step, trainer.position.epoch
        self.state.start(trainer.strategy)  # self.optimizers(), self.lr_schedulers(), self.trainer.optimizers
        for step in (self.train, self.val):
            if step is not None:  # (the check before training called the steps too)
                step.calls = 0
                step.logged.reset()
        for name in ("on_fit_start", "on_train_start"):
            self._hook(trainer, name, self.train_hooks)

    def on_epoch_start(self, trainer, epoch):
        self.state.current_epoch = epoch
        self.train.calls = 0
        self._hook(trainer, "on_train_epoch_start", self.train_hooks)

    def on_step_end(self, trainer, step):
        self.state.global_step = trainer.step
        attach(unwrapped(trainer.model), self.state)
        if self.state.should_stop:
            trainer.should_stop = True

    def on_validation_start(self, trainer):
        if self.val is not None:
            self.val.calls = 0
        for name in ("on_validation_start", "on_validation_epoch_start"):
            self._hook(trainer, name, self.val_hooks)

    def on_figures(self, trainer, record):
        figures = {}
        if "val_loss" in record:
            for name in ("on_validation_epoch_end", "on_validation_end"):
                self._hook(trainer, name, self.val_hooks)
            figures.update(self._means(trainer, self.val.logged if self.val else Logged(), self.val_hooks))
        if "train_loss" in record:  # an epoch's record (a validation within an epoch has none)
            self._hook(trainer, "on_train_epoch_end", self.train_hooks)
            figures.update(self._means(trainer, self.train.logged, self.train_hooks))
        record.update({name: value for name, value in figures.items() if name not in record})
        self.state.callback_metrics.update(
            {
                key: torch.tensor(float(value), dtype=torch.float64)
                for key, value in record.items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)
            }
        )

    @staticmethod
    def _means(trainer, steps: Logged, hooks: Logged) -> dict:
        means = dict(steps.means(trainer.strategy), **hooks.means(trainer.strategy))
        steps.reset()
        hooks.reset()
        return means

    def on_epoch_end(self, trainer, record):
        self.state.current_epoch = record["epoch"]  # Lightning counts an epoch done after its hooks

    def on_fit_end(self, trainer):
        if sys.exc_info()[0] is None:  # (not when training failed)
            for name in ("on_train_end", "on_fit_end"):
                self._hook(trainer, name, self.train_hooks)


def plan_loop(
    objective, *, epochs: float, steps_per_epoch: int, max_steps: int = 0, rank: int = 0, world_size: int = 1
):
    """For a LightningModule's steps: set what `self.trainer` answers (before `configure_optimizers` runs) and
    return the callback that runs its loop on this rank; None for any other objective."""
    step = getattr(objective, "step", None)
    if not isinstance(step, LightningStep):
        return None
    state = step.loop
    total = planned_steps(epochs, steps_per_epoch)
    state.max_epochs = int(epochs) if float(epochs).is_integer() else epochs
    state.max_steps = max_steps or -1
    state.estimated_stepping_batches = min(total, max_steps) if max_steps else total
    state.num_training_batches = steps_per_epoch
    state.global_rank, state.world_size, state.num_devices = rank, world_size, world_size
    val = objective.eval_step if isinstance(objective.eval_step, LightningStep) else None
    return LightningLoop(step, val)


def configured(module: nn.Module, *, validates: bool = True):
    """(optimizer, scheduler or None, interval) of `module.configure_optimizers()` in any of Lightning's forms."""
    result = module.configure_optimizers()
    scheduler, interval, monitor = None, "epoch", "val_loss"
    if (
        isinstance(result, (tuple, list))
        and len(result) == 2
        and all(isinstance(r, (tuple, list)) for r in result)
    ):
        optimizers, schedulers = result
        result = {
            "optimizer": optimizers[0] if len(optimizers) == 1 else optimizers,
            "lr_scheduler": schedulers[0] if len(schedulers) == 1 else schedulers or None,
        }
    if isinstance(result, (tuple, list)) and len(result) == 1:
        result = result[0]
    if isinstance(result, dict):
        optimizer, scheduler = result.get("optimizer"), result.get("lr_scheduler")
        monitor = result.get("monitor", monitor)
        if isinstance(scheduler, dict):
            if scheduler.get("frequency", 1) != 1:
                raise UserError(
                    f"configure_optimizers' scheduler has frequency {scheduler['frequency']}; polytrain "
                    f"steps a scheduler every interval (frequency 1)"
                )
            interval = scheduler.get("interval", "epoch")
            monitor = scheduler.get("monitor", monitor)
            scheduler = scheduler.get("scheduler")
    else:
        optimizer = result
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"configure_optimizers returned {type(optimizer).__name__} where polytrain takes one "
            f"optimizer (with at most one scheduler): several optimizers need manual optimisation; "
            f"train such a module with step= and optimizer= of your own"
        )
    if scheduler is not None and not hasattr(scheduler, "step"):
        raise UserError(
            f"configure_optimizers gave a scheduler of type {type(scheduler).__name__}; give one "
            f"torch.optim.lr_scheduler"
        )
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau) and (monitor != "val_loss" or not validates):
        raise UserError(
            "configure_optimizers' ReduceLROnPlateau steps here on the epoch's val_loss, "
            + (
                f"not {monitor!r}; monitor val_loss"
                if validates
                else "and the module has no validation_step; add one"
            )
        )
    return optimizer, scheduler, interval


class Configured:
    """What `configure_optimizers` makes, over the parameters the strategy trains: `optimizer(params)` is its
    optimizer with the same groups and options, holding those parameters (in the module's order), and
    `scheduler(optimizer)` the scheduler it made with it (none: a constant learning rate), with its interval.
    Each process calls it on its own copy of the module."""

    def __init__(self, module: nn.Module, loop: LoopState = None, *, validates: bool = True):
        self.module = module
        self.loop = loop or LoopState()  # what self.trainer answers (shared with the steps)
        self.validates = validates
        self.made = None  # (optimizer, scheduler, interval) of the latest call in this process
        self.__qualname__ = f"{type(module).__name__}.configure_optimizers"

    def __getstate__(self):
        return {
            "module": self.module,
            "loop": self.loop,
            "validates": self.validates,
            "made": None,
            "__qualname__": self.__qualname__,
        }

    def optimizer(self, params):
        params = list(params)
        position = {id(p): i for i, p in enumerate(self.module.parameters())}
        if len(params) != len(position):
            raise UserError(
                f"configure_optimizers is laid out over the whole model's {len(position)} tensors; "
                f"this strategy trains {len(params)} of them: use the data or sharded strategy"
            )
        attach(self.module, self.loop)
        self.made = configured(self.module, validates=self.validates)
        optimizer = self.made[0]
        for group in optimizer.param_groups:  # never stepped: no state refers to the module's own tensors
            group["params"] = [params[position[id(p)]] for p in group["params"]]
        return optimizer

    def scheduler(self, optimizer):
        if self.made is None or self.made[0] is not optimizer:
            raise UserError(
                "configure_optimizers' scheduler goes with its own optimizer; give scheduler= only "
                "together with optimizer="
            )
        _, scheduler, interval = self.made
        if scheduler is None:  # the learning rate stays as the module leaves it
            return {"scheduler": Unscheduled(optimizer), "interval": "step"}
        return {"scheduler": scheduler, "interval": interval}


def lightning_parts(model: nn.Module, *, step, eval_step, optimizer, scheduler):
    """fit()'s step=, eval_step=, optimizer= and scheduler= for a LightningModule (those given are kept)."""
    if step is not None:
        return step, eval_step, optimizer, scheduler
    name = type(model).__name__
    if getattr(model, "automatic_optimization", True) is False:
        raise UserError(
            f"{name} sets automatic_optimization = False (manual optimisation): polytrain steps the optimizer "
            f"itself after training_step; return the loss from training_step and leave the stepping to "
            f"polytrain, or train with Lightning"
        )
    for hook in NOT_CALLED:
        if defines(model, hook) and callable(getattr(model, hook, None)):
            raise UserError(
                f"{name}.{hook}: polytrain does not call this LightningModule hook; remove it, do its "
                f"work in a hook polytrain calls ({', '.join(TRAIN_HOOKS + VALIDATION_HOOKS)}), or train "
                f"with Lightning"
            )
    loop = LoopState()
    validates = eval_step is not None or (
        callable(getattr(model, "validation_step", None)) and defines(model, "validation_step")
    )
    step = LightningStep("training_step", loop, validates=validates)
    if eval_step is None and validates:
        eval_step = LightningStep("validation_step", loop)
    if (optimizer is None) != (scheduler is None):
        raise UserError(
            "a LightningModule's configure_optimizers gives the optimizer and its scheduler together; "
            "pass both optimizer= and scheduler= or neither"
        )
    if optimizer is None:
        # run on a copy: the module's own tensors stay untouched
        made = Configured(copy.deepcopy(model), loop, validates=validates)
        optimizer, scheduler = made.optimizer, made.scheduler
    return step, eval_step, optimizer, scheduler
