"""LeNet as in the Caffe/MXNet tutorials (20 and 50 filters, 512 hidden units) and the classic LeNet-5."""

import torch.nn as nn

from ._shape import flat_features


class LeNet(nn.Sequential):
    """conv 20@5x5 -> max-pool -> conv 50@5x5 -> max-pool -> dense 512 -> dense classes, ReLU."""

    def __init__(self, input_shape=(1, 28, 28), num_classes=10):
        features = nn.Sequential(
            nn.Conv2d(input_shape[0], 20, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(20, 50, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        width = flat_features(features, input_shape)
        super().__init__(*features, nn.Linear(width, 512), nn.ReLU(), nn.Linear(512, num_classes))


class LeNet5(nn.Sequential):
    """The classic 6/16/120/84 network; 28x28 inputs are padded by 2 to the original 32x32 geometry."""

    def __init__(self, input_shape=(1, 28, 28), num_classes=10):
        pad = 2 if input_shape[1] < 32 else 0
        features = nn.Sequential(
            nn.Conv2d(input_shape[0], 6, 5, padding=pad),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        width = flat_features(features, input_shape)
        super().__init__(
            *features,
            nn.Linear(width, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )
