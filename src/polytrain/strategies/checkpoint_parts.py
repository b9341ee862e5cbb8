"""This rank's part of the model and optimizer state in the form torch.distributed.checkpoint writes and reads
(runtime/shards.py): `{"model": {name: tensor}, "optimizer": {"state": {name: {slot: tensor}}, "param_groups":
[{..., "params": [names]}]}}`, as `get_state_dict` gives it, keyed by the one-device names.

Split layers (DTensors) are written by DCP itself, each rank its slice at the slice's place in the whole tensor.
A fused layer (q, k and v in one colwise Linear) is the exception: its rows are reordered on the ranks so that
each rank's contiguous slice holds its rows of every part (tensor.py's `interleave`), and a DTensor of that
layout would be written in the ranks' order, not the one-device order. Of the routes to the one-device layout
(gather and reorder on one rank; a DTensor of a reshaped (parts, rows, ...) tensor, whose saved shape would
differ from one device's; each slice written as the blocks of rows it is in the one-device tensor) this takes
the last: `Blocks` tells DCP where each run of a rank's rows lies in the whole tensor, for writing and for
reading into the rank's own tensors in place. Nothing is gathered, the saved tensors are exactly one device's,
and any other layout (FSDP2 on any number of ranks, one process) reads them as it reads any DCP checkpoint.

Reading in place also keeps clear of `set_model_state_dict`, which asserts when a tensor-split vocabulary does
not divide evenly (65 tokens on 2 ranks): DCP fills each rank's slices where they lie, even or not.
"""

from __future__ import annotations

import torch

from .optimizer_state import SPEED


class Blocks:
    """A rank's local tensor that lies in the whole tensor (of `size`) as several blocks of its rows: (offsets in
    the whole tensor, sizes, first and end row in the local tensor). DCP writes each block at its offsets and
    reads into the local rows in place (the planners of runtime/shards.py look blocks up by `piece`)."""

    def __init__(self, local: torch.Tensor, size, blocks: list):
        self.local, self.global_size, self.blocks = local, torch.Size(size), blocks

    def size(self) -> torch.Size:
        return self.global_size

    def __create_write_items__(self, fqn: str, _):
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                    properties=properties,
                    size=self.global_size,
                ),
            )
            for offsets, sizes, *_ in self.blocks
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, *_ in self.blocks]

    def piece(self, offsets) -> torch.Tensor:
        """The rows of the local tensor that hold the block at `offsets` (in the whole tensor): a view."""
        for block, _, first, end in self.blocks:
            if tuple(block) == tuple(offsets):
                return self.local[first:end]
        raise ValueError(f"no block of this rank begins at {tuple(offsets)}")

    def clone(self) -> "Blocks":
        """The same blocks of a copy of the local tensor (a snapshot that training does not change)."""
        return Blocks(self.local.detach().clone(), self.global_size, self.blocks)


def fused_rows(value, order: torch.Tensor) -> Blocks:
    """A DTensor whose rows are held in `order` (row i of the ranks' layout is row order[i] of one device's) as
    the blocks of consecutive one-device rows its local slice holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = value.to_local()
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    rows = order[offset[0] : offset[0] + shape[0]].tolist()
    blocks, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            sizes = (i - start, *shape[1:])
            blocks.append(((rows[start], *offset[1:]), sizes, start, i))
            start = i
    return Blocks(local, value.shape, blocks)


def in_one_device_rows(state: dict, fused: dict) -> dict:
    """`state` (get_state_dict's form) with the fused layers' parameters, and their optimizer slots of the same
    shape (momentum, Adam's moments), as `fused_rows`."""
    if not fused:
        return state

    def rows(name, value, like):
        if name in fused and hasattr(value, "device_mesh") and value.shape == like.shape:
            return fused_rows(value, fused[name])
        return value

    model = state["model"]
    result = dict(state, model={name: rows(name, value, value) for name, value in model.items()})
    if "optimizer" in state:
        slots = state["optimizer"]["state"]
        result["optimizer"] = dict(
            state["optimizer"],
            state={
                name: {slot: rows(name, value, model[name]) for slot, value in held.items()}
                for name, held in slots.items()
            },
        )
    return result


def named_optimizer(optimizer, names: dict, groups: list) -> dict:
    """The optimizer's state keyed by parameter names (`names`: id(parameter) -> its one-device name; others
    left out) and `groups`, the whole model's groups by name (every rank writes the same)."""
    optimizer_state = optimizer.state_dict()
    return {
        "state": {
            names[id(p)]: optimizer.state[p]
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) in names and p in optimizer.state
        },
        "param_groups": [
            dict({k: v for k, v in group.items() if k != "params"}, params=list(members))
            for group, members in zip(optimizer_state["param_groups"], groups)
        ],
    }


def apply_groups(optimizer, saved: list) -> None:
    """The saved groups' settings (learning rate, betas, ...) on the optimizer's groups; its kernel choices stay."""
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"it has {len(saved)} parameter group(s), this run {len(optimizer.param_groups)} "
            f"(--no-decay-norms-and-biases, --freeze or param_groups= differ)"
        )
    for group, theirs in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in theirs.items() if k != "params" and k not in SPEED})
