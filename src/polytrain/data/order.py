"""The global sample order every loader cuts its batches from, and each rank's slice of a global batch.

One device and W devices see the same samples in the same steps because both cut the same seeded permutation
the same way; any (epoch, step) can be recomputed from the seed alone, which is what makes mid-epoch resume
exact. The device-resident loader (loader.py) and the Dataset stream (stream.py) both build on this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch


def global_batch_order(num_samples: int, *, epoch: int, seed: int) -> torch.Tensor:
    """The permutation of sample indices for one epoch, identical on every rank and every device count."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def rank_slice(global_batch: torch.Tensor, *, rank: int, world_size: int) -> torch.Tensor:
    """This rank's share of a global batch: contiguous, sizes differing by at most one."""
    return torch.tensor_split(global_batch, world_size)[rank]


def eval_parts(num_samples: int, *, rank: int, world_size: int, batch_size: int) -> tuple:
    """This rank's contiguous shard of `num_samples` validation samples, cut into as many parts as the largest
    shard needs at `batch_size` (sizes differing by at most one): every rank runs the same number of forward
    passes, which ranks that gather weights together (FSDP2) or split layers (tensor parallelism) need, and no
    sample is padded, dropped or repeated."""
    shard = rank_slice(torch.arange(num_samples), rank=rank, world_size=world_size)
    largest = -(-num_samples // world_size)
    return torch.tensor_split(shard, max(1, -(-largest // batch_size)))


@dataclass
class Batch:
    x: Any  # this rank's slice of the inputs: a tensor (images: float, normalised), or a
    # tuple or dict of tensors (a Dataset's items without a separate target)
    y: Optional[
        torch.Tensor
    ]  # the targets (None: the items carry none; the model or the step computes the loss)
    global_count: int  # samples in the whole global batch (all ranks)
    step: int  # index of the batch within the epoch

    def __len__(self) -> int:
        """Samples in this rank's slice."""
        return len(self.y) if self.y is not None else rows(self.x)

    @property
    def whole(self):
        """The batch as a step function receives it: (inputs, targets), or the tuple or dict of the items."""
        return self.x if self.y is None else (self.x, self.y)


def map_tree(fn: Callable[[torch.Tensor], torch.Tensor], value):
    """`fn` applied to every tensor of a tensor, tuple, list or dict (of those), keeping the structure."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: map_tree(fn, item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(map_tree(fn, item) for item in value)
    return value


def leaves(value) -> List[torch.Tensor]:
    """The tensors of a tensor, tuple, list or dict, in order."""
    found = []
    map_tree(lambda t: found.append(t) or t, value)
    return found


def rows(value) -> int:
    """Samples in a batch of any structure: the first dimension of its first tensor."""
    tensors = leaves(value)
    return len(tensors[0]) if tensors else 0


def split_rows(value, parts: int) -> list:
    """`value` cut along its samples into `parts` near-equal parts (as torch.tensor_split), structure kept."""
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, parts))
    if value is None:
        return [None] * parts
    if isinstance(value, dict):
        cut = {key: split_rows(item, parts) for key, item in value.items()}
        return [{key: cut[key][i] for key in value} for i in range(parts)]
    if isinstance(value, (tuple, list)):
        cut = [split_rows(item, parts) for item in value]
        return [type(value)(column[i] for column in cut) for i in range(parts)]
    return [value] * parts
