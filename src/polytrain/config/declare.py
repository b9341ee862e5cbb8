"""How a setting is declared: once, as a dataclass field whose metadata says everything else needs.

    epochs: int = setting(5, "passes over the training set", metavar="N", check="count")

From that one line polytrain derives the command-line flag (`--epochs N`, in its group of `--help`, with its
default), `fit()`'s keyword and its "did you mean" answer, the check of the value, whether `--resume` may
change it, which strategy owns it, and its key in `config.json` and in `--config` files. The flags are built
in `flags.py`; this module is pure (no argparse, no torch).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Tuple

from ..errors import ConfigError

# The sections of `polytrain train --help`, in order, and the table names a --config TOML file may use.
GROUPS = {
    "data": "data",
    "model": "model",
    "optimisation": "optimisation",
    "fine-tuning": "fine-tuning with LoRA adapters",
    "devices": "devices and strategy",
    "pipeline": "pipeline (with --strategy pipeline)",
    "sharded": "sharded (with --strategy sharded)",
    "parameter-server": "parameter server (with --strategy parameter-server)",
    "tensor": "tensor parallelism (with --strategy tensor)",
    "validation": "validation, early stopping and the best weights",
    "reliability": "run folder and reliability",
    "logging": "logging",
}

# What a resume may do with a setting: keep it as the run had it, change it (where and how the run
# continues, never what it computes), or extend it (--epochs, on a schedule that does not depend on the length).
RESUME = ("keep", "change", "extend")


@dataclass(frozen=True)
class Setting:
    """Everything polytrain knows about one setting besides its name, type and default (the field's)."""

    help: str
    group: str
    metavar: Optional[str] = None
    choices: Tuple[str, ...] = ()  # a closed set of values: the flag's metavar and the check
    check: Optional[str] = None  # a value check by kind (see CHECKS)
    example: Any = None  # the value an error suggests ("try --epochs 5")
    must: Optional[str] = None  # the check's words in its error, where the kind's are not precise
    hint: Optional[str] = None  # what the error adds after the value, instead of "; try ..."
    strategies: Tuple[str, ...] = ()  # the strategies that read it; () for every strategy
    resume: str = "keep"
    replans: bool = False  # changing it on resume plans the pipeline's split anew
    flag: str = "value"  # value | switch (--x) | toggle (--x / --no-x) | none (Python only)
    parse: Optional[Callable] = None  # how the command line turns the text into a value (default: type)
    commands: Tuple[str, ...] = ("train", "verify")


def setting(default, help: str, *, group: str, **declared) -> Any:
    """A dataclass field declaring one setting (see `Setting`)."""
    meta = Setting(help=help, group=group, **declared)
    assert (
        meta.group in GROUPS and meta.resume in RESUME and meta.flag in ("value", "switch", "toggle", "none")
    )
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata={"setting": meta})
    return field(default=default, metadata={"setting": meta})


def flag_name(name: str) -> str:
    """`batch_size` -> `--batch-size`."""
    return "--" + name.replace("_", "-")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# check kind -> (test of a value that is not None, what the message says it must be)
CHECKS = {
    "count": (lambda v: _whole(v) and v > 0, "a positive whole number"),
    "count0": (lambda v: _whole(v) and v >= 0, "a whole number >= 0"),
    "positive": (lambda v: _finite(v) and v > 0, "a number above 0"),
    "nonneg": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "fraction": (lambda v: _finite(v) and 0 < v < 1, "a number strictly between 0 and 1"),
    "probability": (lambda v: _finite(v) and 0 <= v < 1, "a probability from 0 up to (not including) 1"),
    "checkpointing": (
        lambda v: isinstance(v, str) and re.fullmatch(r"none|full|selective(:[1-9][0-9]*)?", v) is not None,
        "one of none, full, selective, selective:K (K a positive whole number)",
    ),
}


def check_value(name: str, meta: Setting, value) -> None:
    """The declared check of one value: its choices or its kind; None passes (it means: not set)."""
    if value is None:
        return
    flag = flag_name(name)
    if meta.choices and value not in meta.choices:
        raise ConfigError(f"unknown {flag} {value!r}; choose one of {', '.join(meta.choices)}")
    if meta.check is not None:
        test, words = CHECKS[meta.check]
        if not test(value):
            hint = meta.hint or (
                f"; try {flag} {meta.example}"
                if meta.example is not None
                else "; see polytrain train --help for the default"
                if meta.check == "nonneg"
                else ""
            )
            raise ConfigError(f"{flag} {meta.must or 'must be ' + words}, got {value!r}{hint}")


def declared(cls) -> dict:
    """name -> Setting for every declared field of a settings dataclass, in declaration order."""
    return {f.name: f.metadata["setting"] for f in fields(cls) if "setting" in f.metadata}


def unset(value) -> bool:
    """Whether a strategy's option is left at its unset value (None, or False for a switch)."""
    return value is None or value is False


# Parsers of settings given as text (a flag, a config file)


def numbers_text(text: str) -> tuple:
    """`0.9,0.95` as (0.9, 0.95), for --betas."""
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"expected numbers separated by commas such as 0.9,0.95, got {text!r}") from None


def epochs_text(text: str):
    """`3` as 3 and `1.5` as 1.5, for --epochs (a fraction trains on the first part of the last epoch)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number of epochs such as 3 or 1.5, got {text!r}") from None
    return int(value) if value.is_integer() else value


def shape_text(text: str) -> tuple:
    """`3,32,32` as (3, 32, 32), for --synthetic-shape."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"expected C,H,W such as 3,32,32, got {text!r}") from None
