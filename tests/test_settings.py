"""One declaration per setting (config/settings.py): what is derived from it, "did you mean" only when near,
and settings from a TOML or JSON file with --config."""

import json
from dataclasses import fields

import pytest
import torch
from conftest import polytrain_here

import polytrain
from polytrain.cli import main, parse
from polytrain.config import RESUMABLE, SETTINGS, STRATEGY_OPTIONS, TrainConfig
from polytrain.config.declare import GROUPS, flag_name
from polytrain.config.flags import config_from_args
from polytrain.config.names import edit_distance, nearest
from polytrain.errors import ConfigError, UserError


def config_of(argv):
    _, args = parse(["train", *map(str, argv)])
    return config_from_args(args)


def one_line_error(capsys, argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# --- what the declarations give ---


def test_train_config_is_exactly_the_declared_settings_in_group_order():
    assert [f.name for f in fields(TrainConfig)] == list(SETTINGS)
    order = [SETTINGS[name].group for name in SETTINGS]
    assert order == sorted(order, key=list(GROUPS).index)  # each group's settings together, in order


def test_help_shows_every_flag_under_its_group(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for name, meta in SETTINGS.items():
        if meta.flag == "none":
            continue
        title = text.index(f"\n{GROUPS[meta.group]}:\n")
        following = text.find(":\n\n", title + 1)
        section = text[title : following if following > 0 else len(text)]
        assert f"  {flag_name(name)}" in section, (name, meta.group)
    assert "--num-workers" not in text  # declared Python-only: a keyword of fit(), no flag


def test_every_setting_is_a_keyword_of_fit():
    from polytrain.api import check_keywords

    check_keywords({name: None for name in SETTINGS if name not in ("dataset", "model")})


def test_the_resume_rules_come_from_the_declarations():
    assert set(RESUMABLE) == {
        "devices",
        "device",
        "strategy",
        "plan",
        "max_restarts",
        "max_steps",
        "eval_batch_size",
        "checkpoint_every",
        "hang_timeout",
        "val_every",
        "patience",
        "accumulate",
        "activation_checkpointing",
        "cuda_graphs",
        "async_checkpoint",
        *[n for names in STRATEGY_OPTIONS.values() for n in names],
    }
    assert STRATEGY_OPTIONS == {
        "pipeline": (
            "context_parallel",
            "expert_parallel",
            "microbatches",
            "pipeline_schedule",
            "split",
            "split_at",
            "pipeline_stages",
            "data_parallel",
            "timeline",
            "replicas",
            "tensor_parallel",
        ),
        "sharded": ("context_parallel", "expert_parallel", "cpu_offload", "replicas"),
        "data": ("context_parallel", "expert_parallel"),
        "parameter-server": ("servers", "server_device", "staleness"),
        "tensor": ("context_parallel", "expert_parallel", "replicas", "tensor_plan", "tensor_parallel"),
    }


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(epochs=0), "--epochs must be a number above 0, got 0; try --epochs 5"),
        (dict(optimizer="adamx"), "unknown --optimizer 'adamx' (did you mean adam?); choose one of "),
        (
            dict(val_fraction=1.5),
            "--val-fraction must lie strictly between 0 and 1, got 1.5; try --val-fraction 0.1",
        ),
        (
            dict(image_size=0),
            "--image-size must be a positive whole number of pixels, got 0; try --image-size 32",
        ),
        (
            dict(num_workers=-1),
            "--num-workers must be a whole number >= 0, got -1 (0: load in the training process)",
        ),
        (
            dict(cpu_offload=True),
            "--cpu-offload applies to --strategy sharded only; add --strategy sharded or drop it",
        ),
        (dict(staleness=2, strategy="data"), "--staleness applies to --strategy parameter-server only"),
        (dict(staleness=-1, strategy="parameter-server"), "--staleness must be a whole number >= 0, got -1"),
    ],
)
def test_declared_checks_name_the_flag_and_the_fix(values, message):
    with pytest.raises(ConfigError) as error:
        TrainConfig(**values)
    assert str(error.value).startswith(message)


def test_the_validation_batch_changes_no_result_but_its_rounding(digits, monkeypatch):
    from polytrain.runtime import worker

    batches = []

    def counted(*args, **kwargs):
        train, val = make_loaders(*args, **kwargs)
        batches.append(len(list(val.eval_batches())))
        return train, val

    make_loaders = worker.make_loaders
    monkeypatch.setattr(worker, "make_loaders", counted)
    runs = [
        polytrain.fit("mlp", digits, epochs=1, batch_size=32, verbose=False, **extra).last
        for extra in ({}, {"eval_batch_size": 7})
    ]
    assert batches == [1, 15]  # 100 validation samples: one batch of 1024, or 15 of 7
    assert runs[0]["val_loss"] == pytest.approx(runs[1]["val_loss"], rel=1e-5)
    assert runs[0]["val_acc"] == runs[1]["val_acc"]
    assert config_of(["--eval-batch-size", 7]).eval_batch_size == 7


# --- "did you mean" only when near ---


def test_edit_distance_counts_a_swap_as_one():
    assert edit_distance("epoch", "epochs") == 1 and edit_distance("bacth", "batch") == 1
    assert edit_distance("", "abc") == 3 and edit_distance("kitten", "sitting") == 3


@pytest.mark.parametrize(
    "typed, suggested",
    [
        ("epoch", "epochs"),
        ("batchsize", "batch_size"),
        ("loss_fn", "loss"),
        ("weight_decy", "weight_decay"),
        ("lr_schedule", "schedule"),
        ("max_epochs", "epochs"),
        ("microbatch", "microbatches"),
        ("clip_grad", "clip_grad_norm"),
        ("min_delta", None),
        ("gradient_checkpointing", None),
        ("accumulate_grad_batches", None),
        ("gradient_clip_val", None),
        ("zzz", None),
    ],
)
def test_a_name_is_suggested_only_when_near(typed, suggested):
    known = [*SETTINGS, "loss", "metrics", "val", "train", "resume"]
    assert nearest(typed, known) == suggested


@pytest.mark.parametrize("keyword", ["min_delta", "gradient_checkpointing", "accumulate_grad_batches"])
def test_fit_says_a_far_keyword_does_not_exist(keyword):
    with pytest.raises(ConfigError) as error:
        polytrain.fit("lenet", **{keyword: 1})
    assert "did you mean" not in str(error.value) and str(error.value).startswith(
        f"fit() has no keyword {keyword}="
    )


def test_a_far_flag_is_said_not_to_exist(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--gradient-checkpointing", "1"])
    err = capsys.readouterr().err
    assert (
        "unrecognized argument --gradient-checkpointing: polytrain has no such setting; see polytrain train "
        "--help"
    ) in err
    assert "did you mean" not in err


# --- --config FILE ---


def test_a_toml_file_with_group_tables_sets_and_flags_override_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'model = "mlp"\n[optimisation]\nlr = 0.01\nbatch-size = 32\nepochs = 2\n'
        '[devices]\ndevices = 2\nstrategy = "parameter-server"\n[parameter-server]\nstaleness = 1\n'
    )
    config = config_of(["--config", path, "--lr", "0.2"])
    assert (config.model, config.lr, config.batch_size, config.epochs) == ("mlp", 0.2, 32, 2)
    assert (config.devices, config.strategy, config.staleness) == (2, "parameter-server", 1)
    assert config.momentum == TrainConfig().momentum  # neither given: the default


def test_a_json_file_sets_and_per_device_batch_size_beside_it_overrides_its_batch(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(
        json.dumps({"batch_size": 64, "devices": 2, "synthetic_shape": [1, 8, 8], "dataset": "synthetic"})
    )
    config = config_of(["--config", path, "--per-device-batch-size", 16])
    assert (config.batch_size, config.synthetic_shape) == (32, (1, 8, 8))


@pytest.mark.parametrize(
    "text, message",
    [
        ("bacth_size = 32\n", "unknown setting 'bacth_size'; did you mean 'batch_size'?"),
        (
            "[optimisation]\ngradient_checkpointing = 1\n",
            "unknown setting 'gradient_checkpointing'; no setting is near it; see polytrain train --help",
        ),
        ("lr = \n", "is not valid TOML"),
        ("[runs]\nlr = 0.1\n", "[runs] is not a group of settings; the groups are data, model,"),
    ],
)
def test_a_wrong_file_is_one_line_naming_the_key_and_the_file(capsys, tmp_path, text, message):
    path = tmp_path / "settings.toml"
    path.write_text(text)
    err = one_line_error(capsys, ["train", "--config", path])
    assert f"--config {path}" in err and message in err


def test_a_missing_or_unknown_kind_of_file_is_one_line(capsys, tmp_path):
    assert "no such file" in one_line_error(capsys, ["train", "--config", tmp_path / "none.toml"])
    (tmp_path / "settings.yaml").write_text("lr: 0.1\n")
    assert "give a .toml or .json file" in one_line_error(
        capsys, ["train", "--config", tmp_path / "settings.yaml"]
    )


def test_resume_reads_no_config_file(capsys, tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text("devices = 2\n")
    assert "reads no --config file" in one_line_error(
        capsys, ["train", "--resume", tmp_path, "--config", path]
    )


def test_a_file_value_is_checked_like_a_flag(capsys, tmp_path):
    path = tmp_path / "settings.json"
    path.write_text('{"epochs": 0}')
    assert "--epochs must be a number above 0, got 0" in one_line_error(capsys, ["train", "--config", path])


def test_a_run_of_a_custom_model_cannot_be_repeated_from_the_command_line(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TrainConfig().to_dict(), custom_model=True, versions={})))
    assert "repeat it from Python" in one_line_error(capsys, ["train", "--config", path])


def repeat_and_compare(tmp_path, *flags):
    first, second = tmp_path / "first", tmp_path / "second"
    common = [
        "--dataset",
        "synthetic",
        "--synthetic-size",
        192,
        "--synthetic-shape",
        "1,12,12",
        "--model",
        "mlp",
        "--epochs",
        2,
        "--batch-size",
        32,
        "--seed",
        3,
        "--schedule",
        "cosine",
        *flags,
    ]
    result = polytrain_here(None, "train", *common, "--out", first)
    assert result.returncode == 0, result.stderr
    result = polytrain_here(None, "train", "--config", first / "config.json", "--out", second)
    assert result.returncode == 0, result.stderr
    recorded = [json.loads((folder / "config.json").read_text()) for folder in (first, second)]
    for record in recorded:
        record.pop("out")
    assert recorded[0] == recorded[1]
    weights = [torch.load(folder / "model.pt", weights_only=True) for folder in (first, second)]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


def test_a_run_config_json_repeats_the_run_with_the_same_weights(tmp_path):
    repeat_and_compare(tmp_path)


@pytest.mark.multiprocess
def test_a_two_process_run_repeats_from_its_config_json(tmp_path):
    repeat_and_compare(tmp_path, "--devices", 2, "--strategy", "data")


GPT = [
    "--model",
    "gpt",
    "--dataset",
    "shakespeare",
    "--layers",
    1,
    "--width",
    16,
    "--heads",
    2,
    "--context",
    8,
    "--max-steps",
    2,
    "--device",
    "cpu",
]


@pytest.mark.parametrize(
    "data", [[], ["--dataset", "text", "--data-dir", "corpus.txt"]], ids=["shakespeare", "text"]
)
def test_a_language_model_run_repeats_from_its_config_json(tmp_path, monkeypatch, data):
    """Its config.json records the vocabulary (and the model's own optimizer beside the default momentum): both
    are read past, and the repetition trains the same weights."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("to be or not to be, that is the question\n" * 40)
    first, second = tmp_path / "first", tmp_path / "second"
    assert polytrain_here(None, "train", *GPT, *data, "--out", first).returncode == 0
    assert "vocab" in json.loads((first / "config.json").read_text())
    result = polytrain_here(None, "train", "--config", first / "config.json", "--out", second)
    assert result.returncode == 0, result.stderr
    recorded = [json.loads((folder / "config.json").read_text()) for folder in (first, second)]
    for record in recorded:
        del record["out"], record["momentum"]  # the default beside AdamW: recorded, never read
    assert recorded[0] == recorded[1]
    weights = [torch.load(folder / "model.pt", weights_only=True) for folder in (first, second)]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


@pytest.mark.parametrize(
    "text, message",
    [
        ('epochs = "three"\n', "epochs: expected a number of epochs such as 3 or 1.5, got 'three'"),
        (
            '[optimisation]\nbetas = "0.9;0.99"\n',
            "betas: expected numbers separated by commas such as 0.9,0.95, got '0.9;0.99'",
        ),
        ("betas = 0.9\n", "betas takes a list such as [B1, B2], got 0.9"),
        ('compile = "no"\n', 'compile takes true or false, got "no"'),
        ('seed = "x"\n', 'seed takes a whole number, got "x"'),
        ("epochs = true\n", "epochs takes a number, got true"),
    ],
)
def test_a_file_value_of_the_wrong_form_is_one_line_naming_the_setting_and_the_form(
    capsys, tmp_path, text, message
):
    path = tmp_path / "settings.toml"
    path.write_text(text)
    assert f"polytrain: error: --config {path}: {message}\n" == one_line_error(
        capsys, ["train", "--config", path]
    )


def test_file_values_read_as_flags_read_them(tmp_path):
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"seed": "7", "lr": "0.2", "logger": ["csv"], "compile": False}))
    config = config_of(["--config", path])
    assert (config.seed, config.lr, config.logger, config.compile) == (7, 0.2, "csv", False)


@pytest.mark.parametrize(
    "name, text",
    [
        (
            "run.json",
            json.dumps(
                {
                    "versions": {},
                    "strategy": "tensor",
                    "devices": 2,
                    "tensor_plan": {"1": "colwise", "3": "rowwise"},
                }
            ),
        ),
        ("run.toml", 'strategy = "tensor"\ndevices = 2\ntensor_plan = { 1 = "colwise", 3 = "rowwise" }\n'),
        (
            "run.toml",
            'strategy = "tensor"\ndevices = 2\n[tensor]\ntensor_plan = { 1 = "colwise", 3 = "rowwise" }\n',
        ),
    ],
    ids=["config.json", "toml", "toml-group"],
)
def test_a_tensor_plan_table_in_a_file_is_the_settings_value(tmp_path, name, text):
    """tensor_plan takes a table (a run's config.json records the plan a run was given): it is the setting's
    value, not a group of settings."""
    path = tmp_path / name
    path.write_text(text)
    assert config_of(["--config", path]).tensor_plan == {"1": "colwise", "3": "rowwise"}


@pytest.mark.multiprocess
def test_a_tensor_run_with_its_own_plan_repeats_from_its_config_json(tmp_path):
    from polytrain.runtime.checkpoint import read_weights

    first, second = tmp_path / "first", tmp_path / "second"
    polytrain.fit(
        "mlp", "synthetic", synthetic_size=128, synthetic_shape=(1, 8, 8), devices=2, strategy="tensor",
        tensor_plan={"1": "colwise", "3": "rowwise"}, batch_size=32, max_steps=2, out=str(first), verbose=False,
    )  # fmt: skip
    assert json.loads((first / "config.json").read_text())["tensor_plan"] == {"1": "colwise", "3": "rowwise"}
    result = polytrain_here(None, "train", "--config", first / "config.json", "--out", second)
    assert result.returncode == 0, result.stderr
    weights = [read_weights(folder / "model.pt") for folder in (first, second)]
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key


def test_fit_refuses_per_device_and_global_batch_together():
    with pytest.raises(UserError, match="give either batch_size="):
        polytrain.fit("lenet", batch_size=64, per_device_batch_size=32)


def test_a_replayed_registry_run_keeps_its_data_flags_unset_and_may_move_to_more_devices(tmp_path):
    first = tmp_path / "first"
    assert main(["train", "--max-steps", "2", "--epochs", "1", "--out", str(first)]) == 0
    config = config_of(["--config", first / "config.json"])  # mnist-sample: its recorded [1, 28, 28]
    assert (config.dataset, config.max_steps, config.strategy) == ("mnist-sample", 2, "auto")
    assert config_of(["--config", first / "config.json", "--devices", 2]).devices == 2


@pytest.mark.parametrize(
    "text, flags, expected",
    [
        ("per_device_batch_size = 16\n", ["--batch-size", 48], 48),  # a flag replaces the file's other way
        ("batch_size = 64\n", ["--per-device-batch-size", 8, "--devices", 2], 16),
        ('[data]\nsynthetic_shape = "1,8,8"\ndataset = "synthetic"\n', [], 64),
    ],
)
def test_the_batch_from_a_flag_replaces_the_files_and_file_strings_parse_like_flags(
    tmp_path, text, flags, expected
):
    path = tmp_path / "settings.toml"
    path.write_text(text)
    config = config_of(["--config", path, *flags])
    assert config.batch_size == expected
    if "synthetic_shape" in text:
        assert config.synthetic_shape == (1, 8, 8)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "batch_size = 64\nper_device_batch_size = 8\n",
            "gives both batch_size and per_device_batch_size; keep one",
        ),
        ("[data]\ndevices = 2\n", "devices belongs in [devices], not [data]"),
    ],
)
def test_a_file_that_contradicts_itself_is_one_line(capsys, tmp_path, text, message):
    path = tmp_path / "settings.toml"
    path.write_text(text)
    assert message in one_line_error(capsys, ["train", "--config", path])


@pytest.mark.parametrize(
    "argv, words",
    [
        (["train", "--Epochs", "2"], "did you mean --epochs?"),
        (["train", "--batch_size", "2"], "did you mean --batch-size?"),
        (["train", "--optim", "sgd"], "did you mean --optimizer?"),
        (["train", "-v"], "unrecognized argument -v: polytrain has no such setting"),
        (["train", "stray"], "unexpected argument 'stray'; see polytrain train --help"),
    ],
)
def test_flag_suggestions_ignore_case_and_strays_get_none(capsys, argv, words):
    with pytest.raises(SystemExit):
        main(argv)
    assert words in capsys.readouterr().err
