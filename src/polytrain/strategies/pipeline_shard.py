"""The shard degree of a pipeline: the pipelines side by side (`--devices N --pipeline-stages S`: N / S of them)
are FSDP2 shard groups of their stages instead of whole copies that all-reduce their gradients (torchtitan's
pp x fsdp), a step of `Pipeline.setup` where `--data-parallel shard` makes the shard degree above 1.

    polytrain verify --strategy pipeline --devices 4 --pipeline-stages 2 --data-parallel shard
    polytrain verify --model gpt --dataset shakespeare --strategy pipeline --devices 8 --pipeline-stages 2 \
        --tensor-parallel 2 --data-parallel shard

On a (dp_shard, pp[, tp]) mesh every rank `fully_shard`s each of its stage modules over the dp_shard dimension,
one unit per block, or per layer outside blocks (units.py), after the tensor plan and activation
checkpointing: the ranks that hold one stage (one tensor slice of it) in every pipeline keep one shard each of
its weights, gradients and optimizer state, and a model built on the meta device gets storage for those shards
only (materialise.py). A stage split over tensor ranks is sharded as torchtitan shards its tensor-parallel
blocks: FSDP2 sees each parameter's DTensor over `tp` and shards it further over dp_shard, on the 2-D
(dp_shard, tp) part of the mesh. torch's PipelineStage and schedules drive FSDP2 themselves: no gradient sync in
the step's backward passes but the last, then one reduce-scatter per unit and a reshard. The reduce-scatter sums
(the loss of every micro-batch is already divided by the global batch) instead of FSDP2's default average. As
torchtitan does under a pipeline, the units keep the weights they gathered from the first micro-batch's forward
to the end of the step's backward, instead of gathering them again for every micro-batch; evaluation reshards
them after each batch. `--precision bf16` gathers and computes in bfloat16 with float32 master shards, as
`--strategy sharded` does (sharded.py `mixed_precision`).

Checkpoints are each rank's shards of its stages, written by torch.distributed.checkpoint at their places in the
one-device tensors (checkpoint_parts.py, as every sharded layout writes them), so `--resume` moves a run to any
layout; `model.pt` and whole-state checkpoints gather each stage over its shards first (pipeline_parts.py).
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from .fsdp import GATHERED_IN_BF16, mixed_precision, own_tensor, shard_model
from .mesh import fsdp_submesh


def _units(stage_modules):
    from torch.distributed.fsdp import FSDPModule

    return [unit for stage in stage_modules for unit in stage.modules() if isinstance(unit, FSDPModule)]


def shard_stages(strategy) -> None:
    """Each of this rank's stages sharded over the dp_shard dimension (with --replicas, over the 2-D
    (dp_replicate, dp_shard) part of the mesh: hybrid sharding); their gradients summed, not averaged."""
    options = dict(mesh=fsdp_submesh(strategy.mesh, strategy.layout), reshard_after_forward=False)
    if strategy.plan.layout.tensor > 1:
        # DTensor advises, on every rank and step, to flatten the mesh for the norm's two all-reduces (as in
        # tensor.py), and it gathers the (dp_shard, tp) shards of a whole tensor in two steps
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    policy = mixed_precision(strategy.precision)
    for index, stage in zip(strategy.my_stages, strategy.stage_modules):
        stage.register_forward_hook(own_tensor)  # a stage may end in a view (Flatten); FSDP2 warns of it
        if policy:  # bfloat16 weights may end a stage in another dtype than its peer posted to receive
            end = strategy.boundaries[strategy.plan.stage_layers(index)[-1] + 1][1]
            stage.register_forward_hook(partial(_as_dtype, end))
        if strategy.plan.layout.tensor > 1:  # a split layer's DTensor output, made local, is a view too
            for module in stage.modules():
                if any(p is not None for p in module._parameters.values()):
                    module.register_forward_hook(own_tensor)
        shard_model(stage, **options, **policy)
    for unit in _units(strategy.stage_modules):
        unit.set_gradient_divide_factor(1.0)
        if hasattr(unit, "set_force_sum_reduction_for_comms"):  # a plain sum (gloo has no other)
            unit.set_force_sum_reduction_for_comms(True)


def _as_dtype(dtype, module, inputs, output):
    """A stage's output in the dtype its boundary has under autocast with float32 weights (`_boundary_shapes`),
    which the next stage's receive buffer and the schedule's checks expect."""
    mismatched = isinstance(output, torch.Tensor) and output.is_floating_point() and output.dtype != dtype
    return output.to(dtype) if mismatched else None


def reshard(strategy) -> None:
    """Free the gathered weights of every unit (kept after a forward pass outside the schedule)."""
    for unit in _units(strategy.stage_modules):
        unit.reshard()


def shard_line(strategy, heading: str) -> str:
    """The start-up line of the sharding; `heading` names what each rank's figures count."""
    bf16 = GATHERED_IN_BF16 if mixed_precision(strategy.precision) else ""
    layout = strategy.plan.layout
    shards = layout.shard_group
    copies = f" in each of {layout.copies} replicas" if layout.copies > 1 else ""
    kind = "FSDP2 hybrid sharding" if layout.copies > 1 else "FSDP2"
    return (
        f"  each stage sharded over {shards} ranks{copies} ({kind}; within a step a rank gathers "
        f"its stages' weights and gradients whole, from the first forward to the last backward); {heading}{bf16}"
    )
