"""docs/cli.md is rendered from the settings' declarations and the parser (polytrain.config.reference, run as
`python -m polytrain.cli > docs/cli.md`), never written by hand: it must be what the code renders now."""

import dataclasses
import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.cli import build_parser
from polytrain.config import reference
from polytrain.config.declare import flag_name

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_docs_cli_md_is_what_the_declarations_render():
    written, rendered = PAGE.read_text(), reference.markdown(build_parser())
    if written != rendered:
        diff = "".join(
            list(
                difflib.unified_diff(
                    written.splitlines(True), rendered.splitlines(True), "docs/cli.md", "rendered", n=0
                )
            )[:40]
        )
        pytest.fail(
            "docs/cli.md is out of date with the setting declarations and the parser; regenerate it with\n"
            f"    {reference.COMMAND}\nand commit it. What differs:\n{diff}",
            pytrace=False,
        )


def test_the_regeneration_command_prints_the_page():
    # reference.COMMAND, as the page and this test's failure tell a reader to run it
    done = subprocess.run(
        [sys.executable, "-m", "polytrain.cli"], capture_output=True, text=True, timeout=120, check=True
    )
    assert reference.COMMAND == "python -m polytrain.cli > docs/cli.md"
    assert done.stdout == reference.markdown(build_parser())


def test_every_setting_and_every_command_has_its_row():
    from polytrain.config import SETTINGS
    from polytrain.config.settings import INPUTS

    page = reference.markdown(build_parser())
    for name, meta in (*SETTINGS.items(), *INPUTS.items()):
        shown = f"`{name}=`" if meta.flag == "none" else f"`{flag_name(name)}"
        assert shown in page, name
    for command in build_parser().commands:
        assert f"## `polytrain {command}`" in page, command


def test_a_changed_declaration_changes_the_page(monkeypatch):
    name = "label_smoothing"
    changed = dataclasses.replace(reference.SETTINGS[name], help="smooth the targets | by X <here>")
    monkeypatch.setitem(reference.SETTINGS, name, changed)
    row = next(
        line
        for line in reference.markdown(build_parser()).splitlines()
        if line.startswith("| `--label-smoothing")
    )
    # the table's cells stay cells: a pipe in a text is escaped, and <word> stays visible
    assert row == "| `--label-smoothing X` | `0` | smooth the targets \\| by X \\<here> |  |"


def test_defaults_read_as_the_command_line_gives_them():
    assert reference.shown(None) == "-" and reference.shown(()) == "-"
    assert reference.shown(False, "switch") == "off" and reference.shown(True) == "on"
    assert reference.shown((1, 28, 28)) == "`1,28,28`" and reference.shown(5e-4) == "`0.0005`"
    assert reference.shown("\n") == "`'\\n'`"
