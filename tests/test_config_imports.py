"""The settings and the command line's parser import no torch (`polytrain --help` answers at once), and each
registry's names are written once: config/registry_names.py, which the registries are checked against."""

import subprocess
import sys

import pytest

import polytrain
from polytrain.config import DEFAULTS, TrainConfig
from polytrain.config.registry_names import (
    DATASET_NAMES,
    MODEL_NAMES,
    STRATEGY_NAMES,
    check_registry,
)


def torch_modules_after(code: str) -> list:
    """The torch modules a fresh interpreter holds after running `code`."""
    script = (
        f"{code}\nimport sys\nprint(sorted(name for name in sys.modules if name.split('.')[0] == 'torch'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    return eval(done.stdout.strip().splitlines()[-1])


def test_the_check_sees_torch_where_it_is_imported():
    assert "torch" in torch_modules_after("import polytrain.models")
    assert "torch" in torch_modules_after("import polytrain; polytrain.fit")


def test_the_settings_and_the_parser_import_no_torch():
    code = """
import polytrain
import polytrain.config
from polytrain.cli import build_parser, parse
from polytrain.config.flags import settings_of
from polytrain.config.reference import markdown

parser = build_parser()
parser.format_help()
parser.commands["train"].format_help()
_, args = parse(["train", "--model", "gpt", "--devices", "2", "--strategy", "pipeline"])
assert settings_of(args)["model"] == "gpt"
assert "--model NAME" in markdown(parser)  # docs/cli.md
"""
    assert torch_modules_after(code) == []


def test_the_declared_defaults_pass_every_check():
    # DEFAULTS is built without the optimizer's check (it needs torch.optim); TrainConfig() runs it
    assert TrainConfig() == DEFAULTS


def test_each_registry_holds_the_names_declared_for_it():
    from polytrain.data import DATASETS
    from polytrain.models import MODELS
    from polytrain.strategy_registry import STRATEGIES

    assert (tuple(DATASETS), tuple(MODELS), tuple(STRATEGIES)) == (DATASET_NAMES, MODEL_NAMES, STRATEGY_NAMES)


def test_a_registry_that_differs_from_its_names_fails_at_import():
    check_registry("model", {"lenet": None, "mlp": None}, ("lenet", "mlp"))
    with pytest.raises(
        ImportError, match="holds lenet, mlp, vit but config/registry_names.py names lenet, mlp"
    ):
        check_registry("model", {"lenet": None, "mlp": None, "vit": None}, ("lenet", "mlp"))
    with pytest.raises(ImportError, match="in the same order"):
        check_registry("model", {"mlp": None, "lenet": None}, ("lenet", "mlp"))


def test_the_package_names_are_found_when_first_used():
    assert polytrain.fit.__module__ == "polytrain.api"
    assert polytrain.UserError.__module__ == "polytrain.errors"
    assert {"fit", "evaluate", "predict", "TrainConfig", "ArrayDataset"} <= set(dir(polytrain))
    namespace = {}
    exec("from polytrain import *", namespace)
    assert set(polytrain.__all__) <= set(namespace)
    with pytest.raises(AttributeError, match="no attribute 'fitt'"):
        polytrain.fitt  # noqa: B018
