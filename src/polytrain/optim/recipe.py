"""A `Recipe`: made and checked in the launching process (every mistake one line before any worker starts), it
tells each worker how to build its optimizer and schedule over the parameters it holds; and the lines that say
what a run trains with."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.optim import lr_scheduler

from ..errors import ConfigError, UserError, first_line
from .optimizers import (
    FROM_PYTHON,
    OPTIMIZERS,
    REFUSED,
    SCHEDULERS,
    SCHEDULES,
    check_keywords,
    describe,
    keywords,
    make_optimizer,
    optimizer_kwargs,
    parse_args,
    plan_groups,
    resolve,
)
from .schedules import make_scheduler
from .steps import planned_steps


@dataclass
class Recipe:
    """How every worker builds its optimizer and schedule (picklable; made by `make_recipe`)."""

    optimizer: object = "sgd"  # a torch.optim class or a factory fn(params_or_groups)
    options: dict = field(default_factory=dict)  # the class's keyword arguments (lr, weight_decay, ...)
    no_decay: bool = False
    param_groups: Optional[Callable] = None  # fn(name, parameter) -> options, until `grouped`
    groups: Optional[tuple] = None  # plan_groups over the whole model
    schedule: object = "onecycle"  # polytrain's name, an lr_scheduler class or a factory
    schedule_options: dict = field(default_factory=dict)
    interval: Optional[str] = None  # "step" | "epoch"; None: the factory's dict says
    epochs: float = 1
    warmup_epochs: float = 0.0

    @property
    def per_step(self) -> bool:
        return self.interval != "epoch"

    def grouped(self, model: nn.Module) -> "Recipe":
        """The groups laid out over the whole `model` (the function given as param_groups= is spent)."""
        if self.groups is not None or not (self.no_decay or self.param_groups):
            return self
        groups = plan_groups(model.named_parameters(), no_decay=self.no_decay, options_of=self.param_groups)
        return replace(self, groups=groups, param_groups=None)

    def optimizer_factory(self) -> Callable:
        return partial(make_optimizer, name=self.optimizer, groups=self.groups, options=self.options)

    def scheduler_factory(self, steps_per_epoch: int) -> Callable:
        """Per step, polytrain's schedules count optimizer steps; per epoch, epochs (warm-up in whole epochs)."""
        unit = steps_per_epoch if self.per_step else 1
        return partial(
            make_scheduler,
            kind=self.schedule,
            options=self.schedule_options,
            total_steps=planned_steps(self.epochs, unit),
            warmup_steps=round(self.warmup_epochs * unit),
        )

    def checked(self, model: nn.Module, *, staleness: int = 0) -> "Recipe":
        """Grouped over `model`, with the optimizer and schedule built once on its parameters (they do not
        change): a mistake is one line here, and a factory's {"interval": ...} is learnt."""
        recipe = self.grouped(model)
        # stand-ins without storage: each worker trains its own copy of the model, so an optimizer that holds
        # anything but the parameters it is given (a factory over `model.parameters()` of the user's object)
        # would step tensors nobody trains
        given = [
            (name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad))
            for name, p in model.named_parameters()
        ]
        try:
            optimizer = recipe.optimizer_factory()(given)
        except Exception as error:
            if isinstance(error, UserError):
                raise
            raise UserError(
                f"optimizer {describe(recipe.optimizer)} failed on the model's parameters: "
                f"{type(error).__name__}: {first_line(error)}"
            ) from None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(f"optimizer= must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
        check_holds_given(optimizer, given, recipe.optimizer)
        for options in (recipe.groups or ([],))[0]:
            unknown = sorted(set(options) - set(optimizer.defaults))
            if unknown:
                raise UserError(
                    f"param_groups=: {type(optimizer).__name__} has no group option {unknown[0]!r}; "
                    f"its options: {', '.join(sorted(optimizer.defaults))}"
                )
        interval = recipe.interval
        if interval is None:
            made = recipe.schedule(optimizer) if callable(recipe.schedule) else None
            interval = made.get("interval", "epoch") if isinstance(made, dict) else "epoch"
            if interval not in ("step", "epoch"):
                raise UserError(
                    f"scheduler=: the dict's interval must be 'step' or 'epoch', got {interval!r}"
                )
            recipe = replace(recipe, interval=interval)
        try:
            scheduler = recipe.scheduler_factory(1)(optimizer)
        except Exception as error:
            raise UserError(
                f"scheduler {describe(recipe.schedule)} failed on the optimizer: {type(error).__name__}: "
                f"{first_line(error)}"
            ) from None
        check_interval(
            scheduler if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau) else None,
            recipe.interval,
            staleness,
        )
        return recipe


def check_holds_given(optimizer, given: list, factory) -> None:
    """Refuse an optimizer that holds parameters other than the `given` ones it was built over."""
    ids = {id(p) for _, p in given}
    foreign = sum(
        1 for group in optimizer.param_groups for p in group["params"] if id(p) not in ids and p.numel() > 0
    )
    if foreign:
        raise UserError(
            f"optimizer {describe(factory)} built its optimizer over {foreign} tensor(s) other than the "
            f"parameters it was given (e.g. model.parameters() of your own model object): polytrain "
            f"trains a copy of the model in each worker, so those would never be trained; build it over "
            f"the argument: optimizer=lambda params: torch.optim.SGD(params, lr=0.1)"
        )


def check_interval(plateau, interval: str, staleness: int) -> None:
    if plateau is not None and interval == "step":
        raise ConfigError(
            "ReduceLROnPlateau steps once per epoch on the validation loss; drop --schedule-interval step"
        )
    if staleness and interval == "epoch":
        raise ConfigError(
            "--staleness: the servers apply updates on threads of their own and step the schedule "
            "with them, per step; use a per-step schedule (--schedule-interval step) or drop "
            "--staleness"
        )


def _python(value, given: bool, what: str, flag: str):
    """The label config.json holds for a Python object, where the object must be given again."""
    if isinstance(value, str) and value.endswith(FROM_PYTHON) and not given:
        raise UserError(
            f"{flag} {value!r} was a Python object given to fit(); pass {what}= to fit() again, or "
            f"give {flag} NAME"
        )


def make_recipe(config, *, optimizer=None, scheduler=None, param_groups=None, objects_follow: bool = False):
    """The checked recipe of `config`, with fit()'s objects (a torch.optim class or a factory; an
    lr_scheduler class or a factory). `objects_follow`: labels of objects that come later pass."""
    chosen = optimizer if optimizer is not None else config.optimizer
    _python(chosen, objects_follow, "optimizer", "--optimizer")
    label = isinstance(chosen, str) and chosen.endswith(FROM_PYTHON)
    cls = None if label else resolve(chosen, OPTIMIZERS, "--optimizer") if isinstance(chosen, str) else chosen
    options = {}
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
        if cls in REFUSED:
            raise ConfigError(f"--optimizer {cls.__name__.lower()}: {cls.__name__} {REFUSED[cls]}")
        options = optimizer_kwargs(
            cls,
            lr=config.effective_lr,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
            betas=config.betas,
            eps=config.eps,
            extra=parse_args(config.optimizer_args, "--optimizer-args"),
        )
        if config.no_decay_norms_and_biases and "weight_decay" not in options:
            raise ConfigError(
                f"--no-decay-norms-and-biases: {cls.__name__} has no weight decay to leave out; drop it"
            )
    elif cls is not None and not callable(cls):
        raise UserError("optimizer= must be a name, a torch.optim class, or a function(params) -> Optimizer")
    elif cls is not None:
        for name in ("betas", "eps", "optimizer_args"):
            if getattr(config, name) is not None:
                raise ConfigError(
                    f"{name}= applies to optimizer classes; set it inside the optimizer= function"
                )
    chosen = scheduler if scheduler is not None else config.schedule
    _python(chosen, objects_follow, "scheduler", "--schedule")
    if isinstance(chosen, str) and chosen.endswith(FROM_PYTHON):
        chosen = None
    elif isinstance(chosen, str) and chosen not in SCHEDULES:
        chosen = resolve(chosen, SCHEDULERS, "--schedule", extra=SCHEDULES)
    schedule_options = parse_args(config.schedule_args, "--schedule-args")
    own = isinstance(chosen, str)
    if schedule_options and not (isinstance(chosen, type) and scheduler is None):
        raise ConfigError(
            "--schedule-args applies to a torch.optim.lr_scheduler class named by --schedule; "
            + ("drop it" if own else "give the arguments with functools.partial")
        )
    if isinstance(chosen, type):
        check_keywords(chosen, schedule_options, "--schedule-args")
        missing = [
            name
            for name, p in inspect.signature(chosen.__init__).parameters.items()
            if name in keywords(chosen) and p.default is p.empty and name not in schedule_options
        ]
        if missing:
            raise ConfigError(
                f"{chosen.__name__} needs {', '.join(missing)}: "
                + (
                    f"pass --schedule-args '{missing[0]}=...'"
                    if scheduler is None
                    else f"pass functools.partial(torch.optim.lr_scheduler.{chosen.__name__}, {missing[0]}=...)"
                )
            )
    elif chosen is not None and not own and not callable(chosen):
        raise UserError(
            "scheduler= must be a name, a torch.optim.lr_scheduler class, or a function(optimizer)"
        )
    interval = config.schedule_interval or (
        "step" if own else None if chosen is None else "epoch" if isinstance(chosen, type) else None
    )
    plateau = chosen is lr_scheduler.ReduceLROnPlateau or (
        isinstance(chosen, partial) and chosen.func is lr_scheduler.ReduceLROnPlateau
    )
    check_interval(plateau or None, interval, config.staleness or 0)
    if plateau and interval is None:
        interval = "epoch"
    return Recipe(
        optimizer=cls,
        options=options,
        no_decay=config.no_decay_norms_and_biases,
        param_groups=param_groups,
        schedule=chosen,
        schedule_options=schedule_options,
        interval=interval,
        epochs=config.epochs,
        warmup_epochs=config.warmup_epochs,
    )


def check_settings(config) -> None:
    """TrainConfig's check of the optimizer and schedule settings (objects given to fit() come later)."""
    make_recipe(config, objects_follow=True)


def torch_defaults(cls) -> dict:
    """The keyword arguments' defaults of a torch.optim class (lr, momentum, weight_decay, betas, eps, ...)."""
    return {
        name: p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if name in keywords(cls) and p.default is not p.empty
    }


def _number(value) -> str:
    return (
        f"({', '.join(_number(v) for v in value)})"
        if isinstance(value, tuple)
        else f"{value:g}"
        if isinstance(value, float)
        else str(value)
    )


def recipe_line(recipe: Recipe) -> str:
    """The start line: the optimizer with every setting that differs from torch's defaults, and the schedule
    with the interval it steps at."""
    if isinstance(recipe.optimizer, type):
        defaults = torch_defaults(recipe.optimizer)
        changed = [
            f"{name.replace('_', ' ')} {_number(value)}"
            for name, value in recipe.options.items()
            if name not in defaults or defaults[name] != value
        ]
        optimizer = f"{recipe.optimizer.__name__} " + (
            f"({', '.join(changed)}; torch's defaults otherwise)" if changed else "(torch's defaults)"
        )
        if recipe.groups is not None and len(recipe.groups[0]) > 1:
            optimizer += f" in {len(recipe.groups[0])} parameter groups"
    else:
        optimizer = f"{describe(recipe.optimizer)} (your function, with its own settings)"
    if recipe.schedule == "constant" and not recipe.warmup_epochs:
        return f"optimizer: {optimizer}; schedule: none (a constant learning rate)"
    if isinstance(recipe.schedule, str):
        schedule = f"{recipe.schedule} after {recipe.warmup_epochs:g} epochs of linear warm-up"
    elif recipe.schedule is None:
        schedule = "none"
    else:
        schedule = describe(recipe.schedule)
    every = "optimizer step" if recipe.per_step else "epoch"
    return f"optimizer: {optimizer}; schedule: {schedule}, stepped every {every}"


def recipe_notes(recipe: Recipe, *, steps_per_epoch: int, epochs: float) -> list:
    """Lines that say where a run ends before its schedule does what it was given for: a per-epoch schedule
    that never steps, a warm-up that never reaches the peak learning rate (over the planned run; --max-steps
    only pauses it)."""
    steps = planned_steps(epochs, steps_per_epoch)
    notes = []
    if recipe.schedule is not None and not recipe.per_step and steps < steps_per_epoch:
        notes.append(
            f"note: the schedule {describe(recipe.schedule)} steps once per epoch, and this run ends after "
            f"{steps} of an epoch's {steps_per_epoch} steps, so it never steps; train a whole epoch, or step "
            f"it per optimizer step (--schedule-interval step, or Lightning's {{'interval': 'step'}})"
        )
    warmup = round(recipe.warmup_epochs * (steps_per_epoch if recipe.per_step else 1))
    if (
        isinstance(recipe.schedule, str)
        and warmup
        and warmup >= (steps if recipe.per_step else math.ceil(epochs))
    ):
        notes.append(
            f"note: the warm-up ({recipe.warmup_epochs:g} epochs, {warmup} steps) is as long as the run "
            f"({steps} steps), so the learning rate never reaches its peak; shorten --warmup-epochs"
        )
    return notes


def unscheduled_objects(settings: dict, optimizer, scheduler) -> None:
    """fit()'s optimizer object (a torch.optim class or a factory) with neither scheduler= nor schedule= trains
    at a constant learning rate without warm-up: polytrain's schedule and warm-up belong to its own recipe, and
    a recipe of the user's is trained as written. `settings` take it as given (config.json records it)."""
    if optimizer is not None and not isinstance(optimizer, str) and scheduler is None:
        if "schedule" not in settings:
            settings["schedule"] = "constant"
            settings.setdefault("warmup_epochs", 0.0)


def take_objects(settings: dict, optimizer, scheduler) -> tuple:
    """fit()'s optimizer= and scheduler=: a name becomes the setting; an object is returned, and its label
    (as config.json records it, e.g. "AdamW (from Python)") becomes the setting."""
    if scheduler is not None and "schedule" in settings:
        raise ConfigError("give either schedule= (a name) or scheduler=, not both")
    objects = []
    for value, key in ((optimizer, "optimizer"), (scheduler, "schedule")):
        if value is not None:
            settings[key] = value if isinstance(value, str) else describe(value) + FROM_PYTHON
        objects.append(None if isinstance(value, str) else value)
    if objects[0] is not None and not isinstance(objects[0], type):
        for name in ("lr", "momentum", "weight_decay"):
            if name in settings:
                raise ConfigError(
                    f"{name}= is not passed to an optimizer function; set it inside optimizer=, or "
                    f"pass the optimizer class"
                )
    return tuple(objects)
