"""A LightningModule trained as it is: its `training_step`, `validation_step` and `configure_optimizers`.

Lightning is not needed: any `nn.Module` with `training_step(batch, batch_idx)` and `configure_optimizers()`
is taken for one (the documented subset). The steps run through the strategy's wrapper (DDP, FSDP2) by
redirecting the module's `forward` to the step for the call, as Lightning does, so the wrapper's hooks run.
`self.log(...)` inside the steps is recorded: a `validation_step` that returns nothing is read from what it
logged as `val_loss` (or the one logged name that ends in `loss`). `configure_optimizers` may return an
optimizer, ([optimizers], [schedulers]) or Lightning's dict; polytrain builds the same optimizer over the
parameters its strategy trains (one optimizer: several need manual optimisation, which is refused).
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
from torch.optim import lr_scheduler

from ..errors import UserError

# strategies that split the module or move its optimizer away from it
SPLITTING = ("pipeline", "tensor", "parameter-server")


def is_lightning(model) -> bool:
    return isinstance(model, nn.Module) and callable(getattr(model, "training_step", None)) and \
        callable(getattr(model, "configure_optimizers", None))


def unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (`.module`) or torch.compile (`._orig_mod`)."""
    for attribute in ("module", "_orig_mod"):
        inner = getattr(model, attribute, None)
        if isinstance(inner, nn.Module) and is_lightning(inner):
            return inner
    return model


@contextlib.contextmanager
def redirected(module: nn.Module, method: str, logged: dict):
    """`module.forward` is `module.<method>`, and `module.log`/`log_dict` record into `logged`, for a call."""
    def log(name, value, *args, **kwargs):
        logged[name] = value

    def log_dict(values, *args, **kwargs):
        logged.update(values)
    saved = {key: module.__dict__[key] for key in ("forward", "log", "log_dict") if key in module.__dict__}

    def step(*args, **kwargs):            # inside the step, self(...) is the module's own forward again
        module.__dict__.pop("forward", None)
        if "forward" in saved:
            module.forward = saved["forward"]
        return getattr(module, method)(*args, **kwargs)
    module.forward, module.log, module.log_dict = step, log, log_dict
    try:
        yield
    finally:
        for key in ("forward", "log", "log_dict"):
            module.__dict__.pop(key, None)
        module.__dict__.update(saved)


class LightningStep:
    """A step= for polytrain: the module's `training_step` or `validation_step` on the batch."""

    def __init__(self, method: str):
        self.method = method
        self.__name__ = method
        self.calls = 0                    # batch_idx: batches this process handed to the step so far

    def __call__(self, model: nn.Module, batch):
        module = unwrapped(model)
        logged = {}
        with redirected(module, self.method, logged):
            value = model(batch, self.calls)
        self.calls += 1
        if value is None and self.method == "validation_step":
            losses = [name for name in logged if name.endswith("loss")]
            key = "val_loss" if "val_loss" in logged else losses[0] if len(losses) == 1 else None
            if key is None:
                raise UserError("validation_step returned nothing and logged no val_loss; return the loss or "
                                "self.log('val_loss', loss)")
            value = logged[key]
        if value is None:
            raise UserError(f"{self.method} returned None (Lightning's way to skip a batch); return the loss: "
                            f"polytrain takes every batch on every rank")
        if isinstance(value, dict) and "loss" not in value:
            raise UserError(f"{self.method} returned a dict without 'loss' (keys {', '.join(map(str, value))}); "
                            f"return the loss or a dict with 'loss'")
        return value


def configured(module: nn.Module):
    """(optimizer, scheduler or None, interval) of `module.configure_optimizers()` in any of Lightning's forms."""
    result = module.configure_optimizers()
    scheduler, interval = None, "epoch"
    if isinstance(result, (tuple, list)) and len(result) == 2 and all(isinstance(r, (tuple, list)) for r in result):
        optimizers, schedulers = result
        result = {"optimizer": optimizers[0] if len(optimizers) == 1 else optimizers,
                  "lr_scheduler": schedulers[0] if len(schedulers) == 1 else schedulers or None}
    if isinstance(result, (tuple, list)) and len(result) == 1:
        result = result[0]
    if isinstance(result, dict):
        optimizer, scheduler = result.get("optimizer"), result.get("lr_scheduler")
        if isinstance(scheduler, dict):
            interval = scheduler.get("interval", "epoch")
            scheduler = scheduler.get("scheduler")
    else:
        optimizer = result
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"configure_optimizers returned {type(optimizer).__name__} where polytrain takes one "
                        f"optimizer (with at most one scheduler): several optimizers need manual optimisation; "
                        f"train such a module with step= and optimizer= of your own")
    if scheduler is not None and not hasattr(scheduler, "step"):
        raise UserError(f"configure_optimizers gave a scheduler of type {type(scheduler).__name__}; give one "
                        f"torch.optim.lr_scheduler")
    return optimizer, scheduler, interval


class Configured:
    """What `configure_optimizers` makes, over the parameters the strategy trains: `optimizer(params)` is its
    optimizer with the same groups and options, holding those parameters (in the module's order), and
    `scheduler(optimizer)` the scheduler it made with it (none: a constant learning rate), with its interval.
    Each process calls it on its own copy of the module."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.made = None                  # (optimizer, scheduler, interval) of the latest call in this process
        self.__qualname__ = f"{type(module).__name__}.configure_optimizers"

    def __getstate__(self):
        return {"module": self.module, "made": None, "__qualname__": self.__qualname__}

    def optimizer(self, params):
        params = list(params)
        position = {id(p): i for i, p in enumerate(self.module.parameters())}
        if len(params) != len(position):
            raise UserError(f"configure_optimizers is laid out over the whole model's {len(position)} tensors; "
                            f"this strategy trains {len(params)} of them: use the data or sharded strategy")
        self.made = configured(self.module)
        optimizer = self.made[0]
        for group in optimizer.param_groups:   # never stepped: no state refers to the module's own tensors
            group["params"] = [params[position[id(p)]] for p in group["params"]]
        return optimizer

    def scheduler(self, optimizer):
        if self.made is None or self.made[0] is not optimizer:
            raise UserError("configure_optimizers' scheduler goes with its own optimizer; give scheduler= only "
                            "together with optimizer=")
        _, scheduler, interval = self.made
        if scheduler is None:
            return {"scheduler": lr_scheduler.LambdaLR(optimizer, constant), "interval": "step"}
        return {"scheduler": scheduler, "interval": interval}


def constant(step: int) -> float:
    return 1.0


def lightning_parts(model: nn.Module, *, step, eval_step, optimizer, scheduler):
    """fit()'s step=, eval_step=, optimizer= and scheduler= for a LightningModule (those given are kept)."""
    if step is not None:
        return step, eval_step, optimizer, scheduler
    step = LightningStep("training_step")
    if eval_step is None and callable(getattr(model, "validation_step", None)):
        eval_step = LightningStep("validation_step")
    if (optimizer is None) != (scheduler is None):
        raise UserError("a LightningModule's configure_optimizers gives the optimizer and its scheduler together; "
                        "pass both optimizer= and scheduler= or neither")
    if optimizer is None:
        made = Configured(copy.deepcopy(model))     # run on a copy: the module's own tensors stay untouched
        optimizer, scheduler = made.optimizer, made.scheduler
    return step, eval_step, optimizer, scheduler
