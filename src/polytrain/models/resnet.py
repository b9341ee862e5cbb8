"""ResNet-20 for CIFAR-10 (He et al. 2016, section 4.2): 3 stages of 3 basic blocks, 16/32/64 channels."""

from collections import OrderedDict

import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet20(nn.Sequential):
    """stem -> stages -> head, as a Sequential of named parts so a pipeline can split it between blocks."""

    def __init__(self, input_shape=(3, 32, 32), num_classes=10, blocks_per_stage: int = 3):
        stem = nn.Sequential(
            nn.Conv2d(input_shape[0], 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
        )
        layers, inputs = [], 16
        for stage, width in enumerate((16, 32, 64)):
            for block in range(blocks_per_stage):
                layers.append(BasicBlock(inputs, width, 2 if stage > 0 and block == 0 else 1))
                inputs = width
        head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))
        super().__init__(OrderedDict(stem=stem, stages=nn.Sequential(*layers), head=head))
