"""DistributedDataParallel as polytrain applies it: the user's module kept reachable through the wrapper, and
parameters and buffers given the strides DDP expects (the same values, nothing computes differently)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def default_strides_where_alike(model: nn.Module) -> None:
    """Channels-last parameters whose memory order is the default one too (a convolution over one input
    channel: the strides differ only in a dimension of size 1) get the default strides: cuDNN returns their
    gradients so, and DDP's gradient buckets, which follow each parameter's strides, would otherwise warn on
    every step. The same values in the same memory order: nothing computes differently."""
    for parameter in model.parameters():
        if parameter.dim() == 4 and parameter.is_contiguous():
            plain = parameter.data.clone(memory_format=torch.contiguous_format)
            if plain.stride() != parameter.stride():
                parameter.data = plain


def default_strides(shape) -> tuple:
    """The strides of a tensor of `shape` in the default (row-major) memory order."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def contiguous_buffers(model: nn.Module) -> None:
    """Buffers with the default strides (which `is_contiguous` does not check in a dimension of size 1): DDP broadcasts rank 0's buffers before each forward through one
    flat tensor, and copying back into a buffer of unusual strides fails (a positional encoding made with
    `unsqueeze(0).transpose(0, 1)`: "some elements of the input tensor and the written-to tensor refer to a
    single memory location"). The same values: nothing computes differently."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.stride() != default_strides(buffer.shape):
                module._buffers[name] = buffer.clone(memory_format=torch.contiguous_format)


class Replicated(DistributedDataParallel):
    """DistributedDataParallel whose attributes it lacks are its module's: a `step=` function may call the
    user's methods and read their attributes (`model.init_hidden(batch)`) as it does on one device, while
    calling it runs DDP's forward."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)


def apply_ddp(
    module: nn.Module, device: torch.device, *, group=None, stage: bool = False, leave_out=()
) -> nn.Module:
    """Step 6 with copies: DistributedDataParallel over every rank, or the ranks of `group` (`Replicated`). A
    pipeline's `stage` sums the copies' gradients (its loss is already divided by the global batch) into
    gradients that are views of DDP's buckets (no second copy of them), and keeps each copy's buffers its own
    (as one pipeline's BatchNorm statistics are its own). The parameters named in `leave_out` are not DDP's
    (experts split over the ranks, which their own copies average: experts.py)."""
    if not dist.is_initialized():
        raise RuntimeError("the data strategy needs an initialised process group; start it with --devices N")
    device_ids = [device.index] if device.type == "cuda" else None
    # gradient_as_bucket_view=True measured no gain on CPU and, with channels-last weights, makes DDP copy
    # every mismatched gradient (its "grad strides do not match bucket view strides" warning on GPUs); a
    # pipeline's stages hold no channels-last weights.
    if device.type == "cuda":
        default_strides_where_alike(module)
    contiguous_buffers(module)
    if leave_out:  # (torch's own way of telling DDP which parameters are not its)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(leave_out))
    if not stage:
        return Replicated(module, device_ids=device_ids)
    # (torch 2.13 renamed broadcast_buffers, and warns of the old name)
    keep_buffers = {"forward_sync_buffers" if _takes("forward_sync_buffers") else "broadcast_buffers": False}
    wrapped = Replicated(
        module, device_ids=device_ids, process_group=group, gradient_as_bucket_view=True, **keep_buffers
    )
    wrapped.register_comm_hook(group, _summed)
    return wrapped


def _takes(keyword: str) -> bool:
    import inspect

    return keyword in inspect.signature(DistributedDataParallel.__init__).parameters


def _summed(group, bucket):
    """DDP's all-reduce of one bucket of gradients, summed instead of averaged (torch's collective)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])


def release_reducers(modules) -> None:
    """Drop each DDP module's reducer (and the logger that holds it) once training is over. The reducer holds its
    process group in C++; where it went last, at the worker's exit, the gloo group's destructor waited for gloo's
    threads with the GIL held while one of them needed the GIL to free a collective's tensors (torch's deadlock,
    pytorch#56297: a worker stopped by Ctrl-C hung at its exit). Dropped here, while the groups are registered,
    the groups go last as Python objects, which release the GIL as they go (runtime/worker.py)."""
    for module in modules:
        if isinstance(module, DistributedDataParallel):
            module.reducer = module.logger = None
