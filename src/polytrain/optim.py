"""Optimizers and learning-rate schedules: any `torch.optim` class (by name or as an object) or a factory,
parameter groups, polytrain's warm-up schedules or any `torch.optim.lr_scheduler`.

A `Recipe` is made and checked in the launching process (every mistake one line before any worker starts)
and tells each worker how to build its optimizer over the parameters it holds. Parameter groups are laid out
once over the whole model, so every rank builds the same groups in the same order (a group with no
parameter on a rank gets a zero-size placeholder) and their states merge into one device's numbering.
"""
from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.optim import lr_scheduler

from .checkpoint import planned_steps
from .config.names import nearest
from .errors import ConfigError, UserError, first_line

SCHEDULES = ("constant", "cosine", "onecycle")        # polytrain's, after a linear warm-up
FROM_PYTHON = " (from Python)"                         # how config.json names an object given to fit()
REFUSED = {torch.optim.LBFGS: "calls the model again inside step(closure), and polytrain takes one step per "
                              "batch; choose another optimizer",
           torch.optim.SparseAdam: "needs sparse gradients, and polytrain's strategies make dense ones; use adam"}


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def _classes(module, base) -> dict:
    return {_key(name): cls for name, cls in vars(module).items()
            if isinstance(cls, type) and issubclass(cls, base) and cls is not base and not name.startswith("_")}


OPTIMIZERS = _classes(torch.optim, torch.optim.Optimizer)
SCHEDULERS = {key: cls for key, cls in _classes(lr_scheduler, lr_scheduler.LRScheduler).items()}
SCHEDULERS[_key("ReduceLROnPlateau")] = lr_scheduler.ReduceLROnPlateau


def resolve(name: str, table: dict, flag: str, extra=()):
    """The class `name` stands for in `table` (any case, `-`/`_` ignored), or one line with the nearest name."""
    if _key(name) in table:
        return table[_key(name)]
    names = [*extra, *(cls.__name__.lower() for cls in table.values())]
    close = nearest(name, names)
    raise ConfigError(f"unknown {flag} {name!r}" + (f" (did you mean {close}?)" if close else "")
                      + f"; choose one of {', '.join(names)}")


def keywords(cls) -> list:
    """The keyword arguments a class takes besides what it works on (params, optimizer)."""
    return [name for name, p in inspect.signature(cls.__init__).parameters.items()
            if name not in ("self", "params", "optimizer") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _value(text: str):
    text = text.strip()
    if "," in text:
        return tuple(_value(part) for part in text.split(","))
    lower = text.lower()
    if lower in ("true", "false"):
        return lower == "true"
    if lower == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_args(text, flag: str) -> dict:
    """`k=v,k=v` (values as bool, int, float, str; `k=1,2` a tuple) or a dict, as keyword arguments."""
    if text is None or isinstance(text, dict):
        return dict(text or {})
    if not isinstance(text, str):
        raise ConfigError(f"{flag} takes key=value pairs such as 'a=1,b=true', got {text!r}")
    pairs = {}
    for piece in re.split(r",(?=\s*[A-Za-z_]\w*\s*=)", text):
        key, equals, value = piece.partition("=")
        if not equals or not key.strip().isidentifier():
            raise ConfigError(f"{flag}: {piece.strip()!r} is not key=value; write pairs like 'a=1,b=true'")
        pairs[key.strip()] = _value(value)
    return pairs


def check_keywords(cls, given, flag: str) -> None:
    known = keywords(cls)
    for name in given:
        if name not in known:
            raise ConfigError(f"{flag}: {cls.__name__} takes no keyword {name!r}; its keywords: {', '.join(known)}")


def describe(obj) -> str:
    """A readable name for a class, function or functools.partial given from Python."""
    if isinstance(obj, partial):
        given = [repr(a) for a in obj.args] + [f"{k}={v!r}" for k, v in obj.keywords.items()]
        return f"{describe(obj.func)}({', '.join(given)})"
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__


def optimizer_kwargs(cls, *, lr, momentum, weight_decay, betas=None, eps=None, extra=None) -> dict:
    """The keyword arguments of `cls` from the settings: lr, weight decay and momentum where it takes them,
    betas and eps where given (refused for a class without them), then `extra` (checked against its keywords)."""
    takes, extra = keywords(cls), dict(extra or {})
    kwargs = {name: value for name, value in (("lr", lr), ("weight_decay", weight_decay), ("momentum", momentum))
              if name in takes and value is not None}
    for name, value in (("betas", betas), ("eps", eps)):
        if value is None:
            continue
        if name not in takes:
            raise ConfigError(f"--{name} does not apply to {cls.__name__}, which takes no {name}; drop --{name}")
        if name == "betas" and len(value) != 2:
            raise ConfigError(f"--betas takes two numbers B1,B2 such as 0.9,0.999, got {value!r}")
        kwargs[name] = tuple(value) if name == "betas" else value
    check_keywords(cls, extra, "--optimizer-args")
    return dict(kwargs, **extra)


def speed_options(cls, params: list, given: dict) -> dict:
    """One fused kernel on CUDA (SGD, Adam, AdamW), multi-tensor `foreach` kernels otherwise, never a Python
    loop over the parameters; nothing where the caller chose."""
    if "fused" in given or "foreach" in given or not isinstance(cls, type):
        return {}
    if cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW) and params and all(p.is_cuda for p in params):
        return {"fused": True}
    return {"foreach": True} if "foreach" in keywords(cls) else {}


def plan_groups(named_params, *, no_decay: bool = False, options_of: Optional[Callable] = None) -> tuple:
    """(the options of each group, parameter name -> its group) over the whole model: weight decay 0 for
    tensors of one dimension (biases, norm weights) with `no_decay`, then `options_of(name, parameter)`;
    parameters with equal options share a group, groups in the order their first parameter comes."""
    groups, member = [], {}
    for name, parameter in named_params:
        options = {"weight_decay": 0.0} if no_decay and parameter.dim() <= 1 else {}
        if options_of is not None:
            extra = options_of(name, parameter)
            if not isinstance(extra, dict) and extra is not None:
                raise UserError(f"param_groups= must return a dict of group options (or None) for each parameter; "
                                f"for {name!r} it returned {type(extra).__name__}")
            options.update(extra or {})
        if options not in groups:
            groups.append(options)
        member[name] = groups.index(options)
    return groups, member


def group_params(named_params, groups: Optional[tuple]):
    """What a torch optimizer takes: the parameters (one group without options), or one dict per planned
    group, a zero-size placeholder standing in where this rank holds none of the group's parameters."""
    named = [(name, p) for name, p in named_params if name != ""]
    real = [p for _, p in named]
    if groups is None or groups[0] in ([], [{}]):
        return real or [nn.Parameter(torch.zeros(0))]
    options, member = groups
    device = real[0].device if real else torch.device("cpu")
    lists = [[] for _ in options]
    for name, parameter in named:
        lists[member[name]].append(parameter)
    return [dict(group, params=params or [nn.Parameter(torch.zeros(0, device=device))])
            for group, params in zip(options, lists)]


def make_optimizer(named_params, *, name="sgd", lr=None, momentum=None, weight_decay=None,
                   betas=None, eps=None, options: Optional[dict] = None, groups: Optional[tuple] = None):
    """An optimizer over `named_params` ((name, parameter) pairs; the name "" marks a placeholder of a rank
    that holds no parameters) in `groups` (`plan_groups`; None: one group). `name` is a torch.optim class
    name (any case) with its keyword arguments (lr, ... where it takes them; `options` add to and override
    them), a class, or a factory fn(params_or_groups) -> Optimizer (the settings are then its own)."""
    named = list(named_params)
    params = group_params(named, groups)
    cls = resolve(name, OPTIMIZERS, "--optimizer") if isinstance(name, str) else name
    if not isinstance(cls, type):
        return cls(params)
    kwargs = optimizer_kwargs(cls, lr=lr, momentum=momentum, weight_decay=weight_decay, betas=betas, eps=eps,
                              extra=options)
    return cls(params, **kwargs, **speed_options(cls, [p for n, p in named if n != ""], kwargs))


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


def make_scheduler(optimizer, *, kind="onecycle", total_steps: int = 1, warmup_steps: int = 0,
                   options: Optional[dict] = None):
    """polytrain's schedule `kind` over `total_steps` (after `warmup_steps`), a torch.optim.lr_scheduler class
    (by name or object, with `options`), or what a factory fn(optimizer) returns (a Lightning-style
    {"scheduler": s, "interval": ...} gives s)."""
    if kind in SCHEDULES:
        factor = partial(lr_factor, total_steps=total_steps, warmup_steps=warmup_steps, kind=kind)
        return lr_scheduler.LambdaLR(optimizer, factor)
    made = (resolve(kind, SCHEDULERS, "--schedule") if isinstance(kind, str) else kind)(optimizer, **(options or {}))
    return made["scheduler"] if isinstance(made, dict) else made


def step_per_epoch(scheduler, record: dict) -> None:
    """One epoch's step of a per-epoch schedule; ReduceLROnPlateau reads the epoch's validation loss."""
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        scheduler.step(record["val_loss"])
    else:
        scheduler.step()


@dataclass
class Recipe:
    """How every worker builds its optimizer and schedule (picklable; made by `make_recipe`)."""
    optimizer: object = "sgd"          # a torch.optim class or a factory fn(params_or_groups)
    options: dict = field(default_factory=dict)    # the class's keyword arguments (lr, weight_decay, ...)
    no_decay: bool = False
    param_groups: Optional[Callable] = None        # fn(name, parameter) -> options, until `planned`
    groups: Optional[tuple] = None                 # plan_groups over the whole model
    schedule: object = "onecycle"                  # polytrain's name, an lr_scheduler class or a factory
    schedule_options: dict = field(default_factory=dict)
    interval: Optional[str] = None                 # "step" | "epoch"; None: the factory's dict says
    epochs: float = 1
    warmup_epochs: float = 0.0

    @property
    def per_step(self) -> bool:
        return self.interval != "epoch"

    def planned(self, model: nn.Module) -> "Recipe":
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
        return partial(make_scheduler, kind=self.schedule, options=self.schedule_options,
                       total_steps=planned_steps(self.epochs, unit), warmup_steps=round(self.warmup_epochs * unit))

    def checked(self, model: nn.Module, *, staleness: int = 0) -> "Recipe":
        """Planned over `model`, with the optimizer and schedule built once on its parameters (they do not
        change): a mistake is one line here, and a factory's {"interval": ...} is learnt."""
        recipe = self.planned(model)
        # stand-ins without storage: each worker trains its own copy of the model, so an optimizer that holds
        # anything but the parameters it is given (a factory over `model.parameters()` of the user's object)
        # would step tensors nobody trains
        given = [(name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad))
                 for name, p in model.named_parameters()]
        try:
            optimizer = recipe.optimizer_factory()(given)
        except Exception as error:
            if isinstance(error, UserError):
                raise
            raise UserError(f"optimizer {describe(recipe.optimizer)} failed on the model's parameters: "
                            f"{type(error).__name__}: {first_line(error)}") from None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(f"optimizer= must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
        check_holds_given(optimizer, given, recipe.optimizer)
        for options in (recipe.groups or ([],))[0]:
            unknown = sorted(set(options) - set(optimizer.defaults))
            if unknown:
                raise UserError(f"param_groups=: {type(optimizer).__name__} has no group option {unknown[0]!r}; "
                                f"its options: {', '.join(sorted(optimizer.defaults))}")
        interval = recipe.interval
        if interval is None:
            made = recipe.schedule(optimizer) if callable(recipe.schedule) else None
            interval = made.get("interval", "epoch") if isinstance(made, dict) else "epoch"
            if interval not in ("step", "epoch"):
                raise UserError(f"scheduler=: the dict's interval must be 'step' or 'epoch', got {interval!r}")
            recipe = replace(recipe, interval=interval)
        try:
            scheduler = recipe.scheduler_factory(1)(optimizer)
        except Exception as error:
            raise UserError(f"scheduler {describe(recipe.schedule)} failed on the optimizer: {type(error).__name__}: "
                            f"{first_line(error)}") from None
        check_interval(scheduler if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau) else None,
                       recipe.interval, staleness)
        return recipe


def check_holds_given(optimizer, given: list, factory) -> None:
    """Refuse an optimizer that holds parameters other than the `given` ones it was built over."""
    ids = {id(p) for _, p in given}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"]
                  if id(p) not in ids and p.numel() > 0)
    if foreign:
        raise UserError(f"optimizer {describe(factory)} built its optimizer over {foreign} tensor(s) other than the "
                        f"parameters it was given (e.g. model.parameters() of your own model object): polytrain "
                        f"trains a copy of the model in each worker, so those would never be trained; build it over "
                        f"the argument: optimizer=lambda params: torch.optim.SGD(params, lr=0.1)")


def check_interval(plateau, interval: str, staleness: int) -> None:
    if plateau is not None and interval == "step":
        raise ConfigError("ReduceLROnPlateau steps once per epoch on the validation loss; drop --schedule-interval "
                          "step")
    if staleness and interval == "epoch":
        raise ConfigError("--staleness: the servers apply updates on threads of their own and step the schedule "
                          "with them, per step; use a per-step schedule (--schedule-interval step) or drop "
                          "--staleness")


def _python(value, given: bool, what: str, flag: str):
    """The label config.json holds for a Python object, where the object must be given again."""
    if isinstance(value, str) and value.endswith(FROM_PYTHON) and not given:
        raise UserError(f"{flag} {value!r} was a Python object given to fit(); pass {what}= to fit() again, or "
                        f"give {flag} NAME")


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
        options = optimizer_kwargs(cls, lr=config.effective_lr, momentum=config.momentum,
                                   weight_decay=config.weight_decay, betas=config.betas, eps=config.eps,
                                   extra=parse_args(config.optimizer_args, "--optimizer-args"))
        if config.no_decay_norms_and_biases and "weight_decay" not in options:
            raise ConfigError(f"--no-decay-norms-and-biases: {cls.__name__} has no weight decay to leave out; drop it")
    elif cls is not None and not callable(cls):
        raise UserError("optimizer= must be a name, a torch.optim class, or a function(params) -> Optimizer")
    elif cls is not None:
        for name in ("betas", "eps", "optimizer_args"):
            if getattr(config, name) is not None:
                raise ConfigError(f"{name}= applies to optimizer classes; set it inside the optimizer= function")
    chosen = scheduler if scheduler is not None else config.schedule
    _python(chosen, objects_follow, "scheduler", "--schedule")
    if isinstance(chosen, str) and chosen.endswith(FROM_PYTHON):
        chosen = None
    elif isinstance(chosen, str) and chosen not in SCHEDULES:
        chosen = resolve(chosen, SCHEDULERS, "--schedule", extra=SCHEDULES)
    schedule_options = parse_args(config.schedule_args, "--schedule-args")
    own = isinstance(chosen, str)
    if schedule_options and not (isinstance(chosen, type) and scheduler is None):
        raise ConfigError("--schedule-args applies to a torch.optim.lr_scheduler class named by --schedule; "
                          + ("drop it" if own else "give the arguments with functools.partial"))
    if isinstance(chosen, type):
        check_keywords(chosen, schedule_options, "--schedule-args")
        missing = [name for name, p in inspect.signature(chosen.__init__).parameters.items()
                   if name in keywords(chosen) and p.default is p.empty and name not in schedule_options]
        if missing:
            raise ConfigError(f"{chosen.__name__} needs {', '.join(missing)}: " + (
                f"pass --schedule-args '{missing[0]}=...'" if scheduler is None else
                f"pass functools.partial(torch.optim.lr_scheduler.{chosen.__name__}, {missing[0]}=...)"))
    elif chosen is not None and not own and not callable(chosen):
        raise UserError("scheduler= must be a name, a torch.optim.lr_scheduler class, or a function(optimizer)")
    interval = config.schedule_interval or ("step" if own else None if chosen is None else
                                            "epoch" if isinstance(chosen, type) else None)
    plateau = chosen is lr_scheduler.ReduceLROnPlateau or (isinstance(chosen, partial)
                                                           and chosen.func is lr_scheduler.ReduceLROnPlateau)
    check_interval(plateau or None, interval, config.staleness or 0)
    if plateau and interval is None:
        interval = "epoch"
    return Recipe(optimizer=cls, options=options, no_decay=config.no_decay_norms_and_biases,
                  param_groups=param_groups, schedule=chosen, schedule_options=schedule_options, interval=interval,
                  epochs=config.epochs, warmup_epochs=config.warmup_epochs)


def check_settings(config) -> None:
    """TrainConfig's check of the optimizer and schedule settings (objects given to fit() come later)."""
    make_recipe(config, objects_follow=True)


def torch_defaults(cls) -> dict:
    """The keyword arguments' defaults of a torch.optim class (lr, momentum, weight_decay, betas, eps, ...)."""
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if name in keywords(cls) and p.default is not p.empty}


def _number(value) -> str:
    return f"({', '.join(_number(v) for v in value)})" if isinstance(value, tuple) else \
        f"{value:g}" if isinstance(value, float) else str(value)


def recipe_line(recipe: Recipe) -> str:
    """The start line: the optimizer with every setting that differs from torch's defaults, and the schedule
    with the interval it steps at."""
    if isinstance(recipe.optimizer, type):
        defaults = torch_defaults(recipe.optimizer)
        changed = [f"{name.replace('_', ' ')} {_number(value)}" for name, value in recipe.options.items()
                   if name not in defaults or defaults[name] != value]
        optimizer = f"{recipe.optimizer.__name__} " + (
            f"({', '.join(changed)}; torch's defaults otherwise)" if changed else "(torch's defaults)")
        if recipe.groups is not None and len(recipe.groups[0]) > 1:
            optimizer += f" in {len(recipe.groups[0])} parameter groups"
    else:
        optimizer = f"{describe(recipe.optimizer)} (your function, with its own settings)"
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
        notes.append(f"note: the schedule {describe(recipe.schedule)} steps once per epoch, and this run ends after "
                     f"{steps} of an epoch's {steps_per_epoch} steps, so it never steps; train a whole epoch, or step "
                     f"it per optimizer step (--schedule-interval step, or Lightning's {{'interval': 'step'}})")
    warmup = round(recipe.warmup_epochs * (steps_per_epoch if recipe.per_step else 1))
    if isinstance(recipe.schedule, str) and warmup and warmup >= (steps if recipe.per_step else math.ceil(epochs)):
        notes.append(f"note: the warm-up ({recipe.warmup_epochs:g} epochs, {warmup} steps) is as long as the run "
                     f"({steps} steps), so the learning rate never reaches its peak; shorten --warmup-epochs")
    return notes


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
                raise ConfigError(f"{name}= is not passed to an optimizer function; set it inside optimizer=, or "
                                  f"pass the optimizer class")
    return tuple(objects)
