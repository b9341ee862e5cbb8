"""What one training forward of a model keeps for its backward pass, per sample, as the cost model's
activation figures (planning/activations.py): all of it, and per checkpointing block what it keeps, its input and
its matrix products' outputs.

The forward runs on fake tensors (torch's FakeTensorMode: shapes, dtypes and the device's choice of kernels,
no memory), on a copy of the model whose weights are fake too, so a model built on the meta device, of any
size, is measured in the launching process without allocating it; the CPU's attention kernel (which keeps its
output and log-sum-exp, not the T x T scores) is the one measured, as it runs. Saved tensors are counted
by storage (q, k and v are views of one), weights not at all. The forward's causal attention calls are noted
as the `attention` figure (planning/activations.py `AttentionShape`): what a context rank keeps beyond 1/C of them
is counted from it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel.block_attention import blockwise as attends_blockwise

FIELDS = (
    "activation_bytes",
    "blocks",
    "block_bytes",
    "block_input_bytes",
    "block_matmul_bytes",
    "attention",
    "backward_bytes",
)


def fake_copy(model: nn.Module, device: str) -> nn.Module:
    """`model` with every parameter and buffer replaced by an empty fake tensor on `device` (call inside a
    FakeTensorMode); ties kept, no weight copied."""
    memo = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in memo:
            empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            keep = isinstance(tensor, nn.Parameter)
            memo[id(tensor)] = nn.Parameter(empty, requires_grad=tensor.requires_grad) if keep else empty
    return copy.deepcopy(model, memo)


@contextlib.contextmanager
def quiet_fake_tensors():
    """Without torch's error lines for an operation fake tensors cannot run ("failed while attempting to run
    meta for aten.mm", with its traceback): this probe catches the error and reports the figures unknown, and a
    model whose `step=` reshapes its inputs may fail here on the probe's and train well."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def activation_profile(
    model: nn.Module,
    objective,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    device: str = "cpu",
    precision: str = "fp32",
):
    """The Workload's activation fields (`FIELDS`), per sample of `x`, for a training forward and loss of
    `model` on `device`'s kernels in `precision` (bf16 and fp16 under autocast, as a run computes: the matrix
    products' outputs it keeps are half the bytes of float32's); {} where the forward cannot run on fake tensors
    or the objective needs more than outputs and targets."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from ..parallel.activation_checkpoint import KEPT_OPS, find_blocks

    class MatmulOutputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
                if _key(args[0]) in weights:  # autocast's copy of a weight is a weight, not an activation
                    weights.add(_key(out))
            if current[0] is not None and func.overloadpacket in KEPT_OPS:
                for tensor in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(tensor, torch.Tensor):
                        products.setdefault(current[0], {})[_key(tensor)] = (tensor, _nbytes(tensor))
            return out

    class AttentionCalls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                calls.append(_attention_call(*args, **kwargs))
            return func(*args, **kwargs)

    calls: List[Optional[tuple]] = []
    saved: Dict[int, tuple] = {}  # storage -> (tensor, bytes, block index or None)
    products: Dict[int, dict] = {}  # block -> {storage: (tensor, bytes)}
    inputs: Dict[int, int] = {}
    current = [None]
    try:
        with quiet_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True):
            fake = fake_copy(model, device).train()
            weights = {_key(p) for p in fake.parameters()}
            blocks = [module for _, module in find_blocks(fake)]
            hooks = []
            for index, block in enumerate(blocks):
                hooks.append(block.register_forward_pre_hook(_enter(current, index, inputs)))
                hooks.append(block.register_forward_hook(_leave(current)))

            def pack(tensor):
                if _key(tensor) not in weights:
                    saved.setdefault(_key(tensor), (tensor, _nbytes(tensor), current[0]))
                return tensor

            fx, fy = torch.zeros_like(x, device=device), torch.zeros_like(y, device=device)
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
            with (
                MatmulOutputs(),
                AttentionCalls(),
                torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
                torch.autocast(device, dtype=dtype, enabled=dtype is not None),
            ):
                objective.loss_sum(fake(fx), fy)
            for hook in hooks:
                hook.remove()
    except Exception:  # a forward fake tensors cannot run (data-dependent control flow): unknown
        return {}
    count = len(x)
    within = [sum(size for _, size, block in saved.values() if block == b) for b in range(len(blocks))]
    total = sum(size for _, size, _ in saved.values())
    per_block = lambda values: sum(values) / len(blocks) / count if blocks else 0.0  # noqa: E731
    return dict(
        activation_bytes=total / count,
        blocks=len(blocks),
        block_bytes=per_block(within),
        block_input_bytes=per_block(inputs.values()),
        block_matmul_bytes=per_block(
            [sum(size for _, size in products.get(b, {}).values()) for b in range(len(blocks))]
        ),
        attention=_attention_shape(calls, model, blockwise=attends_blockwise(device)),
        backward_bytes=backward_peak(model, objective, x, y, device=device, dtype=dtype, kept=total / count),
    )


def backward_peak(model: nn.Module, objective, x, y, *, device: str, dtype, kept: float) -> float:
    """Bytes per sample of `x` that the training pass holds at its peak beyond what the forward kept (`kept`, per
    sample): in the backward, the gradients of the activations and the kernels' temporaries of the layer it is in
    (an attention's backward holds its queries', keys' and values' gradients at once; a large vocabulary's loss,
    its logits' gradients). Measured on fake tensors: every storage an operation makes, from the moment it is made
    until it is freed, the weights (autocast's copies of them too) and their gradients left out, as they are counted
    apart. 0 where the backward cannot run on fake tensors. A 2-layer Llama of width 128 at T = 8192 on a CPU
    peaked within 1% of what torch's MemTracker measured on real tensors (tests/test_activation_memory.py)."""
    import itertools
    import weakref

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.weak import WeakIdKeyDictionary

    marks, events, weights, count = WeakIdKeyDictionary(), [], set(), itertools.count()

    def mark(tensor: torch.Tensor) -> int:
        """The storage of `tensor` by a number of its own, its bytes noted where it appears and where it is freed."""
        storage = tensor.untyped_storage()
        found = marks.get(storage)
        if found is None:
            found = marks[storage] = next(count)
            events.append((found, storage.nbytes()))
            weakref.finalize(storage, events.append, (found, -storage.nbytes()))
        return found

    class Storages(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            copied = func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor)
            copied = copied and mark(args[0]) in weights  # autocast's copy of a weight is a weight
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor):
                    made = mark(tensor)
                    if copied:
                        weights.add(made)
            return out

    try:
        with quiet_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True):
            fake = fake_copy(model, device).train()
            weights.update(mark(p) for p in fake.parameters())
            fx, fy = torch.zeros_like(x, device=device), torch.zeros_like(y, device=device)
            with Storages():
                with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                    loss = objective.loss_sum(fake(fx), fy)
                loss.backward()
            left = weights | {mark(p.grad) for p in fake.parameters() if p.grad is not None}
            held = peak = 0
            for each, nbytes in list(events):
                if each not in left:
                    held += nbytes
                    peak = max(peak, held)
    except Exception:  # a backward fake tensors cannot run: unknown (0)
        return 0.0
    return max(0.0, peak / len(x) - kept)


def _attention_call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *_, **__):
    """(heads, kv_heads, head_dim, tokens, element bytes) of a causal attention call without a mask
    (batch, heads, tokens, head_dim); None for another."""
    if attn_mask is not None or not is_causal or query.dim() != 4:
        return None
    return query.shape[1], key.shape[1], query.shape[3], query.shape[2], query.element_size()


def _attention_shape(calls: list, model: nn.Module, *, blockwise: bool = False):
    """The forward's attention as an AttentionShape where every call is the same causal attention; None
    where there is none, or another kind among them. `blockwise`: a context rank on this device attends block by
    block (CPUs)."""
    from ..planning.activations import AttentionShape

    if not calls or None in calls or len(set(calls)) != 1:
        return None
    heads, kv_heads, head_dim, tokens, element_bytes = calls[0]
    parameters = float(sum(p.numel() for p in model.parameters()))
    return AttentionShape(
        len(calls), heads, kv_heads, head_dim, tokens, element_bytes, parameters, blockwise=blockwise
    )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


def _enter(current: list, index: int, inputs: dict):
    def hook(module, args):
        current[0] = index
        inputs[index] = sum(_nbytes(a) for a in args if isinstance(a, torch.Tensor))

    return hook


def _leave(current: list):
    def hook(module, args, output):
        current[0] = None

    return hook
