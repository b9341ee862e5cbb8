"""The layout of a run's devices: independent degrees of parallelism whose product is the world size.

`Layout(replicate=2, tensor=2)` is 2 data-parallel replicas of 2 tensor ranks each. The degrees are
torchtitan's `ParallelDims`: data-parallel replicate (whole copies that all-reduce gradients), data-parallel
shard (FSDP2 ranks that each keep a shard), pipeline (stages), context (each sequence's tokens split), tensor
(each layer split); an expert degree has its place beside them when it comes. The device mesh is laid out in that
order, the tensor dimension innermost, so a tensor group is consecutive ranks (one machine's devices), and a
context group the ranks next to them.

What a layout means is asked of it: how the global batch is cut (`data_degree`), over how many replicas the
gradient is averaged, the mesh's shape and names, the words that describe it. The strategy names users give
(`--strategy data|sharded|pipeline|tensor`, with `--tensor-parallel`, `--pipeline-stages`, `--data-parallel`,
`--replicas` and `--context-parallel`) are presets of degrees (`layout_of`). The parameter server is a different algorithm, not a layout: its workers
are replicas.

Pure: numbers in, numbers out (no torch), so a layout for hundreds of devices is planned anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from ..errors import ConfigError


def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


# mesh order, outermost first; the names are the device mesh's dimension names
DEGREES = ("replicate", "shard", "pipeline", "context", "tensor")
MESH_NAMES = {
    "replicate": "dp_replicate",
    "shard": "dp_shard",
    "pipeline": "pp",
    "context": "cp",
    "tensor": "tp",
}
# a rank's place along the degrees that split the work on its slice of the batch (`Layout.place`)
PLACES = {"context": "context rank", "tensor": "tensor slice"}
WORDS = {
    "replicate": "replica",
    "shard": "shard",
    "pipeline": "stage",
    "context": "context rank",
    "tensor": "tensor rank",
}


@dataclass(frozen=True)
class Layout:
    """Degrees of parallelism (each at least 1); their product is the number of devices."""

    replicate: int = 1
    shard: int = 1
    pipeline: int = 1
    context: int = 1
    tensor: int = 1
    # which data dimension the context ranks join in holding the parameters (they hold the same ones): "shard"
    # (FSDP2 over them, torchtitan's dp_shard_cp) or "replicate" (whole copies, DDP over them); without context
    # ranks it says nothing and is "shard"
    context_in: str = "shard"

    def __post_init__(self) -> None:
        for name in DEGREES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"the {name} degree must be a whole number of at least 1, got {value!r}")
        if self.context_in not in ("shard", "replicate"):
            raise ConfigError(f"context_in must be 'shard' or 'replicate', got {self.context_in!r}")
        if self.context == 1:  # (one description per layout: equal layouts compare equal)
            object.__setattr__(self, "context_in", "shard")

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.pipeline * self.context * self.tensor

    @property
    def data_degree(self) -> int:
        """Into how many slices each global batch is cut, and over how many the gradient is averaged: the
        data-parallel ranks (the ranks of one pipeline, of one context group and of one tensor group read the same
        slice)."""
        return self.replicate * self.shard

    @property
    def data_parallel(self) -> str:
        """How the ranks that hold the same parameters (the data ranks and the context ranks beside a tensor
        group or a pipeline stage) hold them: "none" (there are none), "replicate" (whole copies, DDP) or
        "shard" (FSDP2; also over whole copies of a tensor plan's DTensors, which DDP does not take)."""
        if self.replicate * self.shard * self.context == 1:
            return "none"
        if self.shard > 1 or self.tensor > 1 or (self.context > 1 and self.context_in == "shard"):
            return "shard"
        return "replicate"

    @property
    def holds_parts(self) -> bool:
        """True where each rank's parameters are DTensors, parts of the whole model's (FSDP2's shards, a tensor
        plan's slices): its state is gathered and cut back, and its checkpoints are each rank's parts."""
        return self.data_parallel == "shard" or self.tensor > 1

    @property
    def splits_model(self) -> bool:
        """True where no rank holds the whole model's parameters."""
        return self.shard > 1 or self.pipeline > 1 or self.tensor > 1

    @property
    def gradient_ranks(self) -> int:
        """Over how many ranks' gradients the one-device gradient is the average, each rank's loss divided by the
        global batch over this: the data ranks; the ranks of a context group each hold a part of their slice's
        loss, so their gradients count as ranks of their own (summed over the group, a part each)."""
        return self.data_degree * self.context

    @property
    def sharding(self) -> "Layout":
        """The data dimensions FSDP2 shards over, as a layout of their own: the context groups' ranks hold the
        same parameters, so they fold into the shard dimension (torchtitan's dp_shard_cp)."""
        return Layout(replicate=self.replicate, shard=self.shard * self.context)

    def degrees(self) -> Dict[str, int]:
        """Every degree above 1, in mesh order (empty on one device)."""
        return {name: getattr(self, name) for name in DEGREES if getattr(self, name) > 1}

    @property
    def mesh_shape(self) -> Tuple[int, ...]:
        return tuple(self.degrees().values())

    @property
    def mesh_names(self) -> Tuple[str, ...]:
        return tuple(MESH_NAMES[name] for name in self.degrees())

    def coordinates(self, rank: int) -> Dict[str, int]:
        """This rank's index along every degree (the tensor index varies fastest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a layout of {self.world_size} devices")
        found = {}
        for name in reversed(DEGREES):
            rank, found[name] = divmod(rank, getattr(self, name))
        return {name: found[name] for name in DEGREES}

    def data_rank(self, rank: int) -> int:
        """Which slice of each global batch `rank` reads."""
        where = self.coordinates(rank)
        return where["replicate"] * self.shard + where["shard"]

    def rank_with(self, rank: int, **changed: int) -> int:
        """The rank at `rank`'s coordinates with some of them changed (`pipeline=1`: its peer on stage 1)."""
        where = dict(self.coordinates(rank), **changed)
        found = 0
        for name in DEGREES:
            found = found * getattr(self, name) + where[name]
        return found

    def ranks_where(self, **fixed: int) -> list:
        """Every rank at these coordinates (`pipeline=0`: the ranks of stage 0 in every pipeline), in order."""
        return [
            rank
            for rank in range(self.world_size)
            if all(self.coordinates(rank)[name] == value for name, value in fixed.items())
        ]

    def place(self, rank: int) -> str:
        """Where `rank` sits in the degrees that split its slice of the batch, in words (', context rank 1/2,
        tensor slice 2/2'; '' where there are none): start-up lines name each rank's place so."""
        at = self.coordinates(rank)
        return "".join(
            f", {PLACES[name]} {at[name] + 1}/{getattr(self, name)}"
            for name in PLACES
            if getattr(self, name) > 1
        )

    @property
    def sequence_words(self) -> str:
        """', each sequence split over C context ranks' where there are context ranks ('' else)."""
        return f", each sequence split over {self.context} context ranks" if self.context > 1 else ""

    def describe(self) -> str:
        """In words: '2 replicas x 2 tensor ranks'; 'one device'."""
        parts = [f"{size} {WORDS[name]}s" for name, size in self.degrees().items()]
        return " x ".join(parts) if parts else "one device"


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


# the presets that split sequences over context groups (--context-parallel)
CONTEXT_PRESETS = ("data", "sharded", "tensor", "pipeline")


def layout_of(
    strategy: str,
    devices: int,
    *,
    pipeline_stages: Optional[int] = None,
    tensor_parallel: Optional[int] = None,
    data_parallel: Optional[str] = None,
    replicas: Optional[int] = None,
    context_parallel: Optional[int] = None,
) -> Layout:
    """The degrees `--strategy` names on `--devices` (with --pipeline-stages, --tensor-parallel, and
    --data-parallel: whether a pipeline's replicas replicate or shard; --replicas: the copies of a sharded
    model; --context-parallel: the ranks each sequence is split over); one line naming the fix where they do not
    multiply out."""
    if strategy not in PRESETS:
        raise ConfigError(f"unknown --strategy {strategy!r}; choose one of {', '.join(PRESETS)}")
    options = dict(context_parallel=context_parallel) if context_parallel not in (None, 1) else {}
    if options and strategy not in CONTEXT_PRESETS:
        raise ConfigError(
            f"--context-parallel applies to --strategy {', '.join(CONTEXT_PRESETS[:-1])} or {CONTEXT_PRESETS[-1]} so "
            f"far; use one of them, "
            f"or drop --context-parallel"
        )
    if tensor_parallel is not None and (tensor_parallel < 2 or devices % tensor_parallel):
        raise ConfigError(
            f"--tensor-parallel {tensor_parallel} must be 2 or more and divide --devices {devices} (each group "
            f"of {tensor_parallel} ranks splits every layer; --devices / {tensor_parallel} groups split the "
            f"batch); use a divisor of {devices}"
        )
    return PRESETS[strategy](
        devices,
        pipeline_stages=pipeline_stages,
        tensor_parallel=tensor_parallel,
        data_parallel=data_parallel,
        replicas=replicas,
        **options,
    )


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
    of 4 tensor ranks) and its context ranks (`sharded cp2`)."""
    mesh = mesh_of(strategy, layout)
    words = f"{strategy} {'x'.join(map(str, mesh))}" if mesh else strategy
    return words + (f" cp{layout.context}" if layout.context > 1 else "")


def flags_of(strategy: str, layout: Layout) -> dict:
    """The settings beside `--strategy` that give its mesh (`layout_of` the other way): --replicas R of hybrid
    sharding, --tensor-parallel T of groups of tensor ranks, --context-parallel C; {} for a plain layout."""
    mesh = mesh_of(strategy, layout)
    flags = {}
    if mesh:
        flags["replicas" if strategy == "sharded" else "tensor_parallel"] = mesh[
            0 if strategy == "sharded" else 1
        ]
    if layout.context > 1:
        flags["context_parallel"] = layout.context
    return flags


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
