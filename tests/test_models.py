import pytest
import torch

from polytrain.errors import UserError
from polytrain.models import MODELS, build_model


@pytest.mark.parametrize("name", sorted(set(MODELS) - {"gpt"}))      # gpt reads text: test_gpt.py
@pytest.mark.parametrize("shape, classes", [((1, 28, 28), 10), ((3, 32, 32), 10), ((1, 28, 28), 7)])
def test_every_model_maps_its_input_to_class_scores(name, shape, classes):
    model = build_model(name, shape, classes)
    out = model(torch.rand(3, *shape))
    assert out.shape == (3, classes)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_lenet_has_the_documented_layers():
    model = build_model("lenet", (1, 28, 28), 10)
    # conv 20@5x5, conv 50@5x5, dense 800->512, dense 512->10
    expected = (1 * 25 + 1) * 20 + (20 * 25 + 1) * 50 + (800 + 1) * 512 + (512 + 1) * 10
    assert sum(p.numel() for p in model.parameters()) == expected


def test_mlp_is_784_128_64_10():
    model = build_model("mlp", (1, 28, 28), 10)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [(128, 784), (128,), (64, 128), (64,), (10, 64), (10,)]


def test_unknown_model_names_the_choices():
    with pytest.raises(UserError, match="unknown --model 'vgg'; choose one of"):
        build_model("vgg", (1, 28, 28), 10)
