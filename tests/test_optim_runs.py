"""Optimizers and schedules in whole runs: what config.json records of Python objects, the line that states
polytrain's defaults for a module of the user's, and AdamW with two parameter groups and a per-epoch schedule
stopped on a pipeline and resumed on a parameter server like one device."""

import functools
import json

import pytest
import torch
import torch.nn as nn
from conftest import RESUME_TRAIN, assert_same_weights, load_weights, tiny_digits

import polytrain
from polytrain.cli import main


def module():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.LayerNorm(16), nn.Linear(16, 10))


def test_python_objects_are_recorded_by_name_and_defaults_are_stated_once(tmp_path, capsys):
    data = tiny_digits(n_train=64, n_val=16)
    settings = dict(epochs=2, batch_size=32, device="cpu")
    polytrain.fit(module(), data, **settings)
    out = capsys.readouterr().out
    assert (
        out.count(
            "optimizer: SGD (lr 0.05, weight decay 0.0005, momentum 0.9; torch's defaults otherwise); "
            "schedule: onecycle after 0.5 epochs of linear warm-up, stepped every optimizer step"
        )
        == 1
    )
    history = polytrain.fit(
        module(),
        data,
        lr=0.1,
        optimizer=torch.optim.AdamW,
        scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
        out=str(tmp_path / "run"),
        **settings,
    )
    assert (
        capsys.readouterr().out.count(
            "optimizer: AdamW (lr 0.1; torch's defaults otherwise); schedule: "
            "StepLR(step_size=1, gamma=0.5), stepped every epoch"
        )
        == 1
    )
    assert [record["lr"] for record in history.epochs] == pytest.approx([0.1, 0.05])  # stepped per epoch
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["optimizer"] == "AdamW (from Python)"
    assert recorded["schedule"] == "StepLR(step_size=1, gamma=0.5) (from Python)"


def constant_sgd_by_hand(data, *, lr: float, epochs: int, batch_size: int) -> dict:
    """torch.optim.SGD at a constant `lr` over polytrain's global batches of normalised images."""
    from polytrain.data.order import global_batch_order

    model = module()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    mean, std = data.channel_stats()
    images = (data.train_x.float() / 255 - mean.reshape(1, -1, 1, 1)) / std.reshape(1, -1, 1, 1)
    for epoch in range(epochs):
        order = global_batch_order(len(images), epoch=epoch, seed=0)
        for start in range(0, len(images), batch_size):
            index = order[start : start + batch_size]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(images[index]), data.train_y[index]).backward()
            optimizer.step()
    return model.state_dict()


def test_an_optimizer_of_the_users_without_a_schedule_keeps_its_learning_rate(capsys):
    data = tiny_digits(n_train=64, n_val=16)
    model = module()
    history = polytrain.fit(
        model, data, optimizer=torch.optim.SGD, lr=0.5, epochs=2, batch_size=32, device="cpu"
    )
    assert (
        "optimizer: SGD (lr 0.5; torch's defaults otherwise); schedule: none (a constant learning rate)"
        in capsys.readouterr().out
    )
    assert history["lr"] == [0.5, 0.5]
    assert_same_weights(model.state_dict(), constant_sgd_by_hand(data, lr=0.5, epochs=2, batch_size=32))


# Without a warm-up, Adam's first updates are about lr * sign(gradient), so rounding flips the sign of tiny
# gradients between layouts (3e-3 apart after 6 steps); --eps 1e-4 makes those updates proportional (1e-7).
# Leaving the decay on the one-dimension tensors would move them by 2e-5 to 1e-3.
GROUPED = [
    *RESUME_TRAIN[: RESUME_TRAIN.index("--schedule")],
    "--optimizer",
    "AdamW",
    "--lr",
    "0.001",
    "--eps",
    "1e-4",
    "--weight-decay",
    "0.05",
    "--no-decay-norms-and-biases",
    "--schedule",
    "steplr",
    "--schedule-args",
    "step_size=1,gamma=0.5",
    *RESUME_TRAIN[RESUME_TRAIN.index("--seed") :],
]


@pytest.mark.multiprocess
def test_adamw_with_two_groups_stopped_on_a_pipeline_resumes_on_a_parameter_server_like_one_device(
    tmp_path, capfd
):
    assert main(["train", *GROUPED, "--out", str(tmp_path / "straight")]) == 0
    assert (
        main(
            [
                "train",
                *GROUPED,
                "--strategy",
                "pipeline",
                "--devices",
                "2",
                "--max-steps",
                "3",
                "--out",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    assert main(["train", "--resume", str(tmp_path / "run"), "--strategy", "parameter-server"]) == 0
    assert "server 0 (rank 0): 8 tensors" in capfd.readouterr().out  # rank 1 steps placeholders only
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["optimizer"]
    assert [group["weight_decay"] for group in saved["param_groups"]] == [0.05, 0.0]
    assert [group["params"] for group in saved["param_groups"]] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [group["lr"] for group in saved["param_groups"]] == pytest.approx([0.00025, 0.00025])  # 2 epochs
    assert_same_weights(
        load_weights(tmp_path / "run" / "model.pt"), load_weights(tmp_path / "straight" / "model.pt")
    )


def test_runs_that_end_before_their_schedule_acts_and_fp16_on_a_cpu_say_so_in_one_line(capsys):
    data = tiny_digits(n_train=64, n_val=16)
    step_lr = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    polytrain.fit(
        module(),
        data,
        epochs=0.5,
        batch_size=16,
        optimizer=torch.optim.SGD,
        lr=0.1,
        scheduler=step_lr,
        device="cpu",
    )
    out = capsys.readouterr().out
    assert (
        out.count(
            "note: the schedule StepLR(step_size=1, gamma=0.5) steps once per epoch, and this run ends "
            "after 2 of an epoch's 4 steps, so it never steps"
        )
        == 1
    )
    polytrain.fit(module(), data, epochs=1, batch_size=16, warmup_epochs=2, device="cpu", precision="fp16")
    out = capsys.readouterr().out
    assert out.count("note: the warm-up (2 epochs, 8 steps) is as long as the run (4 steps)") == 1
    assert out.count("note: --precision fp16 on a CPU computes in emulated half precision") == 1
    polytrain.fit(
        module(),
        data,
        epochs=2,
        batch_size=16,
        optimizer=torch.optim.SGD,
        lr=0.1,
        scheduler=step_lr,
        device="cpu",
    )
    assert "note:" not in capsys.readouterr().out
