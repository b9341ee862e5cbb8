"""`--compile` as a step of `parallelize`: torch.compile applied as torchtitan applies it, to each of the model's
blocks in place (`nn.Module.compile`: the module and its parameter names stay the model's), after the tensor plan
and activation checkpointing and before FSDP2 or DDP wrap the model. Each block's forward and backward is then
one compiled graph: FSDP2 gathers and reduces between blocks, DDP's bucketed reductions still overlap the
backward block by block, and a recomputed block is recomputed inside its graph. A model without blocks (LeNet,
an nn.Sequential of torch layers) is compiled whole, around what wraps it, as `torch.compile(model)` would be."""

from __future__ import annotations

import torch.nn as nn

from .activation_checkpoint import find_blocks


def apply_compile(module: nn.Module) -> bool:
    """Each of `module`'s blocks compiled in place; False where it has none (the caller compiles it whole)."""
    blocks = find_blocks(module)
    for _, block in blocks:
        block.compile()
    return bool(blocks)
