import pytest
import torch

from polytrain.errors import UserError
from polytrain.models import MODELS, build_model


@pytest.mark.parametrize("name", sorted(set(MODELS) - {"gpt", "llama"}))  # text: test_gpt, test_llama
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


def test_a_convolutional_module_object_trains_channels_last_unless_it_cannot_take_it():
    """fit(build_model("lenet")) trained in the default format, 1.2x slower than fit("lenet") on the CPU."""
    import torch.nn as nn
    from conftest import tiny_digits

    import polytrain
    from polytrain.models import takes_channels_last

    data = tiny_digits(n_train=64, n_val=16)
    sample = data.sample_inputs(2)

    class ViewFlatten(nn.Module):  # flattens with .view(), which a channels-last tensor cannot do
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(1, 4, 3), nn.Linear(4 * 26 * 26, 10)

        def forward(self, x):
            x = self.conv(x)
            return self.fc(x.view(x.size(0), -1))

    assert takes_channels_last(build_model("lenet", (1, 28, 28), 10), sample)
    assert not takes_channels_last(ViewFlatten(), sample)
    assert not takes_channels_last(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), sample.flatten(1))
    settings = dict(epochs=1, batch_size=16, verbose=False, device="cpu")
    torch.manual_seed(0)
    module = build_model("lenet", (1, 28, 28), 10)
    polytrain.fit(module, data, **settings)
    torch.manual_seed(0)
    asked = build_model("lenet", (1, 28, 28), 10)
    polytrain.fit(asked, data, channels_last=True, **settings)  # as fit("lenet") trains it
    for (name, got), expected in zip(module.state_dict().items(), asked.state_dict().values()):
        assert torch.equal(got, expected), name
    polytrain.fit(ViewFlatten(), data, **settings)  # trains, in the default format
