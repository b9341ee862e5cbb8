"""Strategies by name; `auto` picks `single` for one device and `data` for several. The names are declared in
config/registry_names.py (the command line reads them without importing torch); `STRATEGIES` maps them to
classes and is checked against them when first used. The names are presets of degrees (parallel/layout.py
`layout_of`): one class, `Strategy`, runs every layout whose ranks all take one step (single, data, sharded,
tensor, with context ranks, and their meshes), prepared by `parallelize`; the pipeline is `parallelize` applied
per stage with a schedule of its own; the parameter server is a different algorithm.

`Pipeline` lives in polytrain/pipeline/strategy.py, which builds on this package's modules (base.py,
distributed.py, ...): it and `STRATEGIES` are imported when first asked for (PEP 562's module `__getattr__`), so
that importing polytrain.pipeline.strategy first, which imports this package before `Pipeline` exists, works."""

from __future__ import annotations

from ..config.registry_names import STRATEGY_NAMES, check_registry
from ..errors import ConfigError
from ..parallel.parallelize import check_model
from ..parallel.presets import layout_of
from .base import StepStats, Strategy
from .parameter_server import ParameterServer

_STRATEGIES: dict = {}  # filled by strategy_classes


def strategy_classes() -> dict:
    """`STRATEGIES`: each strategy's class by name, made (and checked against the declared names) once."""
    if not _STRATEGIES:
        from ..pipeline.strategy import Pipeline

        classes = {
            "single": Strategy,
            "data": Strategy,
            "pipeline": Pipeline,
            "sharded": Strategy,
            "parameter-server": ParameterServer,
            "tensor": Strategy,
        }
        check_registry("strategy", classes, STRATEGY_NAMES)
        _STRATEGIES.update(classes)
    return _STRATEGIES


def __getattr__(name: str):
    if name == "STRATEGIES":
        return strategy_classes()
    if name == "Pipeline":
        return strategy_classes()["pipeline"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_strategy_name(name: str, devices: int) -> str:
    """The strategy that runs `name` on `devices` (auto: single on one device, data on several), for settings
    already validated: the layout of the settings (parallel/layout.py `layout_of`) has refused a name it does not
    know, and one that does not fit the devices, in one line each."""
    if name == "auto":
        return "single" if devices == 1 else "data"
    return name


def contiguous_strategies() -> tuple:
    """The strategies that train in the default memory format even where channels-last is asked for: a
    pipeline's (`keeps_channels_last`), and those whose ranks hold parts of the parameters on several devices
    (FSDP2 shards contiguous parameters only)."""
    return tuple(
        name
        for name, strategy in strategy_classes().items()
        if not strategy.keeps_channels_last or (name != "single" and layout_of(name, 2).holds_parts)
    )


def make_plan(name: str, config, model, dataset, *, device):
    """The strategy's plan for these settings, checked in the launching process (None: nothing to plan)."""
    if config.activation_checkpointing != "none" and config.split_at:
        raise ConfigError(
            "--activation-checkpointing does not combine with --split-at (traced stages); write the model as "
            "an nn.Sequential (stages split by --split), or drop --activation-checkpointing"
        )
    check_model(model, config.layout, activation_checkpointing=config.activation_checkpointing)
    return strategy_classes()[name].make_plan(config, model, dataset, device=device)


__all__ = [
    "ParameterServer",
    "Pipeline",
    "STRATEGIES",
    "StepStats",
    "Strategy",
    "contiguous_strategies",
    "make_plan",
    "resolve_strategy_name",
    "strategy_classes",
]
