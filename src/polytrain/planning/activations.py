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

**A rank of a context group** (`--context-parallel C`, parallel/context.py) holds T/C tokens of
each sample: 1/C of every figure above, plus what its attention keeps beyond 1/C of one device's
(`context_part`). Per attention layer and sample, with h query heads, g key/value heads of width d, e bytes an
element, L = T/C the rank's tokens and P the rows its two chunks' attention sees with their zero rows in front
(chunk r over the keys before (r+1) T/2C, chunk 2C-1-r before (2C-r) T/2C: P = T + T/2C in all):

    gathered keys and values       2 g T d e      (its own 2 g L d e no longer kept beside them)
    padded queries and outputs     2 h P d e      (its own queries h L d e no longer kept)
    log-sum-exp                    h P f          (f = 4 bytes, float64's 8; its own h L f no longer kept)

so x = e d (2 g (T - L) + h (2P - L)) + f h (P - L) more per layer, of which the attention's outputs,
m' = (e d + f) h (P - L), are among what selective checkpointing keeps. Every block then keeps b/C + x (one
attention a block), every figure else is 1/C: with full checkpointing only the recomputed block's x comes on
top of 1/C. The attention's shape (`AttentionShape`) is read off one device's forward
(activation_memory.py); counted so, the figures equal what a context rank's forward keeps on fake tensors
(tests/test_context_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

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
    kept, plus one recomputed block where any is recomputed."""
    kind, count = checkpointed(mode, work.blocks)
    recomputed = work.block_bytes if count and work.block_bytes else 0.0
    return kept_bytes(work, mode) + recomputed


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


def context_bytes(shape: AttentionShape, size: int) -> Tuple[float, float]:
    """(x, m'): bytes per sample and attention layer that a rank of a context group of `size` keeps beyond
    1/size of one device's, and of them the attention's outputs (the table in the module's docstring)."""
    if size == 1:
        return 0.0, 0.0
    tokens, local = shape.context, shape.context / size
    padded = tokens + tokens / (2 * size)
    log_sum_exp = max(4, shape.element_bytes)  # float32, or float64 for float64 queries
    width = shape.element_bytes * shape.head_dim
    kept = width * (2 * shape.kv_heads * (tokens - local) + shape.heads * (2 * padded - local))
    outputs = (width + log_sum_exp) * shape.heads * (padded - local)
    return kept + log_sum_exp * shape.heads * (padded - local), outputs


def context_part(work, size: int, tensor: int = 1):
    """`work` with its per-sample figures those of a context rank's part of each sample (`size` ranks split
    each sequence): 1/size of one device's (the cuts' too), and the attention's extra (`context_bytes`) in
    every block and in the whole, for the heads a rank of `tensor` ranks runs (the tensor plan splits the query
    heads, and the key/value heads where the ranks divide them). Without `work.attention` (a model whose
    attention was not seen) only 1/size: a lower bound."""
    if size == 1:
        return work
    attention: Optional[AttentionShape] = getattr(work, "attention", None)
    if attention and tensor > 1:
        kv_heads = attention.kv_heads // tensor if attention.kv_heads % tensor == 0 else attention.kv_heads
        attention = replace(attention, heads=max(1, attention.heads // tensor), kv_heads=kv_heads)
    extra, outputs = context_bytes(attention, size) if attention else (0.0, 0.0)
    per_block = attention.layers / work.blocks if attention and work.blocks else 0.0
    return replace(
        work,
        activation_bytes=work.activation_bytes / size + (attention.layers * extra if attention else 0.0),
        block_bytes=work.block_bytes / size + per_block * extra,
        block_input_bytes=work.block_input_bytes / size,
        block_matmul_bytes=work.block_matmul_bytes / size + per_block * outputs,
        boundary_bytes=tuple(cut / size for cut in work.boundary_bytes),
    )
