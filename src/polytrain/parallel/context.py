"""Context parallelism: each sequence's tokens split across the C ranks of a context group, so that activations
per rank fall to about 1/C and contexts that no single device holds can train.

**The split (head-tail).** A sequence of T tokens is cut into 2C chunks of T/2C; rank r holds chunks r and
2C-1-r, side by side (torchtitan's load balancing). Under a causal mask a token attends to those before it, so
a plain split into C pieces would give the last rank C times the first's work; a head and a tail each give
every rank the same. Token ids, labels and anything else laid out by token are split alike (`split_sequence`,
inverted by `join_sequence`); `head_tail_positions` says which global positions a rank's tokens have. A T
that does not cut into 2C chunks is refused (`check_length`).

**Attention over the split sequence.** A rank computes its own queries, keys and values, then gathers the keys
and values of the whole sequence over the context group, puts them in global order and attends with its
queries under the causal mask of their global positions (`causal_attention`): the all-gather context
parallelism of the Llama 3 paper. On CPUs each chunk attends block by block, only to the keys it can see, the
blocks merged by their log-sum-exp (block_attention.py): every rank computes 1/C of each sequence's attention,
and keeps only its own tokens' tensors for the backward. Elsewhere (GPUs) each chunk attends as follows. The
gather is torch's autograd-aware functional collective, whose backward
sums each key's and value's gradient over every rank's queries onto the rank that holds the token (a
reduce-scatter). The older `torch.distributed.nn.functional.all_gather` gives the right output and query
gradients but wrong key gradients, and is not used. GPUs run the same gather: torch's `context_parallel` (ring
attention over DTensor) would overlap it with the attention there, but is not used yet (no GPU has proved it
here); on CPU processes it has no sharding rule for the CPU attention kernel.

**Switching a model into context-parallel mode.** The GPT's and the Llama's modules that depend on where a
token is in the sequence declare a class attribute `context_parallel = None`: the GPT's `Embeddings` (rows of
the table of learned positions) and `CausalSelfAttention`, the Llama's `Attention` (rotary angles and the
causal mask). `apply_context_parallel(model, group)` sets it to a `ContextGroup` on each such module, as one
step of preparing a model (no strategy object involved; `apply_context_parallel(model, None)` switches back).
While it is set, a module takes its tokens' global positions from `ContextGroup.positions(T_local)` (so
rotary angles and learned positions are those of one device) and calls `ContextGroup.attention(q, k, v)` in
place of `F.scaled_dot_product_attention(q, k, v, is_causal=True)`: the same (B, heads, T_local, head_dim)
tensors in and out, fewer key/value heads than query heads allowed (grouped-query attention). The models
import nothing from here: the object carries the behaviour. Whoever feeds such a model gives each rank its
`split_sequence` of the batch's ids and labels.

**The loss.** A rank's `Objective.token_loss`, with `sequence_parts` set to C, is its part of one device's: its
tokens' cross-entropy summed and its trained tokens counted, both over the whole sequence's T (not the T/C a
rank holds), so that summed over the context group, as the reductions over data and context ranks sum them,
they are one device's loss and count. Each rank differentiates its own part only; the gather's backward brings it the gradients
that other ranks' queries give its keys and values. Parameter gradients are then partial sums, added over the
context group as over data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError
from .block_attention import block_attention, blockwise
from .global_batch import is_attention

# torch's autograd-aware all-gather: `all_gather_single_autograd` where torch has it (the older name then warns
# that it is deprecated), else `all_gather_tensor_autograd`; used along dim 0, which every version supports
_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def check_length(length: int, size: int) -> None:
    """Refuse a sequence of `length` tokens that does not cut into 2 x `size` equal head-tail chunks."""
    if length % (2 * size):
        chunks = 2 * size
        fit = max(chunks, length // chunks * chunks)
        raise ConfigError(
            f"--context {length} does not cut into {chunks} equal chunks for --context-parallel {size} (each "
            f"rank holds a head and a tail chunk of every sequence); give a --context that is a multiple of "
            f"{chunks}, such as {fit}"
        )


def head_tail_positions(length: int, rank: int, size: int, *, device=None) -> torch.Tensor:
    """The global positions (int64, length / size of them) of the tokens that `rank` of `size` holds of a
    sequence of `length`: chunk `rank`'s, then chunk 2 x size - 1 - rank's, each length / (2 x size) long."""
    check_length(length, size)
    chunk = length // (2 * size)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([head, tail])


def split_sequence(tokens: torch.Tensor, rank: int, size: int, *, dim: int = 1):
    """(this rank's part, the global positions of its tokens) of `tokens` laid out by token along `dim`: ids
    or labels (B, T) give (B, T / size), a (B, heads, T, head_dim) tensor with `dim=2` its T / size."""
    length = tokens.shape[dim]
    check_length(length, size)
    chunk = length // (2 * size)
    head = tokens.narrow(dim, rank * chunk, chunk)
    tail = tokens.narrow(dim, (2 * size - 1 - rank) * chunk, chunk)
    return torch.cat([head, tail], dim=dim), head_tail_positions(length, rank, size, device=tokens.device)


def join_sequence(parts: List[torch.Tensor], *, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's `split_sequence` part, `parts` in rank order: its inverse."""
    size = len(parts)
    halves = [part.chunk(2, dim=dim) for part in parts]
    in_order = [halves[r][0] for r in range(size)] + [halves[r][1] for r in reversed(range(size))]
    return torch.cat(in_order, dim=dim)


def gather_sequence(part: torch.Tensor, context: "ContextGroup", *, dim: int = 2) -> torch.Tensor:
    """The whole sequence in global order from every rank's `part` (its head-tail tokens along `dim`), gathered
    over the context group with torch's autograd-aware all-gather: the gradient of the whole sequence comes
    back to each rank as the sum, over every rank, of the gradients of its own tokens."""
    gathered = _gather(part.contiguous(), 0, context.group)  # the ranks' parts stacked along dim 0
    return join_sequence(list(gathered.chunk(context.size, dim=0)), dim=dim)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: "ContextGroup"
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole split sequence: q (B, heads, T/C, head_dim), k
    and v (B, kv_heads, T/C, head_dim) this rank's head-tail tokens, kv_heads dividing heads; out as q. Equal
    to one device's `F.scaled_dot_product_attention(q, k, v, is_causal=True)` on the whole sequence, this
    rank's tokens of it.

    Each of the rank's two chunks (c queries from global position a) attends to the keys before its end,
    [0, a + c), under the causal mask aligned to their last rows. torch's `is_causal` aligns a non-square mask
    to the first rows instead, so the chunk's queries are put after a rows of zeros (whose outputs are dropped,
    and whose gradients are zero): `is_causal` then needs no mask tensor, and the fused kernels keep O(T)
    memory per layer. An explicit (T/C, T) mask would be turned into float32 and saved for the backward pass
    of every layer (4 T^2 / C bytes), and make the kernel compute every masked pair too."""
    if blockwise(q.device.type):
        return block_attention(q, k, v, context)
    keys, values = gather_sequence(k, context), gather_sequence(v, context)
    grouped = q.shape[1] != keys.shape[1]
    chunk = q.shape[2] // 2
    outputs = []
    for part, start in zip(q.split(chunk, dim=2), context.chunk_starts(chunk)):
        end = start + chunk
        padded = torch.cat([part.new_zeros(*part.shape[:2], start, part.shape[3]), part], dim=2)
        out = F.scaled_dot_product_attention(
            padded, keys[:, :, :end], values[:, :, :end], is_causal=True, enable_gqa=grouped
        )
        outputs.append(out[:, :, start:])
    return torch.cat(outputs, dim=2)


@dataclass(frozen=True)
class ContextGroup:
    """The context group of a rank: `group` (a process group, or a 1-D DeviceMesh such as mesh["cp"]) over
    which each sequence is split, this rank's place in it (`rank`) and its size (C)."""

    group: Any
    rank: int
    size: int

    @classmethod
    def of(cls, group) -> "ContextGroup":
        """The ContextGroup of `group` (a process group, dist.group.WORLD, or a 1-D DeviceMesh)."""
        if hasattr(group, "get_local_rank"):
            return cls(group, group.get_local_rank(), group.size())
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def positions(self, length: int, *, device=None) -> torch.Tensor:
        """The global positions of the `length` tokens this rank holds (its head and tail chunks)."""
        return head_tail_positions(length * self.size, self.rank, self.size, device=device)

    def chunk_starts(self, chunk: int) -> tuple:
        """The global positions where this rank's head and tail chunks, `chunk` tokens each, begin."""
        return self.rank * chunk, (2 * self.size - 1 - self.rank) * chunk

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`causal_attention` over this group: the models' stand-in for causal scaled_dot_product_attention."""
        return causal_attention(q, k, v, self)

    @torch.no_grad()
    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the group (not differentiated): a figure of whole sequences from its parts."""
        total = tensor.clone()
        group = self.group.get_group() if hasattr(self.group, "get_group") else self.group
        dist.all_reduce(total, group=group)
        return total

    def joined(self, parts: List[torch.Tensor], *, dim: int) -> torch.Tensor:
        """The whole sequence in global order from every rank's head-tail part (`join_sequence`)."""
        return join_sequence(parts, dim=dim)

    def part_of(self, whole: torch.Tensor, rank: int, *, dim: int) -> torch.Tensor:
        """Rank `rank`'s head and tail chunks of `whole` laid out by token along `dim` (`split_sequence`)."""
        return split_sequence(whole, rank, self.size, dim=dim)[0]

    def own_tokens(self, tokens):
        """This rank's head and tail chunks of `tokens` laid out by token along dim 1 ((B, T) ids or labels; each
        of a tuple or list of them: packed rows' ids and positions); anything else as it is."""
        if isinstance(tokens, (tuple, list)):
            return type(tokens)(self.own_tokens(part) for part in tokens)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            return tokens
        return split_sequence(tokens, self.rank, self.size)[0]

    def __deepcopy__(self, memo) -> "ContextGroup":
        return self  # a copy of a model on this rank splits its sequences over the same group


def rank_sample_shape(shape: tuple, layout) -> tuple:
    """A sample's shape (tokens first) as one rank of `layout` holds it: 1/C of its tokens on a context group's
    rank (a pipeline gives its stages these shapes up front)."""
    return (shape[0] // layout.context, *shape[1:]) if layout.context > 1 else tuple(shape)


def tensor_plan_beside(plan, layout):
    """A tensor plan as it runs beside `layout`'s context ranks: the sequence is split over them already, so the
    norms stay whole on each tensor rank (no sequence parallelism)."""
    if layout.context > 1 and plan.sequence_parallel:
        from dataclasses import replace

        return replace(plan, sequence_parallel=False)
    return plan


def sequence_modules(model: nn.Module) -> List[nn.Module]:
    """The modules of `model` that declare `context_parallel`: those context parallelism switches (none: its
    sequences cannot be split here)."""
    return [module for module in model.modules() if hasattr(type(module), "context_parallel")]


def apply_context_parallel(model: nn.Module, group, *, part: bool = False) -> nn.Module:
    """Switch `model` into context-parallel mode over `group` (a process group, a 1-D DeviceMesh, or a
    ContextGroup; None switches it back): every module that declares `context_parallel` gets the group. A
    model with no such module is refused: its attention cannot be split here; a `part` of one (a pipeline
    rank's stages, the head alone) may have none."""
    context = group if group is None or isinstance(group, ContextGroup) else ContextGroup.of(group)
    switched = sequence_modules(model)
    if not switched and not part:
        raise ConfigError(
            f"--context-parallel splits the sequence of the gpt and llama models; {type(model).__name__} has no "
            f"attention that polytrain can split (no module declares context_parallel)"
        )
    for module in switched:
        module.context_parallel = context
    return model


def split_model_sequences(model: nn.Module, objective, mesh, slices: int, *, part: bool = False):
    """(this rank's ContextGroup, the start-up line that says so): `model` (or a `part` of one) switched to
    context-parallel mode over this rank's context group, the `cp` dimension of the run's mesh (`mesh`), and
    `objective`'s token loss to a part of each window's; `slices`: into how many slices the batch is cut (for the
    line)."""
    context = ContextGroup.of(mesh)
    apply_context_parallel(model, context, part=part)
    size = mesh.size()
    objective.sequence_parts = size
    length = getattr(model, "context", None)
    tokens, chunk = (f" of {length} tokens", f" of {length // (2 * size)}") if length else ("", "")
    how = (
        "attention block by block over the keys each chunk sees"
        if blockwise(getattr(mesh, "device_type", "cpu"))
        else "keys and values gathered over the group for attention"
    )
    line = (
        f"context parallel: each sequence{tokens} split over {size} ranks (a head and a tail chunk{chunk} "
        f"each), {how}; "
        + (f"{slices} such groups split the batch" if slices > 1 else "every rank reads the whole batch")
    )
    return context, line


def own_attention(model: nn.Module):
    """(name, class) of the first attention layer of a model's own (global_batch.py `is_attention`), or None: what a
    refusal of context parallelism names."""
    for module_name, module in model.named_modules():
        if module_name and is_attention(module):
            return module_name, type(module).__name__
    return None


def check_context_parallel(model: nn.Module, size: int, *, name: str) -> None:
    """One line, before any worker starts, where `model` (called `name`) cannot have its sequences split over
    `size` ranks: no attention polytrain can split, a context that does not cut into head-tail chunks, or
    dropout (whose masks would be drawn by each rank for its own tokens: not the one-device model)."""
    if size == 1:
        return
    if not sequence_modules(model):
        own = own_attention(model)
        why = (
            f"its {own[0]} ({own[1]}) attends over the whole sequence, which polytrain cannot split"
            if own
            else "its attention and positions would need the whole sequence on every rank"
        )
        raise ConfigError(
            f"--context-parallel splits the sequences of --model gpt and llama; {name} has no attention that "
            f"polytrain can split ({why}): use --model gpt or llama, or drop --context-parallel"
        )
    if getattr(model, "pools_last_token", False):
        raise ConfigError(
            f"--context-parallel splits each sequence over {size} ranks, and the {name} sequence classifier scores a "
            f"text by its last token's hidden state, which one rank holds; drop --context-parallel (--strategy data or "
            f"sharded split the batch)"
        )
    check_length(getattr(model, "context", 0), size)
    dropouts = [
        module_name or "the model"
        for module_name, module in model.named_modules()
        if isinstance(module, nn.Dropout) and module.p > 0
    ]
    if dropouts:
        raise ConfigError(
            f"--context-parallel does not split dropout masks yet (each rank would draw its own for its tokens, "
            f"another model than one device's; {', '.join(dropouts[:3])}{' ...' if len(dropouts) > 3 else ''}): "
            f"give {'--lora-dropout' if any('lora_dropout' in d for d in dropouts) else '--dropout'} 0, or drop "
            f"--context-parallel"
        )
