"""The predicted step of a layout on a cluster of GPUs (`polytrain plan`, cluster_plan.py).

Compute is the model's FLOPs per rank (6 per parameter outside the embedding and 12 L H Q T of
attention per token, torchtitan's count, so that MFU reads alike; a full recomputation adds the forward's third)
at `gpus.ACHIEVED` of the GPU's peak. Communication is the collectives the layout issues, ring algorithms under
the alpha-beta model (planning/costmodel.py's), each over NVLink where its ranks sit in one node (the mesh puts the
tensor dimension innermost, then context, then the data dimensions) and the network otherwise: FSDP2's two
all-gathers and one reduce-scatter per step and hybrid sharding's all-reduce across replicas, DDP's all-reduce
(each hidden behind the computation up to `gpus.OVERLAP` of it), the tensor plan's four all-reduces per block, the
collectives of each degree beside the ranks holding the parameters (planning/beside.py, each degree's
`collectives`: context parallelism's gather of keys and values and reduce-scatter of their gradients per block;
expert parallelism's all-to-alls, each mixture sending a rank's tokens to their K experts' ranks and back in the
forward, and their gradients in the backward, again in a full recomputation, routing taken as even, as the memory
check takes it: exposed), a pipeline's sends while it fills and drains, and its bubble, (stages - 1) /
micro-batches of the compute.
"""

from __future__ import annotations

from ..planning.beside import split_beside
from .gpus import ACHIEVED, LATENCY, OVERLAP


def _ring(kind: str, ranks: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Seconds of one ring collective of `nbytes` (the whole tensor; an all-to-all's, what one rank sends and
    keeps) over `ranks`."""
    if ranks == 1:
        return 0.0
    factor = 2 * (ranks - 1) / ranks if kind == "all-reduce" else (ranks - 1) / ranks
    return factor * nbytes / bandwidth + (ranks - 1) * latency


def _link(request, span: int):
    """(bandwidth, latency) of a group whose ranks lie within `span` consecutive ranks: NVLink within a node, the
    network across nodes."""
    if span <= request.gpus_per_node:
        return request.gpu.nvlink, LATENCY["nvlink"]
    return request.gpu.network, LATENCY["network"]


def flops_per_token(work, context: int) -> float:
    """The model's training FLOPs per token, torchtitan's count: 6 per parameter outside the embedding, and
    12 L H Q T for attention (`work.attention`: layers, heads, head size; T the sequence)."""
    shape = work.attention
    attention = 12 * shape.layers * shape.heads * shape.head_dim * context if shape else 0.0
    return 6 * work.dense_parameters + attention


def step_time(request, row, held, work) -> None:
    """Fill `row`'s compute, exposed communication, bubble, tokens per second per GPU, MFU and limit for the
    layout built as `held` (full_size.py) from the model's `work` (cluster_plan.ModelWork)."""
    layout, gpu = row.layout, request.gpu
    tokens = request.batch_size * request.context
    model_flops = flops_per_token(work, request.context) * tokens / layout.world_size
    recompute = 4 / 3 if row.checkpointing == "full" else 1.0
    row.compute = model_flops * recompute / (gpu.peak_flops(request.precision) * ACHIEVED)
    element = 2 if request.precision != "fp32" else 4
    exposed = {}
    if layout.data_parallel == "shard":
        shards = layout.fsdp_ranks
        # elements of this rank's tensor-parallel part, gathered (the shard group spans the dp_shard, pp, cp and
        # tp dimensions: the mesh's order), of which a degree beside may gather a share only (expert parallelism:
        # its experts', E/P of them, over the 1/P of the ranks that shard them); a pipeline of shards gathers its
        # stages once per step, FSDP2 alone twice (forward, and again for the backward)
        whole = held.parameter_bytes / 4 * shards
        for degree in split_beside(layout):
            whole *= degree.gathered_share(work, layout)
        bandwidth, latency = _link(request, layout.world_size // layout.replicate)
        gathers = 1 if layout.pipeline > 1 else 2
        seconds = gathers * _ring("all-gather", shards, whole * element, bandwidth, latency * held.units)
        # the gradients of the parameters that train only (frozen ones, --freeze or --lora's base, have none)
        trained = whole * held.trained_bytes / max(1, held.parameter_bytes)
        seconds += _ring("reduce-scatter", shards, trained * 4, bandwidth, latency * held.units)
        if layout.replicate > 1:
            bandwidth, latency = _link(request, layout.world_size)
            seconds += _ring("all-reduce", layout.replicate, held.trained_bytes, bandwidth, latency)
        exposed["fsdp"] = max(0.0, seconds - OVERLAP * row.compute)
    elif layout.data_parallel == "replicate":
        bandwidth, latency = _link(request, layout.world_size)
        seconds = _ring("all-reduce", layout.gradient_ranks, held.trained_bytes, bandwidth, latency)
        exposed["ddp"] = max(0.0, seconds - OVERLAP * row.compute * 2 / 3)  # beside the backward pass
    shape, local_batch = work.attention, request.batch_size / layout.data_degree
    layers = shape.layers / layout.pipeline if shape else 0  # a rank's blocks: its stage's
    # the residual stream's width (Qwen3's heads together may be wider)
    width = work.width or (shape.heads * shape.head_dim if shape else 0)
    if layout.tensor > 1 and shape:
        nbytes = local_batch * layout.tokens_per_rank(request.context) * width * element
        bandwidth, latency = _link(request, layout.tensor)
        exposed["tensor"] = 4 * layers * _ring("all-reduce", layout.tensor, nbytes, bandwidth, latency)
    for degree in split_beside(layout):
        issued = degree.collectives(
            work,
            layout,
            samples=local_batch,
            sequence=request.context,
            element=element,
            width=width,
            layers=layers,
            checkpointing=row.checkpointing,
        )
        if issued:
            exposed[degree.name] = sum(
                count * _ring(kind, ranks, nbytes, *_link(request, span))
                for kind, ranks, nbytes, span, count in issued
            )
    if layout.pipeline > 1 and shape:
        # each micro-batch's activations to the next stage and their gradients back; only the sends while the
        # pipeline fills and drains are on the critical path (the rest overlap other micro-batches' compute)
        nbytes = local_batch / row.microbatches * layout.tokens_per_rank(request.context) * width * element
        bandwidth, latency = _link(request, 2 * layout.stage_ranks)
        exposed["pipeline"] = 2 * (layout.pipeline - 1) * (nbytes / bandwidth + latency)
        row.bubble = row.compute * (layout.pipeline - 1) / row.microbatches
    row.communication = {key: value for key, value in exposed.items() if value > 0}
    row.tokens_per_second_per_device = tokens / row.step_seconds / layout.world_size
    row.mfu = flops_per_token(work, request.context) * row.tokens_per_second_per_device / gpu.bf16_flops
    if request.precision == "fp32":
        row.mfu = flops_per_token(work, request.context) * row.tokens_per_second_per_device / gpu.fp32_flops
    slowest = max(row.communication.items(), key=lambda item: item[1], default=("", 0.0))
    row.limit = (
        "memory"
        if not row.fits
        else (f"{slowest[0]} communication" if slowest[1] > 0.25 * row.compute else "compute")
    )
