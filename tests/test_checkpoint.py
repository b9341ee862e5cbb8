"""Checkpoints: atomic, safe to load, refused when they do not fit; exact resume mid-epoch."""

import json
import os

import pytest
import torch
from conftest import tiny_digits

import polytrain
from polytrain.api import train_run
from polytrain.cli import main
from polytrain.config import TrainConfig
from polytrain.models import build_model
from polytrain.runtime.checkpoint import CheckpointError, atomic_torch_save, load_weights, safe_load


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def run(tmp_path, name, data, **settings):
    config = TrainConfig(out=str(tmp_path / name), epochs=3, batch_size=32, model="lenet", **settings)
    history, model, run_dir = train_run(config, data=data, verbose=False)
    return history, weights(model), run_dir


def test_resume_mid_epoch_equals_an_uninterrupted_run(tmp_path):
    data = tiny_digits(n_train=200)  # 7 steps per epoch
    straight_history, straight, _ = run(tmp_path, "straight", data)
    _, _, run_dir = run(tmp_path, "stopped", data, max_steps=10, checkpoint_every=4)
    assert safe_load(run_dir / "checkpoint.pt")["position"]["step"] == 3  # epoch 2, step 3 of 7
    config = TrainConfig.from_dict(json.loads((run_dir / "config.json").read_text()) | {"max_steps": 0})
    history, model, _ = train_run(config, data=data, resume_dir=str(run_dir), verbose=False)
    resumed = weights(model)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], atol=1e-6, rtol=0)
    assert [r["epoch"] for r in history.epochs] == [1, 2, 3]
    assert history["train_loss"] == pytest.approx(straight_history["train_loss"], abs=1e-6)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the record of epoch 2's first 3 steps, where --max-steps paused the run, stays before epoch 2's own
    assert [(r["epoch"], r.get("step")) for r in lines] == [(1, None), (2, 3), (2, None), (3, None)]
    assert lines[1]["partial"] is True


def test_resume_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    common = [
        "--dataset",
        "synthetic",
        "--synthetic-size",
        "96",
        "--model",
        "mlp",
        "--epochs",
        "2",
        "--batch-size",
        "32",
    ]
    assert main(["train", *common, "--out", str(out), "--max-steps", "4"]) == 0
    assert "continue with: polytrain train --resume" in capsys.readouterr().out
    assert main(["train", "--resume", str(out)]) == 0
    assert "done: validation accuracy" in capsys.readouterr().out
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r.get("partial")) for r in lines] == [
        (1, None),
        (2, True),
        (2, None),
    ]  # paused at 4 of 3+3
    assert main(["train", *common, "--out", str(tmp_path / "straight")]) == 0
    for (_key, a), b in zip(
        torch.load(out / "model.pt", weights_only=True).items(),
        torch.load(tmp_path / "straight" / "model.pt", weights_only=True).values(),
    ):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "model.pt"
    atomic_torch_save({"w": torch.ones(3)}, path)

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        atomic_torch_save({"w": torch.zeros(3)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    atomic_torch_save(build_model("mlp", (1, 28, 28), 10).state_dict(), tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="different model"):
        load_weights(tmp_path / "model.pt", build_model("lenet", (1, 28, 28), 10))
    atomic_torch_save(build_model("lenet", (1, 28, 28), 7).state_dict(), tmp_path / "seven.pt")
    with pytest.raises(CheckpointError, match="shape"):
        load_weights(tmp_path / "seven.pt", build_model("lenet", (1, 28, 28), 10))


@pytest.mark.parametrize("tamper", ["truncate", "flip", "garbage", "pickle"])
def test_tampered_files_are_refused_without_running_code(tmp_path, tamper):
    path = tmp_path / "model.pt"
    model = build_model("mlp", (1, 28, 28), 10)
    atomic_torch_save(model.state_dict(), path)
    data = bytearray(path.read_bytes())
    if tamper == "truncate":
        data = data[: len(data) // 2]
    elif tamper == "flip":
        data[len(data) // 3 : len(data) // 3 + 64] = bytes(64)
    elif tamper == "garbage":
        data = bytearray(os.urandom(500))
    else:

        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {tmp_path / 'pwned'}",))

        torch.save({"x": Evil()}, path)
        data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data))
    try:
        load_weights(path, model)
    except CheckpointError as error:
        assert "\n" not in str(error)
    else:  # a flipped run of bytes may land in tensor data only: then the values changed but loading is safe
        assert tamper == "flip"
    assert not (tmp_path / "pwned").exists()


def test_resume_refuses_settings_that_would_change_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--dataset",
                "synthetic",
                "--synthetic-size",
                "64",
                "--model",
                "mlp",
                "--epochs",
                "2",
                "--batch-size",
                "32",
                "--out",
                str(out),
                "--max-steps",
                "1",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--batch-size", "16", "--lr", "0.3"]) == 2
    err = capsys.readouterr().err
    assert (
        "drop --batch-size, --lr" in err
        and "trained with --batch-size 32, --lr 0.05" in err
        and err.count("\n") == 1
    )
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "not a polytrain run folder" in capsys.readouterr().err


def test_a_run_of_a_custom_module_resumes_from_python_not_the_command_line(tmp_path, capsys):
    data = tiny_digits(n_train=96)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    straight = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    straight.load_state_dict(model.state_dict())
    settings = dict(epochs=2, batch_size=32, device="cpu", verbose=False)
    polytrain.fit(model, data, out=str(tmp_path / "run"), max_steps=4, **settings)
    assert main(["train", "--resume", str(tmp_path / "run")]) == 2
    assert "resume it there: polytrain.fit(model, data, resume=" in capsys.readouterr().err
    polytrain.fit(model, data, resume=str(tmp_path / "run"), **settings)
    polytrain.fit(straight, data, **settings)
    for a, b in zip(model.state_dict().values(), straight.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_resuming_on_a_dataset_of_another_size_names_the_sizes(tmp_path):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    settings = dict(epochs=2, batch_size=32, device="cpu", verbose=False)
    polytrain.fit(model, tiny_digits(n_train=96), out=str(tmp_path / "run"), max_steps=2, **settings)
    with pytest.raises(CheckpointError) as refused:
        polytrain.fit(model, tiny_digits(n_train=90), resume=str(tmp_path / "run"), **settings)
    assert str(refused.value).endswith(
        "written for 96 training samples, but this run's training set has 90: the "
        "dataset changed; resume with the data the run had"
    )
