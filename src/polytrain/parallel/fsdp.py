"""FSDP2 (`torch.distributed.fsdp.fully_shard`) as polytrain applies it: one unit per block, then the root, over
the data dimensions of the run's mesh, with the bf16 policy and host-memory offload where asked. The sharded
and tensor strategies (through `parallelize`) and a pipeline's stages (pipeline/sharding.py) shard with it."""

from __future__ import annotations

import logging
import warnings
from functools import partial

import torch
import torch.nn as nn

from .units import shard_units


def own_tensor(module, inputs, output):
    """A unit whose output is a view (an nn.Linear given (B, T, C) with a bias returns a view of its (B*T, C)
    product) makes FSDP2 warn that an in-place op on the view would skip its backward hook. Nothing else holds
    that output: the unit returns it as a tensor of its own (the same memory and numbers, no copy)."""
    if isinstance(output, torch.Tensor) and output._base is not None:
        return torch.ops.aten._unsafe_view(output, output.shape)
    if isinstance(output, tuple) and type(output) is tuple:  # (nn.MultiheadAttention: output, weights)
        owned = [own_tensor(module, inputs, item) for item in output]
        if any(item is not None for item in owned):
            return tuple(item if new is None else new for item, new in zip(output, owned))
    return None


def mixed_precision(precision: str) -> dict:
    """fully_shard's options for --precision bf16 (sharded, tensor, and pipelines of shards): parameters cast to
    bfloat16 for the forward and backward passes and gathered so (half the bytes of each all-gather and of the
    layer gathered whole), gradients reduced in float32 into the float32 shards the optimizer steps (the master
    weights)."""
    if precision != "bf16":
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


# the start-up line's words where `mixed_precision` gives a policy
GATHERED_IN_BF16 = ", gathered in bf16 for compute (float32 master shards)"


def _placement(parameter, *, shards: int):
    """FSDP2's cut of `parameter`: along dimension 0, as by default, but a mixture's stacked experts ([E, F, D],
    models/moe.py) fewer than the shards are cut along their second dimension, so that every rank holds 1/shards
    of them (along dimension 0, ranks past the E-th would hold none and the others 1/E)."""
    from torch.distributed.tensor import Shard

    return Shard(1) if parameter.dim() == 3 and parameter.shape[0] < shards else None


def shard_model(model: nn.Module, **options) -> nn.Module:
    """`model` sharded with FSDP2 (`fully_shard`'s `options`), one unit per block, or per layer outside blocks
    (units.py), then the root: only a unit's full weights (and the next one's, prefetched) exist at a time."""
    from torch.distributed.fsdp import fully_shard

    mesh = options.get("mesh")
    if mesh is not None and "shard_placement_fn" not in options:
        options["shard_placement_fn"] = partial(_placement, shards=mesh.shape[-1])
    for _, unit in shard_units(model):
        unit.register_forward_hook(own_tensor)  # (before FSDP2's hook, which checks it)
        _shard_over_own_ranks(unit, options)
        fully_shard(unit, **options)
    model.register_forward_hook(own_tensor)  # the root's output too (a head kept in the root returns a view)
    fully_shard(model, **options)
    return model


# the attribute by which a step of `parallelize` gives a module ranks of its own to be sharded over (a DeviceMesh):
# expert parallelism's mixtures, whose experts FSDP2 shards over the ranks that hold the same ones
SHARD_OVER = "shard_over"


def _shard_over_own_ranks(unit: nn.Module, options: dict) -> None:
    """FSDP2 over its own ranks for each module in `unit` that a step gave some (`SHARD_OVER`), before the unit
    (which then leaves their parameters to them), averaging their gradients over those ranks."""
    from torch.distributed.fsdp import fully_shard

    for module in unit.modules():
        ranks = getattr(module, SHARD_OVER, None)
        if ranks is not None:
            placement = partial(_placement, shards=ranks.shape[-1])
            fully_shard(module, **dict(options, mesh=ranks, shard_placement_fn=placement))


def apply_fsdp(
    module: nn.Module,
    mesh,
    *,
    precision: str,
    cpu_offload: bool = False,
    roots: tuple = (),
    sums: bool = False,
    keep_gathered: bool = False,
) -> None:
    """Step 6 with shards: FSDP2 over the data dimensions of the run's `mesh` (its `fsdp`: dp_shard, the context ranks
    folded in, within each dp_replicate copy for hybrid sharding), one unit per block (units.py), `module` the
    root, or each of `roots` (a pipeline rank's stages, which torch's schedule drives one by one). With `sums` the
    units sum the data ranks' gradients instead of averaging them (the loss is already divided by the global
    batch); with `keep_gathered` a unit keeps its gathered weights from its forward to its backward (a pipeline's
    micro-batches reuse them)."""
    if any(
        hasattr(p, "device_mesh") for p in module.parameters()
    ):  # FSDP2 over DTensors: a 2-D mesh, as torchtitan
        # DTensor advises, on every rank and step, to flatten the mesh for the norm's two all-reduces
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        # FSDP2 warns that the model's output is a view (the head's DTensor made local); nothing writes to it
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    options = {"mesh": mesh.fsdp, **mixed_precision(precision)}
    if cpu_offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        options["offload_policy"] = CPUOffloadPolicy()
    if keep_gathered:
        options["reshard_after_forward"] = False
    from torch.distributed.fsdp import FSDPModule

    for root in roots or (module,):
        shard_model(root, **options)
        for unit in root.modules():
            if sums and isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)
                if hasattr(unit, "set_force_sum_reduction_for_comms"):  # a plain sum (gloo has no other)
                    unit.set_force_sum_reduction_for_comms(True)
