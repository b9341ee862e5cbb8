"""The caller's own module object: trained as itself where the run trains in this process, as a hand-written
loop trains it; left as it was by the checks that run it on samples before training; and what comes back of it
from worker processes.

On one device in this process (the single strategy, not under torchrun or srun) the object itself trains:
whatever its `forward`, a LightningModule's steps or its hooks set on it (a counter, `global_step`, ...) is there
after `fit`, and the changes polytrain makes to train it (the device, channels-last weights, activation
checkpointing, the dropout of its steps) are undone when training ends. Worker processes each train a copy
unpickled from it, and only the trained weights and buffers come back into the object.
"""

from __future__ import annotations

import contextlib
from itertools import chain

import torch
import torch.nn as nn
from torch.nn.modules.lazy import LazyModuleMixin

from .launch import spawns_workers


def trains_in_place(module, *, devices: int, launched: bool) -> bool:
    """Whether the run trains `module` itself: a module with values (not one built on the meta device) that
    trains in this process on one device."""
    from ..parallel.meta import is_meta

    return (
        isinstance(module, nn.Module) and not launched and not spawns_workers(devices) and not is_meta(module)
    )


def workers_note(module: nn.Module, devices: int) -> str:
    """The start line of a run whose copies of the caller's module train in worker processes."""
    return (
        f"note: {devices} worker process{'es' if devices > 1 else ''} each train a copy of your "
        f"{type(module).__name__}; only its weights and buffers come back into it (attributes set during "
        f"training, such as counters or a LightningModule's global_step, stay in the workers)"
    )


@contextlib.contextmanager
def attributes_kept(module):
    """Around polytrain's checks, which run `module` (or its steps) on samples: every attribute its submodules
    bind or add meanwhile is put back or removed again, so that training starts from the object as given (a
    counter in `forward` counts the training's calls only). Tensors changed in place are not touched (the
    checks run in eval mode, where layers keep their statistics); a lazy layer initialised by them keeps
    its new shape."""
    if not isinstance(module, nn.Module):
        yield
        return
    before = {m: (type(m), dict(m.__dict__)) for m in module.modules() if not isinstance(m, LazyModuleMixin)}
    try:
        yield
    finally:
        for m, (kind, attributes) in before.items():
            if type(m) is not kind:
                continue
            now = m.__dict__
            for key in [key for key in now if key not in attributes]:
                del now[key]
            for key, value in attributes.items():
                if key in now and now[key] is not value:
                    now[key] = value


@contextlib.contextmanager
def left_as_given(module: nn.Module):
    """Around training `module` itself: afterwards (also after a failure) its layers' `forward` is their own
    again (no activation checkpointing, no whole-batch dropout) and its tensors are on the device and in the
    memory format they were given in (polytrain's strategy moves them to the training device and may make
    images' weights channels-last)."""
    forwards = {m: m.__dict__.get("forward") for m in module.modules()}
    tensors = list(chain(module.parameters(), module.buffers()))
    devices = {t.device for t in tensors}
    plain = all(t.is_contiguous() for t in tensors if t.dim() == 4)
    try:
        yield
    finally:
        for m, forward in forwards.items():
            if forward is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = forward
        now = list(chain(module.parameters(), module.buffers()))
        if len(devices) == 1 and any(t.device not in devices for t in now):
            module.to(next(iter(devices)))
        if plain and not all(t.is_contiguous() for t in now if t.dim() == 4):
            module.to(memory_format=torch.contiguous_format)
