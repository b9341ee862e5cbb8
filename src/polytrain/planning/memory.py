"""Bytes the busiest rank of a layout holds: its weights, gradients and optimizer state as the layout splits them,
the weights it gathers whole at once, and the activations it keeps for backward (planning/activations.py). The memory
check (scaling/fits.py) and the automatic choice (scaling/auto.py) ask it; the step's time is costmodel.py's.

Pure: numbers in, numbers out (no torch), so a layout for hundreds of devices is sized anywhere.
"""

from __future__ import annotations

from ..parallel.layout import Layout
from .activations import peak_bytes, tensor_part
from .beside import rank_part, split_beside
from .costmodel import Workload


def memory_per_rank(
    work: Workload,
    layout: Layout,
    *,
    optimizer_slots: int = 1,
    servers: int = 0,
    checkpointing: str = "none",
) -> float:
    """Bytes the busiest rank of `layout` holds: weights, gradients and `optimizer_slots` tensors of optimizer
    state per weight, plus the activations held for backward for its slice (per sample: `activation_bytes` at the
    peak of the backward pass under `--activation-checkpointing` `checkpointing`, planning/activations.py;
    without them, each cut's bytes per sample). `servers`: the server ranks of a parameter server, which trains
    the layout's copies (0: none does).

    DDP's copies: a whole replica; a parameter server: a replica without optimizer state, and on a server rank its
    share of the master weights and their state; FSDP2 over n ranks: 1/n of everything plus the weights gathered
    whole at once (`gathered_bytes`: the root's and two units', else the whole model, an upper bound); p pipeline
    stages: about 1/p of the weights, and activations for as many micro-batches as stages in flight; T tensor
    ranks: the split layers' 1/T and the replicated ones whole, over the groups sharded as FSDP2 shards, and of
    its group's batch the blocks' activations a tensor rank keeps (planning/activations.py `tensor_part`: 1/T
    where the plan is sequence-parallel, `work.sequence_splits`), the rest whole.
    """
    weights = work.parameter_bytes
    # every rank of a data replica computes its slice; a pipeline's stages each keep their micro-batches'; the
    # degrees beside them cut each sample (a context group's ranks each keep their part of every sequence's)
    part = rank_part(work, layout)
    part = tensor_part(part, layout.tensor, sequence=layout.tensor in work.sequence_splits)
    per_sample = peak_bytes(part, checkpointing) if work.activation_bytes else sum(part.boundary_bytes)
    activations = per_sample * work.batch_size / (layout.data_degree * layout.pipeline)
    if servers and layout.world_size > 1:  # a replica without optimizer state, and a server's
        return weights * 2 + weights / servers * (1 + optimizer_slots) + activations
    held = work.tensor_rank_bytes(layout.tensor) if layout.tensor > 1 else weights
    # frozen parameters (--freeze) hold their weights only: no gradient, no optimizer state
    trained = 1.0 if work.trained_bytes is None or not weights else work.trained_bytes / weights
    # FSDP2 shards over the data ranks and, where it shards at all (not DDP's copies), the context ranks too
    # (a pipeline's stages are FSDP2 modules where the pipelines beside each other shard them, or where a tensor plan
    # splits them: pipeline/sharding.py)
    shards = layout.fsdp_ranks if layout.data_parallel == "shard" else 1
    per_weight = 1 + (1 + optimizer_slots) * trained
    states = held * per_weight / (shards * layout.pipeline)
    # what the degrees beside them hold less (DDP's copies each hold 1/P of the experts split over P of them)
    states -= sum(
        degree.states_saved(work, layout, per_weight=per_weight, sharded=shards > 1)
        for degree in split_beside(layout)
    )
    # FSDP2 gathers a unit whole (and prefetches the next): as counted where known, else the model (an upper
    # bound); a pipeline of shards keeps its stage's weights and their gradients whole through a step
    # (pipeline/sharding.py)
    gathered = (work.gathered_bytes or held) if shards > 1 else 0.0
    if shards > 1 and layout.pipeline > 1:
        gathered = held * 2 / layout.pipeline
    return states + gathered + activations
