"""`polytrain plan`: the layouts a model can train in on a cluster of GPUs it does not have, each built at full size
by the code a run uses (full_size.py), its memory per GPU split into what holds it, its step predicted from first
principles, and the layouts ranked by tokens per second.

**Memory** (rank 0, the busiest): its parts of the parameters, as many gradients and the optimizer's state per
slot, exactly as the code creates them on the fake process group; FSDP2's buffers: two units gathered whole (the
one computing and the one prefetched) in the gathered dtype, and one unit's gradients before the reduce-scatter in
the reduce dtype; the activations a rank keeps at the peak of its backward pass for its slice of the batch,
measured on fake tensors in the run's precision (activation_memory.py) for one device and cut for the rank as the
memory check cuts them (planning/beside.py `rank_part`: a context rank's part of each sequence;
planning/activations.py `peak_bytes`); under a tensor plan the blocks keep (10 + 24/t) / 34 of one device's, and
1/t where the plan runs sequence-parallel (the built-in GPT's and Llama's without mixtures: their inputs too)
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2, with attention
that keeps no scores). A pipeline (set up by the pipeline strategy itself) keeps its stages gathered with their
gradients through a step where its copies shard, and under 1F1B its first stage holds the blocks' activations of as
many micro-batches as there are stages, its last stage one micro-batch's and the logits; the busier of the two
ranks is shown. Not counted: the CUDA context and the caching allocator's reserve beyond the tensors.

**Step time**: cluster_time.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch.nn as nn

from ..errors import ConfigError, UserError
from ..parallel.layout import Layout, divisors
from ..parallel.presets import settings_of
from ..planning.activations import peak_bytes, tensor_part
from ..planning.beside import borrowed, rank_part
from .cluster_time import step_time
from .forked import fork_count, forked_map
from .gpus import GPUS_PER_NODE, Gpu

GIB = 2**30
SLOTS = {"adamw": 2, "adam": 2, "sgd": 1}  # optimizer state tensors per trained parameter
# --activation-checkpointing auto: the modes tried on each layout, least recomputation first
CHECKPOINTING_TRIED = ("none", "selective", "full")


@dataclass
class PlanRequest:
    """What a cluster plan is asked for: a model (a function that builds it on the meta device, and its name),
    the cluster, and the run's batch (`batch_size` sequences of `context` tokens per step), precision and
    activation checkpointing."""

    build: Callable[[], nn.Module]
    name: str
    devices: int
    gpu: Gpu
    batch_size: int
    context: int
    precision: str = "bf16"
    checkpointing: str = "none"
    optimizer: str = "adamw"
    gpus_per_node: int = GPUS_PER_NODE
    schedule: str = "1f1b"  # a pipeline's (pipeline/schedule.py)
    layers: int = 0  # the model's flattened layers (what pipeline stages cut), once known
    microbatches: Optional[int] = None  # a pipeline's (default: `default_microbatches`)
    config: Optional[object] = None  # a run's own TrainConfig (train --dry-run): its layout built as it runs
    slots: Optional[int] = None  # optimizer state tensors per trained parameter (default: `SLOTS`'s)
    # what is measured or built once per request (its copies share it): the model's work by (context,
    # precision) (`model_work`), and the model as built, which the settings' checks read (`reference_model`)
    cached: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class LayoutPlan:
    """One layout's row of the plan: bytes per GPU by what holds them, a step's seconds by what they are spent on."""

    layout: Layout
    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    compute: float = 0.0
    communication: dict = field(default_factory=dict)  # collective -> exposed seconds
    bubble: float = 0.0  # a pipeline's idle seconds while its stages fill and drain
    microbatches: int = 0  # a pipeline's
    tokens_per_second_per_device: float = 0.0
    mfu: float = 0.0
    fits: bool = False
    limit: str = ""
    refused: str = ""  # the line the code refused the layout with at full size
    # its --activation-checkpointing (under "auto": the least recomputation that fits)
    checkpointing: str = ""
    sequence_parallel: bool = False  # its tensor plan runs the norms on parts of the sequence

    @property
    def memory(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers

    @property
    def step_seconds(self) -> float:
        return self.compute + sum(self.communication.values()) + self.bubble

    def as_json(self, gpu: Gpu) -> dict:
        split = {
            key: getattr(self, key) / GIB
            for key in ("parameters", "gradients", "optimizer", "activations", "buffers")
        }
        return {
            "layout": self.layout.named() or {"single": 1},  # its degrees by name
            "layout_words": self.layout.words(),  # as --layout and polytrain.plan(layout=...) take it
            "memory_gib": self.memory / GIB,
            "memory_split_gib": split,
            "activation_checkpointing": self.checkpointing,
            "device_memory_gib": gpu.memory_gib,
            "fits": self.fits,
            "step_seconds": self.step_seconds,
            "compute_seconds": self.compute,
            "exposed_communication_seconds": dict(self.communication),
            "pipeline_bubble_seconds": self.bubble,
            **({"microbatches": self.microbatches} if self.microbatches else {}),
            "tokens_per_second_per_device": self.tokens_per_second_per_device,
            "mfu": self.mfu,
            "limit": self.limit,
            **({"sequence_parallel": self.sequence_parallel} if self.layout.tensor > 1 else {}),
            **({"refused": self.refused} if self.refused else {}),
        }


def candidate_layouts(request: PlanRequest) -> List[Layout]:
    """Every layout of dp_replicate x dp_shard x pp x cp x tp on the devices that splits the batch and the sequence
    evenly: tensor groups within a node, context groups that cut each sequence into head-tail chunks, pipelines of
    2 to `layers` // 2 stages, the data ranks as whole copies (no tensor plan), shards, or copies of shard groups."""
    n, found = request.devices, []
    for tp in divisors(n):
        if tp > request.gpus_per_node:
            continue
        for pp in divisors(n // tp):
            if pp > 1 and (pp > request.layers // 2 or request.batch_size < pp):
                continue
            for cp in divisors(n // (tp * pp)):
                if cp > 1 and request.context % (2 * cp):
                    continue
                data = n // (tp * pp * cp)
                if request.batch_size % data:
                    continue
                if (
                    tp == 1 or pp > 1
                ):  # whole copies (a pipeline's stages split over tensor ranks: FSDP2 of one)
                    found.append(
                        Layout(replicate=data, pipeline=pp, context=cp, tensor=tp, context_in="replicate")
                    )
                for shard in divisors(data):
                    if shard > 1 or (data == 1 and tp * cp > 1 and pp == 1):
                        found.append(
                            Layout(replicate=data // shard, shard=shard, pipeline=pp, context=cp, tensor=tp)
                        )
    return [layout for layout in dict.fromkeys(found) if layout.world_size == n]


def with_borrowed(layouts: List[Layout], request: PlanRequest, work) -> List[Layout]:
    """`layouts`, and each again with a degree beside them that borrows its ranks (planning/beside.py, each
    degree's `variants` on a cluster: for a model with mixtures of experts, each layout that shards with FSDP2 with
    its experts split over P of its shard ranks, within a node, for each P that divides them and the experts)."""
    return list(layouts) + [
        variant for layout in layouts for variant in borrowed(work, layout, per_node=request.gpus_per_node)
    ]


def plan_layout(request: PlanRequest, layout: Layout, work) -> LayoutPlan:
    """One layout built at full size and sized; `work`: the model's Workload with its activations per sample
    measured in the run's precision (`model_work`). A layout the code refuses gets the line it refuses with."""
    from ..config.train import TrainConfig
    from ..strategy_registry import make_plan
    from .full_size import holdings_at_full_size

    row = LayoutPlan(layout)
    tried = (request.checkpointing,)
    if request.checkpointing == "auto":  # (a model without blocks to recompute is planned without)
        tried = CHECKPOINTING_TRIED if work.blocks else ("none",)
    try:
        config = request.config or TrainConfig(
            devices=layout.world_size,
            batch_size=request.batch_size,
            precision=request.precision,
            activation_checkpointing=tried[-1],
            **settings_of(layout),
        )
        if config.layout != layout:
            raise ConfigError(
                f"{layout.describe()} is not a layout polytrain runs (it made {config.layout.describe()})"
            )
        model = reference_model(request)
        if layout.pipeline > 1:
            plan = pipeline_plan(request, config, model)
            row.microbatches = plan.microbatches
            last = layout.rank_with(
                0, pipeline=layout.pipeline - 1
            )  # the head's stage, and the loss's logits
            holdings = [
                (rank, holdings_at_full_size(request.build, layout, pipeline_plan=plan, precision=request.precision, rank=rank))
                for rank in (0, last)
            ]  # fmt: skip
        else:
            plan = make_plan(config.strategy, config, model, None, device=None)
            held = holdings_at_full_size(request.build, layout, tensor_plan=plan, precision=request.precision)
            holdings = [(0, held)]
            row.sequence_parallel = bool(getattr(plan, "sequence_parallel", False))
        for mode in tried:  # the least recomputation that fits, else the last tried; the busier rank shown
            sized = []
            for rank, held in holdings:
                each = dataclasses.replace(row, communication={}, checkpointing=mode)
                _memory(request, each, held, work, last_stage=layout.pipeline > 1 and rank != 0)
                sized.append((each.memory, each, held))
            _, chosen, held = max(sized, key=lambda item: item[0])
            if chosen.fits:
                break
        row = chosen
    except UserError as error:
        row.refused, row.limit = str(error), "refused"
        return row
    except (
        Exception
    ) as error:  # a failure of polytrain's, not the layout's: named, and the others still planned
        first = (str(error).strip().splitlines() or [""])[0]
        row.refused, row.limit = f"could not be built here ({type(error).__name__}: {first})", "error"
        return row
    step_time(request, row, held, work)
    return row


def pipeline_plan(request: PlanRequest, config, model: nn.Module):
    """The pipeline a run of `config` would have, its stages cut where the layers' parameters outside embeddings
    balance (a run measures each layer's time; a transformer's blocks are alike, so the cut is the same but at the
    ends), `default_microbatches` micro-batches of the pipeline's slice of the batch."""
    from ..pipeline.balance import balance_by_time
    from ..pipeline.layers import flatten_layers
    from ..pipeline.plan import PipelinePlan, default_microbatches
    from ..pipeline.planning import model_stages
    from ..strategies.tensor import plan_for_stages

    layout = config.layout
    layers = flatten_layers(model)
    stages = model_stages(layers, layout, request.schedule)

    def cost(module: nn.Module) -> float:
        return float(
            sum(
                p.numel()
                for m in module.modules()
                if not isinstance(m, nn.Embedding)
                for p in m.parameters(recurse=False)
            )
        )

    costs = tuple(cost(module) for _, module in layers)
    tensor = plan_for_stages(config, model, tensor=layout.tensor) if layout.tensor > 1 else None
    return PipelinePlan(
        request.schedule,
        request.microbatches
        or default_microbatches(request.batch_size // layout.data_degree, layout.pipeline),
        balance_by_time(costs, stages=stages),
        tuple(name for name, _ in layers),
        (request.context,),
        costs,
        "seconds",
        "int64",
        tensor=tensor,
    )


def _memory(request: PlanRequest, row: LayoutPlan, held, work, *, last_stage: bool = False) -> None:
    """`row`'s bytes per GPU from what the rank holds (`held`) and its activations under `row.checkpointing`."""
    layout, mixed = row.layout, request.precision != "fp32"
    row.parameters, row.gradients = float(held.parameter_bytes), float(held.trained_bytes)
    slots = request.slots if request.slots is not None else SLOTS.get(request.optimizer, 2)
    row.optimizer = slots * float(held.trained_bytes)
    gathered, reduced = (2, 4) if mixed else (4, 4)  # FSDP2's policy: gathered in bf16, reduced in float32
    # FSDP2: two units gathered (computing, prefetched) and one unit's gradients; a pipeline of shards keeps its
    # stages gathered with their gradients through the step
    row.buffers = held.unit_parameters * (
        (gathered + reduced) if layout.pipeline > 1 else (2 * gathered + reduced)
    )
    if mixed and layout.data_parallel != "shard":  # autocast's bf16 copy of every weight, saved for backward
        row.buffers = held.parameter_bytes / 2
    part = rank_part(work, layout)
    part = tensor_part(part, layout.tensor, sequence=row.sequence_parallel)
    local = request.batch_size / layout.data_degree
    row.activations = peak_bytes(part, row.checkpointing) * local
    if (
        layout.pipeline > 1
    ):  # a stage's blocks for the micro-batches in flight; the logits and loss on the last
        outside = part.activation_bytes - part.blocks * part.block_bytes
        # (what one backward holds on top: a stage runs one micro-batch's at a time, the loss's on the last)
        transient = part.backward_bytes
        inside = peak_bytes(part, row.checkpointing) - outside - transient
        m = row.microbatches
        flight = m if request.schedule == "gpipe" else (1 if last_stage else min(m, layout.pipeline))
        row.activations = (inside / layout.pipeline + (outside if last_stage else 0.0)) * local / m * flight
        row.activations += transient * local / m
    row.fits = row.memory <= request.gpu.memory_gib * GIB


@dataclass(frozen=True)
class ModelWork:
    """What the plan needs of a model beside the layout: per-sample activation figures (planning/activations.py) and
    the attention's shape, measured once on fake tensors in the run's precision, and the parameters a token uses
    outside the embedding (a mixture's K experts of E)."""

    activation_bytes: float
    blocks: int
    block_bytes: float
    block_input_bytes: float
    block_matmul_bytes: float
    attention: object
    dense_parameters: float
    boundary_bytes: tuple = ()
    # what the backward holds at its peak beyond what the forward kept, per sample
    backward_bytes: float = 0.0
    width: int = 0  # the residual stream's (an embedding's), where the model has one
    mixtures: int = 0  # blocks whose feed-forward is a mixture of experts
    experts_per_token: int = 0  # ... and the experts each token goes to in them
    expert_share: float = 0.0  # the share of the parameters that are the mixtures' experts
    experts: int = 0  # the experts of each mixture


def idle_expert_parameters(model: nn.Module) -> float:
    """The parameters of a mixture's experts that a token does not use (E - K of every E; models/moe.py): a step's
    FLOPs count the K experts each token goes to."""
    from ..models.moe import MixtureOfExperts

    return sum(
        sum(p.numel() for p in mixture.experts.parameters())
        * (1 - mixture.per_token / mixture.experts.experts)
        for mixture in model.modules()
        if isinstance(mixture, MixtureOfExperts)
    )


def model_work(request: PlanRequest) -> ModelWork:
    """The model's activation figures for one sequence of `request.context` tokens in the run's precision,
    measured once per request (a plan's table, then its advice of more GPUs, ask again)."""
    key = (request.context, request.precision)
    if key not in request.cached:
        request.cached[key] = _measured_work(request)
    return request.cached[key]


def reference_model(request: PlanRequest) -> nn.Module:
    """The model `request.build()` makes, built once: what a layout's settings are checked against and its plan
    made from (a tensor plan's layers, a pipeline's cuts), which read it and leave it as it is; each layout is
    built on a model of its own."""
    if "model" not in request.cached:
        request.cached["model"] = request.build()
    return request.cached["model"]


def _measured_work(request: PlanRequest) -> ModelWork:
    import torch

    from ..models.moe import MixtureOfExperts
    from ..objective import Objective
    from .activation_memory import activation_profile

    model = request.build()
    tables = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    embeddings = sum(m.weight.numel() for m in tables)
    dense = sum(p.numel() for p in model.parameters()) - embeddings - idle_expert_parameters(model)
    mixtures = [m for m in model.modules() if isinstance(m, MixtureOfExperts)]
    x = torch.zeros(1, request.context, dtype=torch.long)
    figures = activation_profile(model, Objective(kind="language"), x, x, precision=request.precision)
    if not figures:
        raise UserError(f"{request.name}: its forward pass could not be measured on fake tensors")
    if figures.get("attention") is not None:  # a GPU's context rank attends over the gathered keys
        figures["attention"] = dataclasses.replace(figures["attention"], blockwise=False)
    return ModelWork(
        dense_parameters=float(dense),
        width=tables[0].embedding_dim if tables else 0,
        mixtures=len(mixtures),
        experts_per_token=mixtures[0].per_token if mixtures else 0,
        experts=mixtures[0].experts.experts if mixtures else 0,
        expert_share=sum(p.numel() for m in mixtures for p in m.experts.parameters())
        / max(1, sum(p.numel() for p in model.parameters())),
        **figures,
    )


def make_plan_table(
    request: PlanRequest, layout: Optional[Layout] = None, *, progress=None, workers: Optional[int] = None
) -> List[LayoutPlan]:
    """Every candidate layout (or the one given) built and sized; fitting layouts first, fastest first.
    `progress(row, built, layouts)` after each layout is built; `workers`: the processes that build them
    (forked.py `fork_count`'s by default; 1: this process alone)."""
    from ..pipeline.layers import flatten_layers

    work = model_work(request)
    try:  # what pipeline stages cut (none: no pipeline layouts, the run's own line where one is asked for)
        request.layers = len(flatten_layers(reference_model(request)))
    except UserError:
        request.layers = 0
    layouts = [layout] if layout is not None else with_borrowed(candidate_layouts(request), request, work)
    if not layouts:
        raise UserError(
            f"no layout of {request.devices} GPUs splits a batch of {request.batch_size} sequences of "
            f"{request.context} tokens evenly; use a --batch-size that a divisor of --devices divides"
        )
    rows = forked_map(
        lambda each: plan_layout(request, each, work),  # (each fork builds its share of the layouts)
        layouts,
        workers=fork_count(len(layouts)) if workers is None else workers,
        progress=progress,
    )
    # fitting first, fastest first, and of equally fast ones the one that holds least
    rows.sort(
        key=lambda row: (
            bool(row.refused),
            not row.fits,
            -round(row.tokens_per_second_per_device, 6),
            row.memory,
        )
    )
    return rows


def smallest_fit(request: PlanRequest, work=None, *, most: int = 64, tries: int = 4) -> Optional[LayoutPlan]:
    """Where no layout of `request.devices` fits: the fewest GPUs, doubling up to `most` times as many, with a
    layout that fits the same batch, among those that hold least (FSDP2 over every data rank, beside the most
    tensor, pipeline and context ranks: the `tries` of them that split the model most); None where none does."""
    work = work or model_work(request)
    devices = request.devices * 2
    while devices <= request.devices * most:
        more = dataclasses.replace(request, devices=devices, config=None)  # (not the run's own settings)
        least = [
            layout
            for layout in candidate_layouts(more)
            if layout.replicate == 1 and layout.data_parallel == "shard"
        ]
        least.sort(key=lambda layout: -(layout.world_size // layout.data_degree))  # the most ranks per slice
        for layout in least[:tries]:
            row = plan_layout(more, layout, work)
            if row.fits and not row.refused:
                return row
        devices *= 2
    return None


def tokens_line(row: LayoutPlan) -> str:
    return (
        f"{row.tokens_per_second_per_device:,.0f} tokens/s per GPU, MFU {row.mfu:.0%}"
        if math.isfinite(row.mfu)
        else ""
    )
