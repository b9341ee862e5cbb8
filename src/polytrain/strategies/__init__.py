"""Strategies by name; `auto` picks `single` for one device and `data` for several."""
from __future__ import annotations

from ..errors import ConfigError
from .base import StepStats, Strategy
from .data import DataParallel
from .single import SingleDevice

STRATEGIES = {"single": SingleDevice, "data": DataParallel}


def resolve_strategy_name(name: str, devices: int) -> str:
    if name == "auto":
        return "single" if devices == 1 else "data"
    if name not in STRATEGIES:
        raise ConfigError(f"unknown --strategy {name!r}; choose one of auto, {', '.join(STRATEGIES)}")
    if name == "single" and devices != 1:
        raise ConfigError(f"--strategy single runs on one device, but --devices is {devices}; "
                          f"use --strategy data or --devices 1")
    return name


__all__ = ["STRATEGIES", "StepStats", "Strategy", "resolve_strategy_name"]
