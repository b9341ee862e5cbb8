"""The in-memory dataset: uint8 images (N, C, H, W) and int64 labels, split into train and validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np
import torch

from ..errors import DataError


@dataclass
class ArrayDataset:
    name: str
    train_x: torch.Tensor  # uint8 (N, C, H, W)
    train_y: torch.Tensor  # int64 (N,)
    val_x: torch.Tensor
    val_y: torch.Tensor
    num_classes: int = 10
    augment: bool = False  # random crop + flip during training by default (natural images, not digits)
    flip: bool = False  # whether mirrored images stay valid (CIFAR yes; digits no: a flipped 2 is no 2)
    dtype: torch.dtype = torch.float32  # of the normalised inputs (float64 where `polytrain verify` compares)

    def __post_init__(self) -> None:
        for split, x, y in (("train", self.train_x, self.train_y), ("validation", self.val_x, self.val_y)):
            if x.dtype != torch.uint8 or x.dim() != 4:
                raise DataError(
                    f"{self.name}: {split} images must be uint8 of shape (N, C, H, W), "
                    f"got {x.dtype} {tuple(x.shape)}"
                )
            if y.dim() != 1 or len(y) != len(x):
                raise DataError(f"{self.name}: {split} has {len(x)} images but {len(y)} labels")
            if len(x) == 0:
                raise DataError(f"{self.name}: the {split} split is empty")
        if self.train_x.shape[1:] != self.val_x.shape[1:]:
            raise DataError(
                f"{self.name}: train images {tuple(self.train_x.shape[1:])} and validation images "
                f"{tuple(self.val_x.shape[1:])} differ in shape"
            )
        self.train_y = self.train_y.long()
        self.val_y = self.val_y.long()
        top = int(max(self.train_y.max(), self.val_y.max()))
        if int(min(self.train_y.min(), self.val_y.min())) < 0 or top >= self.num_classes:
            raise DataError(f"{self.name}: labels must lie in 0..{self.num_classes - 1}, found {top}")

    @property
    def input_shape(self) -> Tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])

    @property
    def num_train(self) -> int:
        return len(self.train_y)

    @property
    def num_val(self) -> int:
        return len(self.val_y)

    def sample_inputs(self, count: int) -> torch.Tensor:
        """The first `count` training images as floats in 0..1 (to probe a model's shapes and speed)."""
        return self.train_x[:count].to(self.dtype) / 255

    @classmethod
    def from_numpy(cls, name, train_x, train_y, val_x, val_y, *, augment=False, flip=False, num_classes=10):
        def as_tensor(a):
            return torch.from_numpy(np.ascontiguousarray(a))

        return cls(
            name,
            as_tensor(train_x),
            as_tensor(train_y).long(),
            as_tensor(val_x),
            as_tensor(val_y).long(),
            num_classes=num_classes,
            augment=augment,
            flip=flip,
        )

    def channel_stats(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-channel mean and standard deviation of the training images, on the 0..1 scale."""
        x = self.train_x.to(torch.float64).div_(255)
        mean = x.mean(dim=(0, 2, 3))
        std = x.std(dim=(0, 2, 3)).clamp_min(1e-6)
        return mean.float(), std.float()


def synthetic_dataset(*, size: int, shape=(1, 28, 28), seed: int = 0, num_classes: int = 10) -> ArrayDataset:
    """Random images and labels for benchmarks; a fifth of `size` (at least one) is held out."""
    generator = torch.Generator().manual_seed(seed)
    held_out = max(1, size // 5)
    x = torch.randint(0, 256, (size + held_out, *shape), dtype=torch.uint8, generator=generator)
    y = torch.randint(0, num_classes, (size + held_out,), generator=generator)
    return ArrayDataset("synthetic", x[:size], y[:size], x[size:], y[size:], num_classes=num_classes)
