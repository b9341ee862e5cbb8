"""Flattening a model into layers, and measuring them for the split: pure, in one process."""

import time

import torch
import torch.nn as nn

from polytrain.models import build_model
from polytrain.pipeline.balance import balance_by_time
from polytrain.pipeline.layers import flatten_layers, layer_memory, named_subset, time_layers


class Sleep(nn.Module):
    """A layer that takes a known time (forward only; the backward of an identity is free)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x * 1.0


def test_timed_layers_are_split_where_their_known_times_balance():
    model = nn.Sequential(Sleep(0.040), Sleep(0.010), Sleep(0.010), Sleep(0.010), Sleep(0.010))
    costs = time_layers(flatten_layers(model), torch.ones(2, 3), repeats=3)
    for cost, seconds in zip(costs, (0.040, 0.010, 0.010, 0.010, 0.010)):
        assert seconds <= cost < seconds + 0.030  # sleep is a lower bound; load only adds
    assert balance_by_time(costs, stages=2) == (1,)  # 40 ms | 4 x 10 ms: any other split is 50 ms or more


def test_nested_sequentials_flatten_to_layers_named_as_in_the_model():
    model = build_model("resnet", (3, 32, 32), 10)
    layers = flatten_layers(model)
    assert [name for name, _ in layers][:4] == ["stem.0", "stem.1", "stem.2", "stages.0"]
    assert [name for name, _ in layers][-3:] == ["head.0", "head.1", "head.2"]
    part = named_subset(layers[3:5])
    assert list(part.state_dict()) == [
        key for key in model.state_dict() if key.startswith(("stages.0.", "stages.1."))
    ]


def test_memory_counts_saved_activations_and_parameter_state_exactly():
    layers = [("0", nn.Linear(4, 3)), ("1", nn.ReLU())]
    dense, relu = layer_memory(layers, torch.randn(5, 4), optimizer_slots=1)
    # Linear keeps its input for the weight gradient (5 x 4 floats), plus weights, gradients and momentum
    # of 4 x 3 + 3 floats; ReLU keeps its output (5 x 3 floats).
    assert dense == 5 * 4 * 4 + (4 * 3 + 3) * 4 * 3
    assert relu == 5 * 3 * 4


def test_the_first_layer_keeps_nothing_for_an_input_gradient_nobody_needs():
    (relu,) = layer_memory([("0", nn.ReLU())], torch.randn(5, 4), optimizer_slots=1)
    assert relu == 0
