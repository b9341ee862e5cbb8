"""The command-line flags of every setting, derived from the declarations, and settings from parsed flags.

cli.py builds the parser and calls this; nothing else turns arguments into a `TrainConfig`. Precedence:
flags given on the command line, then a `--config` file, then the declared defaults.
"""

from __future__ import annotations

import argparse
import re
from typing import Optional

from ..errors import UserError
from .declare import GROUPS, Setting, flag_name
from .files import read_config_file
from .host import launcher_env
from .model_defaults import OWN_OPTIMIZER_SETTINGS, apply_model_defaults
from .names import as_flag, foreign, nearest
from .pretrained import apply_checkpoint
from .registry_names import DATASET_NAMES, MODEL_NAMES, STRATEGY_NAMES, datasets_using, unused_dataset_options
from .settings import INPUTS
from .train import DEFAULTS, SETTINGS, TrainConfig, apply_inputs

REGISTRIES = {
    "datasets": ", ".join(DATASET_NAMES),
    "models": ", ".join(MODEL_NAMES),
    "strategies": ",".join(STRATEGY_NAMES),
}


def _fill(text: str) -> str:
    """A declared text with the registries' names where it says `{datasets}`, `{models}` or `{strategies}`."""
    for key, names in REGISTRIES.items():
        text = text.replace("{" + key + "}", names)
    return text


def _value_type(name: str):
    """How the command line reads a value: the declared parser, else the type of the declared field."""
    annotation = str(TrainConfig.__dataclass_fields__[name].type) if name in SETTINGS else "int"
    return int if "int" in annotation else float if "float" in annotation else str


def _add_flag(group, name: str, meta: Setting) -> None:
    default = getattr(DEFAULTS, name, None)
    kwargs = dict(default=None, help=_fill(meta.help) % {"default": default})
    if meta.flag == "switch":
        kwargs.update(action="store_true")
    elif meta.flag == "toggle":
        kwargs.update(action=argparse.BooleanOptionalAction)
    else:
        kwargs.update(
            type=_argparse_type(meta.parse) if meta.parse else _value_type(name),
            metavar=_fill(meta.metavar or "{" + ",".join(meta.choices) + "}"),
        )
    group.add_argument(flag_name(name), **kwargs)


def add_model_flags(parser: argparse.ArgumentParser, names) -> None:
    """The flags of the model settings `names`, as `polytrain train` has them (none given by default), for a
    command that builds its model from them too (`polytrain bench`)."""
    group = parser.add_argument_group("the model's settings, as polytrain train takes them")
    for name in names:
        _add_flag(group, name, SETTINGS[name])


def _argparse_type(parse):
    def read(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    read.__name__ = getattr(parse, "__name__", "value")  # argparse names it in "invalid int value"
    return read


def add_setting_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """One flag per declared setting that `command` takes, in the groups of settings.py, plus `--config`."""
    groups = {}
    for name, meta in (*SETTINGS.items(), *INPUTS.items()):
        if meta.flag == "none" or command not in meta.commands:
            continue
        if meta.group not in groups:
            groups[meta.group] = parser.add_argument_group(GROUPS[meta.group])
        _add_flag(groups[meta.group], name, meta)
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="read settings from a TOML or JSON file (a run's config.json repeats that run); "
        "flags given beside it override it",
    )


def given_settings(args) -> dict:
    """The settings and inputs given as flags: name -> value."""
    known = (*SETTINGS, *INPUTS)
    return {name: value for name, value in vars(args).items() if name in known and value is not None}


def settings_of(args) -> dict:
    """The file's settings under the flags given beside it; `args.given` becomes every name either set.

    The global and the per-device batch are two ways to say one setting: a flag for either replaces the
    file's, and one source giving both is a mistake."""
    flags = given_settings(args)
    _one_batch(flags, "give either --batch-size (global) or --per-device-batch-size, not both")
    if not getattr(args, "config", None):
        return flags
    from_file = read_config_file(args.config)
    _one_batch(from_file, f"--config {args.config} gives both batch_size and per_device_batch_size; keep one")
    if {"batch_size", "per_device_batch_size"} & set(flags):
        from_file.pop("batch_size", None)
        from_file.pop("per_device_batch_size", None)
    # JSON has no tuples: [1, 28, 28] is the default (1, 28, 28), so it was not given
    # the optimizer's settings a file writes out were chosen, default or not (a run's config.json repeats them)
    args.given = frozenset(
        args.given
        | {
            name
            for name, value in from_file.items()
            if (tuple(value) if isinstance(value, list) else value) != getattr(DEFAULTS, name, None)
            or name in OWN_OPTIMIZER_SETTINGS
        }
    )
    return dict(from_file, **flags)


def _one_batch(values: dict, message: str) -> None:
    if "batch_size" in values and "per_device_batch_size" in values:
        raise UserError(message)


def flag_list(names) -> str:
    """Setting names as the command line spells them: `batch_size` -> `--batch-size`, comma-separated."""
    return ", ".join(flag_name(name) for name in names)


def config_from_args(args) -> TrainConfig:
    values = settings_of(args)
    launcher = launcher_env()  # under torchrun/srun the device count is its world size
    if launcher is not None:
        values["devices"] = launcher.world_size
    apply_inputs(values)
    # --init-from: the checkpoint's model and sizes, a flag that contradicts them refused
    model, given = apply_checkpoint(values, set(args.given) | set(values), values.get("model"))
    # a model's own defaults (config.json records them) for what was not given; the caller may say them
    args.model_defaults = apply_model_defaults(values, given, model or DEFAULTS.model)
    config = TrainConfig(**values)
    refuse_ignored(config, args.given)
    unused = unused_dataset_options(config.dataset, args.given)
    if unused:
        raise UserError(
            f"{flag_list(unused)} {'is' if len(unused) == 1 else 'are'} not used by --dataset "
            f"{config.dataset}; "
            f"drop {'it' if len(unused) == 1 else 'them'}, or choose a dataset that uses "
            f"{'it' if len(unused) == 1 else 'them'} ({', '.join(datasets_using(unused[0]))})"
        )
    return config


def refuse_ignored(config: TrainConfig, given) -> None:
    """Settings given on purpose that the chosen optimizer or schedule would not use: one line, never ignored."""
    from ..optim import OPTIMIZERS, SCHEDULES, _key, keywords

    cls = OPTIMIZERS.get(_key(config.optimizer)) if isinstance(config.optimizer, str) else None
    if cls is not None and "momentum" in given and "momentum" not in keywords(cls):
        raise UserError(
            f"--momentum does not apply to {cls.__name__}, which takes no momentum; drop --momentum"
            + (" (set its betas with --betas 0.9,0.999)" if "betas" in keywords(cls) else "")
        )
    if (
        "warmup_epochs" in given
        and isinstance(config.schedule, str)
        and _key(config.schedule) not in SCHEDULES
    ):
        raise UserError(
            f"--warmup-epochs belongs to polytrain's {', '.join(SCHEDULES)} schedules, not to "
            f"--schedule {config.schedule}; drop --warmup-epochs (a warm-up before a torch schedule: "
            f"fit(scheduler=...) with torch's SequentialLR)"
        )


def unknown_flag(word: str, known_flags, command: Optional[str]) -> str:
    """The one line for an argument the command does not take: the nearest real flag, only if it is near."""
    if not word.startswith("-"):
        return f"unexpected argument {word!r}; see polytrain {command or ''} --help".replace("  ", " ")
    bare = word.split("=", 1)[0]
    said = foreign(bare, as_flag)
    if said:
        return f"unrecognized argument {bare}: {said}"
    python_only = SETTINGS.get(bare.lstrip("-").replace("-", "_"))
    if python_only is not None and python_only.flag == "none":
        name = bare.lstrip("-").replace("-", "_")
        what = re.split(r" \(|:", python_only.help, maxsplit=1)[0]
        return (
            f"unrecognized argument {bare}: {name}= is a setting of polytrain.fit() only ({what}); the "
            f"command line does not take it"
        )
    close = nearest(bare, [flag for flag in known_flags if flag not in ("-h", "--help")])
    if close:
        return f"unrecognized argument {bare}; did you mean {close}?"
    return f"unrecognized argument {bare}: polytrain has no such setting; see polytrain {command or ''} --help".replace(
        "  ", " "
    )


def parse_list(text, flag: str, *, counts: bool = False) -> tuple:
    """`--devices 1,2,4` as (1, 2, 4), `--strategies data,sharded` as names; a malformed list is one line."""
    if isinstance(text, tuple):
        return text
    parts = tuple(part.strip() for part in str(text).split(",") if part.strip())
    if not counts:
        if not parts:
            raise UserError(f"{flag} takes names separated by commas, got {text!r}")
        return parts
    try:
        numbers = tuple(int(part) for part in parts)
    except ValueError:
        numbers = ()
    if not numbers or min(numbers) < 1:
        raise UserError(
            f"{flag} takes positive whole numbers separated by commas such as 1,2,4, got {text!r}"
        )
    return numbers
