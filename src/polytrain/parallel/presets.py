"""The strategy names users give as presets of degrees: `--strategy data|sharded|pipeline|tensor` with
`--tensor-parallel`, `--pipeline-stages`, `--data-parallel`, `--replicas` and `--context-parallel` make a `Layout`
(`layout_of`), each setting checked once with one line naming the fix; and back (`settings_of`, `flags_of`), and
the labels the cost model, bench and `--strategy auto` print. The parameter server is a different algorithm, not a
layout: its workers are replicas.

Pure: numbers in, numbers out (no torch).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, Optional, Tuple

from ..errors import ConfigError
from .layout import BORROWED, Layout, divisors, flag_of

# the presets whose layouts have ranks that hold the same parameters: they split sequences over context groups
# (--context-parallel) and lend those ranks to the degrees borrowed from them (layout.py `BORROWED`: --expert-parallel)
SPLITTING_PRESETS = ("data", "sharded", "tensor", "pipeline")
BORROWED_FLAGS = {flag_of(name): name for name in BORROWED}  # each borrowed degree by its setting

# the settings beside --strategy that shape its layout (`layout_of`'s keywords)
LAYOUT_SETTINGS = (
    "pipeline_stages",
    "tensor_parallel",
    "data_parallel",
    "replicas",
    "context_parallel",
    *BORROWED_FLAGS,
)


def settings_in(values) -> dict:
    """The layout settings (`LAYOUT_SETTINGS`) that `values` gives, a mapping or an object holding them as
    attributes; those unset (None) left out."""
    read = values.get if isinstance(values, dict) else (lambda name: getattr(values, name, None))
    return {name: read(name) for name in LAYOUT_SETTINGS if read(name) is not None}


def kept_on_new_devices(strategy: str, settings: dict) -> bool:
    """Whether a resumed run given other --devices keeps its `strategy` rather than choosing one again: a
    pipeline stays a pipeline, and a run that splits its sequences keeps its preset while it still does."""
    return strategy == "pipeline" or (settings.get("context_parallel") or 1) > 1


def _one_device(devices: int, **_) -> Layout:
    if devices != 1:
        raise ConfigError(
            f"--strategy single runs on one device, but --devices is {devices}; "
            f"use --strategy data or --devices 1"
        )
    return Layout()


def _tensor(
    devices: int,
    *,
    tensor_parallel: Optional[int] = None,
    replicas: Optional[int] = None,
    context_parallel: Optional[int] = None,
    **_,
) -> Layout:
    if devices < 2:
        raise ConfigError("--strategy tensor splits every layer over --devices 2 or more; add --devices 2")
    group, context = tensor_parallel or devices, context_parallel or 1
    groups = devices // group  # (layout_of has checked that --tensor-parallel divides --devices)
    if groups % context:
        raise ConfigError(
            f"--context-parallel {context} must divide the {groups} tensor groups (--devices / --tensor-parallel): "
            f"each sequence is split over {context} tensor groups; use a divisor of {groups}, or more --devices"
        )
    copies, slices = replicas or 1, groups // context
    if slices % copies or (copies > 1 and copies >= slices):
        per = " / --context-parallel" if context > 1 else ""
        raise ConfigError(
            f"--replicas {copies} must divide the {slices} tensor groups (--devices / --tensor-parallel{per}) and "
            f"be fewer than them; use a divisor of {slices} below {slices}, or drop --replicas"
        )
    # the data dimension is sharded (FSDP2; with the context ranks folded in); with --replicas, as copies of shard
    # groups (HSDP)
    return Layout(replicate=copies, shard=slices // copies, context=context, tensor=group)


def _pipeline(
    devices: int,
    *,
    pipeline_stages: Optional[int] = None,
    tensor_parallel=None,
    data_parallel=None,
    replicas: Optional[int] = None,
    context_parallel: Optional[int] = None,
    **_,
) -> Layout:
    tensor, context = tensor_parallel or 1, context_parallel or 1
    shard = data_parallel == "shard"  # the pipelines beside each other shard their stages (FSDP2)
    stages = pipeline_stages or devices // (tensor * context)
    copies = replicas or 1
    _check_pipeline(devices, stages, tensor, shard, copies, context)
    pipelines = devices // (stages * tensor * context)
    if copies > 1:
        return Layout(
            replicate=copies, shard=pipelines // copies, pipeline=stages, context=context, tensor=tensor
        )
    return Layout(
        **{"shard" if shard else "replicate": pipelines},
        pipeline=stages,
        context=context,
        tensor=tensor,
        context_in="shard" if shard else "replicate",
    )


def _check_pipeline(
    devices: int, ranks: int, tensor: int, shard: bool, copies: int, context: int = 1
) -> None:
    """One line where `ranks` pipeline stages of `tensor` ranks each (and `context` such groups splitting each
    sequence), the pipelines beside each other sharding (`shard`) as `copies` replicas, do not fit `devices`."""
    width = tensor * context  # the ranks of one stage in one pipeline
    named = [f"--tensor-parallel {tensor}"] * (tensor > 1) + [f"--context-parallel {context}"] * (context > 1)
    of_ranks = f" of {width} {'tensor ' if context == 1 else ''}ranks" if width > 1 else ""
    if ranks < 2 and width > 1:
        raise ConfigError(
            f"--strategy pipeline {' '.join(named)} needs at least 2 pipeline stages "
            f"of {width} ranks, got {ranks}; use --devices {2 * width} or more"
        )
    if ranks < 2:
        raise ConfigError(
            f"--strategy pipeline needs at least 2 pipeline stages, got {ranks}; use "
            f"--devices 2 or more (or --strategy data for replicas only)"
        )
    if width == 1 and devices % ranks:
        raise ConfigError(
            f"--pipeline-stages {ranks} does not divide --devices {devices}; use one "
            f"of {', '.join(str(d) for d in divisors(devices) if d > 1)}"
        )
    if width > 1 and devices % (ranks * width):
        raise ConfigError(
            f"--pipeline-stages {ranks} x {' x '.join(named)} = "
            f"{ranks * width} ranks per pipeline do not divide --devices {devices}; "
            f"use --devices a multiple of {ranks * width}, or fewer --pipeline-stages"
        )
    pipelines = devices // (ranks * width)
    if shard and pipelines < 2:
        fits = [d for d in divisors(devices // width) if 2 <= d <= devices // (2 * width)]
        fix = (
            f"--pipeline-stages {fits[-1]}"
            if fits
            else f"--devices {2 * ranks * width} --pipeline-stages {ranks}"
        )
        raise ConfigError(
            f"--data-parallel shard shards each stage over the pipelines beside each other, but --devices "
            f"{devices} in {ranks} stages{of_ranks} make one pipeline; use {fix} (2 or "
            f"more pipelines), or drop --data-parallel"
        )
    if copies == 1:
        return
    if not shard:
        raise ConfigError(
            f"--replicas {copies} with --strategy pipeline makes replicas of sharded pipelines, but "
            f"without --data-parallel shard every pipeline is a replica already; add --data-parallel shard, "
            f"or drop --replicas"
        )
    if pipelines % copies or copies >= pipelines:
        per = "".join(f" x {flag.split()[0]}" for flag in named) or " x --tensor-parallel"
        raise ConfigError(
            f"--replicas {copies} must divide the {pipelines} pipelines (--devices / "
            f"(--pipeline-stages{per})) and be fewer than them; use a divisor of "
            f"{pipelines} below {pipelines}, or drop --replicas"
        )


def _context_groups(devices: int, context: int) -> int:
    """How many context groups of `context` ranks `devices` make; one line where they do not divide."""
    if devices % context:
        raise ConfigError(
            f"--context-parallel {context} must divide --devices {devices} (each group of {context} ranks splits "
            f"every sequence; --devices / {context} such groups split the batch); use a divisor of {devices}"
        )
    return devices // context


def _data(devices: int, *, context_parallel: Optional[int] = None, **_) -> Layout:
    context = context_parallel or 1
    # whole copies on every rank, the context ranks' too (DDP over them all)
    return Layout(replicate=_context_groups(devices, context), context=context, context_in="replicate")


def _sharded(
    devices: int, *, replicas: Optional[int] = None, context_parallel: Optional[int] = None, **_
) -> Layout:
    copies, context = replicas or 1, context_parallel or 1
    groups = _context_groups(devices, context)
    if groups % copies or (copies > 1 and copies >= groups):
        per = f" / --context-parallel ({groups})" if context > 1 else f" {devices}"
        raise ConfigError(
            f"--replicas {copies} must divide --devices{per} and be fewer than it (each replica shards "
            f"over --devices / {copies} ranks); use a divisor of {groups} below {groups}, or --strategy data"
        )
    # hybrid sharding (HSDP) where copies > 1; FSDP2 shards over the context groups' ranks too
    return Layout(replicate=copies, shard=groups // copies, context=context)


# The strategy names as presets of degrees. `auto` is planned as replicas until the cost model has chosen;
# the parameter server's workers are replicas of the whole model.
PRESETS: Dict[str, Callable[..., Layout]] = {
    "single": _one_device,
    "auto": lambda devices, **_: Layout(replicate=devices),
    "data": _data,
    "parameter-server": lambda devices, **_: Layout(replicate=devices),
    "sharded": _sharded,
    "tensor": _tensor,
    "pipeline": _pipeline,
}


def layout_of(
    strategy: str,
    devices: int,
    *,
    pipeline_stages: Optional[int] = None,
    tensor_parallel: Optional[int] = None,
    data_parallel: Optional[str] = None,
    replicas: Optional[int] = None,
    context_parallel: Optional[int] = None,
    **borrowed: Optional[int],
) -> Layout:
    """The degrees `--strategy` names on `--devices` (with --pipeline-stages, --tensor-parallel, and
    --data-parallel: whether a pipeline's replicas replicate or shard; --replicas: the copies of a sharded
    model; --context-parallel: the ranks each sequence is split over; `borrowed`, the flags of the degrees borrowed
    from the ranks that hold the same parameters: --expert-parallel, the ranks each mixture's experts are split
    over); one line naming the fix where they do not multiply out."""
    unknown = set(borrowed) - set(BORROWED_FLAGS)
    if unknown:
        raise TypeError(f"layout_of() got unexpected keyword arguments {sorted(unknown)}")
    lent = {BORROWED_FLAGS[flag]: size for flag, size in borrowed.items() if size not in (None, 1)}
    named = [f"--{flag_of(name).replace('_', '-')}" for name in lent]
    if named and strategy not in SPLITTING_PRESETS:
        raise ConfigError(
            f"{named[0]} takes --strategy {', '.join(SPLITTING_PRESETS[:-1])} or {SPLITTING_PRESETS[-1]} so far "
            f"(its ranks are borrowed from those that hold the same parameters); use one of them, or drop {named[0]}"
        )
    if strategy not in PRESETS:
        raise ConfigError(f"unknown --strategy {strategy!r}; choose one of {', '.join(PRESETS)}")
    options = dict(context_parallel=context_parallel) if context_parallel not in (None, 1) else {}
    if options and strategy not in SPLITTING_PRESETS:
        raise ConfigError(
            f"--context-parallel applies to --strategy {', '.join(SPLITTING_PRESETS[:-1])} or "
            f"{SPLITTING_PRESETS[-1]} so far; use one of them, or drop --context-parallel"
        )
    if tensor_parallel is not None and (tensor_parallel < 2 or devices % tensor_parallel):
        raise ConfigError(
            f"--tensor-parallel {tensor_parallel} must be 2 or more and divide --devices {devices} (each group "
            f"of {tensor_parallel} ranks splits every layer; --devices / {tensor_parallel} groups split the "
            f"batch); use a divisor of {devices}"
        )
    layout = PRESETS[strategy](
        devices,
        pipeline_stages=pipeline_stages,
        tensor_parallel=tensor_parallel,
        data_parallel=data_parallel,
        replicas=replicas,
        **options,
    )
    return replace(layout, **lent) if lent else layout


def plain_layout(strategy: str, devices: int) -> Layout:
    """The layout `strategy` names on `devices` with no other setting (one device: no degree at all, whatever
    the strategy)."""
    return Layout() if devices == 1 else layout_of(strategy, devices)


def mesh_of(strategy: str, layout: Layout) -> Tuple[int, ...]:
    """The numbers a label shows beside the strategy where its layout is a mesh that the strategy's plain layout
    is not: (R, G) of hybrid sharding, R copies of G shards; (R, T) of R groups of T tensor ranks; () else."""
    if strategy == "sharded" and layout.replicate > 1:
        return layout.replicate, layout.shard
    if strategy == "tensor" and layout.data_degree > 1:
        return layout.data_degree, layout.tensor
    return ()


def label(strategy: str, layout: Layout) -> str:
    """How the cost model, bench and `--strategy auto` print a strategy on its layout, for reading only: the
    strategy's name, with its mesh where it has one (`sharded 2x4`: 2 copies of 4 shards; `tensor 2x4`: 2 groups
    of 4 tensor ranks), its context ranks (`sharded cp2`) and its borrowed degrees (`data ep2`)."""
    mesh = mesh_of(strategy, layout)
    words = f"{strategy} {'x'.join(map(str, mesh))}" if mesh else strategy
    words += f" cp{layout.context}" if layout.context > 1 else ""
    return words + "".join(f" {BORROWED[name]}{size}" for name, size in layout.borrowed().items())


def _borrowed_flags(layout: Layout) -> dict:
    """The settings that give `layout`'s borrowed degrees (--expert-parallel P), by name."""
    return {flag_of(name): size for name, size in layout.borrowed().items()}


def flags_of(strategy: str, layout: Layout) -> dict:
    """The settings beside `--strategy` that give its mesh (`layout_of` the other way): --replicas R of hybrid
    sharding, --tensor-parallel T of groups of tensor ranks, --context-parallel C, a borrowed degree's; {} for a
    plain layout."""
    mesh = mesh_of(strategy, layout)
    flags = {}
    if mesh:
        flags["replicas" if strategy == "sharded" else "tensor_parallel"] = mesh[
            0 if strategy == "sharded" else 1
        ]
    if layout.context > 1:
        flags["context_parallel"] = layout.context
    return {**flags, **_borrowed_flags(layout)}


def settings_of(layout: Layout) -> dict:
    """The --strategy and the flags beside it that make `layout` (`layout_of` the other way, for any layout a
    preset makes: `layout_of(**settings_of(layout))` is `layout`)."""
    flags = {"context_parallel": layout.context} if layout.context > 1 else {}
    flags.update(_borrowed_flags(layout))
    if layout.pipeline > 1:
        flags.update(pipeline_stages=layout.pipeline)
        flags.update({"tensor_parallel": layout.tensor} if layout.tensor > 1 else {})
        if layout.shard > 1:
            flags.update(
                data_parallel="shard", **({"replicas": layout.replicate} if layout.replicate > 1 else {})
            )
        return dict(strategy="pipeline", **flags)
    if layout.tensor > 1:
        flags["tensor_parallel"] = layout.tensor
        if layout.replicate > 1:
            flags["replicas"] = layout.replicate
        return dict(strategy="tensor", **flags)
    if layout.data_parallel == "replicate":
        return dict(strategy="data", **flags)
    if layout.replicate > 1:
        flags["replicas"] = layout.replicate
    return dict(strategy="sharded" if layout.world_size > 1 else "single", **flags)


def layout_or_none(
    strategy: str,
    devices,
    pipeline_stages: Optional[int] = None,
    tensor_parallel: Optional[int] = None,
    **options,
) -> Optional[Layout]:
    """`layout_of` (with its other `options`) for settings not validated yet: None where they do not make a
    layout."""
    try:
        return layout_of(
            strategy, devices, pipeline_stages=pipeline_stages, tensor_parallel=tensor_parallel, **options
        )
    except (ConfigError, TypeError, ZeroDivisionError):
        return None
