"""The activation bytes a training step holds per sample under each `--activation-checkpointing` mode: pure
arithmetic on what one forward of the model saves for its backward pass (measured by
scaling/activation_memory.py, on fake tensors, so any model size is measured without memory).

Per sample, with A the bytes autograd keeps after a forward with nothing recomputed (each storage once,
weights not at all), n the blocks checkpointing recomputes (parallel/activation_checkpoint.py `find_blocks`),
and, averaged over the blocks, b the bytes one block keeps, i its input and m the outputs of its matrix
multiplications (mm, addmm, bmm, attention: what selective checkpointing keeps), O = A - n b is what is kept
outside the blocks (embeddings, the last norm, the head's scores, the loss):

    mode          kept after the forward         held at the peak (during the backward pass)
    none          A                              A
    full          O + n i                        O + n i + b
    selective:K   O + (n - c) b + c i            O + (n - c) b + c i + b      c = floor(n / K) blocks in full
    selective     O + n (i + m)                  O + n (i + m) + b

A checkpointed block keeps only its input (and, selective, its matrix products' outputs); in the backward
pass its forward runs again, one block at a time, and holds that block's b until its gradients are computed:
the peak adds one block's b (an upper bound for selective, which recomputes only what is not kept). A model
without blocks (n = 0) keeps A in every mode.

A rank of a context group (`--context-parallel C`) holds a part of each sample: planning/context.py counts it.
A rank of a tensor group of t holds (`tensor_part`) (10 + 24/t) / 34 of each block's b and m, its input i
whole, and where the plan runs sequence-parallel 1/t of all three (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Table 2, with attention that keeps no scores); what is kept outside
the blocks is its whole (the head's scores gathered whole).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Tuple

MODES = ("none", "full", "selective")


def checkpointed(mode: str, blocks: int) -> Tuple[str, int]:
    """(kind, how many of `blocks` it recomputes) of a mode: "full" all, "selective:K" every K-th in full,
    "selective" all at op level, "none" none."""
    kind, _, every = (mode or "none").partition(":")
    if every:
        return "full", blocks // int(every)
    return kind, 0 if kind == "none" else blocks


def kept_bytes(work, mode: str = "none") -> float:
    """Bytes per sample kept after the forward pass (the table's middle column), from `work`'s
    `activation_bytes` and block figures (`blocks`, `block_bytes`, `block_input_bytes`, `block_matmul_bytes`)."""
    kind, count = checkpointed(mode, work.blocks)
    if not count or not work.block_bytes:
        return work.activation_bytes
    outside = work.activation_bytes - work.blocks * work.block_bytes
    if kind == "selective":
        return outside + count * (work.block_input_bytes + work.block_matmul_bytes)
    return outside + (work.blocks - count) * work.block_bytes + count * work.block_input_bytes


def peak_bytes(work, mode: str = "none") -> float:
    """Bytes per sample held at the peak of the backward pass (the table's last column): what the forward
    kept, plus one recomputed block where any is recomputed, plus what the backward of one layer holds beyond
    them (`backward_bytes`: its gradients and temporaries, measured on fake tensors; 0 where unknown)."""
    kind, count = checkpointed(mode, work.blocks)
    recomputed = work.block_bytes if count and work.block_bytes else 0.0
    return kept_bytes(work, mode) + recomputed + work.backward_bytes


def tensor_part(work, tensor: int, *, sequence: bool = False):
    """`work` with its per-sample figures those of a rank of a tensor group of `tensor` ranks (the module's
    docstring); `sequence`: the plan runs the norms on parts of the sequence. Unchanged without blocks."""
    if tensor == 1 or not work.blocks or not work.block_bytes:
        return work
    keep = 1 / tensor if sequence else (10 + 24 / tensor) / 34
    return replace(
        work,
        activation_bytes=work.activation_bytes - work.blocks * work.block_bytes * (1 - keep),
        block_bytes=work.block_bytes * keep,
        block_input_bytes=work.block_input_bytes * (keep if sequence else 1.0),
        block_matmul_bytes=work.block_matmul_bytes * keep,
        backward_bytes=work.backward_bytes * keep,  # (the split layer's gradients)
    )


@dataclass(frozen=True)
class AttentionShape:
    """One device's causal attention as its forward calls it: `layers` calls, each of (batch, `heads`,
    `context`, `head_dim`) queries over `kv_heads` key/value heads, `element_bytes` an element; `parameters`:
    the model's, whose matrix products beside attention do 6 FLOPs per parameter and token
    (planning/context.py)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    element_bytes: int = 4
    parameters: float = 0.0
    # how a context rank attends (planning/context.py): block by block, keeping only its own tokens' tensors
    # (parallel/block_attention.py, on CPUs), or over the gathered keys with zero rows in front (GPUs)
    blockwise: bool = False
