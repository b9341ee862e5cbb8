"""The two measurements that need the whole model in the launching process, refused in one line before
anything is allocated where it would not fit: `--strategy auto` times whole steps of the model (one device's,
and N replicas' side by side), and `polytrain bench` trains it on one device beside its N-device rows.

What they would hold is counted from the model's shapes (built on the meta device, it costs nothing): `copies`
copies of the parameters, each with its gradients and SGD's momentum (3 x the parameter bytes; an upper
bound for the copies that are only run forward). It must stay under `SAFE_FRACTION` of what this machine has
free (a GPU's free memory, or the host's MemAvailable), which leaves room for the activations and for the
other programs running. Everything else the launching process does with a large model works from its shapes
(`check_fits`, `--split N,M`) or one layer at a time (`--split auto`: meta.py `one_by_one`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import UserError
from ..parallel.meta import materialised_copy
from .fits import available_per_rank

SAFE_FRACTION = 0.5
HELD_PER_PARAMETER = 3  # the weight, its gradient, SGD's momentum


def measuring_bytes(model: nn.Module, *, copies: int) -> float:
    """Bytes `copies` trained copies of `model` hold (weights, gradients, momentum), from its shapes."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return float(weights * HELD_PER_PARAMETER * copies)


def check_measurable(model: nn.Module, *, copies: int, device: torch.device, what: str, instead: str) -> None:
    """One line where `what` (which holds `copies` whole copies of `model` here) would take more than
    `SAFE_FRACTION` of the memory free on `device`, saying what to do `instead`."""
    needed = measuring_bytes(model, copies=copies)
    available = available_per_rank(device, 1)
    if needed <= SAFE_FRACTION * available:
        return
    count = sum(p.numel() for p in model.parameters())
    raise UserError(
        f"{what} holds the whole model in this process ({copies} copies of {count / 1e9:,.2f}B parameters "
        f"with gradients and momentum: {needed / 2**30:,.1f} GiB), more than {SAFE_FRACTION:.0%} of the "
        f"{available / 2**30:,.1f} GiB free on the {device.type}; {instead}"
    )


def measurable_copy(
    model: nn.Module, *, copies: int, device: torch.device, seed: int, what: str, instead: str
):
    """A copy of `model` with values on the CPU (initial ones where it was built on meta; measuring must not
    touch the model's own statistics), for a measurement of the whole model, after `check_measurable`."""
    check_measurable(model, copies=copies, device=device, what=what, instead=instead)
    return materialised_copy(model, device="cpu", seed=seed)


def check_bench(meta_model: nn.Module, *, devices: int, on) -> None:
    """`polytrain bench` trains the model in this process (the one-device rows and the workload's timings:
    the model, its copy and `devices` replicas side by side) and in each of `devices` CPU processes: one line
    where that would not fit on this machine, or on a GPU (the model and its copy); `on`: the first device of
    each kind the bench runs on (runtime/bench.py)."""
    for device in on:
        check_measurable(
            meta_model,
            copies=2 * devices + 3 if device.type == "cpu" else 2,
            device=device,
            what="polytrain bench trains the model on one device and",
            instead="bench a smaller one (fewer --layers, a smaller --width or --size), or train this one with "
            "--strategy sharded, whose fit check reads only the model's shapes",
        )
