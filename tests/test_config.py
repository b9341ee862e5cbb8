import math

import pytest

from polytrain.config import TrainConfig
from polytrain.errors import ConfigError


@pytest.mark.parametrize(
    "settings, flag",
    [
        (dict(epochs=0), "--epochs"),
        (dict(epochs=-3), "--epochs"),
        (dict(batch_size=0), "--batch-size"),
        (dict(batch_size=-1), "--batch-size"),
        (dict(lr=math.nan), "--lr"),
        (dict(lr=-0.1), "--lr"),
        (dict(lr=0), "--lr"),
        (dict(lr=math.inf), "--lr"),
        (dict(optimizer="lion"), "--optimizer"),
        (dict(momentum=1.5), "--momentum"),
        (dict(devices=0), "--devices"),
        (dict(batch_size=63, devices=2), "--batch-size"),
        (dict(precision="fp8"), "--precision"),
        (dict(schedule="step"), "--schedule"),
        (dict(device="tpu"), "--device"),
        (dict(weight_decay=-1), "--weight-decay"),
    ],
)
def test_bad_settings_name_the_flag(settings, flag):
    with pytest.raises(ConfigError) as error:
        TrainConfig(**settings)
    message = str(error.value)
    assert flag in message and "\n" not in message


def test_defaults_are_valid_and_round_trip():
    config = TrainConfig()
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_linear_lr_scaling_multiplies_by_devices():
    assert TrainConfig(lr=0.1, devices=4, batch_size=256, lr_scale="linear").effective_lr == pytest.approx(
        0.4
    )
    assert TrainConfig(lr=0.1, devices=4, batch_size=256).effective_lr == pytest.approx(0.1)
