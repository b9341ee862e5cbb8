"""`--epochs 1.5`: a run that ends within its last epoch, with its schedule laid over the steps it takes and a
validation at the end, equal to a hand-written loop of those steps; it resumes to more epochs exactly."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_digits

import polytrain
from polytrain.cli import main
from polytrain.errors import ConfigError
from polytrain.models import build_model

LR, BATCH = 0.05, 32


def normalised(data):
    pixels = data.train_x.double() / 255
    mean, std = pixels.mean().float(), pixels.std().float()
    return (data.train_x.float() / 255 - mean) / std, (data.val_x.float() / 255 - mean) / std


def hand_written(model, data, *, steps, warmup):
    """SGD (momentum 0.9, weight decay 5e-4) for `steps` optimizer steps over the epochs' shuffled orders, the
    learning rate rising linearly over `warmup` steps, then half a cosine reaching 0 at `steps`."""
    train_x, val_x = normalised(data)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4)
    batches = []
    for epoch in range(math.ceil(steps * BATCH / len(train_x))):
        order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(epoch))
        batches += [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
    for step, idx in enumerate(batches[:steps]):
        factor = (
            (step + 1) / warmup
            if step < warmup
            else 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))
        )
        for group in opt.param_groups:
            group["lr"] = LR * factor
        opt.zero_grad()
        F.cross_entropy(model(train_x[idx]), data.train_y[idx]).backward()
        opt.step()
    with torch.no_grad():
        return float(F.cross_entropy(model(val_x), data.val_y))


def test_one_and_a_half_epochs_take_the_first_half_of_the_second_with_the_schedule_over_the_steps_taken():
    data = tiny_digits(n_train=256, n_val=64)  # 8 steps per epoch: 1.5 epochs are 12 steps
    torch.manual_seed(0)
    model = build_model("mlp", data.input_shape, 10)
    reference = copy.deepcopy(model)
    val_loss = hand_written(reference, data, steps=12, warmup=2)
    history = polytrain.fit(
        model,
        data,
        epochs=1.5,
        batch_size=BATCH,
        lr=LR,
        schedule="cosine",
        warmup_epochs=0.25,
        device="cpu",
        verbose=False,
    )
    for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0, msg=name)
    assert [record["epoch"] for record in history.epochs] == [1, 2]
    assert abs(history.epochs[-1]["val_loss"] - val_loss) < 1e-5
    assert history.epochs[-1]["lr"] == 0.0  # the cosine reached its end at the last step taken


COMMON = [
    "--dataset",
    "synthetic",
    "--synthetic-size",
    "96",
    "--model",
    "mlp",
    "--batch-size",
    "16",
    "--device",
    "cpu",
    "--schedule",
    "constant",
    "--warmup-epochs",
    "0.5",
]


def train(capsys, *args):
    code = main(["train", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_fractional_run_resumes_to_more_epochs_like_a_longer_run(tmp_path, capsys):
    short, long = tmp_path / "short", tmp_path / "long"
    code, out, _ = train(capsys, *COMMON, "--epochs", 1.5, "--out", short)
    assert code == 0 and "epoch 2/1.5" in out
    assert len((short / "metrics.jsonl").read_text().splitlines()) == 2
    code, out, _ = train(capsys, "--resume", short)
    assert code == 0 and "already finished its 1.5 epochs" in out
    code, out, _ = train(capsys, "--resume", short, "--epochs", 2)
    assert code == 0 and "in epoch 2 at step 3 of 6" in out.splitlines()[0], out
    assert train(capsys, *COMMON, "--epochs", 2, "--out", long)[0] == 0
    extended = torch.load(short / "model.pt", weights_only=True)
    longer = torch.load(long / "model.pt", weights_only=True)
    for key in longer:
        torch.testing.assert_close(extended[key], longer[key], atol=1e-6, rtol=0)
    lines = [json.loads(line) for line in (short / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (long / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [1, 2]  # the half epoch's record replaced by the whole one's
    for ours, theirs in zip(lines, again):
        assert (
            abs(ours["train_loss"] - theirs["train_loss"]) < 1e-6
            and abs(ours["val_loss"] - theirs["val_loss"]) < 1e-6
        )


def test_epochs_that_are_not_a_positive_number_are_one_line(tmp_path, capsys):
    code, _, err = train(capsys, *COMMON, "--epochs", 0, "--out", tmp_path / "zero")
    assert code == 2 and err.count("\n") == 1 and "--epochs must be a number above 0, got 0" in err, err
    with pytest.raises(SystemExit) as stopped:
        main(["train", *COMMON, "--epochs", "two"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err
    assert "expected a number of epochs such as 3 or 1.5, got 'two'" in err.strip().splitlines()[-1]
    with pytest.raises(ConfigError, match="epochs= must be a number above 0, got -1"):
        polytrain.fit("mlp", "synthetic", epochs=-1, device="cpu", verbose=False)
