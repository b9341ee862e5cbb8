"""Storage for what a rank holds of a model built on the meta device, filled with its one-device values.

Strategies prepare a meta-device model in their fixed order (stages, tensor plan, activation checkpointing,
FSDP2) and then call `materialise`: every tensor this rank holds gets storage on the device, and its part of
the tensor's one-device initial value (parallel/meta.py makes those one module at a time, from a seed per module
name): a DTensor its shard or slice, in any placement (FSDP2 over a tensor split included), a plain tensor all
of it. Shards, slices, stages and one device therefore start from the same weights. With a pretrained
checkpoint (--init-from, runtime/pretrained.py) its values replace the initial ones: each rank reads the pieces
it holds, and only tensors the checkpoint lacks are initialised.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .meta import full_values, is_meta, to_empty

__all__ = ["is_meta", "materialise"]


def _named_tensors(model: nn.Module) -> dict:
    """name -> tensor of every parameter and buffer `model` holds, ties included."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


@torch.no_grad()
def materialise(
    model: nn.Module, blueprint: nn.Module, *, device, seed: int, reorder=None, weights=None
) -> bool:
    """Give `model`'s tensors storage on `device` and this rank's part of their one-device values; the names of
    `model`'s tensors are those of the meta-device `blueprint` (the whole model before it was split). `reorder`:
    name -> the row order a tensor's rows take on the ranks (fused layers of a tensor plan). `weights`: a
    `Pretrained` checkpoint whose values replace the initial ones. Returns whether there was anything to do
    (False: `model` is not on the meta device)."""
    if not is_meta(model):
        return False
    to_empty(model, device=device)
    targets = _named_tensors(model)
    reorder = reorder or {}
    if weights is not None:
        filled, wholes = weights.read_into(targets, reorder=reorder)
        for name, full in wholes.items():
            _write(targets[name], full[reorder[name]] if name in reorder else full)
        targets = {name: t for name, t in targets.items() if name not in filled and name not in wholes}
        if not targets:
            return True
    for names, value in full_values(blueprint, seed, wanted=set(targets)):
        for name in names:
            if name in targets:
                full = value[reorder[name]] if name in reorder else value
                _write(targets[name], full)
    return True


def _write(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` (the whole tensor) into `target` (a DTensor's local part, or all)."""
    if not hasattr(target, "device_mesh"):
        target.copy_(full)
        return
    from torch.distributed.tensor import distribute_tensor

    mesh, placements, full = target.device_mesh, target.placements, full.to(target.device)
    try:  # every rank holds the whole value: cut its part locally, no communication
        part = distribute_tensor(full, mesh, placements, src_data_rank=None)
    except TypeError:  # torch before 2.6: rank 0's value (the same) is scattered
        part = distribute_tensor(full, mesh, placements)
    target.to_local().copy_(part.to_local())
