"""The global sample order every loader cuts its batches from, and each rank's slice of a global batch.

One device and W devices see the same samples in the same steps because both cut the same seeded permutation
the same way; any (epoch, step) can be recomputed from the seed alone, which is what makes mid-epoch resume
exact. The device-resident loader (loader.py) and the Dataset stream (stream.py) both build on this.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def global_batch_order(num_samples: int, *, epoch: int, seed: int) -> torch.Tensor:
    """The permutation of sample indices for one epoch, identical on every rank and every device count."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def rank_slice(global_batch: torch.Tensor, *, rank: int, world_size: int) -> torch.Tensor:
    """This rank's share of a global batch: contiguous, sizes differing by at most one."""
    return torch.tensor_split(global_batch, world_size)[rank]


@dataclass
class Batch:
    x: torch.Tensor            # float, normalised, this rank's slice
    y: torch.Tensor            # int64
    global_count: int          # samples in the whole global batch (all ranks)
    step: int                  # index of the batch within the epoch
