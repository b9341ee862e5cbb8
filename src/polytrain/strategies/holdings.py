"""What a rank holds, as the splitting strategies' start-up lines say it: its parameters (its part of each
DTensor), as many gradients, and the optimizer's state slots per parameter, next to what a whole replica holds."""

from __future__ import annotations

import torch

from ..parallel.fsdp import GATHERED_IN_BF16, mixed_precision
from ..parallel.layout import Layout
from .optimizer_state import state_slots


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view of its storage: collectives write into it), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def whole(value):
    """A DTensor's whole value (a collective over its mesh), else the value."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def part_like(value, like):
    """The whole tensor `value` as a DTensor placed as `like` (this rank's part of it: its slice or shard, cut as
    torch.chunk cuts, FSDP2's shards of a tensor slice included); anything else as it is."""
    if not hasattr(like, "device_mesh") or not isinstance(value, torch.Tensor) or value.shape != like.shape:
        return value
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh, part = like.device_mesh, value.to(like.device)
    try:  # every rank holds the whole value: its part is cut locally, no communication
        return distribute_tensor(part, mesh, like.placements, src_data_rank=None)
    except TypeError:  # torch before 2.6 (no src_data_rank): plain shards, one dimension after another
        for dim, placement in enumerate(like.placements):
            if placement.is_shard():
                part = part.chunk(mesh.size(dim), dim=placement.dim)[mesh.get_local_rank(dim)]
        return DTensor.from_local(part.contiguous(), mesh, like.placements, run_check=False)


def local_bytes(tensors) -> int:
    """Bytes of this rank's parts of `tensors`."""
    total = 0
    for tensor in tensors:
        part = local_part(tensor)
        total += part.numel() * part.element_size()
    return total


def optimizer_slots(optimizer) -> int:
    """State tensors per parameter, counted on a probe of the same class and settings."""
    return state_slots(type(optimizer), optimizer.defaults)


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def heading(slots: int) -> str:
    return f"per rank, parameters + gradients + optimizer state ({slots} slot{'s' if slots != 1 else ''} per parameter)"


def figures(parameters: int, slots: int, stepped: int = None, *, trained: int = None) -> str:
    """`P + G + S`: parameters, the gradients of the `trained` bytes (default all; frozen ones have none), and
    the optimizer's state of the `stepped` bytes (default the trained)."""
    trained = parameters if trained is None else trained
    return f"{mib(parameters)} + {mib(trained)} + {mib((trained if stepped is None else stepped) * slots)}"


def beside(layout: Layout) -> str:
    """The tensor groups beside each other in `layout`, in words ("" for one group)."""
    groups = layout.world_size // layout.tensor
    if groups == 1:
        return ""
    if layout.replicate > 1:
        shards = groups // layout.replicate
        return f"; {groups} such groups as {layout.replicate} replicas of {shards} shards (hybrid sharding)"
    return f"; {groups} such groups side by side, FSDP2 over them"


def holding_lines(
    layout: Layout, rows: list, slots: int, full: tuple, *, tensor_plan=None, offload: bool, precision: str
) -> list:
    """The start-up lines of what each rank holds where ranks hold parts of the model: `rows` of (rank, device,
    bytes of parameters held, of those that train: their gradients, and optimizer state from its `slots` per
    parameter, after its first step) beside `full` (bytes, trained bytes) of a whole replica; the first line
    says how the model is split (a tensor plan's layers, or FSDP2's shards, hybrid where the layout has
    replicas)."""
    if tensor_plan is not None:
        lines = [f"tensor: {tensor_plan.describe(layout)}{beside(layout)}; {heading(slots)}"]
    elif layout.data_parallel == "replicate":  # DDP's copies, each with parts of the model split over them
        lines = [f"data: {layout.describe()}; {heading(slots)}"]
    else:
        sharding, ranks = layout.sharding, f"{layout.world_size} ranks"
        if sharding.replicate > 1:
            ranks = f"{sharding.replicate} replicas of {sharding.shard} shards (hybrid sharding)"
        lines = [
            f"sharded: {ranks}; {heading(slots)}"
            + (", held in host memory (--cpu-offload)" if offload else "")
            + (GATHERED_IN_BF16 if mixed_precision(precision) else "")
        ]
    for rank, device, size, trained in rows:
        where = ""
        if tensor_plan is not None:
            where = f", data shard {layout.data_rank(rank) + 1}/{layout.data_degree}" * (
                layout.data_degree > 1
            )
            where += layout.place(rank)
        whole = (
            "a replica"
            if tensor_plan is not None
            else "whole experts"
            if layout.data_parallel == "replicate"
            else "data parallel"
        )
        lines.append(
            f"  rank {rank} ({device}{where}): {figures(size, slots, trained=trained)}; {whole} would hold "
            f"{figures(full[0], slots, trained=full[1])}"
        )
    return lines
