"""Causal attention of a context rank's head and tail chunks, computed block by block over the keys each chunk can
see and merged by their log-sum-exp, the keys and values passed around the context group's ring: no attention
pair is computed that one device's causal mask hides, no zero rows, no mask, and no rank holds the whole
sequence's keys and values (context.py splits the sequences; this is how a rank attends over the whole of each).
It imports nothing from context.py: the ContextGroup it is given says where each rank's chunks lie.

**The blocks.** Each of the C ranks holds two chunks of c = T/2C tokens of each sequence (context.py, head-tail):
rank r's begin at r c and (2C - 1 - r) c. A query chunk sees a key chunk whole where the key chunk begins before
it, under the causal mask where it is its own, and not at all where it begins after it. Each block is one call of
torch's CPU flash attention kernel (`aten._scaled_dot_product_flash_attention_for_cpu`: the output and the
log-sum-exp of each query row), non-causal, or `is_causal` on the diagonal block. Every rank computes 2C c^2 pairs
of each sequence, 1/C of one device's (2C c)^2 / 2, whichever the rank.

**The ring.** In C steps a rank attends over each rank's keys and values in turn: its own first, then those the
previous rank of the ring held a step before, while it passes the ones it holds to the next rank
(`torch.distributed.batch_isend_irecv`), so the next part is in flight while a part is computed. A rank holds two
ranks' keys and values at a time, never the whole sequence's.

**The merge.** With o_b and l_b a block's output and log-sum-exp, a chunk's output is sum_b exp(l_b - l) o_b with
l = log sum_b exp(l_b): one device's softmax over all the keys it sees.

**The backward** is flash attention's own, block by block: the kernel's backward
(`aten._scaled_dot_product_flash_attention_for_cpu_backward`) given the merged output and the merged log-sum-exp
returns each block's part of the gradients of the queries, keys and values (exact: each block's probabilities are
exp(s - l) with the merged l). The keys and values go around the ring again (the forward keeps only the rank's
own), and the gradients of each rank's keys and values travel with them, each rank adding its queries' part,
until they reach the rank that holds the tokens.

Keys and values with fewer heads than the queries (grouped-query attention): in a block before the chunk (not
causal) the query heads that share a key/value head attend as one, their rows stacked, so the keys and values are
read where they lie; the diagonal block's are repeated for the query heads, and their gradients summed back over
each group. The kernel takes float32, float64, bfloat16 and float16 on CPUs; elsewhere (GPUs) context.py attends
as before (`blockwise` says where this runs). On fake tensors (a shape-only forward: the memory check) nothing is
sent: a part received has the shape of the rank's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def blockwise(device_type: str) -> bool:
    """Whether `block_attention` runs on devices of `device_type`: on CPUs, where torch has the kernel."""
    return device_type == "cpu" and _FORWARD is not None and _BACKWARD is not None


def _ring(context):
    """(process group, the next rank of the ring, the previous one: global ranks) of `context`."""
    group = context.group.get_group() if hasattr(context.group, "get_group") else context.group
    ahead, behind = (context.rank + 1) % context.size, (context.rank - 1) % context.size
    return group, dist.get_global_rank(group, ahead), dist.get_global_rank(group, behind)


def _pass_on(tensors: list, context) -> tuple:
    """Start sending `tensors` to the next rank of the ring and receiving as many of their shapes from the
    previous one: (the tensors being received, what to wait on). On fake tensors nothing is sent."""
    received = [torch.empty_like(tensor) for tensor in tensors]
    if any(_is_fake(tensor) for tensor in tensors):
        return received, []
    group, ahead, behind = _ring(context)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), ahead, group) for tensor in tensors]
    ops += [dist.P2POp(dist.irecv, tensor, behind, group) for tensor in received]
    return received, dist.batch_isend_irecv(ops)


def _arrived(received: list, works: list) -> list:
    for work in works:
        work.wait()
    return received


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _blocks(context, owner: int, chunk: int) -> list:
    """(query chunk, first key, end, causal) of the blocks this rank's chunks attend over in rank `owner`'s part
    (its head then tail chunk: keys 0..2c): the key chunks that begin before a query chunk as one block, not
    causal (their order is no matter there), and its own chunk, causal."""
    mine, theirs = context.chunk_starts(chunk), _starts(owner, context.size, chunk)
    found = []
    for i in range(2):
        before = [j for j in range(2) if theirs[j] < mine[i]]  # (a head chunk where a tail chunk is)
        if before:
            found.append((i, before[0] * chunk, (before[-1] + 1) * chunk, False))
        found += [(i, j * chunk, (j + 1) * chunk, True) for j in range(2) if theirs[j] == mine[i]]
    return found


def _starts(rank: int, size: int, chunk: int) -> tuple:
    """Where rank `rank`'s head and tail chunks begin (ContextGroup.chunk_starts of another rank)."""
    return rank * chunk, (2 * size - 1 - rank) * chunk


def _rows(tensor: torch.Tensor, index: int, chunk: int) -> torch.Tensor:
    """Chunk `index` (0: head, 1: tail) of a rank's tokens along dim 2."""
    return tensor[:, :, index * chunk : (index + 1) * chunk]


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


def _merge(held, block):
    """Two (output, log-sum-exp) of the same queries over other keys, merged (None: `block` alone)."""
    if held is None:
        return block
    (out, lse), (block_out, block_lse) = held, block
    merged = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - merged)[..., None] + block_out * torch.exp(block_lse - merged)[..., None]
    return out.to(block_out.dtype), merged


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's head and tail chunks over the whole split sequence, the keys and values
    passed around the ring (the module's docstring), differentiable in its queries, keys and values."""

    @staticmethod
    def forward(ctx, q, k, v, context, scale):
        batch, heads, length, width = q.shape
        chunk = length // 2
        queries = [_rows(q, i, chunk).contiguous() for i in range(2)]
        held, part = [None, None], [k.contiguous(), v.contiguous()]
        for step in range(context.size):
            last = step == context.size - 1
            received, works = _pass_on(part, context) if not last else (None, [])
            for i, first, end, causal in _blocks(context, (context.rank - step) % context.size, chunk):
                block = _block_forward(queries[i], part[0], part[1], first, end, causal, scale)
                held[i] = _merge(held[i], block)
            if not last:
                part = _arrived(received, works)
        # the output laid out (B, T/C, heads, d) in memory, as the kernel lays out one device's: the models' next
        # layer reads it through a transpose without a copy
        out = q.new_empty(batch, length, heads, width).transpose(1, 2)
        lse = held[0][1].new_empty(batch, heads, length)
        for i in range(2):
            _rows(out, i, chunk).copy_(held[i][0])
            lse[:, :, i * chunk : (i + 1) * chunk] = held[i][1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.context, ctx.scale = context, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        context, scale = ctx.context, ctx.scale
        chunk = q.shape[2] // 2
        rows = [
            [_rows(t, i, chunk).contiguous() for t in (grad, q, out)]
            + [lse[:, :, i * chunk : (i + 1) * chunk].contiguous()]
            for i in range(2)
        ]
        done = [None, None]
        part = [k.contiguous(), v.contiguous()]
        grads = [
            torch.zeros_like(part[0]),
            torch.zeros_like(part[1]),
        ]  # those of the part held, travelling with it
        for step in range(context.size):
            last = step == context.size - 1
            received, works = _pass_on(part, context) if not last else (None, [])
            for i, first, end, causal in _blocks(context, (context.rank - step) % context.size, chunk):
                given, queries, merged, merged_lse = rows[i]
                dq, dk, dv = _block_backward(
                    given, queries, part[0], part[1], merged, merged_lse, first, end, causal, scale
                )
                done[i] = dq if done[i] is None else done[i] + dq
                grads[0][:, :, first:end].add_(dk)
                grads[1][:, :, first:end].add_(dv)
            grads = _arrived(
                *_pass_on(grads, context)
            )  # on to the next rank; the last step's reach their owner
            if not last:
                part = _arrived(received, works)
        return torch.cat(done, dim=2), grads[0], grads[1], None, None


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context, *, scale=None
) -> torch.Tensor:
    """Causal attention of this rank's head-tail queries q (B, heads, T/C, d) over the whole sequence's keys and
    values, this rank's k and v (B, kv_heads, T/C, d) passed around `context`'s ring (a ContextGroup): equal to
    one device's `F.scaled_dot_product_attention(q, k, v, is_causal=True)` on the whole sequence, this rank's
    rows."""
    return _RingAttention.apply(q, k, v, context, scale)
