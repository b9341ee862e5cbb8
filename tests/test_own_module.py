"""The caller's own module: on one device it is trained itself, as a hand-written loop trains it (what its
forward sets during training is there afterwards, and the checks before training leave no trace on it), and it
comes back on its own device, in its own memory format, with its layers' own forward; from worker processes
only the weights and buffers come back, and a start line says so."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import tiny_digits

import polytrain

SETTINGS = dict(epochs=2, batch_size=16, device="cpu")


class Counting(nn.Module):
    """Counts its forward calls and keeps the size of its latest batch: attributes set while it trains."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(4 * 28 * 28, 10))
        self.calls = 0
        self.latest_rows = None

    def forward(self, x):
        self.calls += 1
        self.latest_rows = len(x)
        return self.head(torch.relu(self.conv(x)))


def hand_loop(data, *, epochs: int, batch_size: int) -> Counting:
    """Training by hand: each epoch's batches, then one pass over the validation set (polytrain's default
    evaluation batch, 1,024 samples, takes all 16 in one)."""
    model = Counting()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    train_x, val_x = data.train_x.float() / 255, data.val_x.float() / 255
    for _ in range(epochs):
        model.train()
        for start in range(0, len(train_x), batch_size):
            x, y = train_x[start : start + batch_size], data.train_y[start : start + batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            for start in range(0, len(val_x), 1024):
                model(val_x[start : start + 1024])
    return model


def test_one_device_trains_the_object_itself_as_a_hand_loop_does():
    data = tiny_digits(n_train=64, n_val=16)
    model = Counting()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    polytrain.fit(model, data, verbose=False, **SETTINGS)
    by_hand = hand_loop(data, epochs=2, batch_size=16)
    # 2 epochs of 4 steps and one validation batch: the checks' calls on two samples are not counted
    assert (model.calls, model.latest_rows) == (by_hand.calls, by_hand.latest_rows) == (10, 16)
    assert all(not torch.equal(model.state_dict()[name], value) for name, value in before.items())
    # channels-last weights and whole-batch dropout served training only
    assert model.conv.weight.is_contiguous() and model.conv.weight.device == torch.device("cpu")
    assert [name for name, m in model.named_modules() if "forward" in m.__dict__] == []
    # the object trains on where it stopped: one more epoch counts on
    polytrain.fit(model, data, verbose=False, **dict(SETTINGS, epochs=1))
    assert model.calls == 15


@pytest.mark.multiprocess
def test_from_worker_processes_the_weights_come_back_and_a_line_says_so(capsys):
    data = tiny_digits(n_train=64, n_val=16)
    model, one = Counting(), Counting()
    polytrain.fit(model, data, devices=2, strategy="data", **SETTINGS)
    assert (
        "note: 2 worker processes each train a copy of your Counting; only its weights and buffers come back "
        "into it" in capsys.readouterr().out
    )
    polytrain.fit(one, data, verbose=False, **SETTINGS)
    assert model.calls == 0  # the calls were the workers' copies'
    for name, value in one.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, atol=1e-5, rtol=0)
