"""Refuse, before any worker starts, a layout whose ranks cannot hold the model: the cost model's bytes per
rank (planning/memory.py `memory_per_rank`: parameters, as many gradients and the optimizer's state, a layer
unit's weights gathered whole under FSDP2), worked out from the model's shapes (built on the meta device, so a 70B model
is judged without allocating it), against what each rank has: a GPU's free memory, or the host's available
memory shared among the CPU processes. Where the data is known, the activations the rank's slice of the batch
holds at the peak of its backward pass are counted as --activation-checkpointing leaves them (planning/activations.py,
measured on fake tensors by activation_memory.py), on a context rank its part of each sequence's with the
keys and values its attention gathers and its chunks' zero rows (`context_part`); where they cannot be
measured they are left out and the figure is a lower bound.

What it counts is tensors, as a GPU's allocator holds them. A CPU process holds more where its C allocator keeps
freed blocks in its heap for the next step (runtime/hostenv.py `keep_freed_memory`, several times faster than
mapping them afresh): the heap fragments, and resident memory grows past the live tensors by up to a share of
the activations that depends on --activation-checkpointing (`HEAP_KEEPS`). A layout that fits only without that
gets a process that gives freed blocks back at once (`Fit.gives_back_memory`: steps 1.25-1.4x slower, but
within the memory it has).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from ..errors import UserError
from ..parallel.layout import Layout
from ..parallel.presets import layout_or_none, plain_layout, settings_in
from ..planning.context import context_splits
from ..planning.costmodel import Workload
from ..planning.memory import memory_per_rank

# what a CPU process's heap, keeping freed blocks, holds beyond the live tensors, per byte of activations counted,
# by --activation-checkpointing: measured (resident memory after 3-5 steps less the live peak) 0.22-0.78 without
# and 0.33-0.64 selective, 1.27-1.43 full, where recomputation allocates and frees each block's activations while
# the gradients live (a Llama at T 4096, batch 4, a GPT at T 1024, batch 16; `python benchmarks/memory_check.py`,
# docs/benchmarks.md): the largest, rounded up
HEAP_KEEPS = {"none": 0.8, "selective": 0.8, "full": 1.5}


def heap_keeps(checkpointing: str) -> float:
    """`HEAP_KEEPS` of an --activation-checkpointing mode (selective:K as selective)."""
    return HEAP_KEEPS.get(checkpointing.split(":")[0], max(HEAP_KEEPS.values()))


@dataclass
class Fit:
    """What the memory check found for a rank: bytes of tensors at its step's peak (`needed`), of them the
    activations, and what the rank has."""

    needed: float
    activations: float
    available: float
    checkpointing: str = "none"

    @property
    def kept_heap(self) -> float:
        """What a CPU process whose heap keeps freed blocks holds at most: the tensors, and `heap_keeps` x the
        activations."""
        return self.needed + heap_keeps(self.checkpointing) * self.activations

    def gives_back_memory(self) -> bool:
        """Whether a CPU process must give freed blocks back to the system at once to stay within what it has."""
        return self.kept_heap > self.available

    def line(self) -> str:
        """Why a CPU process gives freed memory back (a start-up line)."""
        return (
            f"memory: freed blocks are given back to the system at once (steps up to about 1.4x slower): each "
            f"process needs {_size(self.needed)} of tensors, {_size(self.activations)} of them activations, "
            f"and has {_size(self.available)}; a heap that kept freed blocks would hold up to "
            f"{_size(self.kept_heap)}"
        )


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


def _size(nbytes: float) -> str:
    return _gib(nbytes) if nbytes >= 2**30 else f"{nbytes / 2**20:,.0f} MiB"


def model_workload(
    model: nn.Module, *, batch_size: int, split_bytes: float = 0.0, sequence_splits: tuple = (), **activations
) -> Workload:
    """What the cost model needs of `model` for memory, from its shapes alone (a meta-device model is fine),
    with the `activations` figures of activation_memory.py where they were measured."""
    from ..parallel.units import gathered_bytes, unit_count

    return Workload(
        compute_seconds=0.0,
        parameter_bytes=float(sum(p.numel() * p.element_size() for p in model.parameters())),
        trained_bytes=float(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)),
        batch_size=batch_size,
        layers=unit_count(model),
        gathered_bytes=gathered_bytes(model),
        split_bytes=split_bytes,
        sequence_splits=sequence_splits,
        **activations,
    )


def measured_activations(model: nn.Module, dataset, device: torch.device, precision: str = "fp32") -> dict:
    """The activation figures of a training forward of `model` on two samples of `dataset` with the built-in
    objective of its kind, in the run's `precision` (under autocast for bf16 and fp16: the saved matrix products
    are half float32's bytes) ({} without data, or where it cannot be measured)."""
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
    return activation_profile(model, objective, x, y, device=device.type, precision=precision)


def _tensor_split(config, model: nn.Module, devices: int) -> dict:
    """What the tensor plan of `devices` ranks tells the memory check: the bytes of the layers it splits
    (`split_bytes`), and `sequence_splits` where it runs sequence-parallel ({} where the model has no plan: all
    replicated)."""
    from ..strategies.tensor import plan_for

    try:
        plan = plan_for(config, model, devices=devices)
    except UserError:
        return {}
    split = sum(
        p.numel() * p.element_size()
        for name, _, _ in plan.styles
        for p in model.get_submodule(name).parameters(recurse=False)
    )
    return dict(split_bytes=float(split), sequence_splits=(devices,) if plan.sequence_parallel else ())


def layout_for(config, strategy: str) -> Optional[Layout]:
    """The degrees `strategy` has with these settings (pipeline stages, tensor ranks, whether a pipeline's
    replicas shard); None where they do not make a layout (the label's preset is used then)."""
    if config.devices == 1:
        return Layout()
    return layout_or_none(strategy, config.devices, **settings_in(config))


def check_fits(
    config,
    model: nn.Module,
    strategy: str,
    *,
    name: str,
    device: torch.device,
    slots: int,
    dataset=None,
    on_this_host: Optional[int] = None,
) -> Fit:
    """One line, before any worker starts, where each rank of `strategy` on `config.devices` would need more
    memory than it has: the figures, and only settings that the same count shows would fit, each with its
    figure; else what it counted (`Fit`). With `dataset`, the activations of each rank's slice of the batch are
    counted. `on_this_host`: how many of the ranks share this host's memory (under a launcher, its local
    world; default all of them)."""
    devices = config.devices
    layout = layout_for(config, strategy) or plain_layout(strategy, devices)
    split = _tensor_split(config, model, layout.tensor) if layout.tensor > 1 else {}
    activations = measured_activations(model, dataset, device, getattr(config, "precision", "fp32") or "fp32")
    accumulate = getattr(config, "accumulate", 1) or 1
    work = model_workload(model, batch_size=config.batch_size, **split, **activations)
    if work.attention and getattr(config, "precision", "fp32") != "fp32":  # autocast's attention: 2 bytes
        work = dataclasses.replace(work, attention=dataclasses.replace(work.attention, element_bytes=2))
    mode = getattr(config, "activation_checkpointing", "none") or "none"

    servers = (getattr(config, "servers", 1) or 1) if strategy == "parameter-server" else 0

    def needs(on_layout, checkpointing, passes) -> float:
        passed = dataclasses.replace(work, batch_size=max(1, math.ceil(config.batch_size / passes)))
        on_servers = servers if on_layout == layout else 0
        return memory_per_rank(
            passed, on_layout, optimizer_slots=slots, checkpointing=checkpointing, servers=on_servers
        )

    needed = needs(layout, mode, accumulate)
    sharing = on_this_host or devices
    available = available_per_rank(device, sharing)
    weights_only = dataclasses.replace(work, activation_bytes=0.0)
    activations = needed - memory_per_rank(
        weights_only, layout, optimizer_slots=slots, checkpointing=mode, servers=servers
    )
    if needed <= available:
        return Fit(needed, activations, available, mode)
    where = (
        "free on the GPU"
        if device.type == "cuda"
        else f"the host's available memory / {sharing} process{'es' * (sharing > 1)}"
    )
    fixes = _fixes(
        needs,
        available,
        layout=layout,
        devices=devices,
        mode=mode,
        accumulate=accumulate,
        batch_size=config.batch_size,
        known=bool(work.activation_bytes),
        sequence=sequence_length(model),
    )
    held = "before activations"
    lower = "; the activations come on top; --activation-checkpointing full and --precision bf16 lower them"
    if work.activation_bytes:
        held, lower = f"{_gib(activations)} of activations with --activation-checkpointing {mode}", ""
    raise UserError(
        f"{name} ({sum(p.numel() for p in model.parameters()) / 1e9:,.2f}B parameters) "
        f"does not fit --strategy {strategy} on {devices} device(s): each rank needs at least "
        f"{_gib(needed)} (parameters, gradients and {slots} optimizer slot(s) per parameter, "
        f"{held}), and has {_gib(available)} ({where}); {fixes}{lower}"
    )


def sequence_length(model: nn.Module) -> int:
    """The tokens of each sequence of a model whose sequences `--context-parallel` can split (0: none)."""
    from ..parallel.context import sequence_modules

    return int(getattr(model, "context", 0) or 0) if sequence_modules(model) else 0


def _fixes(needs, available, *, layout, devices, mode, accumulate, batch_size, known, sequence=0) -> str:
    """The settings that fit by the same count, fewest changes first (at most three, each with its figure), or
    what the closest of them would still need. `needs(layout, checkpointing, passes)` counts.
    A model whose `sequence`s context parallelism splits is also offered --context-parallel."""
    modes = [mode] if mode == "full" or not known else [mode, "full"]
    # more devices split the global batch further (activations) and the shards: at most one sample per rank
    counts = [n for n in (2**k for k in range(1, 17)) if devices < n <= batch_size]
    tried = []  # (flags, bytes per rank)
    for checkpointing in modes:
        flag = [] if checkpointing == mode else [f"--activation-checkpointing {checkpointing}"]
        if checkpointing != mode:
            tried.append((flag, needs(layout, checkpointing, accumulate)))
        if layout.shard < devices:  # not yet every rank a shard of one copy
            tried.append(
                (
                    ["--strategy sharded", *flag],
                    needs(plain_layout("sharded", devices), checkpointing, accumulate),
                )
            )
        per_rank = math.ceil(batch_size / devices)
        for passes in (2**k for k in range(1, 17)) if known else ():  # smaller passes hold fewer activations
            if accumulate < passes <= per_rank:
                cost = needs(plain_layout("sharded", devices), checkpointing, passes)
                tried.append((["--strategy sharded", *flag, f"--accumulate {passes}"], cost))
                if cost <= available:
                    break
        for n in counts:
            cost = needs(plain_layout("sharded", n), checkpointing, accumulate)
            tried.append(([f"--strategy sharded --devices {n}", *flag], cost))
            if cost <= available:
                break
        for split, flags in context_splits(devices, batch_size, sequence, layout) if known else ():
            cost = needs(split, checkpointing, accumulate)
            tried.append((["--strategy sharded", *flags, *flag], cost))
            if cost <= available:
                break
    fitting = sorted(
        ((len(flags), cost, flags) for flags, cost in tried if cost <= available), key=lambda row: row[:2]
    )
    seen, lines = set(), []
    for _, cost, flags in fitting:
        words = " ".join(flags)
        if words not in seen and len(lines) < 3:
            seen.add(words)
            more = ", with as much memory per device" if "--devices" in words else ""
            lines.append(f"{words} ({_gib(cost)} per rank{more})")
    if lines:
        return "use " + "; or ".join(lines)
    flags, cost = min(tried, key=lambda row: row[1]) if tried else ([], math.inf)
    if not flags:
        return "use more memory per device"
    return (
        f"nothing fits: even {' '.join(flags)} needs {_gib(cost)} per rank; use more memory per device, "
        f"a smaller --batch-size or --context, or a smaller model"
    )
