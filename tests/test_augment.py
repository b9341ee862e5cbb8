"""Augmentation is trained only where the run says so: a module of the user's on cifar10 trains on the images as
they are unless augment=True is given (the same weights as with augment=False); polytrain's own models keep
cifar10's shifts and mirroring, said in one line that names the switch."""

import pytest
import torch
import torch.nn as nn
from datafiles import write_cifar_folder

import polytrain

SETTINGS = dict(epochs=1, batch_size=8, device="cpu")


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cifar")
    write_cifar_folder(folder, n_per_file=8)
    return str(folder)


def linear():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))


def trained(cifar, **options) -> dict:
    model = linear()
    polytrain.fit(model, "cifar10", data_dir=cifar, verbose=False, **SETTINGS, **options)
    return model.state_dict()


def test_a_module_of_the_users_is_not_augmented_unless_asked(cifar, capsys):
    default, plain, augmented = trained(cifar), trained(cifar, augment=False), trained(cifar, augment=True)
    for name, value in plain.items():
        assert torch.equal(default[name], value), name
    assert not torch.equal(augmented["1.weight"], plain["1.weight"])
    polytrain.fit(linear(), "cifar10", data_dir=cifar, **SETTINGS)
    assert "augmentation" not in capsys.readouterr().out


def test_polytrains_own_model_says_that_it_augments(cifar, capsys):
    polytrain.fit("cifar-cnn", "cifar10", data_dir=cifar, max_steps=1, **SETTINGS)
    assert (
        "augmentation: random 4-pixel shifts and mirroring of the training images (cifar10's default with "
        "polytrain's models; --no-augment, or augment=False in fit(), turns it off)"
    ) in capsys.readouterr().out
