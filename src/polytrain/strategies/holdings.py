"""What a rank holds, as the splitting strategies' start-up lines say it: its parameters (its part of each
DTensor), as many gradients, and the optimizer's state slots per parameter, next to what a whole replica holds."""

from __future__ import annotations

import torch

from .optimizer_state import state_slots


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view of its storage: collectives write into it), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_bytes(tensors) -> int:
    """Bytes of this rank's parts of `tensors`."""
    total = 0
    for tensor in tensors:
        part = local(tensor)
        total += part.numel() * part.element_size()
    return total


def optimizer_slots(optimizer) -> int:
    """State tensors per parameter, counted on a probe of the same class and settings."""
    return state_slots(type(optimizer), optimizer.defaults)


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def heading(slots: int) -> str:
    return f"per rank, parameters + gradients + optimizer state ({slots} slot{'s' if slots != 1 else ''} per parameter)"


def figures(parameters: int, slots: int, stepped: int = None) -> str:
    """`P + P + S`: parameters, as many gradients, and the optimizer's state of the `stepped` bytes (default all)."""
    return (
        f"{mib(parameters)} + {mib(parameters)} + {mib((parameters if stepped is None else stepped) * slots)}"
    )
