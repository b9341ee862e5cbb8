"""Your own callbacks: each hook it has is called as hook(trainer) at the documented moments, and
`trainer.should_stop = True` stops every rank at the same step with a checkpoint that resumes exactly."""

import json

import pytest
import torch
from conftest import tiny_digits

import polytrain
from polytrain.errors import UserError
from polytrain.models import build_model

# 96 samples in batches of 32: 3 steps per epoch; validations after global steps 2, 3 (epoch end), 4, 6 (end)
SETTINGS = dict(
    epochs=2,
    batch_size=32,
    val_every=2,
    schedule="constant",
    optimizer="adam",
    lr=1e-3,
    device="cpu",
    verbose=False,
)


class Recorder:
    """Writes down every hook call with what the trainer says; no on_step_start (missing hooks are skipped)."""

    def __init__(self):
        self.seen = []

    def on_fit_start(self, trainer):
        self.seen.append(("fit_start", trainer.epoch, trainer.step))

    def on_epoch_start(self, trainer):
        self.seen.append(("epoch_start", trainer.epoch, trainer.step))

    def on_step_end(self, trainer):
        self.seen.append(("step_end", trainer.epoch, trainer.step))
        assert trainer.metrics["step_loss"] > 0 and isinstance(trainer.model, torch.nn.Module)

    def on_validation_end(self, trainer):
        self.seen.append(("validation_end", trainer.epoch, trainer.step, trainer.metrics["val_loss"]))

    def on_epoch_end(self, trainer):
        self.seen.append(("epoch_end", trainer.epoch, trainer.step, trainer.metrics["train_loss"]))

    def on_fit_end(self, trainer):
        self.seen.append(("fit_end", trainer.epoch, trainer.step))


class StopAfter:
    """Asks for a stop once `k` steps are done; writes the step training ended at into `path`."""

    def __init__(self, k, path=None):
        self.k, self.path = k, path

    def on_step_end(self, trainer):
        if trainer.step >= self.k:
            trainer.should_stop = True

    def on_fit_end(self, trainer):
        if self.path:
            with open(self.path, "w") as handle:
                json.dump({"step": trainer.step, "should_stop": trainer.should_stop}, handle)


def model():
    torch.manual_seed(0)
    return build_model("mlp", (1, 28, 28), 10)


def weights(run_dir):
    return torch.load(run_dir / "model.pt", weights_only=True)


def test_each_hook_is_called_with_the_epoch_the_step_and_the_latest_metrics():
    recorder = Recorder()
    history = polytrain.fit(model(), tiny_digits(n_train=96), callbacks=[recorder], **SETTINGS)
    mid = {r["global_step"]: r["val_loss"] for r in history.validations}
    ends = history.epochs
    assert recorder.seen == [
        ("fit_start", 0, 0),
        ("epoch_start", 1, 0),
        ("step_end", 1, 1),
        ("step_end", 1, 2),
        ("validation_end", 1, 2, mid[2]),
        ("step_end", 1, 3),
        ("validation_end", 1, 3, ends[0]["val_loss"]),
        ("epoch_end", 1, 3, ends[0]["train_loss"]),
        ("epoch_start", 2, 3),
        ("step_end", 2, 4),
        ("validation_end", 2, 4, mid[4]),
        ("step_end", 2, 5),
        ("step_end", 2, 6),
        ("validation_end", 2, 6, ends[1]["val_loss"]),
        ("epoch_end", 2, 6, ends[1]["train_loss"]),
        ("fit_end", 2, 6),
    ]


def test_should_stop_stops_at_that_step_with_a_checkpoint_that_resumes_exactly(tmp_path, capsys):
    data = tiny_digits(n_train=96)
    polytrain.fit(model(), data, out=str(tmp_path / "straight"), **SETTINGS)
    history = polytrain.fit(
        model(), data, out=str(tmp_path / "stopped"), callbacks=StopAfter(4), **dict(SETTINGS, verbose=True)
    )
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"stopped by a callback (trainer.should_stop) in epoch 2 at step 1 of 3, checkpoint saved; run folder "
        f"{tmp_path / 'stopped'}"
    )
    assert len(history.epochs) == 1 and history.stopped.startswith("stopped by a callback")
    state = torch.load(tmp_path / "stopped" / "checkpoint.pt", weights_only=True)
    assert (state["position"]["epoch"], state["position"]["step"]) == (1, 1)
    resumed = polytrain.fit(model(), data, resume=str(tmp_path / "stopped"), **SETTINGS)
    assert resumed.stopped is None and [r["global_step"] for r in resumed.validations] == [2, 4]
    for key, value in weights(tmp_path / "straight").items():
        torch.testing.assert_close(weights(tmp_path / "stopped")[key], value, atol=1e-6, rtol=0)


@pytest.mark.multiprocess
def test_on_two_devices_both_ranks_stop_at_the_same_step_and_the_run_resumes(tmp_path):
    data = tiny_digits(n_train=320)  # 10 steps per epoch
    told = tmp_path / "told.json"
    settings = dict(SETTINGS, epochs=1)
    polytrain.fit(model(), data, out=str(tmp_path / "straight"), **settings)
    history = polytrain.fit(
        model(),
        data,
        devices=2,
        strategy="data",
        out=str(tmp_path / "stopped"),
        callbacks=[StopAfter(3, told)],
        **settings,
    )
    ended = json.loads(told.read_text())  # the callback ran in the rank-0 worker
    state = torch.load(tmp_path / "stopped" / "checkpoint.pt", weights_only=True)
    assert ended["should_stop"] and 3 <= ended["step"] < 10 and state["position"]["step"] == ended["step"]
    assert history.stopped.startswith("stopped by a callback") and history.epochs == []
    polytrain.fit(model(), data, resume=str(tmp_path / "stopped"), **settings)  # on one device
    for key, value in weights(tmp_path / "straight").items():
        torch.testing.assert_close(weights(tmp_path / "stopped")[key], value, atol=1e-5, rtol=0)


class TwoArguments:
    def on_epoch_end(self, trainer, record):
        pass


@pytest.mark.parametrize(
    "callbacks, words",
    [
        (Recorder, "callbacks= takes objects; got the class Recorder: pass Recorder()"),
        (object(), "callbacks=: object has none of the methods on_fit_start"),
        (
            TwoArguments(),
            "callbacks=: TwoArguments.on_epoch_end takes arguments polytrain cannot give; write it as "
            "on_epoch_end(self, trainer) (polytrain) or on_epoch_end(self, epoch, logs=None) (Keras)",
        ),
    ],
)
def test_callbacks_that_cannot_work_are_refused_in_one_line(callbacks, words):
    with pytest.raises(UserError) as error:
        polytrain.fit("mlp", tiny_digits(n_train=96), callbacks=callbacks, **SETTINGS)
    assert words in str(error.value) and "\n" not in str(error.value)


class KerasStyle:
    """A callback written for Keras: the epoch or batch index from 0 and a dict of logs by Keras' names."""

    def __init__(self):
        self.seen = []

    def on_train_begin(self, logs=None):
        self.seen.append(("train_begin", logs))

    def on_epoch_begin(self, epoch, logs=None):
        self.seen.append(("epoch_begin", epoch))

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(("batch_end", batch, logs["loss"]))

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(
            (
                "epoch_end",
                epoch,
                logs["loss"],
                logs["acc"],
                logs["accuracy"],
                logs["val_loss"],
                logs["val_acc"],
                logs["val_accuracy"],
            )
        )

    def on_train_end(self, logs=None):
        self.seen.append(("train_end", logs["loss"]))


def test_keras_callbacks_get_the_epoch_from_0_and_the_logs_by_keras_names():
    keras = KerasStyle()
    history = polytrain.fit(
        model(), tiny_digits(n_train=96), callbacks=[keras], **dict(SETTINGS, val_every=0)
    )
    ends = [
        (
            "epoch_end",
            i,
            r["train_loss"],
            r["train_acc"],
            r["train_acc"],
            r["val_loss"],
            r["val_acc"],
            r["val_acc"],
        )
        for i, r in enumerate(history.epochs)
    ]
    batches = [event for event in keras.seen if event[0] == "batch_end"]
    assert [event[1] for event in batches] == [0, 1, 2, 0, 1, 2]
    # a batch's logs are the epoch's running means, as Keras gives them: after the last, the epoch's
    assert [batches[2][2], batches[5][2]] == pytest.approx(history["train_loss"], rel=1e-9)
    assert [event for event in keras.seen if event[0] != "batch_end"] == [
        ("train_begin", {}),
        ("epoch_begin", 0),
        ends[0],
        ("epoch_begin", 1),
        ends[1],
        ("train_end", history.last["train_loss"]),
    ]


class KerasStop:
    """Keras' way to stop: self.model.stop_training = True."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.model.stop_training = True


def test_keras_stop_training_stops_after_that_epoch():
    history = polytrain.fit(
        model(), tiny_digits(n_train=96), callbacks=KerasStop(), **dict(SETTINGS, epochs=3)
    )
    assert len(history.epochs) == 1 and history.stopped.startswith("stopped by a callback")


class LightningStyle:
    """A callback written for Lightning: hooks take the trainer and the module."""

    def __init__(self):
        self.seen = []

    def on_train_start(self, trainer, pl_module):
        self.seen.append(("train_start", trainer.current_epoch, trainer.global_step))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(("batch_end", batch_idx, isinstance(outputs["loss"], torch.Tensor), len(batch[0])))

    def on_validation_epoch_end(self, trainer, pl_module):
        self.seen.append(("validation_epoch_end", trainer.global_step))

    def on_train_epoch_end(self, trainer, pl_module):
        self.seen.append(
            (
                "train_epoch_end",
                trainer.current_epoch,
                trainer.global_step,
                float(trainer.callback_metrics["val_loss"]),
                isinstance(pl_module, torch.nn.Module),
            )
        )


def test_lightning_callbacks_get_the_trainer_and_the_module():
    lightning = LightningStyle()
    history = polytrain.fit(
        model(), tiny_digits(n_train=96), callbacks=[lightning], **dict(SETTINGS, val_every=0)
    )
    batches = [("batch_end", i, True, 32) for i in range(3)]
    assert lightning.seen == [
        ("train_start", 0, 0),
        *batches,
        ("validation_epoch_end", 3),
        ("train_epoch_end", 0, 3, history.epochs[0]["val_loss"], True),
        *batches,
        ("validation_epoch_end", 6),
        ("train_epoch_end", 1, 6, history.epochs[1]["val_loss"], True),
    ]


def test_a_callback_subclassing_lightnings_own_class_runs_its_hooks_only():
    pl = pytest.importorskip("lightning.pytorch")

    class Epochs(pl.Callback):
        def __init__(self):
            self.epochs = []

        def on_train_epoch_end(self, trainer, pl_module):
            self.epochs.append(trainer.current_epoch)

    epochs = Epochs()
    polytrain.fit(model(), tiny_digits(n_train=96), callbacks=[epochs], **SETTINGS)
    assert epochs.epochs == [0, 1]


class KerasWrongArguments:
    def on_epoch_end(self, epoch, logs, extra):
        pass


class NotCalled:
    def on_epoch_end(self, trainer):
        pass

    def on_test_end(self, logs=None):
        pass


@pytest.mark.parametrize(
    "callbacks, words",
    [
        (
            KerasWrongArguments(),
            "callbacks=: KerasWrongArguments.on_epoch_end takes arguments polytrain cannot give; "
            "write it as on_epoch_end(self, trainer) (polytrain) or on_epoch_end(self, epoch, "
            "logs=None) (Keras)",
        ),
        (NotCalled(), "callbacks=: NotCalled.on_test_end is a hook polytrain does not call"),
    ],
)
def test_hooks_of_keras_and_lightning_that_cannot_be_called_as_written_are_refused(callbacks, words):
    with pytest.raises(UserError) as error:
        polytrain.fit("mlp", tiny_digits(n_train=96), callbacks=callbacks, **SETTINGS)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_off_a_terminal_a_long_epoch_prints_progress_lines():
    """The GPT's single default epoch was silent for minutes in a log file or a notebook."""
    import io
    from types import SimpleNamespace

    from polytrain.callbacks import ProgressBar

    stream = io.StringIO()
    bar = ProgressBar(stream=stream, every_seconds=0.0)
    trainer = SimpleNamespace(
        position=SimpleNamespace(step=0),
        epoch=1,
        epochs=1,
        steps_per_epoch=4,
        running_totals=lambda: (6.0, 3, (), 3, 1.5),
    )
    bar.on_epoch_start(trainer, 0)
    for step in range(4):
        bar.on_step_end(trainer, step)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "epoch 1/1 step 1/4  train loss 2.0000  2s, about 4s left in the epoch"
    assert len(lines) == 3  # none after the last step: the epoch's summary line follows
    # a run that stops within the epoch (--max-steps, fractional --epochs) counts only the steps it trains
    for stops in (dict(max_steps=2, total_steps=4), dict(max_steps=0, total_steps=2)):
        stream = io.StringIO()
        bar = ProgressBar(stream=stream, every_seconds=0.0)
        bar.on_epoch_start(SimpleNamespace(**vars(trainer), **stops), 0)
        for step in range(2):
            bar.on_step_end(trainer, step)
        assert stream.getvalue().splitlines() == [
            "epoch 1/1 step 1/4  train loss 2.0000  2s, about 2s left until step 2, where the run stops"
        ]
    quiet = io.StringIO()
    bar = ProgressBar(stream=quiet)  # every 10 s by default
    bar.on_epoch_start(trainer, 0)
    bar.on_step_end(trainer, 0)
    assert quiet.getvalue() == ""


def test_curves_place_the_validations_within_epochs_at_their_fraction(tmp_path):
    from polytrain.callbacks import plot_curves

    within = [{"epoch": 1, "step": s, "val_loss": 3.0 - s / 50} for s in (25, 50, 75)]
    records = [{"epoch": 1, "train_loss": 2.9, "val_loss": 2.8}]
    drawn = plot_curves(records, tmp_path / "curves.png", within=within, steps_per_epoch=100)
    assert drawn["loss", "val"] == [(0.25, 2.5), (0.5, 2.0), (0.75, 1.5), (1, 2.8)]
    assert drawn["loss", "train"] == [(1, 2.9)] and (tmp_path / "curves.png").is_file()


def test_a_run_ended_by_max_steps_writes_its_partial_record_and_curves(tmp_path, capfd):
    """It wrote nothing to metrics.jsonl and no curves.png: a short run said nothing of what it did."""
    import json

    from conftest import polytrain_here

    out = tmp_path / "run"
    common = [
        "--dataset",
        "synthetic",
        "--synthetic-size",
        "256",
        "--model",
        "mlp",
        "--batch-size",
        "32",
        "--epochs",
        "1",
        "--device",
        "cpu",
    ]
    result = polytrain_here(capfd, "train", *common, "--max-steps", "3", "--out", out)
    assert result.returncode == 0, result.stderr
    assert "stopped after 3 steps (train loss " in result.stdout
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert (
        len(lines) == 1 and lines[0]["partial"] is True and lines[0]["step"] == 3 and lines[0]["epoch"] == 1
    )
    assert lines[0]["train_loss"] > 0 and "train_acc" in lines[0] and (out / "curves.png").is_file()
    resumed = polytrain_here(capfd, "train", "--resume", out)
    assert resumed.returncode == 0, resumed.stderr
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r.get("step"), r.get("partial")) for r in lines] == [(1, 3, True), (1, None, None)]


def test_fits_history_last_after_a_max_steps_stop_is_the_partial_record_then_the_epochs():
    """history.last was {} after a run that --max-steps ended within its first epoch; it is the partial record
    (the training figures of the steps so far), and once an epoch ends, that epoch's record."""
    from map_datasets import Pairs, Regressor, regression

    x, y = regression(64)
    data = dict(train=Pairs(x[:48], y[:48]), val=Pairs(x[48:], y[48:]), batch_size=8, num_workers=0)
    settings = dict(loss=torch.nn.MSELoss(), lr=0.05, device="cpu", verbose=False, epochs=2)
    history = polytrain.fit(Regressor(), max_steps=3, **data, **settings)
    assert history.last["partial"] is True and history.last["step"] == 3 and history.last["train_loss"] > 0
    assert history.last is history.validations[-1] and not history.epochs
    history = polytrain.fit(Regressor(), max_steps=8, **data, **settings)  # epoch 1 (6 steps), then 2 more
    assert history.last is history.validations[-1] and history.last["epoch"] == 2
    history = polytrain.fit(Regressor(), **data, **settings)
    assert history.last is history.epochs[-1] and history.last["epoch"] == 2 and "val_loss" in history.last
