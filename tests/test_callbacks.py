"""Your own callbacks: each hook it has is called as hook(trainer) at the documented moments, and
`trainer.should_stop = True` stops every rank at the same step with a checkpoint that resumes exactly."""
import json

import pytest
import torch

import polytrain
from polytrain.errors import UserError
from polytrain.models import build_model
from conftest import tiny_digits

# 96 samples in batches of 32: 3 steps per epoch; validations after global steps 2, 3 (epoch end), 4, 6 (end)
SETTINGS = dict(epochs=2, batch_size=32, val_every=2, schedule="constant", optimizer="adam", lr=1e-3, device="cpu",
                verbose=False)


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
        ("fit_start", 0, 0), ("epoch_start", 1, 0), ("step_end", 1, 1), ("step_end", 1, 2),
        ("validation_end", 1, 2, mid[2]), ("step_end", 1, 3), ("validation_end", 1, 3, ends[0]["val_loss"]),
        ("epoch_end", 1, 3, ends[0]["train_loss"]), ("epoch_start", 2, 3), ("step_end", 2, 4),
        ("validation_end", 2, 4, mid[4]), ("step_end", 2, 5), ("step_end", 2, 6),
        ("validation_end", 2, 6, ends[1]["val_loss"]), ("epoch_end", 2, 6, ends[1]["train_loss"]),
        ("fit_end", 2, 6)]


def test_should_stop_stops_at_that_step_with_a_checkpoint_that_resumes_exactly(tmp_path, capsys):
    data = tiny_digits(n_train=96)
    polytrain.fit(model(), data, out=str(tmp_path / "straight"), **SETTINGS)
    history = polytrain.fit(model(), data, out=str(tmp_path / "stopped"), callbacks=StopAfter(4),
                            **dict(SETTINGS, verbose=True))
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"stopped by a callback (trainer.should_stop) in epoch 2 at step 1 of 3, checkpoint saved; run folder "
        f"{tmp_path / 'stopped'}")
    assert len(history.epochs) == 1 and history.stopped.startswith("stopped by a callback")
    state = torch.load(tmp_path / "stopped" / "checkpoint.pt", weights_only=True)
    assert (state["position"]["epoch"], state["position"]["step"]) == (1, 1)
    resumed = polytrain.fit(model(), data, resume=str(tmp_path / "stopped"), **SETTINGS)
    assert resumed.stopped is None and [r["global_step"] for r in resumed.validations] == [2, 4]
    for key, value in weights(tmp_path / "straight").items():
        torch.testing.assert_close(weights(tmp_path / "stopped")[key], value, atol=1e-6, rtol=0)


@pytest.mark.multiprocess
def test_on_two_devices_both_ranks_stop_at_the_same_step_and_the_run_resumes(tmp_path):
    data = tiny_digits(n_train=320)                      # 10 steps per epoch
    told = tmp_path / "told.json"
    settings = dict(SETTINGS, epochs=1)
    polytrain.fit(model(), data, out=str(tmp_path / "straight"), **settings)
    history = polytrain.fit(model(), data, devices=2, strategy="data", out=str(tmp_path / "stopped"),
                            callbacks=[StopAfter(3, told)], **settings)
    ended = json.loads(told.read_text())                 # the callback ran in the rank-0 worker
    state = torch.load(tmp_path / "stopped" / "checkpoint.pt", weights_only=True)
    assert ended["should_stop"] and 3 <= ended["step"] < 10 and state["position"]["step"] == ended["step"]
    assert history.stopped.startswith("stopped by a callback") and history.epochs == []
    polytrain.fit(model(), data, resume=str(tmp_path / "stopped"), **settings)       # on one device
    for key, value in weights(tmp_path / "straight").items():
        torch.testing.assert_close(weights(tmp_path / "stopped")[key], value, atol=1e-5, rtol=0)


class TwoArguments:
    def on_epoch_end(self, trainer, record):
        pass


@pytest.mark.parametrize("callbacks, words", [
    (Recorder, "callbacks= takes objects; got the class Recorder: pass Recorder()"),
    (object(), "callbacks=: object has none of the methods on_fit_start"),
    (TwoArguments(), "callbacks=: TwoArguments.on_epoch_end must take one argument, the trainer"),
])
def test_callbacks_that_cannot_work_are_refused_in_one_line(callbacks, words):
    with pytest.raises(UserError) as error:
        polytrain.fit("mlp", tiny_digits(n_train=96), callbacks=callbacks, **SETTINGS)
    assert words in str(error.value) and "\n" not in str(error.value)
