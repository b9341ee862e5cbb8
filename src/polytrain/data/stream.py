"""Your own `torch.utils.data.Dataset`s, loaded in the same global sample order as the device-resident path.

A batch sampler cuts each epoch's `global_batch_order` into global batches and yields this rank's slice of
each, so one device and N devices read the same samples in the same steps, and a resumed epoch continues at
its step. `DataLoader` worker processes read and collate the samples ahead of the step (pinned memory on a
GPU); one pool per rank serves both the training and the validation set. Every collated batch is checked in
the worker: a sample of the wrong type or shape, or a label out of range, comes back as one line naming the
dataset and the index, never as a traceback from a worker process.
"""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass
from functools import partial
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from ..errors import DataError
from .collate import Collated, Problem, collate_checked, fetch, places, skeleton, tensor_words, unpack
from .order import Batch, eval_parts, global_batch_order, map_tree, rank_slice, rows


@dataclass
class SampleSpec:
    """What every sample must look like: the first training sample's input and target (for items without a
    separate target, the first tensor), and the shape and type of every tensor of it by its place."""

    x_shape: Tuple[int, ...]
    x_dtype: torch.dtype
    y_shape: Tuple[int, ...]
    y_dtype: torch.dtype
    num_classes: Optional[int] = None  # classification: labels must lie in 0..num_classes-1
    form: str = "pair"  # pair: (input, target); dict or tuple: tensors without a target
    layout: Optional[dict] = None  # place ("[0]", "['input_ids']") -> (shape, dtype) of every tensor
    skeleton: object = None  # the item's structure with each tensor's place in its stead


@dataclass
class DatasetPair:
    """A training and a validation `Dataset` of (input, target) pairs, with what polytrain learned of them."""

    train: Dataset
    val: Dataset
    spec: SampleSpec
    num_workers: int = 0
    name: str = "dataset"
    classes: Optional[List[str]] = None
    augment: bool = False  # augmentation belongs in the Dataset's own transforms
    flip: bool = False
    # "language": targets are token ids (T,) and the model scores every position (next-token cross-entropy)
    kind: str = "classification"

    @property
    def input_shape(self) -> Tuple[int, ...]:
        return self.spec.x_shape

    @property
    def num_classes(self) -> Optional[int]:
        return self.spec.num_classes

    @property
    def num_train(self) -> int:
        return len(self.train)

    @property
    def num_val(self) -> int:
        return len(self.val)

    def sample_inputs(self, count: int):
        """The first `count` training inputs as one batch (to probe a model's shapes and speed): images as
        floats, token ids as the integers they are."""
        x = self.sample_batch(count)[0]
        return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.uint8 else x

    def sample_batch(self, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The first `count` training samples, collated and checked like every batch."""
        batch = collate_checked(
            [(("train", i), fetch(self.train, "train", i)) for i in range(min(count, len(self.train)))],
            self.spec,
        )
        if isinstance(batch, Problem):
            raise DataError(batch.message)
        return batch.x, batch.y


def default_workers(processes: int = 1) -> int:
    """Loader processes per rank: the cores this rank's share leaves beside itself, at least 1, at most 4."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores // max(1, processes) - 1))


def spec_of(dataset: Dataset, *, num_classes: Optional[int], what: str = "train") -> SampleSpec:
    """Read sample 0 of `dataset` (the caller's `train=`) and describe it; one line if it is unusable."""
    if len(dataset) == 0:
        raise DataError(f"{what}= is empty (0 samples); pass a Dataset with samples")
    sample = fetch(dataset, what, 0)
    if isinstance(sample, Problem):
        raise DataError(sample.message)
    form, x, y = unpack(sample, what, 0)
    item = x if y is None else (x, y)
    layout = places(item, f"{what}[0]")
    if not layout:
        raise DataError(f"{what}[0] holds no tensor; a Dataset must return tensors, arrays or numbers")
    first = next(iter(layout.values()))
    target = layout.get("[1]", ((), None)) if y is not None else ((), None)
    spec = SampleSpec(*first, *target, num_classes, form=form, layout=layout, skeleton=skeleton(item))
    if num_classes is not None:
        check_class_targets(spec, what)
    return spec


def check_class_targets(spec: SampleSpec, what: str = "train") -> None:
    """Classification needs targets that are single class indices."""
    if spec.y_shape != () or spec.y_dtype.is_floating_point or spec.y_dtype == torch.bool:
        raise DataError(
            f"{what}[0]'s target is {tensor_words(spec.y_dtype, spec.y_shape)}; classification needs "
            f"one whole-number class index per sample (or pass loss= for another objective)"
        )


class _Indexed(Dataset):
    """Both splits behind one index space of (split, index, epoch) keys, so one worker pool serves both.

    Each item is read with the random generators (torch's, Python's, NumPy's) seeded from the run's seed, the
    epoch and the index, and restored after: a Dataset's random transforms then draw the same for a sample in
    an epoch whichever loader process reads it and however many there are, and reading in the training
    process (no loader processes) leaves the generators that dropout draws from untouched."""

    def __init__(self, train: Dataset, val: Dataset, seed: int = 0):
        self.splits = {"train": train, "val": val}
        self.seed = seed

    def __getitem__(self, key):
        split, index, epoch = key
        with sample_random_state((self.seed * 1_000_003 + epoch) * 10_000_019 + index + (split == "val")):
            return (split, index), fetch(self.splits[split], split, index)

    def __len__(self) -> int:
        return sum(len(split) for split in self.splits.values())


class _BatchList:
    """The batch sampler: the (split, index) keys of each of this rank's batches, for the current pass."""

    def __init__(self):
        self.batches: List[List[tuple]] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class StreamLoader:
    """Training or evaluation batches of one rank from a `DatasetPair`, in the global sample order."""

    def __init__(
        self,
        data: DatasetPair,
        split: str,
        *,
        batch_size: int,
        device,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        channels_last: bool = False,
        pool=None,
    ):
        self.data, self.split = data, split
        self.dataset = data.train if split == "train" else data.val
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.memory_format = (
            torch.channels_last if channels_last and len(data.spec.x_shape) == 3 else torch.contiguous_format
        )
        self.pool = pool or _Pool(data, self.device, seed)

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch_size)

    @property
    def num_samples(self) -> int:
        return len(self.dataset)

    def train_batches(self, epoch: int, *, start_step: int = 0) -> Iterator[Batch]:
        order = global_batch_order(len(self.dataset), epoch=epoch, seed=self.seed)
        steps = range(start_step, len(self))
        globals_ = [order[step * self.batch_size : (step + 1) * self.batch_size] for step in steps]
        keys = [
            [(self.split, int(i), epoch) for i in rank_slice(g, rank=self.rank, world_size=self.world_size)]
            for g in globals_
        ]
        for step, global_batch, batch in zip(steps, globals_, self.pool.run(keys)):
            yield self._batch(batch, len(global_batch), step)

    def eval_batches(self) -> Iterator[Batch]:
        parts = eval_parts(
            len(self.dataset), rank=self.rank, world_size=self.world_size, batch_size=self.batch_size
        )
        keys = [[(self.split, int(i), -1) for i in part] for part in parts if len(part)]
        for step, batch in enumerate(self.pool.run(keys)):
            yield self._batch(batch, rows(batch.x) if batch.y is None else len(batch.y), step)

    def _batch(self, batch: Collated, global_count: int, step: int) -> Batch:
        x = map_tree(lambda t: t.to(self.device, non_blocking=True), batch.x)
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point and x.dim() == 4:
            x = x.contiguous(memory_format=self.memory_format)
        y = batch.y.to(self.device, non_blocking=True) if batch.y is not None else None
        return Batch(x, y, global_count, step)


@contextlib.contextmanager
def sample_random_state(seed: int):
    """torch's CPU generator and Python's and NumPy's global ones seeded with `seed` inside; in the training
    process (no loader processes) restored after, in a loader process left as they are (the next sample seeds
    them again)."""
    in_training_process = get_worker_info() is None
    if in_training_process:
        saved = torch.default_generator.get_state(), random.getstate(), np.random.get_state()
    torch.default_generator.manual_seed(seed % (2**63))
    random.seed(seed)
    np.random.seed(seed % (2**32))
    try:
        yield
    finally:
        if in_training_process:
            torch.default_generator.set_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])


class _Pool:
    """One `DataLoader` (and its persistent workers) per rank, fed a new list of batches each pass."""

    def __init__(self, data: DatasetPair, device: torch.device, seed: int = 0):
        self.batch_list = _BatchList()
        workers = data.num_workers
        # its own generator: each pass's DataLoader iterator draws a base seed, which would otherwise come from
        # the global generator that dropout draws from, once per pass without loader processes and once per
        # run with them (the same seed gave other weights with another core count)
        self.loader = DataLoader(
            _Indexed(data.train, data.val, seed),
            batch_sampler=self.batch_list,
            num_workers=workers,
            collate_fn=partial(collate_checked, spec=data.spec),
            pin_memory=device.type == "cuda",
            persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(seed),
            **({"prefetch_factor": 4} if workers > 0 else {}),
        )

    def run(self, batches: List[List[tuple]]) -> Iterator[Collated]:
        self.batch_list.batches = batches
        for batch in self.loader:
            if isinstance(batch, Problem):
                raise DataError(batch.message)
            yield batch


def make_stream_loaders(
    data: DatasetPair,
    *,
    batch_size: int,
    device,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    channels_last: bool = False,
    eval_batch_size: Optional[int] = None,
):
    common = dict(device=device, rank=rank, world_size=world_size, seed=seed, channels_last=channels_last)
    train = StreamLoader(data, "train", batch_size=batch_size, **common)
    val = StreamLoader(
        data, "val", batch_size=eval_batch_size or max(batch_size, 256), pool=train.pool, **common
    )
    return train, val
