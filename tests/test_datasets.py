"""Your own Datasets, losses and metrics: the same global sample order, exact sums, one-line mistakes."""

import copy

import pytest
import torch
import torch.nn.functional as F
from map_datasets import (
    BadAt,
    Indices,
    Pairs,
    RaisesAt,
    Recorder,
    Regressor,
    batch_rmse,
    mean_absolute_error,
    regression,
)

import polytrain
from polytrain.data.loader import global_batch_order, rank_slice
from polytrain.data.stream import DatasetPair, make_stream_loaders, spec_of
from polytrain.errors import UserError

REGRESSION = dict(
    loss=torch.nn.MSELoss(),
    schedule="constant",
    warmup_epochs=0,
    weight_decay=0.0,
    lr=0.05,
    momentum=0.9,
    device="cpu",
    verbose=False,
)


def loaders(size, *, batch_size, rank=0, world_size=1, workers=0):
    data = DatasetPair(
        Indices(size), Indices(size), spec_of(Indices(size), num_classes=3), num_workers=workers
    )
    return make_stream_loaders(
        data,
        batch_size=batch_size,
        device="cpu",
        rank=rank,
        world_size=world_size,
        seed=3,
        eval_batch_size=batch_size,
    )


@pytest.mark.parametrize("workers", [0, 1])
def test_each_rank_reads_its_slice_of_the_global_batch_order(workers):
    size, batch = 23, 8  # last global batch: 7 samples
    for world in (1, 2, 3):
        for rank in range(world):
            train, _ = loaders(size, batch_size=batch, rank=rank, world_size=world, workers=workers)
            for epoch in (0, 1):
                order = global_batch_order(size, epoch=epoch, seed=3)
                got = [
                    (b.step, b.global_count, b.x.flatten().long().tolist(), b.y.tolist())
                    for b in train.train_batches(epoch, start_step=1)
                ]
                want = []
                for step in range(1, 3):
                    index = rank_slice(order[step * batch : (step + 1) * batch], rank=rank, world_size=world)
                    want.append((step, min(batch, size - step * batch), index.tolist(), (index % 3).tolist()))
                assert got == want


def test_evaluation_reads_each_sample_once_across_ranks():
    seen = []
    for rank in range(3):
        _, val = loaders(10, batch_size=2, rank=rank, world_size=3)
        seen += [i for b in val.eval_batches() for i in b.x.flatten().long().tolist()]
    assert seen == list(range(10))


def test_a_rank_with_no_samples_in_the_last_batch_gets_an_empty_batch():
    train, _ = loaders(9, batch_size=4, rank=1, world_size=2)  # last global batch: 1 sample
    last = list(train.train_batches(0))[-1]
    assert last.global_count == 1 and last.x.shape == (0, 1) and last.y.shape == (0,)


def hand_written_loop(model, x, y, *, batch_size, epochs, lr, momentum, seed=0):
    """The reference: plain PyTorch, mean-squared error over each global batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for epoch in range(epochs):
        order = global_batch_order(len(x), epoch=epoch, seed=seed)
        for start in range(0, len(x), batch_size):
            index = order[start : start + batch_size]
            loss = F.mse_loss(model(x[index]), y[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model


def test_a_regression_on_datasets_equals_a_hand_written_loop():
    x, y = regression(90)
    torch.manual_seed(0)
    model = Regressor()
    reference = hand_written_loop(
        copy.deepcopy(model), x[:70], y[:70], batch_size=16, epochs=2, lr=0.05, momentum=0.9
    )
    history = polytrain.fit(
        model,
        train=Pairs(x[:70], y[:70]),
        val=Pairs(x[70:], y[70:]),
        epochs=2,
        batch_size=16,
        num_workers=0,
        metrics={"mae": mean_absolute_error},
        **REGRESSION,
    )
    for got, want in zip(model.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert "train_acc" not in history.last and "val_acc" not in history.last  # accuracy means nothing here
    with torch.no_grad():
        val_loss = F.mse_loss(model(x[70:]), y[70:]).item()
        val_mae = (model(x[70:]) - y[70:]).abs().mean().item()
    assert history.last["val_loss"] == pytest.approx(val_loss, rel=1e-5)
    assert history.last["val_mae"] == pytest.approx(val_mae, rel=1e-5)


def test_metrics_returning_a_batch_mean_are_weighted_by_the_batch_size():
    x, y = regression(40)
    model = Regressor()
    history = polytrain.fit(
        model,
        train=Pairs(x[:30], y[:30]),
        val=Pairs(x[30:], y[30:]),
        epochs=1,
        batch_size=8,
        num_workers=0,
        metrics={"mse": batch_rmse},
        **REGRESSION,
    )
    assert history.last["val_mse"] == pytest.approx(history.last["val_loss"], rel=1e-6)


def test_classification_on_a_dataset_with_classes_reports_accuracy(tmp_path):
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(60, 1, 28, 28, generator=generator), torch.randint(0, 4, (60,), generator=generator)
    names = ["ant", "bee", "cat", "dog"]
    history = polytrain.fit(
        "mlp",
        train=Pairs(x[:40], y[:40], names),
        val=Pairs(x[40:], y[40:], names),
        epochs=1,
        batch_size=16,
        num_workers=1,
        device="cpu",
        verbose=False,
        out=str(tmp_path / "r"),
    )
    assert 0 <= history.last["val_acc"] <= 1
    import json

    settings = json.loads((tmp_path / "r" / "config.json").read_text())
    assert settings["classes"] == names and settings["custom_data"] is True


@pytest.mark.multiprocess
def test_two_processes_on_datasets_equal_one_device():
    x, y = regression(86)  # 70 training samples, batch 16: a short last batch of 6
    torch.manual_seed(0)
    model = Regressor()
    common = dict(
        train=Pairs(x[:70], y[:70]),
        val=Pairs(x[70:], y[70:]),
        epochs=2,
        batch_size=16,
        num_workers=1,
        metrics={"mae": mean_absolute_error},
        **REGRESSION,
    )
    one, two = copy.deepcopy(model), copy.deepcopy(model)
    history_one = polytrain.fit(one, **common)
    history_two = polytrain.fit(two, devices=2, **common)
    for got, want in zip(two.state_dict().values(), one.state_dict().values()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for key in ("train_loss", "train_mae", "val_loss", "val_mae"):
        assert history_two[key] == pytest.approx(history_one[key], rel=1e-5)


def test_a_run_on_datasets_resumes_mid_epoch_exactly(tmp_path):
    x, y = regression(86)
    torch.manual_seed(0)
    model = Regressor()
    common = dict(
        train=Pairs(x[:70], y[:70]),
        val=Pairs(x[70:], y[70:]),
        epochs=2,
        batch_size=16,
        num_workers=1,
        **REGRESSION,
    )
    straight, stopped = copy.deepcopy(model), copy.deepcopy(model)
    polytrain.fit(straight, **common)
    polytrain.fit(stopped, out=str(tmp_path / "run"), max_steps=7, **common)  # stops in epoch 2, step 2
    resumed = copy.deepcopy(model)
    history = polytrain.fit(resumed, resume=str(tmp_path / "run"), **common)
    for got, want in zip(resumed.state_dict().values(), straight.state_dict().values()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert len(history.epochs) == 2


def test_loggers_write_tensorboard_csv_and_call_logger_objects(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = regression(60)
    recorder = Recorder()
    polytrain.fit(
        Regressor(),
        train=Pairs(x[:48], y[:48]),
        val=Pairs(x[48:], y[48:]),
        epochs=2,
        batch_size=8,
        num_workers=0,
        logger=["tensorboard", "csv", recorder],
        out=str(tmp_path / "run"),
        **REGRESSION,
    )
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    steps = [event.step for event in events.Scalars("train/step_loss")]
    assert steps == list(range(1, 13))  # 6 steps per epoch, 2 epochs
    assert [event.step for event in events.Scalars("epoch/val_loss")] == [1, 2]
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert rows[0] == "epoch,train_loss,val_loss,epoch_seconds,samples_per_second,lr" and len(rows) == 3
    epoch_calls = [metrics for metrics, _ in recorder.calls if "epoch/val_loss" in metrics]
    assert len(epoch_calls) == 2
    assert sum("train/step_loss" in metrics for metrics, _ in recorder.calls) == 12


def test_a_resumed_runs_tensorboard_keeps_every_step_once_and_drops_what_followed_the_checkpoint(tmp_path):
    """The run stops at step 7 (its checkpoint); a crashed predecessor's steps 8 and 9 (written here by hand) are
    dropped, and the resumed run logs 8 to 12: each step once, step 7 kept."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    x, y = regression(60)
    common = dict(
        train=Pairs(x[:48], y[:48]), val=Pairs(x[48:], y[48:]), epochs=2, batch_size=8, num_workers=0,
        logger=["tensorboard"], **REGRESSION,
    )  # fmt: skip
    polytrain.fit(Regressor(), out=str(tmp_path / "run"), max_steps=7, **common)
    stale = SummaryWriter(str(tmp_path / "run" / "tensorboard"))
    for step in (8, 9):
        stale.add_scalar("train/step_loss", 999.0, step)
    stale.close()
    polytrain.fit(Regressor(), resume=str(tmp_path / "run"), **common)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    losses = events.Scalars("train/step_loss")
    assert [event.step for event in losses] == list(range(1, 13))
    assert all(event.value != 999.0 for event in losses)


def test_every_step_and_epoch_is_logged_before_the_checkpoint_that_counts_it(tmp_path, monkeypatch):
    """A resume does not log again what its checkpoint counts as done: at each checkpoint (every 4 steps within
    the 6-step epochs, and each epoch's end) the loggers have had every step up to it and every finished
    epoch's figures; and a run that starts at step 0 in a folder with a predecessor's events (one resumed before
    its first checkpoint) drops them."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from polytrain.runtime.checkpoint import Checkpointer

    x, y = regression(60)
    recorder, seen = Recorder(), []
    saving = Checkpointer.save

    def save(self, trainer, position):
        steps = [step for metrics, step in recorder.calls if "train/step_loss" in metrics]
        epochs = [step for metrics, step in recorder.calls if "epoch/train_loss" in metrics]
        seen.append((position.epoch * 6 + position.step, max(steps), epochs))
        saving(self, trainer, position)

    monkeypatch.setattr(Checkpointer, "save", save)
    polytrain.fit(
        Regressor(), train=Pairs(x[:48], y[:48]), val=Pairs(x[48:], y[48:]), epochs=2, batch_size=8,
        num_workers=0, logger=[recorder], checkpoint_every=4, out=str(tmp_path / "run"), **REGRESSION,
    )  # fmt: skip
    assert seen == [(4, 4, []), (6, 6, [1]), (10, 10, [1]), (12, 12, [1, 2])]

    stale = SummaryWriter(str(tmp_path / "fresh" / "tensorboard"))  # a run killed before its first checkpoint
    stale.add_scalar("train/step_loss", 999.0, 3)
    stale.close()
    polytrain.fit(
        Regressor(), train=Pairs(x[:48], y[:48]), val=Pairs(x[48:], y[48:]), epochs=1, batch_size=8,
        num_workers=0, logger="tensorboard", out=str(tmp_path / "fresh"), **REGRESSION,
    )  # fmt: skip
    events = EventAccumulator(str(tmp_path / "fresh" / "tensorboard"))
    events.Reload()
    losses = events.Scalars("train/step_loss")
    assert [event.step for event in losses] == list(range(1, 7)) and all(e.value != 999.0 for e in losses)


def test_steps_jsonl_holds_every_steps_loss_and_a_resume_drops_what_followed_its_checkpoint(tmp_path):
    """Every run folder has the per-step figures without TensorBoard: step 1's loss is the mean squared error of
    the initial model on the first global batch of the seeded order, and every step's is what a logger object
    gets. A crashed predecessor's lines past the checkpoint (steps 8 and 9, written here by hand, the last cut
    short) are dropped, and the resumed run writes 8 to 12: each step once."""
    import json

    x, y = regression(60)
    recorder, model = Recorder(), Regressor()
    first = global_batch_order(48, epoch=0, seed=0)[:8]
    with torch.no_grad():
        want = F.mse_loss(model(x[:48][first]), y[:48][first]).item()
    common = dict(
        train=Pairs(x[:48], y[:48]), val=Pairs(x[48:], y[48:]), epochs=2, batch_size=8, num_workers=0,
        **REGRESSION,
    )  # fmt: skip
    run = tmp_path / "run"
    polytrain.fit(model, out=str(run), max_steps=7, logger=[recorder], **common)
    with open(run / "steps.jsonl", "a") as stale:
        stale.write(json.dumps({"step": 8, "loss": 999.0, "lr": 0.05}) + "\n" + '{"step": 9, "lo')
    polytrain.fit(Regressor(), resume=str(run), logger=[recorder], **common)
    lines = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 13))
    assert lines[0]["loss"] == pytest.approx(want, rel=1e-6)
    logged = {step: metrics for metrics, step in recorder.calls if "train/step_loss" in metrics}
    assert [line["loss"] for line in lines] == [logged[step]["train/step_loss"] for step in range(1, 13)]
    assert all(set(line) == {"step", "loss", "lr"} for line in lines)


def test_tensorboard_missing_is_one_line_with_the_install_command(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(UserError) as refused:
        polytrain.fit("mlp", "synthetic", logger="tensorboard", epochs=1, verbose=False, out="unused")
    assert "pip install 'polytrain[tensorboard]'" in str(refused.value) and "\n" not in str(refused.value)


X, Y = torch.randn(20, 6), torch.randn(20, 2)


@pytest.mark.parametrize(
    "arguments, words",
    [
        (
            dict(train=BadAt(X, Y, index=7, sample=(torch.randn(5), torch.randn(2))), val=Pairs(X, Y)),
            "train[7]'s input is a float32 tensor of shape (5,), but train[0]'s is a float32 tensor of shape (6,)",
        ),
        (
            dict(train=BadAt(X, Y, index=3, sample="text"), val=Pairs(X, Y)),
            "train[3] returned a str; a Dataset must return (input, target)",
        ),
        (
            dict(train=Pairs(X, Y), val=BadAt(X, Y, index=2, sample=(object(), torch.randn(2)))),
            "val[2]'s input is a object; a Dataset must return tensors",
        ),
        (dict(train=Pairs(X[:0], Y[:0]), val=Pairs(X, Y)), "train= is empty (0 samples)"),
        (
            dict(train=Pairs(X, Y), val=Pairs(X[:1], Y[:1]), devices=2),
            "the validation set has 1 sample, fewer than devices=2",
        ),
        (
            dict(train=Pairs(X, Y), val=Pairs(X, Y), loss=lambda out, y: (out - y) ** 2),
            "loss= returned a float32 tensor of shape (2, 2); return the batch's mean loss (a scalar tensor) or a pair",
        ),
        (
            dict(train=Pairs(X, Y), val=Pairs(X, Y), metrics={"bad": lambda out, y: out}),
            "metric 'bad' returned shape (2, 2) for 2 samples",
        ),
        (dict(train=Pairs(X, Y)), "val= is missing; pass both train= and val= Datasets"),
        (dict(data=Pairs(X, Y)), "a single Dataset was given as data; pass train=DATASET and val=DATASET"),
        (
            dict(train=Pairs(X, Y), val=Pairs(X, Y), loss=lambda out, y: ((out - y) ** 2).mean(), devices=2),
            "loss= cannot be sent to the worker processes",
        ),
        (
            dict(train=Pairs(X, Y), val=Pairs(X, Y), loss=torch.nn.MSELoss(), label_smoothing=0.1),
            "label_smoothing= applies to the built-in cross-entropy",
        ),
    ],
)
def test_bad_datasets_and_objectives_are_one_line_naming_the_index_or_argument(arguments, words):
    arguments = {"loss": torch.nn.MSELoss(), **arguments}
    with pytest.raises(UserError) as refused:
        polytrain.fit(
            Regressor(), epochs=1, batch_size=4, num_workers=0, device="cpu", verbose=False, **arguments
        )
    message = str(refused.value)
    assert words in message and "\n" not in message


def test_a_label_out_of_range_names_the_index_when_its_batch_is_read():
    x = torch.randn(12, 6)
    labels = torch.tensor([0, 1, 2] * 3 + [0, 7, 1])  # index 10 holds 7 with 3 classes
    with pytest.raises(UserError) as refused:
        polytrain.fit(
            torch.nn.Linear(6, 3),
            train=Pairs(x, labels),
            val=Pairs(x, labels % 3),
            epochs=1,
            batch_size=4,
            num_workers=1,
            device="cpu",
            verbose=False,
        )
    assert "train[10] has label 7, outside 0..2" in str(refused.value) and "\n" not in str(refused.value)


def test_a_classification_target_that_is_not_a_class_index_is_refused():
    with pytest.raises(UserError) as refused:
        polytrain.fit(
            torch.nn.Linear(6, 2), train=Pairs(X, Y), val=Pairs(X, Y), epochs=1, device="cpu", verbose=False
        )
    assert (
        "train[0]'s target is a float32 tensor of shape (2,); classification needs one whole-number class index"
        in str(refused.value)
    )


def test_evaluate_takes_a_dataset_and_a_loss():
    x, y = regression(30)
    model = Regressor()
    result = polytrain.evaluate(model, Pairs(x, y), loss=torch.nn.MSELoss(), device="cpu")
    with torch.no_grad():
        assert result["loss"] == pytest.approx(F.mse_loss(model(x), y).item(), rel=1e-5)
    assert result["count"] == 30 and "acc" not in result


@pytest.mark.multiprocess
def test_a_pipeline_on_datasets_with_a_custom_loss_equals_one_device():
    """The pipeline computes the loss on its last stage, micro-batch by micro-batch: still the global mean."""
    x, y = regression(70)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    common = dict(
        train=Pairs(x[:54], y[:54]),
        val=Pairs(x[54:], y[54:]),
        epochs=1,
        batch_size=16,
        num_workers=1,
        metrics={"mae": mean_absolute_error},
        **REGRESSION,
    )
    one, split = copy.deepcopy(model), copy.deepcopy(model)
    history_one = polytrain.fit(one, **common)
    history_split = polytrain.fit(split, devices=2, strategy="pipeline", microbatches=2, **common)
    for got, want in zip(split.state_dict().values(), one.state_dict().values()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for key in ("train_loss", "train_mae", "val_loss", "val_mae"):
        assert history_split[key] == pytest.approx(history_one[key], rel=1e-5)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_dataset_that_raises_is_one_line_naming_the_index_and_the_line(workers):
    with pytest.raises(UserError) as refused:
        polytrain.fit(
            Regressor(),
            train=RaisesAt(X, Y, index=13),
            val=Pairs(X, Y),
            epochs=1,
            batch_size=4,
            num_workers=workers,
            device="cpu",
            verbose=False,
            **{"loss": torch.nn.MSELoss()},
        )
    message = str(refused.value)
    assert "train[13] raised KeyError: 'no file for sample 13' (" in message and "datasets.py:" in message
    assert "\n" not in message


def test_the_same_seed_gives_the_same_weights_with_any_number_of_loader_processes():
    """Dropout draws from the global generator, which each pass's DataLoader iterator used to draw its base seed
    from (once per pass without loader processes, once per run with them), and random transforms drew from
    whichever process read the sample: 0 and 1 loader processes gave validation 0.1416 and 0.162."""
    from map_datasets import NoisyPairs

    torch.manual_seed(0)
    x, y = torch.randn(48, 6), torch.randint(0, 3, (48,))
    weights = []
    for workers in (0, 1, 2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3))
        polytrain.fit(
            model,
            train=NoisyPairs(x[:40], y[:40]),
            val=NoisyPairs(x[40:], y[40:]),
            epochs=2,
            batch_size=8,
            num_workers=workers,
            device="cpu",
            verbose=False,
        )
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1]) and torch.equal(weights[0], weights[2])
