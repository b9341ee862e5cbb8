import math

import torch.nn as nn


class MLP(nn.Sequential):
    """inputs -> 128 -> 64 -> classes, ReLU (784 -> 128 -> 64 -> 10 on digits)."""

    def __init__(self, input_shape=(1, 28, 28), num_classes=10):
        super().__init__(
            nn.Flatten(),
            nn.Linear(math.prod(input_shape), 128),
            nn.ReLU(),
            nn.Linear(128, 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )
