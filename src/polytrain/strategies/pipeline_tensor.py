"""The tensor degree of a pipeline: each pipeline stage split over T consecutive ranks (Megatron's layout), a step
of `Pipeline.setup` where `--tensor-parallel T` is above 1.

    polytrain verify --model gpt --dataset shakespeare --strategy pipeline --devices 4 --tensor-parallel 2
    polytrain verify --model gpt --dataset shakespeare --strategy pipeline --devices 8 --pipeline-stages 2 \
        --tensor-parallel 2

Every rank of a stage applies the tensor plan (plan/tensor.py, the built-in one of the gpt and mlp) to its
stage's layers by their names in the whole model, over the mesh's `tp` dimension; everything else it holds
becomes a replicated DTensor. Stages exchange whole activations as plain tensors (no sequence parallelism):
tensor slice t of stage s sends to slice t of stage s + 1, over one pipeline process group per tensor index. The
ranks of a tensor group compute the same loss, so sums are counted from slice 0 only (`Distributed.reduce`); the
global norm is each stage's DTensor norm (every element once), summed over the stages. Checkpoints hold the
whole model by its original names, fused rows in their original order (pipeline_parts.py), so `--resume` moves
runs between this and any other strategy. The split comes before FSDP2 shards the stages (pipeline_shard.py).
"""

from __future__ import annotations

from dataclasses import replace

from .tensor_split import apply_tensor_plan, replicate_rest


def split_stages(strategy) -> None:
    """Split the layers of this rank's stages over the `tp` dimension by the plan's styles (those of layers the
    rank holds); every other parameter becomes a replicated DTensor. Fused layers' row orders go to
    `strategy.fused`."""
    mesh = strategy.mesh["tp"]
    held = {name for name, _ in strategy.model.named_modules()}
    plan = strategy.plan.tensor
    mine = replace(plan, styles=tuple(entry for entry in plan.styles if entry[0] in held))
    if mine.styles:  # (parallelize.py's tensor step, on the layers this rank's stages hold)
        strategy.fused = apply_tensor_plan(strategy.model, mesh, mine)
    else:
        replicate_rest(strategy.model, mesh)


def tensor_line(plan, tail: str) -> str:
    """The start-up line of the split, `tail` after the plan's description."""
    return (
        f"  each stage split over {plan.layout.tensor} tensor ranks: "
        f"{plan.tensor.describe().split(': ', 1)[-1]}{tail}"
    )
