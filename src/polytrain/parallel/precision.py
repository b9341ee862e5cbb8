"""Reduced precision on the processor at hand: the layers whose kernels cannot run under autocast in bf16 or fp16
here run in float32, and one start-up line says which.

`--precision bf16` (or fp16) runs the forward pass under `torch.autocast`, which hands some layers to kernels that
a processor may lack. On a CPU without bf16 instructions (no `avx512_bf16` or `amx_bf16`, e.g. an AMD EPYC of
the Zen 2 or 3 generations) oneDNN has no LSTM primitive under autocast, in bf16 or in fp16:

    RuntimeError: could not create a primitive descriptor for the LSTM forward propagation primitive.

Which layers fail is asked of the machine, not of a list of processor names: `unsupported(module, device, precision)` runs a
small instance of each layer of `PROBED` forward and backward under autocast, once per process, and keeps the
classes whose kernels raise. Measured with torch 2.13 on a Xeon with oneDNN limited to AVX2
(`ONEDNN_MAX_CPU_ISA=AVX2`, what such a processor offers): only `nn.LSTM` fails, in bf16 and fp16; GRU (autocast
runs it in float32 anyway), RNN, the convolutions (1-3d, transposed too) and Linear run.

`keep_in_float32(module, classes)` makes each such layer of `module` (subclasses included) run with autocast off:
its floating inputs cast to float32 on the way in, its output float32, the layers around it in the reduced
precision as before. It is done with forward hooks, so the model keeps its structure, its parameter names and its
own forward, and a recomputation under activation checkpointing runs the layer as the forward did.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _recurrent(cls) -> Tuple[nn.Module, Callable]:
    return cls(4, 4), lambda: torch.randn(3, 2, 4)


def _convolution(cls, dims: int) -> Tuple[nn.Module, Callable]:
    return cls(2, 2, 3), lambda: torch.randn(1, 2, *([5] * dims))


# the layers torch hands to kernels of their own under autocast (oneDNN's on a CPU, cuDNN's on a GPU), each with a
# small instance and an input for it; a layer is probed only where a run's model holds one
PROBED: Dict[type, Callable] = {
    nn.LSTM: lambda: _recurrent(nn.LSTM),
    nn.GRU: lambda: _recurrent(nn.GRU),
    nn.RNN: lambda: _recurrent(nn.RNN),
    nn.Conv1d: lambda: _convolution(nn.Conv1d, 1),
    nn.Conv2d: lambda: _convolution(nn.Conv2d, 2),
    nn.Conv3d: lambda: _convolution(nn.Conv3d, 3),
    nn.ConvTranspose1d: lambda: _convolution(nn.ConvTranspose1d, 1),
    nn.ConvTranspose2d: lambda: _convolution(nn.ConvTranspose2d, 2),
    nn.ConvTranspose3d: lambda: _convolution(nn.ConvTranspose3d, 3),
}


@functools.lru_cache(maxsize=None)
def _runs(cls: type, device_type: str, dtype: torch.dtype) -> bool:
    """Whether a small `cls` runs forward and backward under autocast at `dtype` on this process's device."""
    layer, make_input = PROBED[cls]()
    layer = layer.to(device_type)
    x = make_input().to(device_type).requires_grad_()
    try:
        with torch.autocast(device_type, dtype=dtype):
            out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
    except RuntimeError:
        return False
    return True


def probed_layers(module: nn.Module) -> List[type]:
    """The classes of `PROBED` that `module` holds a layer of (subclasses counted as the class they derive)."""
    found = []
    for layer in module.modules():
        for cls in PROBED:
            if isinstance(layer, cls) and cls not in found:
                found.append(cls)
    return found


def unsupported(module: nn.Module, device: torch.device, precision: str) -> List[type]:
    """The classes of `module`'s layers whose kernels cannot run under autocast at `precision` on `device`'s kind
    of device here (none under fp32)."""
    if precision not in DTYPES:
        return []
    device_type = torch.device(device).type
    return [cls for cls in probed_layers(module) if not _runs(cls, device_type, DTYPES[precision])]


_saved = threading.local()  # each thread's autocast states, one per layer it is inside


def _enter(layer: nn.Module, args: tuple, kwargs: dict):
    device_type = layer.polytrain_autocast_device
    stack = getattr(_saved, "states", None)
    if stack is None:
        stack = _saved.states = []
    stack.append(torch.is_autocast_enabled(device_type))
    torch.set_autocast_enabled(device_type, False)
    return tree_map(_to_float32, args), tree_map(_to_float32, kwargs)


def _leave(layer: nn.Module, args, kwargs, output):
    torch.set_autocast_enabled(layer.polytrain_autocast_device, _saved.states.pop())
    return None


def _to_float32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value


def keep_in_float32(module: nn.Module, classes: List[type], device: torch.device) -> List[str]:
    """Each layer of `module` of one of `classes` runs in float32 with autocast off, in place; returns their
    names (the module's own names, "" for the module itself)."""
    names = []
    for name, layer in module.named_modules():
        if isinstance(layer, tuple(classes)) and not hasattr(layer, "polytrain_autocast_device"):
            layer.polytrain_autocast_device = torch.device(device).type
            layer.register_forward_pre_hook(_enter, with_kwargs=True)
            layer.register_forward_hook(_leave, with_kwargs=True, always_call=True)
            names.append(name)
    return names


def apply_precision(module: nn.Module, device: torch.device, precision: str) -> str:
    """The layers of `module` whose kernels cannot run at `precision` on this device made to run in float32;
    the start-up line that says so ("" where every layer runs as asked)."""
    classes = unsupported(module, device, precision)
    if not classes:
        return ""
    names = keep_in_float32(module, classes, device)
    kinds = ", ".join(cls.__name__ for cls in classes)
    shown = ", ".join(name or "(the model)" for name in names[:4]) + (", ..." if len(names) > 4 else "")
    layers = f"{len(names)} layer ({shown}) runs" if len(names) == 1 else f"{len(names)} layers ({shown}) run"
    return (
        f"--precision {precision}: this processor has no {str(DTYPES[precision])[6:]} kernel for {kinds} under autocast "
        f"(probed here), so {layers} in float32 and the rest in {precision}; --precision fp32 runs every "
        "layer in float32"
    )
