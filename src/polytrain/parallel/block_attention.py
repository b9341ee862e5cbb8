"""Causal attention of a context rank's head and tail chunks, computed block by block over the keys each chunk can
see and merged by their log-sum-exp: no attention pair is computed that one device's causal mask hides, no zero
rows, no mask (context.py splits the sequences; this is how a rank attends over the whole of each). It imports
nothing from context.py: the ContextGroup it is given joins and cuts the head-tail parts.

**The blocks.** A rank holds two chunks of c = T/2C queries of each sequence (context.py, head-tail), the first at
global position a. Such a chunk sees the keys before it whole, [0, a), and the keys of its own chunk, [a, a + c),
under the causal mask: two blocks, the first absent where a = 0. Each block is one call of torch's CPU flash
attention kernel (`aten._scaled_dot_product_flash_attention_for_cpu`: the output and the log-sum-exp of each query
row), non-causal for the keys before, `is_causal` on the square diagonal block. Rank r's chunks see r c and
(2C - 1 - r) c keys before them and c each of their own: 2C c^2 pairs of each sequence on every rank, 1/C of one
device's (2C c)^2 / 2, whichever the rank.

**The merge.** With o_b and l_b a block's output and log-sum-exp, a chunk's output is sum_b exp(l_b - l) o_b with
l = log sum_b exp(l_b): one device's softmax over all the keys it sees.

**The backward** is flash attention's own, block by block: the kernel's backward
(`aten._scaled_dot_product_flash_attention_for_cpu_backward`) given the merged output and the merged log-sum-exp
returns each block's part of the gradients of the queries, keys and values, summed over blocks (exact: each
block's probabilities are exp(s - l) with the merged l). The keys and values are gathered over the context group
again for it rather than kept from the forward, so a layer keeps only its own tokens' tensors between the passes;
each key's and value's gradient, summed over every rank's queries, goes back to the rank that holds the token by a
reduce-scatter.

Keys and values with fewer heads than the queries (grouped-query attention): in a block before the chunk (not
causal) the query heads that share a key/value head attend as one, their rows stacked, so the gathered keys and
values are read where they lie; the diagonal block's (causal, a chunk long) are repeated for the query heads, and
their gradients summed back over each group. The kernel takes float32, float64, bfloat16 and
float16 on CPUs; elsewhere (GPUs) context.py attends as before (`blockwise` says where this runs).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed._functional_collectives as funcol

# torch's functional all-gather and reduce-scatter along dim 0: the `_single` names where torch has them (the older
# ones then warn that they are deprecated)
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def blockwise(device_type: str) -> bool:
    """Whether `block_attention` runs on devices of `device_type`: on CPUs, where torch has the kernel."""
    return device_type == "cpu" and _FORWARD is not None and _BACKWARD is not None


def _gathered(part: torch.Tensor, context) -> torch.Tensor:
    """The whole sequence's keys or values in global order, gathered from every rank's head-tail `part`
    (B, heads, T/C, d), outside autograd."""
    stacked = funcol.wait_tensor(_ALL_GATHER(part.contiguous(), 0, context.group))
    return context.joined(list(stacked.chunk(context.size, dim=0)), dim=2)


def _blocks(start: int, chunk: int) -> list:
    """(first key, end, causal) of the blocks a chunk of `chunk` queries at `start` sees: the keys before it
    whole, then its own under the causal mask."""
    return ([(0, start, False)] if start else []) + [(start, start + chunk, True)]


def _repeated(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """Each key or value head repeated for the `groups` query heads that share it (grouped-query attention)."""
    return tensor.repeat_interleave(groups, dim=1) if groups > 1 else tensor


def _stacks(causal: bool, groups: int) -> bool:
    """Whether a block's queries are stacked rather than its keys and values repeated: where query heads share
    key/value heads and the block is not causal, the rows of the `groups` query heads of each key/value head
    attend as one head's (their rows independent), so the block's keys and values are read as they lie."""
    return groups > 1 and not causal


def _block_forward(q, keys, values, first: int, end: int, causal: bool, scale):
    """(output, log-sum-exp) of the queries `q` (B, heads, c, d) over keys[first:end] (B, kv_heads, T, d)."""
    (batch, heads, rows, width), groups = q.shape, q.shape[1] // keys.shape[1]
    k, v = keys[:, :, first:end], values[:, :, first:end]
    if _stacks(causal, groups):
        out, lse = _FORWARD(q.reshape(batch, -1, groups * rows, width), k, v, 0.0, False, scale=scale)
        return out.reshape(batch, heads, rows, width), lse.reshape(batch, heads, rows)
    return _FORWARD(q, _repeated(k, groups), _repeated(v, groups), 0.0, causal, scale=scale)


def _block_backward(grad, q, keys, values, out, lse, first: int, end: int, causal: bool, scale):
    """(the gradients of `q`, of keys[first:end] and of values[first:end]) of a block, given the chunk's merged
    `out` and `lse` (`_block_forward`'s arguments)."""
    (batch, _, rows, width), groups = q.shape, q.shape[1] // keys.shape[1]
    k, v = keys[:, :, first:end], values[:, :, first:end]
    if _stacks(causal, groups):
        stacked = (batch, -1, groups * rows, width)
        dq, dk, dv = _BACKWARD(
            grad.reshape(stacked),
            q.reshape(stacked),
            k,
            v,
            out.reshape(stacked),
            lse.reshape(batch, -1, groups * rows),
            0.0,
            False,
            scale=scale,
        )
        return dq.reshape(q.shape), dk, dv
    dq, dk, dv = _BACKWARD(
        grad, q, _repeated(k, groups), _repeated(v, groups), out, lse, 0.0, causal, scale=scale
    )
    if groups > 1:  # each key/value head's gradient: the sum over the query heads that share it
        shape = (batch, keys.shape[1], groups, *dk.shape[2:])
        dk, dv = dk.view(shape).sum(dim=2), dv.view(shape).sum(dim=2)
    return dq, dk, dv


def _chunk_forward(q, keys, values, start: int, scale: Optional[float]):
    """(output, log-sum-exp) of one chunk `q` (B, heads, c, d) at global position `start` over the whole
    sequence's `keys` and `values` (B, kv_heads, T, d)."""
    out = lse = None
    for first, end, causal in _blocks(start, q.shape[2]):
        block_out, block_lse = _block_forward(q, keys, values, first, end, causal, scale)
        if out is None:
            out, lse = block_out, block_lse
            continue
        merged = torch.logaddexp(lse, block_lse)
        out = out * torch.exp(lse - merged)[..., None] + block_out * torch.exp(block_lse - merged)[..., None]
        out, lse = out.to(block_out.dtype), merged
    return out, lse


class _HeadTailAttention(torch.autograd.Function):
    """Causal attention of this rank's head and tail chunks over the whole split sequence (the module's
    docstring), differentiable in its queries, keys and values."""

    @staticmethod
    def forward(ctx, q, k, v, context, scale):
        keys, values = _gathered(k, context), _gathered(v, context)
        batch, heads, length, width = q.shape
        chunk = length // 2
        # the output laid out (B, T/C, heads, d) in memory, as the kernel lays out one device's: the models' next
        # layer reads it through a transpose without a copy
        out, lse = q.new_empty(batch, length, heads, width).transpose(1, 2), None
        for index, start in enumerate(context.chunk_starts(chunk)):
            rows = slice(index * chunk, (index + 1) * chunk)
            chunk_out, chunk_lse = _chunk_forward(q[:, :, rows].contiguous(), keys, values, start, scale)
            lse = chunk_lse.new_empty(batch, heads, length) if lse is None else lse
            out[:, :, rows], lse[:, :, rows] = chunk_out, chunk_lse
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.context, ctx.scale = context, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        context, scale = ctx.context, ctx.scale
        keys, values = _gathered(k, context), _gathered(v, context)
        chunk = q.shape[2] // 2
        grad_q = torch.empty_like(q)
        grad_keys, grad_values = torch.zeros_like(keys), torch.zeros_like(values)
        for index, start in enumerate(context.chunk_starts(chunk)):
            rows = slice(index * chunk, (index + 1) * chunk)
            part, done = q[:, :, rows].contiguous(), None
            given = grad[:, :, rows].contiguous(), out[:, :, rows].contiguous(), lse[:, :, rows].contiguous()
            for first, end, causal in _blocks(start, chunk):
                dq, dk, dv = _block_backward(
                    given[0], part, keys, values, *given[1:], first, end, causal, scale
                )
                done = dq if done is None else done + dq
                grad_keys[:, :, first:end] += dk
                grad_values[:, :, first:end] += dv
            grad_q[:, :, rows] = done
        return (
            grad_q,
            _scattered(grad_keys, context),
            _scattered(grad_values, context),
            None,
            None,
        )


def _scattered(whole: torch.Tensor, context) -> torch.Tensor:
    """This rank's head-tail part of `whole` (B, heads, T, d) summed over the context group: every rank's
    gradient of the whole sequence's keys or values, brought to the ranks that hold them (a reduce-scatter)."""
    stacked = torch.cat([context.part_of(whole, r, dim=2) for r in range(context.size)], dim=0)
    return funcol.wait_tensor(_REDUCE_SCATTER(stacked.contiguous(), "sum", 0, context.group))


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context, *, scale=None
) -> torch.Tensor:
    """Causal attention of this rank's head-tail queries q (B, heads, T/C, d) over the whole sequence's keys and
    values, this rank's k and v (B, kv_heads, T/C, d) gathered over `context` (a ContextGroup): equal to one
    device's `F.scaled_dot_product_attention(q, k, v, is_causal=True)` on the whole sequence, this rank's rows."""
    return _HeadTailAttention.apply(q, k, v, context, scale)
