"""Batched, device-side augmentation: whole-batch tensor ops, no per-sample Python."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def crop_and_flip(
    images: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor, *, pad: int
) -> torch.Tensor:
    """Random-crop each image from a zero-padded copy and mirror the rows where `flips` is set.

    images: (N, C, H, W); offsets: (N, 2) top-left corners in 0..2*pad; flips: (N,) bool.
    """
    n, c, h, w = images.shape
    if n == 0:
        return images
    padded = F.pad(images, (pad, pad, pad, pad))
    rows = offsets[:, 0:1] + torch.arange(h, device=images.device)  # (N, H)
    cols = offsets[:, 1:2] + torch.arange(w, device=images.device)  # (N, W)
    cols = torch.where(flips[:, None], cols.flip(1), cols)
    batch = torch.arange(n, device=images.device)[:, None, None, None]
    channel = torch.arange(c, device=images.device)[None, :, None, None]
    return padded[batch, channel, rows[:, None, :, None], cols[:, None, None, :]]
