"""Models by name. Each builder takes the dataset's input shape (C, H, W) and number of classes."""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch.nn as nn

from ..errors import UserError
from .cifar_cnn import CifarCNN
from .lenet import LeNet, LeNet5
from .mlp import MLP
from .resnet import ResNet20

MODELS: Dict[str, Callable[[Tuple[int, int, int], int], nn.Module]] = {
    "lenet": LeNet,
    "lenet5": LeNet5,
    "mlp": MLP,
    "cifar-cnn": CifarCNN,
    "resnet": ResNet20,
}


def build_model(name: str, input_shape: Tuple[int, int, int], num_classes: int) -> nn.Module:
    if name not in MODELS:
        raise UserError(f"unknown --model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name](tuple(input_shape), num_classes)


__all__ = ["MODELS", "build_model"]
