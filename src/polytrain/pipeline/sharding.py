"""The data degree of a pipeline: the pipelines side by side (`--devices N --pipeline-stages S`: N / S of them)
hold their stages through FSDP2, as torchtitan's pp x fsdp: shard groups of each stage under `--data-parallel
shard` (with `--replicas`, replicas of shard groups). Whole copies are DDP modules (parallel/ddp.py
`apply_ddp`), but where a tensor plan splits the stages into DTensors, which DDP does not take: those are
FSDP2 over a dp_shard dimension of one rank (each keeps the whole stage; the gradients are all-reduced over
dp_replicate).

    polytrain verify --strategy pipeline --devices 4 --pipeline-stages 2 [--data-parallel shard]
    polytrain verify --model gpt --dataset shakespeare --strategy pipeline --devices 8 --pipeline-stages 2 \
        --tensor-parallel 2 --data-parallel shard

`parallelize` shards each of a rank's stage modules (`Preparation.stages`) over the data part of the mesh, one
unit per block, or per layer outside blocks (parallel/units.py), after the tensor plan and activation
checkpointing: the ranks that hold one stage (one tensor slice of it) in every pipeline keep one shard each of
its weights, gradients and optimizer state, and a model built on the meta device gets storage for those shards
only (parallel/materialise.py). A stage split over tensor ranks is sharded as torchtitan shards its
tensor-parallel blocks: FSDP2 sees each parameter's DTensor over `tp` and shards it further, on the (dp_shard,
tp) part of the mesh. torch's PipelineStage and schedules drive FSDP2 themselves: no gradient sync in the
step's backward passes but the last, then one reduce-scatter (and all-reduce over replicas) per unit and a
reshard. The reductions sum (the loss of every micro-batch is already divided by the global batch) instead of
FSDP2's default average. As torchtitan does under a pipeline, the units keep the weights they gathered from
the first micro-batch's forward to the end of the step's backward, instead of gathering them again for every
micro-batch; evaluation reshards them after each batch. `--precision bf16` gathers and computes in bfloat16
with float32 master shards, as `--strategy sharded` does (parallel/fsdp.py `mixed_precision`). Traced stages
(`--split-at`) are not FSDP2 modules: their replicas all-reduce their gradients in the step (strategy.py).

Checkpoints are each rank's shards of its stages, written by torch.distributed.checkpoint at their places in
the one-device tensors (state.py, in the form strategies/checkpoint_parts.py gives every sharded layout), so
`--resume` moves a run to any layout; `model.pt` and whole-state checkpoints gather each stage over its shards
first (state.py).
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from ..parallel.fsdp import GATHERED_IN_BF16, mixed_precision, own_tensor


def _units(stage_modules):
    from torch.distributed.fsdp import FSDPModule

    return [unit for stage in stage_modules for unit in stage.modules() if isinstance(unit, FSDPModule)]


def _as_dtype(dtype, module, inputs, output):
    """A stage's output in the dtype its boundary has under autocast with float32 weights (`_boundary_shapes`),
    which the next stage's receive buffer and the schedule's checks expect."""
    mismatched = isinstance(output, torch.Tensor) and output.is_floating_point() and output.dtype != dtype
    return output.to(dtype) if mismatched else None


class StageSharding:
    """The data degree of `Pipeline`'s stages (a mixin of `Pipeline`)."""

    @property
    def stage_precision(self) -> str:
        """The precision FSDP2 gathers in: shards gather in bf16 under --precision bf16, as --self sharded does;
        whole replicas keep float32 weights under autocast, as a pipeline of one replica does."""
        return self.precision if self.layout.shard > 1 else "fp32"

    def stage_hooks(self) -> None:
        """What FSDP2 needs of a pipeline rank's stages before `parallelize` shards them (registered first, so they
        run before FSDP2's own hooks): a stage that ends in a view (Flatten), and under --tensor-parallel each split
        layer's local output, returned as tensors of their own; with weights gathered in bf16, each stage's output
        in the dtype its peer posted to receive."""
        if self.layout.tensor > 1:
            # DTensor advises, on every rank and step, to flatten the mesh for the norm's two all-reduces (as in
            # strategies/tensor.py), and it gathers the (dp_shard, tp) shards of a whole tensor in two steps
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        bf16 = bool(mixed_precision(self.stage_precision))
        for index, stage in zip(self.my_stages, self.stage_modules):
            stage.register_forward_hook(own_tensor)
            if bf16:
                end = self.boundaries[self.plan.stage_layers(index)[-1] + 1][1]
                stage.register_forward_hook(partial(_as_dtype, end))
            if self.layout.tensor > 1:
                for module in stage.modules():
                    if any(p is not None for p in module._parameters.values()):
                        module.register_forward_hook(own_tensor)

    def reshard(self) -> None:
        """Free the gathered weights of every unit (kept after a forward pass outside the schedule)."""
        for unit in _units(self.stage_modules):
            unit.reshard()

    def shard_line(self, heading: str) -> str:
        """The start-up line of the sharding; `heading` names what each rank's figures count."""
        bf16 = GATHERED_IN_BF16 if mixed_precision(self.precision) else ""
        layout = self.layout
        shards = layout.shard
        copies = f" in each of {layout.replicate} replicas" if layout.replicate > 1 else ""
        kind = "FSDP2 hybrid sharding" if layout.replicate > 1 else "FSDP2"
        return (
            f"  each stage sharded over {shards} ranks{copies} ({kind}; within a step a rank gathers "
            f"its stages' weights and gradients whole, from the first forward to the last backward); {heading}{bf16}"
        )
