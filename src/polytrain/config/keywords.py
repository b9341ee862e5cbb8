"""The Python API's words: which keywords `fit` takes, and messages written for the command line said in them."""

from __future__ import annotations

import re

from ..errors import ConfigError
from . import SETTINGS, TrainConfig
from .names import as_keyword, foreign, nearest
from .settings import INPUTS

# fit()'s own parameters; every other keyword is a declared setting (config/settings.py).
FIT_KEYWORDS = (
    "model",
    "data",
    "train",
    "val",
    "loss",
    "metrics",
    "logger",
    "callbacks",
    "epochs",
    "devices",
    "strategy",
    "out",
    "resume",
    "verbose",
    "optimizer",
    "scheduler",
    "param_groups",
    "step",
    "eval_step",
)


def check_keywords(settings: dict) -> None:
    """Refuse a keyword `fit` does not take, naming the nearest one it does."""
    known = sorted(set(SETTINGS) - {"dataset", "model"} | set(INPUTS) | set(FIT_KEYWORDS))
    for name in settings:
        said = foreign(name, as_keyword) if name not in known else None
        if said:
            raise ConfigError(f"fit() has no keyword {name}=; {said}")
        if name not in known:
            close = nearest(name, known)
            raise ConfigError(
                f"fit() has no keyword {name}="
                + (
                    f"; did you mean {close}=?"
                    if close
                    else f"; it takes {', '.join(k + '=' for k in known)}"
                )
            )


def keyword_words(message: str) -> str:
    """A message written for the command line, in the words of the Python API: `--batch-size 64` becomes
    `batch_size=64`, `--schedule-interval step` (one of the setting's choices) `schedule_interval="step"` and
    a bare `--download` becomes `download=True`."""

    def keyword(match):
        name, value = match.group(1).replace("-", "_"), match.group(2)
        if value is not None and value[0].islower():  # a word: the setting's value only if it is a choice
            meta = SETTINGS.get(name)
            if meta is not None and value in meta.choices:
                return f'{name}="{value}"'
            return keyword_alone(name) + " " + value
        if value is not None:
            return f"{name}={value}"
        return keyword_alone(name)

    def keyword_alone(name):
        field = TrainConfig.__dataclass_fields__.get(name)
        return f"{name}=True" if field is not None and field.type in ("bool", bool) else f"{name}="

    return re.sub(
        r"--([a-z][a-z0-9-]*)(?: (-?[0-9][\w.+-]*|'[^']*'|[A-Z][A-Z_,]*\b|[a-z][\w-]*\b))?", keyword, message
    )
