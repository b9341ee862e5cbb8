"""The strategies' classes. The names a user gives (`--strategy`) are presets of degrees (parallel/presets.py
`layout_of`): one class, `Strategy`, runs every layout whose ranks all take one step (single, data, sharded,
tensor, with context ranks, and their meshes), prepared by `parallelize`; the pipeline (polytrain/pipeline/,
built on this package's modules) is `parallelize` applied per stage with a schedule of its own; the parameter
server is a different algorithm. polytrain/strategy_registry.py maps the names to these classes."""

from __future__ import annotations

from .base import StepStats, Strategy
from .parameter_server import ParameterServer

__all__ = ["ParameterServer", "StepStats", "Strategy"]
