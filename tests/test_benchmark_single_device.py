"""benchmarks/single_device.py times polytrain against its own operations written by hand: the two must
train the same thing, or the comparison measures a different computation."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import tiny_digits

from polytrain.models import build_model

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(monkeypatch, name: str):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports its neighbour interleaved.py
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model_name", ["lenet", "mlp"])
def test_single_device_by_hand_trains_what_polytrain_trains(monkeypatch, model_name):
    bench = load_benchmark(monkeypatch, "single_device")
    data = tiny_digits(n_train=256, n_val=32)
    torch.manual_seed(0)
    ours = build_model(model_name, data.input_shape, 10)
    theirs = copy.deepcopy(ours)
    common = dict(epochs=2, batch_size=32, seed=0, device=torch.device("cpu"))
    our_losses = [loss for _, loss in bench.train_polytrain(ours, data, **common)]
    their_losses = [loss for _, loss in bench.train_by_hand(theirs, data, **common)]
    # the same operations in the same order: equal up to nothing but float32 rounding of identical kernels
    assert our_losses == pytest.approx(their_losses, rel=0, abs=1e-9)
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-8, msg=lambda m, name=name: f"{name}: {m}")
