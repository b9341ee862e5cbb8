"""A pipeline's plan, made in the launching process: the layout of its ranks, the schedule, the number of
micro-batches, and the cut of the model into stages (balanced by each layer's measured time, or its memory
where one micro-batch runs the stages one after another)."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config.layout_settings import DEFAULT_SCHEDULE
from ..errors import ConfigError
from ..parallel.meta import one_by_one
from ..strategies.optimizer_state import state_slots_of
from ..strategies.tensor import plan_for_stages
from .balance import balance_by_time, parse_split
from .layers import flatten_layers, layer_memory, time_layers
from .plan import (
    PipelinePlan,
    check_torch,
    default_microbatches,
    last_batch,
    microbatches_for,
    stages_per_rank,
)
from .traced import traced_plan


def torch_version() -> tuple:
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def model_stages(layers: list, layout, schedule: str) -> int:
    """How many model stages `layout`'s pipeline ranks run under `schedule`; one line where the model's
    flattened `layers` are fewer."""
    stages = layout.pipeline * stages_per_rank(schedule)
    if stages > len(layers):
        raise ConfigError(
            f"cannot split {len(layers)} layers into {stages} stages; use at most "
            f"{len(layers) // stages_per_rank(schedule)} pipeline stages or a deeper model"
        )
    return stages


def plan_pipeline(config, model: nn.Module, dataset, *, device: torch.device) -> PipelinePlan:
    """The pipeline's plan: its layout, schedule, micro-batches and where the model is cut (measured layer by
    layer, or as --split says), with every mistake refused in one line before any worker starts."""
    layout = config.layout  # pipeline ranks, the pipelines beside each other, tensor ranks
    schedule = config.pipeline_schedule or DEFAULT_SCHEDULE
    per_replica = config.batch_size // layout.data_degree
    # with --accumulate K, each of the K passes is cut into the micro-batches
    whole = per_replica // config.accumulate if per_replica % config.accumulate == 0 else per_replica
    microbatches = config.microbatches or default_microbatches(whole, layout.pipeline)
    passes = microbatches * config.accumulate
    if config.accumulate > 1 and per_replica % passes:
        fitting = [
            k for k in range(2, per_replica // microbatches + 1) if per_replica % (microbatches * k) == 0
        ]
        raise ConfigError(
            f"--accumulate {config.accumulate} runs {microbatches} x {config.accumulate} = {passes} "
            f"micro-batches in each step, which do not cut the {per_replica} samples each pipeline "
            f"gets into equal parts; use --accumulate "
            f"{' or '.join(map(str, fitting[:4])) or '1'}, or set --microbatches"
        )
    last = last_batch(dataset.num_train, config.batch_size, config.max_steps)
    parts = [len(part) for part in torch.tensor_split(torch.arange(last), layout.data_degree)]
    if min(parts) == 0:
        raise ConfigError(
            f"the last batch of an epoch has {last} samples, too few for {layout.data_degree} pipeline "
            f"replicas; choose a --batch-size that leaves at least {layout.data_degree} (or none)"
        )
    fewest = min(
        microbatches_for(part, microbatches, schedule=schedule, ranks=layout.pipeline) for part in parts
    )
    check_torch(torch_version(), device_type=device.type, fewest_microbatches=fewest, ranks=layout.pipeline)
    if config.split_at:  # any model, cut by torch's tracer at named modules
        return traced_plan(config, model, dataset, layout, schedule, microbatches, per_replica)
    tensor = plan_for_stages(config, model, tensor=layout.tensor) if layout.tensor > 1 else None
    layers = flatten_layers(model)
    names = tuple(name for name, _ in layers)
    stages = model_stages(layers, layout, schedule)
    dtype = str(dataset.sample_inputs(1).dtype).replace("torch.", "")  # token ids stay integers
    if config.split not in (None, "auto"):
        return PipelinePlan(
            schedule,
            microbatches,
            parse_split(config.split, layers=len(layers), stages=stages),
            names,
            tuple(dataset.input_shape),
            input_dtype=dtype,
            tensor=tensor,
        )
    # copied one layer at a time (never the whole model here), with initial values where built on meta
    measured = one_by_one(model, layers, device=device, seed=config.seed)
    sample = dataset.sample_inputs(per_replica // microbatches).to(device)
    if microbatches == 1:
        # One micro-batch: the stages run one after another whatever the split, so no split is faster
        # than another; balance what each device must hold instead.
        slots = state_slots_of(config)
        costs, unit = tuple(layer_memory(measured, sample, optimizer_slots=slots)), "bytes"
    else:
        costs, unit = tuple(time_layers(measured, sample)), "seconds"
    return PipelinePlan(
        schedule,
        microbatches,
        balance_by_time(costs, stages=stages),
        names,
        tuple(dataset.input_shape),
        costs,
        unit,
        dtype,
        tensor=tensor,
    )
