"""The names each registry offers (datasets, models, strategies, loggers) and what the settings check of them,
apart from what the names stand for, which imports torch: the flags, their help and the checks of a
`TrainConfig` are built from these in a process that never imports torch (`polytrain --help`).

Each name is written here once. The registries (data/__init__.py, models/__init__.py,
strategy_registry.py) map these names to their implementations and call `check_registry`, so a name added
on one side only fails at import, in one line; loggers.py reads `LOGGERS`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..errors import ConfigError

# dataset -> the dataset settings it reads; the others are refused when given, never ignored
DATASET_OPTIONS: Dict[str, Tuple[str, ...]] = {
    "mnist-sample": (),
    "mnist": ("data_dir", "download"),
    "fashion-mnist": ("data_dir", "download"),
    "cifar10": ("data_dir", "download"),
    "folder": ("data_dir", "image_size", "val_fraction", "skip_bad"),
    "synthetic": ("synthetic_size", "synthetic_shape"),
    "shakespeare": (),
    "text": ("data_dir",),
    "tokens": ("data_dir",),
    "hf": ("data_dir", "val_fraction", "tokenizer", "text_key", "train_on_prompt", "pack"),
}
DATASET_NAMES = tuple(DATASET_OPTIONS)
DATASET_SETTINGS = (
    "data_dir",
    "download",
    "synthetic_size",
    "synthetic_shape",
    "image_size",
    "val_fraction",
    "skip_bad",
    "tokenizer",
    "text_key",
    "train_on_prompt",
    "pack",
)
MODEL_NAMES = ("lenet", "lenet5", "mlp", "cifar-cnn", "resnet", "gpt", "llama")
TEXT_MODELS = ("gpt", "llama")  # the models of token windows; the others read images
STRATEGY_NAMES = ("single", "data", "pipeline", "sharded", "parameter-server", "tensor")
LOGGERS = ("tensorboard", "csv")


def check_registry(kind: str, registry: dict, names: Tuple[str, ...]) -> None:
    """Refuse, at import, a registry whose names are not `names` in their order (the help lists them so)."""
    if tuple(registry) != tuple(names):
        raise ImportError(
            f"the {kind} registry holds {', '.join(registry)} but config/registry_names.py names "
            f"{', '.join(names)}; add or remove the name on both sides, in the same order"
        )


def unused_dataset_options(name: Optional[str], given) -> List[str]:
    """The dataset settings in `given` that dataset `name` does not read (all of them when `name` is None:
    data passed as objects), so that they are refused instead of silently ignored."""
    used = DATASET_OPTIONS.get(name, ()) if name is not None else ()
    return [setting for setting in DATASET_SETTINGS if setting in given and setting not in used]


def datasets_using(setting: str) -> List[str]:
    return [name for name, options in DATASET_OPTIONS.items() if setting in options]


def parse_loggers(text: Optional[str]) -> Tuple[str, ...]:
    """`--logger tensorboard,csv` as names, each checked."""
    names = tuple(name.strip() for name in (text or "").split(",") if name.strip())
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(
                f"unknown --logger {name!r}; choose from {', '.join(LOGGERS)} (comma-separated)"
            )
    return names


def check_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--logger tensorboard needs the tensorboard package; run: pip install "
            "'polytrain[tensorboard]' (or pip install tensorboard)"
        ) from None
