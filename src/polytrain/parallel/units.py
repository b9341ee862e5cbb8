"""FSDP2's units: the modules whose weights are gathered together, one all-gather in forward and one
reduce-scatter in backward each, as torchtitan wraps a transformer.

    a block       each of the model's blocks (activation_checkpoint.py `find_blocks`: GPT's `Block`, a Llama's
                  transformer block), its layers gathered in one collective rather than one per Linear
    a layer       outside the blocks (or in a model without blocks, LeNet or a user's Sequential), each module
                  that holds parameters of its own, with its children: `nn.MultiheadAttention` keeps its
                  `out_proj`, a large vocabulary's embedding or head is a unit of its own
    the root      what no unit may take: a parameter two modules share (tied embeddings and head), which
                  FSDP2 requires to stay in one unit, and the model's own parameters; beside blocks, also each
                  layer under a quarter of the smallest block (norms, a position table, a small vocabulary's
                  embedding and head), which would cost a collective of its own for little memory. A larger one
                  is a unit of its own, as torchtitan wraps the embedding and the head: the root stays gathered
                  through the whole step (Llama 3 405B's embedding and head are 2/3 of a block each, 4.2e9
                  parameters the root would hold gathered)

A block is also what activation checkpointing recomputes, so FSDP2's hooks run around a checkpointed region,
never inside it (selective checkpointing replays the region's operations and finds none of FSDP2's there).
The units are a function of the model's structure alone, so the memory check counts the weights gathered at
once from a model built on the meta device (`gathered_bytes`).
"""

from __future__ import annotations

from collections import Counter
from typing import List, Tuple

import torch.nn as nn

from .activation_checkpoint import find_blocks

Units = List[Tuple[str, nn.Module]]  # (name in the model, module), in the model's order


def _holds_parameters(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def shard_units(model: nn.Module) -> Units:
    """The modules of `model` that `fully_shard` wraps before the root, none inside another."""
    registered = Counter(
        id(p) for module in model.modules() for p in module._parameters.values() if p is not None
    )

    def keeps_its_own(module: nn.Module) -> bool:
        """Every parameter under `module` is registered under it only (none shared with the rest)."""
        inside = Counter(id(p) for sub in module.modules() for p in sub._parameters.values() if p is not None)
        return bool(inside) and all(registered[key] == count for key, count in inside.items())

    found = find_blocks(model)
    blocks = {name for name, _ in found}
    # beside blocks, a layer under a quarter of a block stays in the root's unit: gathered with it, in no collective
    # of its own (a norm, a position table, a small vocabulary's embedding and head), as torchtitan's root does
    smallest = min((sum(p.numel() for p in block.parameters()) for _, block in found), default=0) / 4
    units: Units = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = prefix + name
            if path in blocks and keeps_its_own(child):
                units.append((path, child))
            elif _holds_parameters(child) and sum(p.numel() for p in child.parameters()) < smallest:
                continue
            elif _holds_parameters(child) and keeps_its_own(child):
                units.append((path, child))
            else:
                visit(child, path + ".")

    visit(model, "")
    return units


def gathered_bytes(model: nn.Module) -> float:
    """The most parameter bytes a rank holds gathered at once under FSDP2: the root's own (gathered for the
    whole step), and two units, the one computing and the next one prefetched in the backward pass."""
    sizes = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    in_units = [{id(p) for p in unit.parameters()} for _, unit in shard_units(model)]
    unit_bytes = sorted((sum(sizes[key] for key in unit) for unit in in_units), reverse=True)
    root = sum(sizes.values()) - sum(unit_bytes)
    return float(root + sum(unit_bytes[:2]))


def unit_count(model: nn.Module) -> int:
    """FSDP2's collectives per pass: one per unit and one for the root's own parameters."""
    return len(shard_units(model)) + 1
