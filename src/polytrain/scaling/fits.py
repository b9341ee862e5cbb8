"""Refuse, before any worker starts, a layout whose ranks cannot hold the model: the cost model's bytes per
rank (plan/costmodel.py `memory_per_rank`: parameters, as many gradients and the optimizer's state, a layer
unit's weights gathered whole under FSDP2), worked out from the model's shapes (built on the meta device, so a 70B model
is judged without allocating it), against what each rank has: a GPU's free memory, or the host's available
memory shared among the CPU processes. Where the data is known, the activations the rank's slice of the batch
holds at the peak of its backward pass are counted as --activation-checkpointing leaves them (plan/activations.py,
measured on fake tensors by activation_memory.py); where they cannot be measured they are left out and the
figure is a lower bound.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import torch
import torch.nn as nn

from ..errors import UserError
from ..plan.costmodel import Workload, memory_per_rank
from ..plan.layout import Layout, layout_of_label, layout_or_none


def available_bytes(device: torch.device, devices: int) -> float:
    """What one rank may hold: a GPU's free memory, or a 1/n share of the host's available memory."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / devices
    except (ValueError, OSError, AttributeError):
        return math.inf


def available_per_rank(device: torch.device, devices: int) -> float:
    """What one rank may hold: a GPU's free memory, or the host's MemAvailable shared among `devices`
    processes."""
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                fields = dict(line.split(":", 1) for line in meminfo)
            return int(fields["MemAvailable"].split()[0]) * 1024 / devices
        except (OSError, KeyError, ValueError):
            pass
    return available_bytes(device, devices)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


def model_workload(model: nn.Module, *, batch_size: int, split_bytes: float = 0.0, **activations) -> Workload:
    """What the cost model needs of `model` for memory, from its shapes alone (a meta-device model is fine),
    with the `activations` figures of activation_memory.py where they were measured."""
    from ..strategies.units import gathered_bytes, unit_count

    return Workload(
        compute_seconds=0.0,
        parameter_bytes=float(sum(p.numel() * p.element_size() for p in model.parameters())),
        batch_size=batch_size,
        layers=unit_count(model),
        gathered_bytes=gathered_bytes(model),
        split_bytes=split_bytes,
        **activations,
    )


def measured_activations(model: nn.Module, dataset, device: torch.device) -> dict:
    """The activation figures of a training forward of `model` on two samples of `dataset` with the built-in
    objective of its kind ({} without data, or where it cannot be measured)."""
    if dataset is None:
        return {}
    from ..objective import Objective
    from .activation_memory import activation_profile
    from .workload import sample_batch

    try:
        x, y = sample_batch(dataset, 2)
    except Exception:
        return {}
    objective = Objective(kind=getattr(dataset, "kind", "classification"))
    return activation_profile(model, objective, x, y, device=device.type)


def _split_bytes(config, model: nn.Module, devices: int) -> float:
    """Bytes of the layers the tensor plan splits (0 where the model has no plan: all replicated)."""
    from ..strategies.tensor import plan_for

    try:
        plan = plan_for(config, model, devices=devices)
    except UserError:
        return 0.0
    return float(
        sum(
            p.numel() * p.element_size()
            for name, _, _ in plan.styles
            for p in model.get_submodule(name).parameters(recurse=False)
        )
    )


def layout_for(config, strategy: str) -> Optional[Layout]:
    """The degrees `strategy` has with these settings (pipeline stages, tensor ranks, whether a pipeline's
    replicas shard); None where they do not make a layout (the label's preset is used then)."""
    if config.devices == 1:
        return Layout()
    return layout_or_none(
        strategy,
        config.devices,
        getattr(config, "pipeline_stages", None),
        getattr(config, "tensor_parallel", None),
        data_parallel=getattr(config, "data_parallel", None),
        replicas=getattr(config, "replicas", None),
    )


def check_fits(
    config, model: nn.Module, strategy: str, *, name: str, device: torch.device, slots: int, dataset=None
) -> None:
    """One line, before any worker starts, where each rank of `strategy` on `config.devices` would need more
    memory than it has: the figures, and the settings that would make it fit. With `dataset`, the activations
    of each rank's slice of the batch are counted."""
    devices = config.devices
    layout = layout_for(config, strategy) or layout_of_label(strategy, devices)
    split = _split_bytes(config, model, layout.tensor) if layout.tensor > 1 else 0.0
    activations = measured_activations(model, dataset, device)
    work = model_workload(model, batch_size=config.batch_size, split_bytes=split, **activations)
    label = strategy if devices > 1 else "single"
    mode = getattr(config, "activation_checkpointing", "none") or "none"
    needed = memory_per_rank(work, label, devices, optimizer_slots=slots, checkpointing=mode, layout=layout)
    available = available_per_rank(device, devices)
    if needed <= available:
        return
    where = (
        "free on the GPU"
        if device.type == "cuda"
        else f"the host's available memory / {devices} process{'es' * (devices > 1)}"
    )
    fixes = []
    if layout.shard < devices:  # not yet every rank a shard of one copy
        sharded = memory_per_rank(work, "sharded", devices, optimizer_slots=slots, checkpointing=mode)
        fixes.append(f"--strategy sharded ({_gib(sharded)} per rank)")
    more = next(
        (
            n
            for n in (2**k for k in range(1, 17))
            if n > devices
            and memory_per_rank(work, "sharded", n, optimizer_slots=slots, checkpointing=mode) <= available
        ),
        None,
    )
    if more is not None:
        fixes.append(f"--strategy sharded --devices {more} or more (with as much memory per device)")
    else:
        fixes.append("more memory per device: even sharded over 65536 devices it does not fit")
    held, lower = "before activations", "; the activations come on top"
    if work.activation_bytes:
        weights_only = dataclasses.replace(work, activation_bytes=0.0)
        per_rank = needed - memory_per_rank(
            weights_only, label, devices, optimizer_slots=slots, checkpointing=mode, layout=layout
        )
        held, lower = f"{_gib(per_rank)} of activations with --activation-checkpointing {mode}", ""
    if mode != "full":
        lower += "; --activation-checkpointing full and --precision bf16 lower the activations"
    raise UserError(
        f"{name} ({sum(p.numel() for p in model.parameters()) / 1e9:,.2f}B parameters) "
        f"does not fit --strategy {strategy} on {devices} device(s): each rank needs at least "
        f"{_gib(needed)} (parameters, gradients and {slots} optimizer slot(s) per parameter, "
        f"{held}), and has {_gib(available)} ({where}); use {'; or '.join(fixes)}{lower}"
    )
