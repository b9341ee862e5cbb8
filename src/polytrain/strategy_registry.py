"""Strategies by name; `auto` picks `single` for one device and `data` for several. The names are declared in
config/registry_names.py (the command line reads them without importing torch); `STRATEGIES` maps them to the
classes of polytrain/strategies/ and polytrain/pipeline/ and is checked against the names at import."""

from __future__ import annotations

from .config.registry_names import STRATEGY_NAMES, check_registry
from .errors import ConfigError
from .parallel.parallelize import check_model
from .parallel.presets import layout_of
from .pipeline.strategy import Pipeline
from .strategies import ParameterServer, Strategy

STRATEGIES = {
    "single": Strategy,
    "data": Strategy,
    "pipeline": Pipeline,
    "sharded": Strategy,
    "parameter-server": ParameterServer,
    "tensor": Strategy,
}
check_registry("strategy", STRATEGIES, STRATEGY_NAMES)


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
        for name, strategy in STRATEGIES.items()
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
    return STRATEGIES[name].make_plan(config, model, dataset, device=device)


__all__ = ["STRATEGIES", "contiguous_strategies", "make_plan", "resolve_strategy_name"]
