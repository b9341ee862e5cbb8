"""One batch from a Dataset's items: each item unpacked and checked against the first one's form (shapes,
dtypes, classes), stacked, or carried to the training process as a `Problem` that names the bad sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError, first_line


def tensor_words(dtype: torch.dtype, shape) -> str:
    return f"a {str(dtype).replace('torch.', '')} tensor of shape {tuple(shape)}"


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return tensor_words(value.dtype, value.shape)
    kind = type(value)
    return (
        f"a {kind.__qualname__}"
        if kind.__module__ == "builtins"
        else f"a {kind.__module__}.{kind.__qualname__}"
    )


def as_tensor(value, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, np.generic, int, float, bool)):
        return torch.as_tensor(value)
    raise DataError(
        f"{what} is {describe(value)}; a Dataset must return tensors, arrays or numbers "
        f"(add a transform such as torchvision.transforms.ToTensor())"
    )


def unpack(sample, what: str, index):
    """(form, inputs, target or None) of a Dataset item: an (input, target) pair, a dict of tensors, or a
    tuple of another length (the last two are passed to the model whole and carry no separate target)."""
    if isinstance(sample, dict) and sample:
        return "dict", sample, None
    if isinstance(sample, (tuple, list)) and len(sample) == 2:
        return "pair", sample[0], sample[1]
    if isinstance(sample, (tuple, list)) and sample:
        return "tuple", tuple(sample), None
    raise DataError(
        f"{what}[{index}] returned {describe(sample)}; a Dataset must return (input, target), a tuple "
        f"of tensors or a dict of tensors"
    )


def places(value, what: str, found=None, at: str = "") -> dict:
    """Every tensor of an item by its place ("[0]", "['input_ids']", ...) -> (shape, dtype); numbers and
    arrays count as tensors, anything else is one line naming its place."""
    found = {} if found is None else found
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise DataError(
                    f"{what}{at} has the key {key!r}; a dict item needs string keys (the model's "
                    f"argument names)"
                )
            places(item, what, found, f"{at}[{key!r}]")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            places(item, what, found, f"{at}[{i}]")
    else:
        tensor = as_tensor(value, f"{what}{at}")
        found[at] = (tuple(tensor.shape), tensor.dtype)
    return found


def tensors_of(value):
    """The item with its numbers and arrays as tensors, structure kept."""
    if isinstance(value, dict):
        return {key: tensors_of(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return tuple(tensors_of(item) for item in value)
    return torch.as_tensor(value) if not isinstance(value, torch.Tensor) else value


def stack_items(items: list):
    """Items of one structure stacked along a new first dimension, as `default_collate` does."""
    first = items[0]
    if isinstance(first, dict):
        return {key: stack_items([item[key] for item in items]) for key in first}
    if isinstance(first, tuple):
        return tuple(stack_items([item[i] for item in items]) for i in range(len(first)))
    return torch.stack(items)


def skeleton(value, at: str = ""):
    """The item's structure with each tensor's place (as `places` names it) in its stead."""
    if isinstance(value, dict):
        return {key: skeleton(item, f"{at}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return tuple(skeleton(item, f"{at}[{i}]") for i, item in enumerate(value))
    return at


def empty_batch(spec, value=None):
    """A batch of no samples in the spec's structure (a rank's slice of a short last batch)."""
    value = spec.skeleton if value is None else value
    if isinstance(value, dict):
        return {key: empty_batch(spec, item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(empty_batch(spec, item) for item in value)
    shape, dtype = spec.layout[value]
    return torch.empty((0, *shape), dtype=dtype)


@dataclass
class Collated:
    x: object  # a tensor, or a tuple or dict of tensors
    y: Optional[torch.Tensor]

    def pin_memory(self) -> "Collated":  # called by the DataLoader's pinning thread on a GPU
        from .order import map_tree

        return Collated(map_tree(torch.Tensor.pin_memory, self.x), map_tree(torch.Tensor.pin_memory, self.y))


def fetch(dataset: Dataset, split: str, index: int):
    """`dataset[index]`, or a `Problem` that names the index and where the user's `__getitem__` raised."""
    try:
        return dataset[index]
    except Exception as error:
        return Problem(
            f"{split}[{index}] raised {type(error).__name__}: {first_line(error, 160)} ({where(error)})"
        )


def where(error: BaseException) -> str:
    """file:line of the innermost frame of `error`'s traceback."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "no traceback"


@dataclass
class Problem:
    """A bad sample (or one whose `__getitem__` raised), carried from a loader worker to the training process
    as data, not as an exception."""

    message: str


def collate_checked(samples, spec):
    """Stack ((split, index), item) pairs into one batch, or say which sample is wrong."""
    if spec.form != "pair" or list(spec.layout) != ["[0]", "[1]"]:  # not a pair of two tensors
        return collate_items(samples, spec)
    xs, ys = [], []
    try:
        for (split, index), sample in samples:
            what = f"{split}[{index}]"
            if isinstance(sample, Problem):
                return sample
            form, x, y = unpack(sample, split, index)
            if form != "pair" or not isinstance(x, torch.Tensor) and isinstance(x, (dict, tuple, list)):
                return collate_items(samples, spec)
            x, y = as_tensor(x, f"{what}'s input"), as_tensor(y, f"{what}'s target")
            if tuple(x.shape) != spec.x_shape or x.dtype != spec.x_dtype:
                raise DataError(
                    f"{what}'s input is {describe(x)}, but train[0]'s is "
                    f"{tensor_words(spec.x_dtype, spec.x_shape)}; every "
                    f"sample must have the same shape and type (resize or pad them)"
                )
            if tuple(y.shape) != spec.y_shape:
                raise DataError(
                    f"{what}'s target has shape {tuple(y.shape)}, but train[0]'s has {spec.y_shape}"
                )
            if spec.num_classes is not None and not 0 <= int(y) < spec.num_classes:
                raise DataError(
                    f"{what} has label {int(y)}, outside 0..{spec.num_classes - 1} (the model gives "
                    f"{spec.num_classes} class scores)"
                )
            xs.append(x)
            ys.append(y.to(spec.y_dtype) if spec.num_classes is None else y.long())
    except DataError as error:
        return Problem(str(error))
    if not xs:  # this rank's slice of a short last batch
        return Collated(
            torch.empty((0, *spec.x_shape), dtype=spec.x_dtype),
            torch.empty((0, *spec.y_shape), dtype=torch.long if spec.num_classes else spec.y_dtype),
        )
    return Collated(torch.stack(xs), torch.stack(ys))


def collate_items(samples, spec):
    """Items of any structure (dicts, tuples, pairs of those) stacked place by place, or which one is wrong."""
    items = []
    try:
        for (split, index), sample in samples:
            if isinstance(sample, Problem):
                return sample
            what = f"{split}[{index}]"
            form, x, y = unpack(sample, split, index)
            item = x if y is None else (x, y)
            layout = places(item, what)
            if form != spec.form or list(layout) != list(spec.layout):
                raise DataError(
                    f"{what} holds tensors at {', '.join(layout) or 'no place'}, but train[0] at "
                    f"{', '.join(spec.layout)}; every item must have the same structure"
                )
            for at, (shape, dtype) in layout.items():
                if (shape, dtype) != spec.layout[at]:
                    raise DataError(
                        f"{what}{at} is {tensor_words(dtype, shape)}, but train[0]{at} is "
                        f"{tensor_words(spec.layout[at][1], spec.layout[at][0])}; every sample must have "
                        f"the same shapes and types (pad them to one length)"
                    )
            items.append(tensors_of(item))
    except DataError as error:
        return Problem(str(error))
    whole = stack_items(items) if items else empty_batch(spec)
    if spec.form == "pair":
        return Collated(whole[0], whole[1])
    return Collated(whole, None)
