"""Settings: each declared once (settings.py, with declare.py's `setting`), grouped by concern, and assembled
into `TrainConfig`. The command-line flags (flags.py), `fit()`'s keywords, the resume rules, `config.json` and
`--config` files (files.py) are derived from the declarations."""

from .train import (
    DEFAULTS,
    REPLANNING,
    RESUMABLE,
    RESUMABLE_FLAGS,
    SETTINGS,
    STRATEGY_FLAGS,
    STRATEGY_OPTIONS,
    TrainConfig,
    options_of_other_strategies,
    replicas,
    unset_value,
)

__all__ = [
    "DEFAULTS",
    "REPLANNING",
    "RESUMABLE",
    "RESUMABLE_FLAGS",
    "SETTINGS",
    "STRATEGY_FLAGS",
    "STRATEGY_OPTIONS",
    "TrainConfig",
    "options_of_other_strategies",
    "replicas",
    "unset_value",
]
