import torch
import torch.nn as nn


def flat_features(features: nn.Module, input_shape) -> int:
    """How many values `features` outputs per sample for inputs of `input_shape` (C, H, W)."""
    from ..errors import UserError

    try:
        with torch.no_grad():
            return features(torch.zeros(1, *input_shape)).numel()
    except RuntimeError:
        raise UserError(
            f"this --model cannot take images of shape {tuple(input_shape)} (too small for its "
            f"convolutions and pooling); choose another --model, e.g. mlp"
        ) from None
