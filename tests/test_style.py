"""The code stays formatted and linted (ruff, configured in pyproject.toml): a clean clone with unformatted or
lint-failing code fails the test command."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = ["src", "tests", "benchmarks"]


def ruff(*args, stdin=None):
    command = [shutil.which("ruff") or sys.executable, *([] if shutil.which("ruff") else ["-m", "ruff"])]
    return subprocess.run(
        [*command, *args], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module", autouse=True)
def ruff_present():
    if ruff("--version").returncode != 0:
        pytest.fail("ruff is not installed: pip install -e '.[test]' installs it")


def test_the_code_is_formatted():
    result = ruff("format", "--check", *CODE)
    assert result.returncode == 0, f"run `ruff format {' '.join(CODE)}`:\n{result.stdout}{result.stderr}"


def test_the_code_passes_the_linter():
    result = ruff("check", *CODE)
    assert result.returncode == 0, f"run `ruff check {' '.join(CODE)}`:\n{result.stdout}{result.stderr}"


def test_the_checks_fail_on_unformatted_or_wrong_code():
    # the same configuration, on text that breaks it: a line of 130 characters, an unused import
    long_call = "value = some_function(" + ", ".join(f"argument_{i}" for i in range(12)) + ")\n"
    assert ruff("format", "--check", "--stdin-filename", "src/x.py", "-", stdin=long_call).returncode == 1
    assert ruff("check", "--stdin-filename", "src/x.py", "-", stdin="import os\n").returncode == 1
    assert (
        ruff("check", "--stdin-filename", "src/x.py", "-", stdin="import os\n\nprint(os.sep)\n").returncode
        == 0
    )
