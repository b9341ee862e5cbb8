"""The command line end to end, as a user runs it (a subprocess), on small generated data."""

import json

import pytest
import torch
from datafiles import write_mnist_folder
from processes import polytrain as run_polytrain

from polytrain.cli import main


def polytrain(*args, timeout=180):
    return run_polytrain(*args, timeout=timeout)


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mnist")
    write_mnist_folder(folder, n_train=96, n_val=40, gz=True)
    return folder


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, mnist_dir):
    out = tmp_path_factory.mktemp("runs") / "run"
    result = polytrain(
        "train",
        "--dataset",
        "mnist",
        "--data-dir",
        mnist_dir,
        "--epochs",
        2,
        "--batch-size",
        32,
        "--model",
        "lenet5",
        "--out",
        out,
    )
    assert result.returncode == 0, result.stderr
    return out, result


def test_train_writes_the_run_folder(finished_run):
    out, result = finished_run
    assert {"config.json", "metrics.jsonl", "model.pt", "checkpoint.pt", "curves.png"} <= {
        p.name for p in out.iterdir()
    }
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [1, 2]
    for key in ("train_loss", "train_acc", "val_loss", "val_acc", "epoch_seconds", "samples_per_second"):
        assert all(key in r for r in lines)
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == "lenet5" and config["batch_size"] == 32
    assert config["versions"]["torch"] == torch.__version__
    state = torch.load(out / "model.pt", weights_only=True)
    assert "0.weight" in state
    assert "epoch 2/2" in result.stdout and "val loss" in result.stdout


def test_evaluate_reports_the_last_epochs_validation_accuracy(finished_run):
    out, _ = finished_run
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    result = polytrain("evaluate", out)
    assert result.returncode == 0, result.stderr
    assert f"accuracy {last['val_acc']:.4f}" in result.stdout and "(40 samples)" in result.stdout


def test_predict_draws_a_grid(finished_run):
    out, _ = finished_run
    result = polytrain("predict", out, "--show", 9)
    assert result.returncode == 0, result.stderr
    assert (out / "predictions.png").stat().st_size > 1000
    assert "sample 0: predicted" in result.stdout


def test_help_lists_flags_and_defaults():
    result = polytrain("train", "--help")
    for flag in (
        "--dataset",
        "--data-dir",
        "--model",
        "--epochs",
        "--batch-size",
        "--optimizer",
        "--lr",
        "--momentum",
        "--weight-decay",
        "--seed",
        "--device",
        "--out",
        "--devices",
        "--strategy",
    ):
        assert flag in result.stdout
    assert "default: mnist-sample" in result.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--dataset", "imagenet"], "unknown --dataset 'imagenet'"),
        (["--model", "vgg"], "unknown --model 'vgg'"),
        (["--optimizer", "lion"], "unknown --optimizer 'lion'"),
        (["--batch-size", "0"], "--batch-size must be a positive"),
        (["--epochs", "0"], "--epochs must be a number above 0"),
        (["--lr", "nan"], "--lr must be a finite number"),
        (["--lr", "-0.1"], "--lr must be a finite number"),
        (
            ["--dataset", "mnist", "--data-dir", "/no/such/folder"],
            "--data-dir /no/such/folder does not exist",
        ),
        (["--devices", "2", "--batch-size", "63"], "does not divide evenly"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, words):
    out = tmp_path / "run"
    code = main(["train", *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "mismatch"])
def test_broken_data_files_are_named(tmp_path, capsys, damage):
    folder = tmp_path / "mnist"
    write_mnist_folder(folder, n_train=20, n_val=10)
    images = folder / "train-images-idx3-ubyte"
    if damage == "truncate":
        images.write_bytes(images.read_bytes()[:-100])
    elif damage == "garbage":
        images.write_bytes(b"this is not an idx file at all" * 10)
    else:
        write_mnist_folder(tmp_path / "other", n_train=21, n_val=10)
        images.write_bytes((tmp_path / "other" / "train-images-idx3-ubyte").read_bytes())
    code = main(["train", "--dataset", "mnist", "--data-dir", str(folder), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "train-" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_out_folder_holding_a_run_is_refused(finished_run, capsys):
    out, _ = finished_run
    before = (out / "model.pt").read_bytes()
    assert main(["train", "--out", str(out)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (out / "model.pt").read_bytes() == before


def test_evaluate_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["evaluate", str(tmp_path)]) == 2
    assert "not a polytrain run folder" in capsys.readouterr().err


def test_more_devices_than_gpus_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["train", "--devices", "4", "--batch-size", "64"]) == 2
    assert "--devices 4 is more than the 1 GPU(s) present" in capsys.readouterr().err


def test_cifar10_archive_trains_a_resnet_with_augmentation(tmp_path):
    from datafiles import write_cifar_folder

    write_cifar_folder(tmp_path / "cifar", n_per_file=8, layout="tar")
    out = tmp_path / "run"
    result = polytrain(
        "train",
        "--dataset",
        "cifar10",
        "--data-dir",
        tmp_path / "cifar",
        "--model",
        "resnet",
        "--epochs",
        1,
        "--batch-size",
        16,
        "--out",
        out,
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    record = json.loads((out / "metrics.jsonl").read_text())
    assert config["dataset"] == "cifar10" and record["epoch"] == 1
    state = torch.load(out / "model.pt", weights_only=True)
    assert state["stem.0.weight"].shape == (16, 3, 3, 3)


@pytest.mark.parametrize(
    "argv, starts",
    [
        (["train", "--devices", "2"], True),
        (["verify", "--devices", "4", "--strategy", "sharded"], True),
        (["bench"], True),  # (1 and 2 devices by default)
        (["bench", "--devices", "1"], False),
        (["train", "--devices", "1"], False),
        (["train"], False),  # (the count a config or a resumed run gives is known later)
        (["plan", "--devices", "64", "--batch-size", "64"], False),
        (["evaluate", "runs/x"], False),
    ],
)
def test_the_forkserver_starts_as_the_command_line_parses_where_it_launches_workers(
    monkeypatch, argv, starts
):
    """Where the command line asks for workers on this machine, the forkserver that forks them starts before
    this process imports torch, and imports it beside it (runtime/forkserver.py `start_ahead`), before the
    command runs; under torchrun, which starts the workers, it does not."""
    from polytrain import commands
    from polytrain.cli import run_command
    from polytrain.runtime import forkserver

    started, seen = [], []  # the forkserver's starts; how many the command saw as it ran
    monkeypatch.setattr(forkserver, "start_method", lambda: started.append(argv[0]) or "forkserver")
    monkeypatch.setitem(commands.COMMANDS, argv[0], lambda args: seen.append(len(started)) or 0)
    assert run_command(argv) == 0 and started == [argv[0]] * starts and seen == [int(starts)]
    started.clear()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    assert run_command(argv) == 0 and started == []
