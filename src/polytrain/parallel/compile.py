"""`--compile` as a step of `parallelize`: torch.compile applied as torchtitan applies it, to each of the model's
blocks in place (`nn.Module.compile`: the module and its parameter names stay the model's), after the tensor plan
and activation checkpointing and before FSDP2 or DDP wrap the model. Each block's forward and backward is then
one compiled graph: FSDP2 gathers and reduces between blocks, DDP's bucketed reductions still overlap the
backward block by block, and a recomputed block is recomputed inside its graph. A model without blocks (LeNet,
an nn.Sequential of torch layers) is compiled whole, around what wraps it, as `torch.compile(model)` would be; on
a pipeline, each stage is compiled in place before FSDP2 or DDP wrap it (a stage is what torch's schedule
calls)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch.nn as nn

from .activation_checkpoint import find_blocks


def apply_compile(
    module: nn.Module, *, whole: Optional[nn.Module] = None, stages: Sequence[nn.Module] = ()
) -> bool:
    """Each of `module`'s blocks compiled in place; False where it has none (the caller compiles it whole). A
    pipeline rank's part of a model (`whole`: the model it is cut from) compiles the blocks it holds where the
    model has blocks, else each of its `stages` in place, as the schedule runs them (True: nothing is left to
    the caller)."""
    blocks = find_blocks(module)
    for _, block in blocks:
        block.compile()
    if whole is not None and not find_blocks(whole):
        for stage in stages:
            stage.compile()
        return True
    return bool(blocks) or whole is not None
