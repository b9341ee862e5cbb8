"""The settings of how a run optimises: epochs and steps, the batch, the optimizer and its schedule,
accumulation, clipping and precision. Declared as in settings.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .declare import epochs_text, numbers_text, setting


@dataclass
class OptimisationSettings:
    epochs: float = setting(
        5,
        "passes over the training set; a fraction such as 1.5 ends within the last one, "
        "with the schedule laid over the steps taken and a validation at the end (default: "
        "%(default)s)",
        group="optimisation",
        metavar="N",
        check="positive",
        example=5,
        resume="extend",
        parse=epochs_text,
    )
    batch_size: int = setting(
        64,
        "GLOBAL batch, split across --devices (default: %(default)s)",
        group="optimisation",
        metavar="N",
        check="count",
        example=64,
    )
    optimizer: str = setting(
        "sgd",
        "any torch.optim class by name, any case: sgd, adam, adamw, rmsprop, adadelta, "
        "... (default: %(default)s)",
        group="optimisation",
        metavar="NAME",
    )
    optimizer_args: Optional[str] = setting(
        None,
        "more keyword arguments of the optimizer as key=value pairs, e.g. nesterov=true,dampening=0",
        group="optimisation",
        metavar="K=V,...",
    )
    betas: Optional[tuple] = setting(
        None,
        "Adam-family betas, e.g. 0.9,0.95 (default: the optimizer's)",
        group="optimisation",
        metavar="B1,B2",
        parse=numbers_text,
    )
    eps: Optional[float] = setting(
        None,
        "the optimizer's epsilon (default: the optimizer's)",
        group="optimisation",
        metavar="X",
        check="nonneg",
    )
    no_decay_norms_and_biases: bool = setting(
        False,
        "two parameter groups: no weight decay on biases and "
        "normalisation weights (every tensor of one dimension)",
        group="optimisation",
        flag="switch",
    )
    lr: Optional[float] = setting(
        0.05,
        "peak learning rate (default: %(default)s with polytrain's own SGD; an "
        "--optimizer you name keeps torch's default lr, momentum and weight decay "
        "unless given)",
        group="optimisation",
        metavar="X",
        check="nonneg",
    )
    lr_scale: str = setting(
        "none",
        "linear: multiply --lr by --devices (the linear scaling rule, for a global "
        "batch that grows with the devices); default: %(default)s",
        group="optimisation",
        choices=("none", "linear"),
    )
    momentum: Optional[float] = setting(
        0.9,
        "default: %(default)s with polytrain's own SGD, torch's with a named --optimizer",
        group="optimisation",
        metavar="X",
        check="nonneg",
    )
    weight_decay: Optional[float] = setting(
        5e-4,
        "default: %(default)s with polytrain's own SGD, torch's with a named --optimizer",
        group="optimisation",
        metavar="X",
        check="nonneg",
    )
    schedule: str = setting(
        "onecycle",
        "learning-rate schedule after warm-up: constant, cosine, onecycle, or any "
        "torch.optim.lr_scheduler class by name (steplr, ...) with --schedule-args "
        "(default: %(default)s)",
        group="optimisation",
        metavar="NAME",
    )
    schedule_args: Optional[str] = setting(
        None,
        "keyword arguments of a torch.optim.lr_scheduler class, e.g. step_size=2,gamma=0.5",
        group="optimisation",
        metavar="K=V,...",
    )
    schedule_interval: Optional[str] = setting(
        None,
        "step the schedule after every optimizer step or every "
        "epoch (default: step for constant/cosine/onecycle, epoch for "
        "torch.optim.lr_scheduler classes, as Lightning does)",
        group="optimisation",
        choices=("step", "epoch"),
    )
    accumulate: int = setting(
        1,
        "compute each optimizer step's batch in K passes per replica, synchronising "
        "gradients on the last only: K-fold less activation memory, the same training "
        "(default: %(default)s)",
        group="optimisation",
        metavar="K",
        check="count",
        example=4,
        resume="change",
    )
    freeze: Optional[str] = setting(
        None,
        "parameters that do not train: comma-separated globs over the one-device parameter names (e.g. "
        "'embed.*,layers.0.*'); they get no gradient and no optimizer state",
        group="optimisation",
        metavar="PATTERN",
        example="embed.*",
    )
    clip_grad_norm: Optional[float] = setting(
        None,
        "scale the gradients so that their global L2 norm (over the "
        "whole model, on every strategy) is at most X",
        group="optimisation",
        metavar="X",
        check="nonneg",
        example=1.0,
    )
    clip_grad_value: Optional[float] = setting(
        None,
        "clamp every gradient element to [-X, X]",
        group="optimisation",
        metavar="X",
        check="nonneg",
        example=1.0,
    )
    warmup_epochs: float = setting(
        0.5, "linear warm-up length (default: %(default)s)", group="optimisation", metavar="X", check="nonneg"
    )
    label_smoothing: float = setting(
        0.0, "default: %(default)s", group="optimisation", metavar="X", check="nonneg"
    )
    seed: int = setting(
        0, "same seed, same batches and weights (default: %(default)s)", group="optimisation", metavar="N"
    )
