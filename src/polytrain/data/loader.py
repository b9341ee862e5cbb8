"""Device-resident batches cut from a *global* sample order.

The whole split lives on the device as uint8. Each epoch is a seeded permutation of all samples; global
batch b is `order[b*B:(b+1)*B]`, and rank r of W takes the r-th of W near-equal slices of it. One device and
W devices therefore see the same samples in the same steps, and any (epoch, step) can be recomputed from the
seed alone, which is what makes mid-epoch resume exact.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from .augment import crop_and_flip
from .order import Batch, eval_parts, global_batch_order, rank_slice
from .stream import DatasetPair, make_stream_loaders

__all__ = ["Batch", "DeviceLoader", "global_batch_order", "make_loaders", "rank_slice"]


class DeviceLoader:
    """Normalised training or evaluation batches for one rank, from uint8 tensors moved once to `device`."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        batch_size: int,
        mean: torch.Tensor,
        std: torch.Tensor,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        augment: bool = False,
        flip: bool = True,
        channels_last: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        self.images = images.to(device)
        self.labels = labels.to(device)
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.augment = augment
        self.flip = flip
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        shape = (1, -1, 1, 1)
        # x_normalised = (x/255 - mean) / std  ==  x * scale + shift, fused into one multiply-add per batch
        self.scale = (1.0 / (255.0 * std.to(dtype))).reshape(shape).to(device)
        self.shift = (-mean.to(dtype) / std.to(dtype)).reshape(shape).to(device)

    def __len__(self) -> int:
        return -(-len(self.labels) // self.batch_size)

    @property
    def num_samples(self) -> int:
        return len(self.labels)

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        x = torch.addcmul(self.shift, images.to(self.scale.dtype), self.scale)
        return x.contiguous(memory_format=self.memory_format)

    def train_batches(self, epoch: int, *, start_step: int = 0) -> Iterator[Batch]:
        """Shuffled batches of `epoch`, from `start_step` on (to resume mid-epoch)."""
        # One host-to-device copy per epoch; every step then slices the order on the device, so no step
        # waits for a copy from the host.
        order = global_batch_order(len(self.labels), epoch=epoch, seed=self.seed).to(self.device)
        for step in range(start_step, len(self)):
            global_batch = order[step * self.batch_size : (step + 1) * self.batch_size]
            index = rank_slice(global_batch, rank=self.rank, world_size=self.world_size)
            images = self.images[index]
            if self.augment:
                images = self._augment(images, len(global_batch), epoch=epoch, step=step)
            yield Batch(self.normalise(images), self.labels[index], len(global_batch), step)

    def eval_batches(self) -> Iterator[Batch]:
        """This rank's contiguous shard of the split in order: no sample padded, dropped or repeated."""
        parts = eval_parts(
            len(self.labels), rank=self.rank, world_size=self.world_size, batch_size=self.batch_size
        )
        for step, part in enumerate(parts):
            index = part.to(self.device, non_blocking=True)
            yield Batch(self.normalise(self.images[index]), self.labels[index], len(index), step)

    def _augment(self, images: torch.Tensor, global_count: int, *, epoch: int, step: int) -> torch.Tensor:
        # Draw the random crops and flips for the whole global batch, then keep this rank's rows, so the
        # augmented samples do not depend on the number of devices.
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 100_003 + step)
        pad = 4
        offsets = torch.randint(0, 2 * pad + 1, (global_count, 2), generator=generator)
        flips = (torch.rand(global_count, generator=generator) < 0.5) & self.flip
        rows = rank_slice(torch.arange(global_count), rank=self.rank, world_size=self.world_size)
        return crop_and_flip(images, offsets[rows].to(self.device), flips[rows].to(self.device), pad=pad)


# a validation pass reads this many training passes' samples by default (`make_loaders`)
EVAL_PASSES = 2


def training_pass(batch_size: int, world_size: int, accumulate: int = 1) -> int:
    """The most samples one rank computes in one training pass: its slice of the global batch (the first ranks
    take one more where it does not divide), over `accumulate` passes."""
    per_rank = -(-batch_size // world_size)
    return max(1, -(-per_rank // accumulate))


def make_loaders(
    dataset,
    *,
    batch_size: int,
    device,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    augment: Optional[bool] = None,
    channels_last: bool = False,
    eval_batch_size: Optional[int] = None,
    accumulate: int = 1,
):
    """Training and validation loaders: device-resident for an in-memory dataset (normalised with the training
    set's per-channel statistics) and for text (token windows, text.py), loader processes for `Dataset`s (see
    stream.py). Validation reads `eval_batch_size` samples per rank in each pass; by default, for text and
    `Dataset`s, `EVAL_PASSES` training passes' worth of this rank's samples (a pass: its slice of the global
    batch over `accumulate` passes), at most the larger of the global batch and 256: validation keeps no
    activations for a backward pass, but its memory grows with the samples of a pass (on a 4-block Llama,
    64 passes' worth held twice training's peak, 8 passes' 15% more than training, 1 pass's less); for
    in-memory images the larger of the global batch and 1024."""
    streamed = getattr(dataset, "kind", None) == "language" or isinstance(dataset, DatasetPair)
    if eval_batch_size is None and streamed:
        passes = EVAL_PASSES * training_pass(batch_size, world_size, accumulate)
        eval_batch_size = min(max(batch_size, 256), passes)
    if getattr(dataset, "kind", None) == "language" and not isinstance(dataset, DatasetPair):
        from .text import make_token_loaders

        return make_token_loaders(
            dataset,
            batch_size=batch_size,
            device=device,
            rank=rank,
            world_size=world_size,
            seed=seed,
            eval_batch_size=eval_batch_size,
        )
    if isinstance(dataset, DatasetPair):
        return make_stream_loaders(
            dataset,
            batch_size=batch_size,
            device=device,
            rank=rank,
            world_size=world_size,
            seed=seed,
            channels_last=channels_last,
            eval_batch_size=eval_batch_size,
        )
    mean, std = dataset.channel_stats()
    augment = dataset.augment if augment is None else augment
    common = dict(
        mean=mean,
        std=std,
        device=device,
        rank=rank,
        world_size=world_size,
        seed=seed,
        channels_last=channels_last,
        dtype=getattr(dataset, "dtype", torch.float32),
    )
    train = DeviceLoader(
        dataset.train_x, dataset.train_y, batch_size=batch_size, augment=augment, flip=dataset.flip, **common
    )
    val = DeviceLoader(
        dataset.val_x, dataset.val_y, batch_size=eval_batch_size or max(batch_size, 1024), **common
    )
    return train, val
