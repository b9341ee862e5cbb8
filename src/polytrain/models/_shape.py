import torch
import torch.nn as nn


def flat_features(features: nn.Module, input_shape) -> int:
    """How many values `features` outputs per sample for inputs of `input_shape` (C, H, W)."""
    with torch.no_grad():
        return features(torch.zeros(1, *input_shape)).numel()
