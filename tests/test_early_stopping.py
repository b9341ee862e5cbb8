"""Validation every N steps, the best weights (best.pt) and early stopping, against the records of a run
that was never stopped and the loss of best.pt computed by hand."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from polytrain.api import load_run
from polytrain.callbacks import Monitor, metrics_lines
from polytrain.cli import main
from polytrain.trainer import History

# 8 steps per epoch, 2 epochs; validations after global steps 3, 6, 8 (epoch end), 9, 12, 15, 16 (epoch end)
RUN = [
    "--dataset",
    "synthetic",
    "--synthetic-size",
    "256",
    "--model",
    "mlp",
    "--batch-size",
    "32",
    "--epochs",
    "2",
    "--device",
    "cpu",
    "--lr",
    "0.5",  # fast enough that validation loss turns up within the run (early stopping has something to do)
    "--val-every",
    "3",
]


def train(capsys, *args):
    code = main(["train", *map(str, args)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_times(record):
    return {k: v for k, v in record.items() if k not in ("epoch_seconds", "samples_per_second", "best")}


def hand_val_loss(dataset, model) -> float:
    """Cross-entropy of `model` on the validation split, normalised with the training statistics."""
    mean, std = dataset.channel_stats()
    x = (dataset.val_x.float() / 255 - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    with torch.no_grad():
        return F.cross_entropy(model.eval()(x), dataset.val_y).item()


def test_the_monitor_keeps_the_best_and_counts_the_patience():
    monitor = Monitor("val_loss", patience=2)
    assert (
        monitor.mode == "min" and Monitor("val_acc").mode == "max" and Monitor("val_acc", "min").mode == "min"
    )
    steps = [(0.5, True), (0.6, False), (0.4, True), (float("nan"), False), (0.4, False)]
    for step, (value, better) in enumerate(steps, 1):
        assert monitor.update(value, epoch=1, within=step, step=step) is better
    assert (monitor.best, monitor.step, monitor.bad, monitor.exhausted) == (0.4, 3, 2, True)
    assert monitor.early_stop_line() == (
        "early stop: val_loss has not improved for 2 validations (best 0.4 at epoch 1, step 3)"
    )
    again = Monitor("val_loss", patience=3)
    again.restore(monitor.state())
    assert (again.best, again.bad, again.exhausted) == (0.4, 2, False)


def test_metrics_lines_put_validations_within_epochs_in_order_and_mark_the_best():
    history = History(
        epochs=[{"epoch": 1, "val_loss": 2.0}, {"epoch": 2, "val_loss": 1.0}],
        validations=[
            {"epoch": 2, "step": 1, "val_loss": 1.5},
            {"epoch": 1, "step": 2, "val_loss": 3.0},
            {"epoch": 3, "step": 1, "val_loss": 0.5},
        ],
        best={"epoch": 2, "step": None},
    )
    assert [(r["epoch"], r.get("step"), r.get("best")) for r in metrics_lines(history)] == [
        (1, 2, None),
        (1, None, None),
        (2, 1, None),
        (2, None, True),
        (3, 1, None),
    ]


def test_validation_every_n_steps_changes_nothing_else_and_best_pt_holds_the_best(tmp_path, capsys):
    plain = tmp_path / "plain"
    train(capsys, *RUN[:-2], "--out", plain)
    full = tmp_path / "full"
    out = train(capsys, *RUN, "--out", full)
    for key, value in torch.load(plain / "model.pt", weights_only=True).items():  # the same trajectory
        torch.testing.assert_close(
            torch.load(full / "model.pt", weights_only=True)[key], value, atol=0, rtol=0
        )
    records = lines(full)
    assert [(r["epoch"], r.get("step"), r.get("global_step")) for r in records] == [
        (1, 3, 3),
        (1, 6, 6),
        (1, None, None),
        (2, 1, 9),
        (2, 4, 12),
        (2, 7, 15),
        (2, None, None),
    ]
    assert [without_times(r) for r in records if "step" not in r] == [without_times(r) for r in lines(plain)]
    best = min(records, key=lambda r: r["val_loss"])
    assert [r for r in records if r.get("best")] == [best]
    _, dataset, model = load_run(full, weights="best")
    assert hand_val_loss(dataset, model) == pytest.approx(best["val_loss"], abs=1e-5)
    where = f"epoch {best['epoch']}" + (f", step {best['step']}" if "step" in best else "")
    assert f"best val_loss {best['val_loss']:.4g} at {where} (best.pt)" in out
    assert main(["evaluate", str(full), "--weights", "best"]) == 0
    assert f"validation loss {best['val_loss']:.4f}" in capsys.readouterr().out
    assert main(["predict", str(full), "--weights", "best"]) == 0
    (full / "best.pt").unlink()
    assert main(["evaluate", str(full), "--weights", "best"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no best.pt" in err and "--weights final" in err

    # Early stopping: the run stops at the first validation that is the 2nd in a row without a new best,
    # with the validations of the full run up to there, and a resume without patience finishes like it.
    stopped = tmp_path / "stopped"
    out = train(capsys, *RUN, "--patience", 2, "--out", stopped)
    losses, bad, best_so_far = [r["val_loss"] for r in records], 0, math.inf
    for count, loss in enumerate(losses, 1):  # noqa: B007 (read after the loop)
        bad, best_so_far = (0, loss) if loss < best_so_far else (bad + 1, best_so_far)
        if bad == 2:
            break
    assert count < len(losses), "the data no longer make the run stop early; pick a smaller --patience"
    assert [without_times(r) for r in lines(stopped)] == [without_times(r) for r in records[:count]]
    last = records[count - 1]
    assert out.splitlines()[-1] == (
        f"early stop: val_loss has not improved for 2 validations (best "
        f"{best['val_loss']:.4g} at {where}); run folder {stopped}"
    )
    state = torch.load(stopped / "checkpoint.pt", weights_only=True)
    assert state["monitor"]["bad"] == 2 and state["monitor"]["best"] == best["val_loss"]
    assert state["position"]["epoch"] * 8 + state["position"]["step"] == last.get(
        "global_step", 8 * last["epoch"]
    )
    out = train(capsys, "--resume", stopped)  # the same patience: nothing to do
    assert "it had stopped there: resume with --patience above 2" in out
    train(capsys, "--resume", stopped, "--patience", 0)
    assert [without_times(r) for r in lines(stopped)] == [without_times(r) for r in records]
    for key, value in torch.load(full / "model.pt", weights_only=True).items():
        torch.testing.assert_close(
            torch.load(stopped / "model.pt", weights_only=True)[key], value, atol=1e-6, rtol=0
        )


def test_an_unknown_monitor_names_the_available_ones(tmp_path, capsys):
    assert main(["train", *RUN, "--monitor", "val_f1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (
        "polytrain: error: --monitor 'val_f1' is not a validation figure of this run; choose one of "
        "val_loss, val_acc\n"
    )
    assert not (tmp_path / "run").exists()


def test_val_acc_is_monitored_higher_is_better(tmp_path, capsys, digits):
    import polytrain

    history = polytrain.fit(
        "mlp",
        digits,
        epochs=2,
        batch_size=64,
        val_every=2,
        monitor="val_acc",
        device="cpu",
        verbose=False,
        out=str(tmp_path / "run"),
    )
    everything = history.validations + history.epochs
    assert history.best["value"] == max(r["val_acc"] for r in everything) and history.best["mode"] == "max"
