import torch.nn as nn

from ._shape import flat_features


class CifarCNN(nn.Sequential):
    """The Keras CIFAR-10 example: conv 32,32 -> pool -> conv 64,64 -> pool -> dense 512 -> classes, dropout."""

    def __init__(self, input_shape=(3, 32, 32), num_classes=10):
        features = nn.Sequential(
            nn.Conv2d(input_shape[0], 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
            nn.Flatten(),
        )
        width = flat_features(features, input_shape)
        super().__init__(
            *features, nn.Linear(width, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, num_classes)
        )
