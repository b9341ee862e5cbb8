"""Models by name. Each builder takes the dataset's input shape (C, H, W) and number of classes."""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
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


@torch.no_grad()
def check_model_output(model: nn.Module, dataset, *, exact: bool = True) -> None:
    """Run `model` on two training images and refuse, in one line, a model that cannot take them or whose
    output does not give one score per class: before any process starts, not as an error deep in a step."""
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    sample = dataset.train_x[:2].to(device=device, dtype=first.dtype if first is not None else torch.float32) / 255
    shape = "x".join(map(str, dataset.input_shape))
    was_training = model.training
    try:
        model.eval()
        output = model(sample)
    except Exception as error:           # the user's module on our data: say what went wrong, in one line
        line = (str(error).strip().splitlines() or [""])[0][:200]
        raise UserError(f"the model cannot take the dataset's {shape} images (C x H x W): {type(error).__name__}: "
                        f"{line}; make its first layers fit that shape") from None
    finally:
        model.train(was_training)
    needed = int(max(dataset.train_y.max(), dataset.val_y.max())) + 1
    classes = dataset.num_classes if exact else needed
    if not isinstance(output, torch.Tensor) or output.dim() != 2 or output.shape[0] != len(sample):
        got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise UserError(f"the model must return one row of {classes} class scores per image, shape (N, {classes}); "
                        f"for {len(sample)} images it returned {got}")
    if output.shape[1] < needed or (exact and output.shape[1] != classes):
        raise UserError(f"the model gives {output.shape[1]} outputs per image, but the dataset has {classes} "
                        f"classes (labels 0..{classes - 1}); make its last layer give {classes} outputs")


__all__ = ["MODELS", "build_model", "check_model_output"]
