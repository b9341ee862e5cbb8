"""A LightningModule's loop as Lightning runs it: global_step, current_epoch and batch_idx advance, its hooks are
called in Lightning's order, what it logs reaches the epoch record, `self.trainer` answers in
configure_optimizers, and a module without validation_step trains without validation. Checked against counts
worked out by hand, and against Lightning itself where it is installed."""

import json

import pytest
import token_data
import torch
from token_data import LitRecorder, PaddedTokens, TokenModel, token_accuracy

import polytrain
from polytrain.data.order import global_batch_order
from polytrain.errors import UserError

# 64 training sequences in batches of 16: 4 steps an epoch; 32 validation sequences in 2 batches of 16
SETTINGS = dict(epochs=2, batch_size=16, eval_batch_size=16, verbose=False)


@pytest.fixture(scope="module")
def data():
    return PaddedTokens(64, seed=1), PaddedTokens(32, seed=2)


def loop_events():
    """SEEN without configure_optimizers (which polytrain calls before training to build the recipe, as
    Lightning's set-up does): nothing runs before on_fit_start."""
    events = [event for event in token_data.SEEN if event[0] != "configure_optimizers"]
    assert events[0][0] == "on_fit_start", events[:3]
    return events


def by_hand():
    """The loop of 2 epochs of 4 steps, validated at each epoch's end, as Lightning runs it."""
    events = [("on_fit_start", 0, 0), ("on_train_start", 0, 0)]
    for epoch in range(2):
        done = 4 * epoch + 4
        events += [
            ("on_train_epoch_start", epoch, done - 4),
            *[("train", epoch, done - 4 + i, i) for i in range(4)],
            ("on_validation_start", epoch, done),
            ("on_validation_epoch_start", epoch, done),
            ("val", epoch, done, 0),
            ("val", epoch, done, 1),
            ("on_validation_epoch_end", epoch, done),
            ("on_validation_end", epoch, done),
            ("on_train_epoch_end", epoch, done),
        ]
    return events + [("on_train_end", 2, 8), ("on_fit_end", 2, 8)]


def test_the_loop_hooks_and_logged_values_are_lightnings(data, tmp_path):
    token_data.SEEN.clear()
    model = LitRecorder()
    history = polytrain.fit(model, train=data[0], val=data[1], out=str(tmp_path / "run"), **SETTINGS)
    events = loop_events()
    assert events == by_hand()
    configured = [e for e in token_data.SEEN if e[0] == "configure_optimizers"]
    assert configured and all(e == ("configure_optimizers", 2, 8) for e in configured)
    # the logged means: batches of 16 sequences, so the plain mean of each batch's accuracy
    for record in history.epochs:
        assert 0 < record["train_acc"] < 1 and 0 < record["val_acc"] < 1
    assert history.last["val_acc"] == pytest.approx(validation_accuracy(model, data[1]), rel=1e-6)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["train_acc"] for line in lines] == history["train_acc"]
    assert [line["val_acc"] for line in lines] == history["val_acc"]


def validation_accuracy(model, val, batch_size=16) -> float:
    """The mean over validation batches of each batch's token accuracy (what self.log's epoch mean is)."""
    values = []
    with torch.no_grad():
        for start in range(0, len(val), batch_size):
            items = [val[i] for i in range(start, min(start + batch_size, len(val)))]
            batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
            values.append(token_accuracy(model(batch["input_ids"])["logits"], batch["labels"]).item())
    return sum(values) / len(values)


class TrainOnly(TokenModel):
    """A LightningModule with training_step and configure_optimizers only."""

    def training_step(self, batch, batch_idx):
        total, count = self(**batch)["loss"]
        return total / count

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_a_module_without_validation_step_trains_without_validation(data):
    history = polytrain.fit(TrainOnly(), train=data[0], val=data[1], **SETTINGS)
    assert [sorted(key for key in record if key.startswith("val_")) for record in history.epochs] == [[], []]
    assert history.best == {} and history.validations == []
    # and needs no val= (a module with validation_step still does)
    with_val, without = TrainOnly(), TrainOnly()
    polytrain.fit(with_val, train=data[0], val=data[1], **SETTINGS)
    alone = polytrain.fit(without, train=data[0], **SETTINGS)
    assert alone["train_loss"] == history["train_loss"] and alone.validations == []
    for name, value in with_val.state_dict().items():
        assert torch.equal(without.state_dict()[name], value), name
    with pytest.raises(UserError, match="val= is missing; pass both train= and val= Datasets"):
        polytrain.fit(LitRecorder(), train=data[0], **SETTINGS)
    for options, words in ((dict(patience=2), "patience="), (dict(val_every=2), "val_every=")):
        with pytest.raises(
            UserError, match=f"{words} needs validation, and the LightningModule has no validation_step"
        ):
            polytrain.fit(TrainOnly(), train=data[0], val=data[1], **SETTINGS, **options)


class UncalledHook(TrainOnly):
    def on_after_backward(self):
        pass


class ManualOptimisation(TrainOnly):
    automatic_optimization = False


class SummedLog(TrainOnly):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("tokens", 1.0, reduce_fx="sum")
        return loss


@pytest.mark.parametrize(
    "module, words",
    [
        (UncalledHook, "UncalledHook.on_after_backward: polytrain does not call this LightningModule hook"),
        (SummedLog, "self.log('tokens', ..., reduce_fx='sum'): polytrain records the epoch's mean"),
        (ManualOptimisation, "ManualOptimisation sets automatic_optimization = False (manual optimisation)"),
    ],
)
def test_what_polytrain_would_not_do_as_lightning_is_refused_in_one_line(data, module, words):
    with pytest.raises(UserError) as error:
        polytrain.fit(module(), train=data[0], val=data[1], **SETTINGS)
    assert words in str(error.value) and "\n" not in str(error.value)


class ManualWarmup(TrainOnly):
    """The usual pattern of a learning rate set by hand: a linear warm-up over the first 3 steps, written in
    training_step through self.optimizers(); what self.trainer.optimizers and self.lr_schedulers() give is
    recorded at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.epoch_ends = []

    def training_step(self, batch, batch_idx):
        for group in self.optimizers().param_groups:
            group["lr"] = 0.5 * min(1.0, (self.global_step + 1) / 3)
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self):
        optimizer = self.trainer.optimizers[0]
        self.epoch_ends.append((optimizer.param_groups[0]["lr"], self.lr_schedulers(), self.global_step))


def warmup_by_hand(data, epochs: int = 2, batch_size: int = 16) -> dict:
    """SGD with the learning rate 0.5 * min(1, (step + 1) / 3), on polytrain's global batches of each epoch."""
    model = TokenModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    step = 0
    for epoch in range(epochs):
        order = global_batch_order(len(data), epoch=epoch, seed=0)
        for start in range(0, len(data), batch_size):
            items = [data[int(i)] for i in order[start : start + batch_size]]
            batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
            for group in optimizer.param_groups:
                group["lr"] = 0.5 * min(1.0, (step + 1) / 3)
            optimizer.zero_grad()
            total, count = model(**batch)["loss"]
            (total / count).backward()
            optimizer.step()
            step += 1
    return model.state_dict()


def assert_weights_equal(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(
            got[name], value, atol=1e-6, rtol=0, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_a_learning_rate_set_by_hand_through_self_optimizers_is_kept(data):
    model = ManualWarmup()
    polytrain.fit(model, train=data[0], **SETTINGS)
    assert model.epoch_ends == [(0.5, None, 4), (0.5, None, 8)]
    assert (model.global_step, model.current_epoch) == (8, 2)  # the object trained: as Lightning leaves them
    assert_weights_equal(model.state_dict(), warmup_by_hand(data[0]))


class StepScheduled(token_data.LitTokens):
    """LitTokens (StepLR stepped per step) reading its scheduler back at the end."""

    def on_train_end(self):
        self.last = (self.lr_schedulers().last_epoch, self.trainer.lr_scheduler_configs[0].interval)


def test_self_lr_schedulers_is_the_scheduler_that_steps(data):
    model = StepScheduled()
    polytrain.fit(model, train=data[0], val=data[1], **SETTINGS)
    assert model.last == (8, "step")


@pytest.mark.multiprocess
def test_logged_values_are_reduced_across_two_ranks(data):
    """The same weights on one device and two (a token-exact loss); each rank validates one of the two batches
    of 16, and the epoch's val_acc is their mean, as on one device."""
    from token_data import LitAccuracy

    one = polytrain.fit(LitAccuracy(), train=data[0], val=data[1], **SETTINGS)
    two = polytrain.fit(LitAccuracy(), train=data[0], val=data[1], devices=2, strategy="data", **SETTINGS)
    assert two["val_acc"] == pytest.approx(one["val_acc"], abs=1e-6)
    assert all(0 < value < 1 for value in two["train_acc"])


class EpochOrder(torch.utils.data.Sampler):
    """polytrain's global sample order of each epoch, for Lightning's DataLoader (Lightning calls set_epoch)."""

    def __init__(self, count: int):
        self.count, self.epoch = count, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(global_batch_order(self.count, epoch=self.epoch, seed=0).tolist())

    def __len__(self):
        return self.count


def test_lightning_itself_runs_the_same_loop_and_logs_the_same_means(data):
    pl = pytest.importorskip("lightning.pytorch")

    class LitReal(token_data.Recording, TokenModel, pl.LightningModule):
        pass

    class Figures(pl.Callback):
        """The epoch means Lightning has when the next epoch starts, and at the end."""

        def __init__(self):
            self.epochs = []

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch:
                self.epochs.append({key: float(value) for key, value in trainer.callback_metrics.items()})

        def on_train_end(self, trainer, pl_module):
            self.epochs.append({key: float(value) for key, value in trainer.callback_metrics.items()})

    def collate(items):
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}

    token_data.SEEN.clear()
    figures = Figures()
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[figures],
    )
    train = torch.utils.data.DataLoader(
        data[0], batch_size=16, sampler=EpochOrder(len(data[0])), collate_fn=collate
    )
    val = torch.utils.data.DataLoader(data[1], batch_size=16, collate_fn=collate)
    trainer.fit(LitReal(), train, val)
    lightning_events, lightning_configured = loop_events(), token_data.SEEN[0]

    token_data.SEEN.clear()
    history = polytrain.fit(LitRecorder(), train=data[0], val=data[1], **SETTINGS)
    assert loop_events() == lightning_events == by_hand()
    configured = {event for event in token_data.SEEN if event[0] == "configure_optimizers"}
    assert configured == {lightning_configured} == {("configure_optimizers", 2, 8)}
    for ours, theirs in zip(history.epochs, figures.epochs):
        for key in ("train_acc", "val_acc", "val_loss"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key


def test_lightning_itself_trains_the_manual_warm_up_alike(data):
    """Lightning's own self.optimizers() (through trainer.strategy) on polytrain's stand-in, and the module
    after fit: its global_step and current_epoch, and its weights, as Lightning leaves them."""
    pl = pytest.importorskip("lightning.pytorch")

    class LitWarmup(ManualWarmup, pl.LightningModule):
        pass

    def collate(items):
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}

    theirs = LitWarmup()
    pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(
        theirs,
        torch.utils.data.DataLoader(
            data[0], batch_size=16, sampler=EpochOrder(len(data[0])), collate_fn=collate
        ),
    )
    ours = LitWarmup()
    polytrain.fit(ours, train=data[0], **SETTINGS)
    assert (ours.global_step, ours.current_epoch) == (theirs.global_step, theirs.current_epoch) == (8, 2)
    assert ours.epoch_ends == theirs.epoch_ends
    assert_weights_equal(ours.state_dict(), theirs.state_dict())
    assert_weights_equal(ours.state_dict(), warmup_by_hand(data[0]))


def test_monitor_may_name_what_validation_step_logs(data, tmp_path):
    # LitRecorder logs val_acc in validation_step: known only once validation ran, as in Lightning
    history = polytrain.fit(
        LitRecorder(), train=data[0], val=data[1], monitor="val_acc", out=str(tmp_path / "a"), **SETTINGS
    )
    best = max(range(2), key=lambda epoch: history["val_acc"][epoch])
    assert history.best["metric"] == "val_acc" and history.best["mode"] == "max"
    assert history.best["value"] == history["val_acc"][best] and history.best["epoch"] == best + 1
    with pytest.raises(
        UserError, match=r"monitor='val_f1' is not a figure the validation gave \(it gave val_acc"
    ):
        polytrain.fit(
            LitRecorder(), train=data[0], val=data[1], monitor="val_f1", out=str(tmp_path / "b"), **SETTINGS
        )
