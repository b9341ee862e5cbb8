"""Activation checkpointing: a model's blocks keep fewer tensors for the backward pass and compute the rest again
in it (`torch.utils.checkpoint`, non-reentrant). The same numbers, less memory, more computation:

    none         autograd keeps what every op saves until the backward pass (the default)
    full         each block keeps only its input; its forward runs again in the backward pass
    selective    each block keeps the outputs of its matrix multiplications (mm, addmm, bmm, attention) and
                 recomputes the rest (norms, activations, additions): torch's selective checkpointing
    selective:K  every K-th block (the K-th, 2K-th, ...) as in full, the others as in none

A block is a module of the model's own classes (not torch.nn's) that holds parameters, or one of torch.nn's
transformer layers (`nn.TransformerEncoderLayer`, `nn.TransformerDecoderLayer`: attention and an MLP, as a
model's own block), the outermost such, of the class that occurs most often (on a tie, the one with more
layers): GPT's `Block`, a Llama's transformer block. Each block's `forward` is replaced on the instance, so the
model keeps its structure and parameter names: a `checkpoint_wrapper` would add `_checkpoint_wrapped_module.`
to them, and the tensor plan, the pipeline's split, the optimizer's parameter names and every state dict read
those names. Strategies apply it
after the pipeline split and the tensor plan, before FSDP2 or DDP wraps the model; nothing here knows them.

Random ops draw the same numbers when recomputed: torch.utils.checkpoint restores the RNG state first
(`preserve_rng_state`, on by default), so dropout keeps its mask. BatchNorm is refused: recomputing its forward
in training mode would update its running statistics twice per step.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import List, Tuple

import torch
import torch.nn as nn

from ..errors import ConfigError

MODES = ("none", "full", "selective")
FLAG = "--activation-checkpointing"

# what selective checkpointing keeps: the outputs of matrix multiplications (the costly ops to recompute)
_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")
_ATTENTION = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
KEPT_OPS = tuple(
    getattr(torch.ops.aten, name) for name in _MATMULS + _ATTENTION if hasattr(torch.ops.aten, name)
)


def parse_mode(mode: str) -> Tuple[str, int]:
    """`full` as ("full", 1), `selective` as ("selective", 0) (op-level), `selective:K` as ("full", K): every
    K-th block in full; `none` as ("none", 0). The setting's declared check has refused other values."""
    kind, _, every = mode.partition(":")
    if every:
        return "full", int(every)
    return kind, 1 if kind == "full" else 0


def keep_matmul_outputs(ctx, op, *args, **kwargs):
    """Selective checkpointing's policy: save what matrix multiplications return, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op.overloadpacket in KEPT_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _own_class(module: nn.Module) -> bool:
    return not type(module).__module__.startswith("torch.")


# torch.nn's layers that are whole transformer blocks (attention and an MLP), which a model stacks as its own
TORCH_BLOCKS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def _block_class(module: nn.Module) -> bool:
    return _own_class(module) or isinstance(module, TORCH_BLOCKS)


def _keeps_statistics(module: nn.Module) -> bool:
    """Whether the module updates running statistics in a training forward (BatchNorm)."""
    return (
        bool(getattr(module, "track_running_stats", False))
        and getattr(module, "running_mean", None) is not None
    )


def find_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name in the model, module) of each block, in the model's order ([] where the model has none)."""
    outermost, inside = [], set()
    for name, module in model.named_modules():
        if not name or any(name.startswith(prefix) for prefix in inside):
            continue
        if _block_class(module) and any(True for _ in module.parameters()):
            outermost.append((name, module))
            inside.add(name + ".")
    if not outermost:
        return []
    counts = Counter(type(module) for _, module in outermost)
    layers = {type(module): sum(1 for m in module.modules() if not _own_class(m)) for _, module in outermost}
    chosen = max(counts, key=lambda kind: (counts[kind], layers[kind]))
    return [(name, module) for name, module in outermost if type(module) is chosen]


def check_activation_checkpointing(model: nn.Module, mode: str) -> List[str]:
    """The names of the blocks `mode` checkpoints in `model`; refused in one line where it means nothing."""
    kind, every = parse_mode(mode)
    if kind == "none":
        return []
    blocks = find_blocks(model)
    if not blocks:
        raise ConfigError(
            f"{FLAG} {mode} recomputes the model's blocks (modules of its own classes that hold parameters, "
            f"such as GPT's Block, or nn.TransformerEncoderLayer), and {type(model).__name__} is made of "
            f"torch.nn layers only, where recomputing a layer saves nothing; drop {FLAG}"
        )
    kind_name = type(blocks[0][1]).__name__
    norms = [name for name, module in blocks if any(_keeps_statistics(m) for m in module.modules())]
    if norms:
        raise ConfigError(
            f"{FLAG} recomputes each {kind_name}'s forward, and {kind_name} {norms[0]} holds BatchNorm, "
            f"whose running statistics would then update twice per step; drop {FLAG}"
        )
    if every > len(blocks):
        raise ConfigError(
            f"{FLAG} {mode} checkpoints one block in {every}, and the model has {len(blocks)} "
            f"({kind_name}); use selective:K with K at most {len(blocks)}, or full"
        )
    return [name for i, (name, _) in enumerate(blocks, 1) if not every or i % every == 0]


class _Recomputed:
    """A block's forward run under torch.utils.checkpoint (an object holding the block and its class's forward,
    not a closure: the model still deep-copies and pickles)."""

    def __init__(self, module: nn.Module, selective: bool):
        self.module, self.function, self.selective = module, type(module).forward, selective

    def __call__(self, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        if self.selective:
            contexts = functools.partial(create_selective_checkpoint_contexts, keep_matmul_outputs)
            return checkpoint(
                self.function, self.module, *args, use_reentrant=False, context_fn=contexts, **kwargs
            )
        return checkpoint(self.function, self.module, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> List[str]:
    """Checkpoint `model`'s blocks in place as `mode` says; returns the names of those checkpointed."""
    kind, _ = parse_mode(mode)
    names = check_activation_checkpointing(model, mode)
    modules = dict(model.named_modules())
    for name in names:
        block = modules[name]
        if not isinstance(block.__dict__.get("forward"), _Recomputed):  # (once, if applied twice)
            block.forward = _Recomputed(block, selective=kind == "selective")
    return names
