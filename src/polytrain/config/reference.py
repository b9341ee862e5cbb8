"""The command-line reference (docs/cli.md), rendered from the settings' declarations and the parser.

    python -m polytrain.cli > docs/cli.md

`polytrain train` and `polytrain verify` take every declared setting (settings.py and the *_settings.py beside it): each is
listed from its declaration (flag, default, help, group, which strategy reads it, what --resume may do with it).
The few flags that are not settings (`--resume`, `--steps`, the other commands' arguments) are read from the
parser that cli.py builds and hands to `markdown(parser)` (config sits below the command line and never imports
it), so nothing on the page is written by hand but its opening. tests/test_cli_reference.py
fails while docs/cli.md differs from what this renders.
"""

from __future__ import annotations

import argparse
from typing import Iterable, List

from .declare import GROUPS, Setting, flag_name
from .flags import _fill
from .model_defaults import MODEL_DEFAULTS
from .settings import INPUTS
from .train import DEFAULTS, SETTINGS

COMMAND = "python -m polytrain.cli > docs/cli.md"

OPENING = f"""# Command-line reference

Every command and flag of `polytrain`, with its default and what it does. This page is generated from the
code: the settings' declarations (`src/polytrain/config/settings.py` and the `*_settings.py` files beside
it) and the parser (`src/polytrain/cli.py`). Do not edit it by hand;
after changing a setting or a flag, run

```bash
{COMMAND}
```

(`tests/test_cli_reference.py` fails while this page is out of date).

How to read it:

- `polytrain --help` and `polytrain COMMAND --help` print the same in the terminal.
- `RUN_DIR` may be `runs/LATEST`: the newest run folder under `runs/`.
- Flags are matched exactly: `--epoch` is an error that suggests `--epochs`, never a guess. A mistake is one
  line (`polytrain train: error: ...; see polytrain train --help`).
- Every setting is also a keyword of `polytrain.fit()` (`--batch-size 32` is `batch_size=32`) and a key of a
  `--config` file. Flags given on the command line win over the file, and the file over the defaults below
  ([config-files.md](config-files.md)).
- A default of `-` means "not set": the text says what happens then.
"""


def cell(text) -> str:
    """Text for one cell of a markdown table: pipes escaped, `<word>` kept visible, one line."""
    text = " ".join(str(text).split())
    return text.replace("|", "\\|").replace("<", "\\<")


def code(text) -> str:
    return f"`{text}`" if text not in ("", "-") else text


def shown(value, flag: str = "value") -> str:
    """A default as the table shows it."""
    if flag in ("switch", "toggle") and value in (False, None):
        return "off" if value is False else "-"
    if value is None or value == ():
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return code(",".join(str(part) for part in value))
    if isinstance(value, str) and not value.isprintable():
        return code(repr(value))
    if isinstance(value, float):
        return code(f"{value:g}")
    return code(value)


def help_text(meta: Setting, default) -> str:
    return cell(_fill(meta.help) % {"default": default})


def flag_words(name: str, meta: Setting) -> str:
    flag = flag_name(name)
    if meta.flag == "switch":
        return code(flag)
    if meta.flag == "toggle":
        return f"{code(flag)} / {code('--no-' + flag[2:])}"
    metavar = _fill(meta.metavar or "{" + ",".join(meta.choices) + "}")
    return code(f"{flag} {metavar}")


def notes(name: str, meta: Setting) -> str:
    said = []
    if meta.strategies and tuple(meta.strategies) != (meta.group,):
        said.append("with `--strategy " + "` or `".join(meta.strategies) + "` only")
    if meta.commands == ("train",):
        said.append("`train` only")
    if meta.resume == "change":
        said.append("`--resume` may change it")
    elif meta.resume == "extend":
        said.append("`--resume` may extend it (a schedule that does not depend on it)")
    for model, defaults in MODEL_DEFAULTS.items():
        if name in defaults:
            said.append(f"`--model {model}`: {shown(defaults[name])}")
    return cell("; ".join(said))


def settings_section() -> List[str]:
    lines = [
        "## Settings of `train` and `verify`",
        "",
        "Declared once each, in groups; `polytrain train --help` lists them in the same groups. A setting that",
        "one strategy reads is refused with another strategy. `--resume` keeps every setting the run had, except",
        "those marked here (see [reliability.md](reliability.md#resume)).",
    ]
    for group, title in GROUPS.items():
        rows = [
            (name, meta)
            for name, meta in (*SETTINGS.items(), *INPUTS.items())
            if meta.group == group and meta.flag != "none"
        ]
        if not rows:
            continue
        lines += ["", f"### {title[0].upper() + title[1:]}", ""]
        lines += ["| flag | default | what it does | notes |", "| --- | --- | --- | --- |"]
        for name, meta in rows:
            default = getattr(DEFAULTS, name, None)
            lines.append(
                f"| {cell(flag_words(name, meta))} | {cell(shown(default, meta.flag))} | "
                f"{help_text(meta, default)} | {notes(name, meta)} |"
            )
    python_only = [(name, meta) for name, meta in SETTINGS.items() if meta.flag == "none"]
    lines += [
        "",
        "### Settings of `polytrain.fit()` only",
        "",
        "These take Python objects or belong to `train=`/`val=` Datasets; the command line has no flag for them.",
        "",
        "| keyword | default | what it does | notes |",
        "| --- | --- | --- | --- |",
    ]
    for name, meta in python_only:
        default = getattr(DEFAULTS, name, None)
        lines.append(
            f"| {code(name + '=')} | {cell(shown(default))} | {help_text(meta, default)} | {notes(name, meta)} |"
        )
    return lines


def action_words(action: argparse.Action) -> str:
    if not action.option_strings:
        return code(action.metavar or action.dest)
    flag = max(action.option_strings, key=len)
    if action.nargs == 0:
        return code(flag)
    metavar = action.metavar or (
        "{" + ",".join(action.choices) + "}" if action.choices else action.dest.upper()
    )
    return code(f"{flag} {metavar}")


def action_rows(actions: Iterable[argparse.Action]) -> List[str]:
    rows = ["| argument | default | what it does |", "| --- | --- | --- |"]
    for action in actions:
        words = (action.help or "") % {"default": action.default} if action.help else ""
        default = "-" if not action.option_strings else shown(action.default)
        if isinstance(action, argparse._VersionAction):
            default = "-"
        rows.append(f"| {cell(action_words(action))} | {cell(default)} | {cell(words)} |")
    return rows


def own_actions(parser: argparse.ArgumentParser, *, settings: bool) -> list:
    """The parser's arguments but --help; with `settings`, only those that are not declared settings."""
    known = {*SETTINGS, *INPUTS} if settings else set()
    return [
        action
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
        and action.dest not in known
    ]


def commands_section(parser: argparse.ArgumentParser) -> List[str]:
    """The commands and their own arguments, read from the command line's parser (cli.build_parser())."""
    summaries = {
        choice.dest: choice.help
        for group in parser._actions
        if isinstance(group, argparse._SubParsersAction)
        for choice in group._choices_actions
    }
    lines = ["## Commands", "", "| command | what it does |", "| --- | --- |"]
    lines += [f"| `polytrain {name}` | {cell(summaries.get(name, ''))} |" for name in parser.commands]
    lines += ["", "`polytrain --version` prints the version; `polytrain` alone prints the help."]
    for name, sub in parser.commands.items():
        lines += ["", f"## `polytrain {name}`", ""]
        said = sub.description or summaries.get(name, "")
        lines.append(cell(said[:1].upper() + said[1:] + ("" if said.endswith(".") else ".")))
        takes_settings = name in ("train", "verify")
        if takes_settings:
            lines += [
                "",
                "It takes every setting of [Settings of `train` and `verify`](#settings-of-train-and-verify)"
                + (" (but those marked `train` only)" if name == "verify" else "")
                + ", and these arguments of its own:",
            ]
        lines += [""] + action_rows(own_actions(sub, settings=takes_settings))
    return lines


def markdown(parser: argparse.ArgumentParser) -> str:
    """The whole of docs/cli.md, for the command line's parser (cli.build_parser())."""
    return "\n".join([OPENING, *commands_section(parser), "", *settings_section()]) + "\n"
