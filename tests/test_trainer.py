"""The trainer against a hand-written PyTorch loop: same data order, same maths, same weights."""

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_digits

import polytrain
from polytrain.errors import UserError
from polytrain.models import build_model


def hand_written(model, data, *, epochs, batch_size, lr, momentum, weight_decay, seed=0, optimizer="sgd"):
    """The plain loop polytrain must reproduce: normalise with train statistics, shuffle, step."""
    pixels = data.train_x.double() / 255
    mean, std = pixels.mean().float(), pixels.std().float()
    x_all = (data.train_x.float() / 255 - mean) / std
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for epoch in range(epochs):
        order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        total = 0.0
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            loss = F.cross_entropy(model(x_all[idx]), data.train_y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        losses.append(total / len(order))
    return losses


# Adam divides by sqrt(v) + 1e-8: for weights whose gradients are ~0 it turns last-bit rounding differences
# (polytrain normalises with one fused multiply-add, the reference subtracts and divides) into ~2e-6 within
# a few steps, so Adam is held to 1e-5 over 3 steps; SGD to 1e-6 over two full epochs.
@pytest.mark.parametrize("optimizer, lr, n_train", [("sgd", 0.05, 200), ("adam", 1e-3, 96)])
def test_fit_equals_a_hand_written_loop(optimizer, lr, n_train):
    data = tiny_digits(n_train=n_train)
    torch.manual_seed(0)
    model = build_model("lenet", data.input_shape, 10)
    reference = copy.deepcopy(model)
    epochs = 2 if optimizer == "sgd" else 1
    losses = hand_written(
        reference,
        data,
        epochs=epochs,
        batch_size=32,
        lr=lr,
        momentum=0.9,
        weight_decay=5e-4,
        optimizer=optimizer,
    )
    momentum = {"momentum": 0.9} if optimizer == "sgd" else {}  # Adam takes none: refused if given
    history = polytrain.fit(
        model,
        data,
        epochs=epochs,
        batch_size=32,
        lr=lr,
        weight_decay=5e-4,
        **momentum,
        optimizer=optimizer,
        schedule="constant",
        warmup_epochs=0,
        device="cpu",
        verbose=False,
    )
    for ours, theirs in zip(model.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(ours, theirs, atol=1e-6 if optimizer == "sgd" else 1e-5, rtol=0)
    assert history["train_loss"] == pytest.approx(losses, abs=1e-5)


def test_same_seed_same_weights_different_seed_different_weights(digits):
    def train(seed):
        torch.manual_seed(seed)
        model = build_model("mlp", digits.input_shape, 10)
        polytrain.fit(model, digits, epochs=1, seed=seed, device="cpu", verbose=False)
        return torch.cat([p.flatten() for p in model.parameters()])

    assert torch.equal(train(3), train(3))
    assert not torch.equal(train(3), train(4))


def test_history_has_the_documented_keys_and_learns(digits):
    history = polytrain.fit("lenet", digits, epochs=3, verbose=False)
    assert len(history.epochs) == 3
    for key in (
        "epoch",
        "train_loss",
        "train_acc",
        "val_loss",
        "val_acc",
        "epoch_seconds",
        "samples_per_second",
    ):
        assert key in history.last
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert history.last["val_acc"] > 0.9


def test_validation_accuracy_counts_every_sample(digits):
    model = build_model("mlp", digits.input_shape, 10)
    result = polytrain.evaluate(model, digits, device="cpu")
    assert model.training  # the caller's module is left as it was
    mean, std = digits.channel_stats()
    x = (digits.val_x.float() / 255 - mean) / std
    with torch.no_grad():
        correct = int((model(x).argmax(1) == digits.val_y).sum())
    assert result["count"] == len(digits.val_y)
    assert result["acc"] == correct / len(digits.val_y)


def test_a_diverging_loss_stops_with_a_clear_message(digits):
    with pytest.raises(UserError, match="loss became (nan|inf)"):
        polytrain.fit("lenet", digits, epochs=2, lr=1e5, momentum=0.0, verbose=False)


class TutorialNet(torch.nn.Module):
    """A user model in the classic tutorial style: flattens with .view(), which needs contiguous input."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 5)
        self.fc = torch.nn.Linear(4 * 24 * 24, 10)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        return self.fc(x.view(x.size(0), -1))


def test_a_user_module_that_flattens_with_view_trains(digits):
    history = polytrain.fit(TutorialNet(), digits, epochs=1, device="cpu", verbose=False)
    assert history.last["val_acc"] > 0.2


def test_the_watchdog_stops_when_fit_fails(digits, monkeypatch):
    import threading

    for name, value in (("TORCHELASTIC_RUN_ID", "test"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)  # as in a worker started by torchrun
    with pytest.raises(UserError):
        polytrain.fit(
            "lenet", digits, epochs=1, lr=1e5, momentum=0.0, hang_timeout=30, device="cpu", verbose=False
        )
    deadline = time.monotonic() + 5
    while any(t.name == "polytrain-watchdog" and t.is_alive() for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the watchdog outlived a failed fit"
        time.sleep(0.05)


def test_a_run_trained_on_an_object_dataset_is_not_evaluated_on_a_guess(tmp_path, digits):
    polytrain.fit("mlp", digits, epochs=1, out=str(tmp_path / "run"), device="cpu", verbose=False)
    with pytest.raises(UserError, match="in-memory dataset"):
        polytrain.evaluate(str(tmp_path / "run"))


def test_more_than_ten_classes_from_tensors():
    x = torch.randint(0, 255, (60, 1, 8, 8), dtype=torch.uint8)
    y = torch.arange(60) % 12
    history = polytrain.fit("mlp", (x, y, x[:24], y[:24]), epochs=1, device="cpu", verbose=False)
    assert history.last["val_acc"] >= 0
