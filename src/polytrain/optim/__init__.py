"""Optimizers and learning-rate schedules: any `torch.optim` class (by name or as an object) or a factory,
parameter groups, polytrain's warm-up schedules or any `torch.optim.lr_scheduler`.

A `Recipe` is made and checked in the launching process (every mistake one line before any worker starts)
and tells each worker how to build its optimizer over the parameters it holds. Parameter groups are laid out
once over the whole model, so every rank builds the same groups in the same order (a group with no
parameter on a rank gets a zero-size placeholder) and their states merge into one device's numbering.
"""

from .optimizers import (
    FROM_PYTHON,
    OPTIMIZERS,
    REFUSED,
    SCHEDULERS,
    SCHEDULES,
    _key,
    check_keywords,
    describe,
    group_params,
    keywords,
    make_optimizer,
    optimizer_kwargs,
    parse_args,
    plan_groups,
    resolve,
    speed_options,
)
from .recipe import (
    Recipe,
    check_holds_given,
    check_interval,
    check_settings,
    make_recipe,
    recipe_line,
    recipe_notes,
    take_objects,
    torch_defaults,
    unscheduled_objects,
)
from .schedules import lr_factor, make_scheduler, step_per_epoch

__all__ = [
    "FROM_PYTHON",
    "_key",
    "OPTIMIZERS",
    "REFUSED",
    "Recipe",
    "SCHEDULERS",
    "SCHEDULES",
    "check_holds_given",
    "check_interval",
    "check_keywords",
    "check_settings",
    "describe",
    "group_params",
    "keywords",
    "lr_factor",
    "make_optimizer",
    "make_recipe",
    "make_scheduler",
    "optimizer_kwargs",
    "parse_args",
    "plan_groups",
    "recipe_line",
    "recipe_notes",
    "resolve",
    "speed_options",
    "step_per_epoch",
    "take_objects",
    "torch_defaults",
    "unscheduled_objects",
]
