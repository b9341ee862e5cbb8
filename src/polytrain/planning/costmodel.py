"""Predicted step time of each strategy on n devices, from one device's measured compute and an alpha-beta link.

Pure arithmetic (no torch.distributed), tested against values worked out by hand. The inputs are what one
device and one measured link can tell:

- `Workload.compute_seconds`: one optimizer step of the whole global batch on one device (forward, backward,
  update); `update_seconds` of it is the optimizer update, which every replica repeats in full;
- `parameter_bytes` S: the gradients (= weights) exchanged per step;
- `boundary_bytes`: activation bytes per sample crossing each possible pipeline cut, and `layers`: the
  number of parameter-holding layers (FSDP2 gathers each layer's shard separately);
- `activation_bytes`: the bytes per sample that the forward pass keeps for the backward pass (all of them, not
  only those at the cuts). A sample is what the loader counts: an image, or for a language model a window of
  `context` tokens, whose activations grow with the context: a transformer keeps about 16 floats per token and
  width in each block (the norms' inputs, q, k, v, the attention's output, the MLP's 4x-wide hidden layer twice)
  and the vocabulary's scores per token at the head, far more than the width per token that crosses a cut;
- `Link(alpha, beta)`: seconds per message and bytes per second, fitted to measured transfers.

Where the devices share one machine's cores (CPU processes), compute does not split evenly: a rank's pass
over its 1/n of the batch on its 1/n of the cores is measured instead and given as `replica_seconds[n]`
(and `microbatch_seconds[p]` for one micro-batch through the whole model on a pipeline rank's share). Without
them the pass splits evenly (compute/n), as on separate GPUs.

Each message also costs something inside a training step that back-to-back messages do not show: the
transport's thread waking after compute, a strategy's copies and hooks around each collective (FSDP2 copies
every layer in and out). `Prediction.messages` counts a step's sequential messages, and `message_costs` adds a
per-strategy cost per message, fitted (`fit_message_cost`) to one measured step of that strategy.

A convolutional model trains channels-last where the strategy allows it; strategies that cannot (`contiguous`
names them) are predicted from `Workload.plain`, the same model measured in the default memory format.

Models (n devices, the update not split except where sharded):

- data parallel: compute/n + ring all-reduce 2(n-1)/n S/B + 2(n-1) alpha;
- parameter server (K servers, S split evenly between them): each server's link carries the pushes of the
  n-1 other ranks in and their pulls out, one after the other: 2 (n-1) S / (K B) + 2 (n-1) alpha;
- sharded (FSDP2): weights all-gathered in forward and backward and gradients reduce-scattered:
  3 (n-1)/n S/B + 3 (n-1) alpha per layer; the update is split n ways. Gloo (CPU processes) runs FSDP2's
  reduce-scatter as an all-reduce (the profiler shows `gloo:all_reduce`, one per layer and step), which moves
  twice the bytes in twice the messages: 4 (n-1)/n S/B + 4 (n-1) alpha per layer there (`scatter_by_allreduce`);
  Hybrid sharding (`sharded RxG`, R copies of G shards): the same within a copy over G ranks, then each layer's
  gradient shard all-reduced across the R copies, 2 (R-1)/R (S/G)/B + 2 (R-1) alpha per layer; the update is
  split G ways;
- pipeline (p stages, m micro-batches, perfectly balanced): each slot is compute/(p m) plus one forward and
  one backward transfer of a micro-batch's activations at a cut; a step is (m + p - 1) slots, so the idle
  share (the bubble) is (p - 1)/(m + p - 1);
- tensor (`tensor_parallel`: groups of T ranks split the layers the model's plan names, R = n/T groups side
  by side split the batch, b = batch/R per group): the split layers' share s of the pass runs 1/T on each rank,
  the rest (embeddings, norms, head) whole: pass/R ((1 - s) + s/T). Megatron's activation all-reduces, one per
  entry of `tensor_reductions` (the built-in GPT: two per block in forward, after the attention's and the MLP's
  row-wise layer, and two in backward, before their column-wise ones, each b x context x width floats), each a
  ring over T: 2 (T-1)/T bytes/B + 2 (T-1) alpha. Where the plan runs sequence-parallel (`sequence_splits`)
  each becomes a reduce-scatter and an all-gather, the same bytes and ring messages in twice the collectives
  (gloo runs the reduce-scatter as an all-reduce: 3 (T-1)/T bytes/B, 3 (T-1) messages), plus `sequence_gathers`
  all-gathers (with a whole head and embeddings: into the head in forward, out of the embeddings in backward)
  and small all-reduces of the norms' gradients (`SEQUENCE_REDUCTIONS` per parameter, counted with the
  profiler on torch 2.13). A head split by the vocabulary all-gathers its scores (`tensor_gathers`). With R > 1,
  FSDP2 over the data dimension moves each rank's weights, split/T + replicated, as `sharded` does over R ranks.
  Most of a tensor step is host work of each rank, not the link: DTensor's dispatch and redistribution around
  each collective, whatever its ring's length (`Prediction.collectives`, priced at tensor's fitted cost per
  collective), and each ring message's own CPU time beside its latency (one more alpha). Where CPU processes
  outnumber the cores (`turns` processes per core) both stretch by the turns: the link given is already turned
  (`link_for`), and the cost per collective is multiplied by `Prediction.turns`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, Mapping, Optional, Sequence, Tuple

from ..errors import ConfigError
from ..parallel.layout import Layout
from ..parallel.presets import label, plain_layout
from .activations import AttentionShape


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message (latency)
    beta: float  # bytes per second (bandwidth)

    def seconds(self, nbytes: float, messages: float = 1.0) -> float:
        return messages * self.alpha + nbytes / self.beta

    @classmethod
    def fit(cls, sizes: Sequence[float], seconds: Sequence[float], *, relative: bool = False) -> "Link":
        """Least-squares alpha and 1/beta from (bytes, seconds) of measured messages (at least two sizes).

        `relative`: minimise relative errors (weights 1/seconds^2), so that the microseconds of small messages
        set alpha instead of vanishing beside the milliseconds' noise of large ones, which set beta."""
        if len(sizes) != len(seconds) or len(set(sizes)) < 2:
            raise ValueError("fitting a link needs messages of at least two different sizes")
        weights = [1.0 / max(y, 1e-12) ** 2 if relative else 1.0 for y in seconds]
        total = sum(weights)
        mean_x = sum(w * x for w, x in zip(weights, sizes)) / total
        mean_y = sum(w * y for w, y in zip(weights, seconds)) / total
        slope = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(weights, sizes, seconds)) / sum(
            w * (x - mean_x) ** 2 for w, x in zip(weights, sizes)
        )
        slope = max(slope, 1e-15)  # noise must not give an infinite or negative bandwidth
        return cls(alpha=max(0.0, mean_y - slope * mean_x), beta=1.0 / slope)


@dataclass(frozen=True)
class Workload:
    compute_seconds: float  # one global batch on one device: forward + backward + update
    parameter_bytes: float  # S
    batch_size: int  # the global batch
    update_seconds: float = 0.0  # the optimizer update's part of compute_seconds
    layers: int = 1  # FSDP2's units (messages per collective; parallel/units.py)
    boundary_bytes: Tuple[float, ...] = ()  # activation bytes per sample at each cut between layers
    activation_bytes: float = 0.0  # bytes per sample kept for backward (0: unknown, the cuts' sum stands in)
    gathered_bytes: float = (
        0.0  # the most parameter bytes FSDP2 gathers at once (0: unknown, the whole model)
    )
    # what activation checkpointing changes (planning/activations.py): the blocks it recomputes, and per sample the
    # bytes one keeps, its input, its matrix products' outputs (0: unknown, every mode keeps activation_bytes)
    blocks: int = 0
    block_bytes: float = 0.0
    block_input_bytes: float = 0.0
    block_matmul_bytes: float = 0.0
    attention: Optional[AttentionShape] = None  # one device's causal attention (None: not seen)
    # bytes per sample the backward holds at its peak beyond what the forward kept (one layer's gradients and
    # temporaries; 0: unknown)
    backward_bytes: float = 0.0
    # measured forward + backward of one rank's 1/n slice on its share of the machine, by n
    replica_seconds: Mapping[int, float] = field(default_factory=dict)
    # measured forward + backward of one micro-batch through the whole model on a pipeline rank's share, by p
    microbatch_seconds: Mapping[int, float] = field(default_factory=dict)
    # the same measurements in the default memory format, where the ones above are channels-last
    plain: Optional["Workload"] = None
    # tensor parallelism, where the model has a plan (`tensor_splits` empty: none)
    tensor_splits: Tuple[int, ...] = ()  # the group sizes T the plan splits the model into
    split_bytes: float = 0.0  # parameter bytes of the layers the plan splits (the rest: replicated)
    trained_bytes: Optional[float] = (
        None  # parameter bytes that train (--freeze: the rest has no gradient, no state)
    )
    split_share: float = 0.0  # the share of one device's forward + backward spent in those layers
    tensor_reductions: Tuple[float, ...] = ()  # bytes per sample of each activation all-reduce of a step
    tensor_gathers: Tuple[
        float, ...
    ] = ()  # bytes per sample of each output gathered whole (a vocabulary's scores)
    sequence_splits: Tuple[int, ...] = ()  # the T at which the plan runs sequence-parallel
    sequence_parameters: int = 0  # parameter tensors of the modules run on parts of the sequence
    sequence_gathers: int = 0  # sequence-parallel: gathers of the widest activation more (whole head)
    # measured forward + backward of one tensor rank's share (split layers at 1/T, its group's batch), by (n, T)
    tensor_seconds: Mapping[Tuple[int, int], float] = field(default_factory=dict)
    # mixtures of experts (models/moe.py; 0: a dense model): how many, the experts of each, the bytes of all their
    # stacked experts, and the bytes per sample one mixture sends in one all-to-all (its tokens x K x width)
    mixtures: int = 0
    experts: int = 0
    expert_bytes: float = 0.0
    routed_bytes: float = 0.0
    routed_counts: Tuple[
        float, ...
    ] = ()  # the (token, choice) pairs each expert got of a sample batch (uneven)

    def in_format(self, contiguous: bool) -> "Workload":
        """The measurements in the default memory format (`contiguous`) or the one they were taken in."""
        return self.plain if contiguous and self.plain is not None else self

    @property
    def pass_seconds(self) -> float:
        """Forward + backward: the part of a step that splits across devices."""
        return self.compute_seconds - self.update_seconds

    def replica_pass(self, devices: int) -> float:
        """Forward + backward of one rank's slice when `devices` ranks split the batch."""
        return self.replica_seconds.get(devices, self.pass_seconds / devices)

    def tensor_pass(self, devices: int, tensor: int) -> float:
        """Forward + backward of one rank of a tensor group of `tensor` ranks, `devices` / `tensor` such groups
        splitting the batch: measured, or the split layers' share divided by `tensor` and the rest whole."""
        if (devices, tensor) in self.tensor_seconds:
            return self.tensor_seconds[(devices, tensor)]
        return self.pass_seconds / (devices // tensor) * (1 - self.split_share + self.split_share / tensor)

    def tensor_rank_bytes(self, tensor: int) -> float:
        """Weights one rank of a tensor group holds: the split layers' 1/T and every replicated one whole."""
        return self.split_bytes / tensor + (self.parameter_bytes - self.split_bytes)


@dataclass(frozen=True)
class Prediction:
    strategy: str
    devices: int
    compute: float  # seconds of a step spent computing
    communication: float  # seconds of a step spent moving bytes (not overlapped)
    idle: float = 0.0  # seconds of a step waiting (pipeline bubble)
    note: str = ""
    # sequential messages of a step (each pays alpha, and any per-message cost); counted for one collective of
    # the whole tensor where the strategy may split it (DDP's buckets): a fitted cost per message absorbs that
    messages: float = 0.0
    shard_messages: float = (
        0.0  # of them, FSDP2's (a (data, tensor) mesh): priced at sharded's cost where known
    )
    collectives: float = 0.0  # host-side collective calls (tensor): priced per call, not per ring message
    turns: float = 1.0  # CPU processes per core: host work per collective stretches by it
    # all-to-all calls of a step (experts split over ranks: planning/experts.py, which prices them)
    exchanges: float = 0.0
    # the degrees it predicts (None: the strategy's plain layout on `devices`, where that is one)
    layout: Optional[Layout] = None

    def __post_init__(self):
        if self.layout is None:
            try:
                object.__setattr__(self, "layout", plain_layout(self.strategy, self.devices))
            except ConfigError:  # (a prediction of what cannot run: its note says why)
                pass

    @property
    def label(self) -> str:
        """The strategy on its layout, as printed (`sharded 2x4`; parallel/layout.py `label`)."""
        return label(self.strategy, self.layout) if self.layout is not None else self.strategy

    @property
    def step_seconds(self) -> float:
        return self.compute + self.communication + self.idle

    def speedup(self, one_device_seconds: float) -> float:
        return one_device_seconds / self.step_seconds


def ring_allreduce(devices: int, nbytes: float, link: Link) -> float:
    if devices == 1:
        return 0.0
    return 2 * (devices - 1) / devices * nbytes / link.beta + 2 * (devices - 1) * link.alpha


def data_parallel(work: Workload, devices: int, link: Link) -> Prediction:
    compute = work.replica_pass(devices) + work.update_seconds
    return Prediction(
        "data",
        devices,
        compute,
        ring_allreduce(devices, work.parameter_bytes, link),
        messages=2 * (devices - 1),
    )


def parameter_server(work: Workload, devices: int, link: Link, *, servers: int = 1) -> Prediction:
    compute = work.replica_pass(devices) + work.update_seconds / servers
    if devices == 1:
        return Prediction("parameter-server", devices, compute, 0.0)
    messages = 2 * (devices - 1)  # every other rank's push in and pull out
    communication = messages * work.parameter_bytes / (servers * link.beta) + messages * link.alpha
    return Prediction("parameter-server", devices, compute, communication, messages=messages)


def sharded(
    work: Workload, devices: int, link: Link, *, scatter_by_allreduce: bool = False, replicas: int = 1
) -> Prediction:
    """FSDP2 over every rank; with `replicas` R (hybrid sharding, `sharded RxG`) over G = n/R ranks within each
    of R copies: the gathers and the gradient's reduction run within a copy, each layer's gradient shard (1/G
    of it) is then all-reduced across the copies, 2 (R-1)/R (S/G)/B + 2 (R-1) alpha per layer, and the update
    is split G ways."""
    shards, layout = devices // replicas, Layout(replicate=replicas, shard=devices // replicas)
    compute = work.replica_pass(devices) + work.update_seconds / shards
    if devices == 1:
        return Prediction("sharded", devices, compute, 0.0, layout=layout)
    rings = 2 + (2 if scatter_by_allreduce else 1)  # two all-gathers, then the gradient's reduction
    messages = (rings * (shards - 1) + 2 * (replicas - 1)) * work.layers
    copies = ring_allreduce(replicas, work.parameter_bytes / shards, Link(0.0, link.beta))  # bytes only
    communication = (
        rings * (shards - 1) / shards * work.parameter_bytes / link.beta + copies + messages * link.alpha
    )
    return Prediction("sharded", devices, compute, communication, messages=messages, layout=layout)


# hybrid sharding's shard groups in the cost model's rows: up to one machine of 8 GPUs (a copy within a machine,
# the copies' all-reduce across machines)
HYBRID_SHARDS = (2, 4, 8)


def pipeline(work: Workload, stages: int, link: Link, *, microbatches: int) -> Prediction:
    if stages > 1 and len(work.boundary_bytes) < stages - 1:
        return Prediction(
            "pipeline",
            stages,
            0.0,
            0.0,
            float("inf"),
            note=f"{stages} stages need {stages - 1} cuts; the model has {len(work.boundary_bytes)}",
        )
    slots = microbatches + stages - 1
    work_per_slot = (
        work.microbatch_seconds[stages] / stages
        if stages in work.microbatch_seconds
        else work.pass_seconds / (stages * microbatches)
    )
    per_sample = max(work.boundary_bytes) if stages > 1 else 0.0
    transfer = 2 * link.seconds(per_sample * work.batch_size / microbatches) if stages > 1 else 0.0
    compute = microbatches * work_per_slot + work.update_seconds / stages
    return Prediction(
        "pipeline",
        stages,
        compute,
        slots * transfer,
        (stages - 1) * work_per_slot,
        messages=2 * slots if stages > 1 else 0,
    )


def bubble(stages: int, microbatches: int) -> float:
    return (stages - 1) / (microbatches + stages - 1)


# small all-reduces of each sequence-parallel norm parameter's gradient per step (torch 2.13's profiler, gloo: 3 on
# a 1-D tensor mesh, 1 on a (data, tensor) mesh)
SEQUENCE_REDUCTIONS, MESH_SEQUENCE_REDUCTIONS = 3, 1


def tensor_collectives(work: Workload, devices: int, tensor: int) -> dict:
    """What one step of tensor parallelism sends over each group of `tensor` ranks: kind of collective -> the
    bytes of the whole tensor each one gathers or reduces (FSDP2's over the data dimension are `sharded`'s)."""
    groups = devices // tensor
    batch = work.batch_size / groups
    sizes = [per_sample * batch for per_sample in work.tensor_reductions]
    whole = [per_sample * batch for per_sample in work.tensor_gathers]
    if tensor not in work.sequence_splits:
        return {"all-reduce": sizes, "all-gather": whole}
    widest = max(sizes, default=0.0)
    small = work.sequence_parameters * (SEQUENCE_REDUCTIONS if groups == 1 else MESH_SEQUENCE_REDUCTIONS)
    return {
        "reduce-scatter": sizes,
        "all-gather": sizes + [widest] * work.sequence_gathers + whole,
        "small all-reduce": [0.0] * small,
    }


def tensor_parallel(
    work: Workload,
    devices: int,
    link: Link,
    *,
    tensor: Optional[int] = None,
    scatter_by_allreduce: bool = False,
    turns: float = 1.0,
) -> Prediction:
    """Groups of `tensor` ranks (default: all `devices`) splitting the plan's layers; several groups split the
    batch, FSDP2 sharding each rank's weights over them. Each ring message costs alpha twice (its latency, and
    its rank's CPU time); `turns`: CPU processes per core, which stretch the host work per collective."""
    tensor = tensor or devices
    groups = devices // tensor
    layout = Layout(shard=groups, tensor=tensor) if devices % tensor == 0 else None
    if devices % tensor or tensor not in work.tensor_splits:
        return Prediction(
            "tensor",
            devices,
            0.0,
            0.0,
            float("inf"),
            note=f"the model's tensor plan does not split over {tensor} ranks",
            layout=layout,
        )
    held = work.tensor_rank_bytes(tensor)
    compute = work.tensor_pass(devices, tensor) + work.update_seconds * held / work.parameter_bytes / groups
    rings = {
        "all-reduce": 2,
        "reduce-scatter": 2 if scatter_by_allreduce else 1,
        "all-gather": 1,
        "small all-reduce": 2,
    }  # passes around the ring of each kind (gloo reduce-scatters by all-reducing)
    moved = messages = calls = 0.0
    for kind, sizes in tensor_collectives(work, devices, tensor).items():
        moved += rings[kind] * sum(sizes)
        messages += rings[kind] * (tensor - 1) * len(sizes)
        calls += len(sizes)
    communication = (tensor - 1) / tensor * moved / link.beta + 2 * messages * link.alpha
    shard_messages = 0.0
    if groups > 1:  # FSDP2 over the data dimension, on each rank's weights
        data = sharded(
            replace(work, parameter_bytes=held), groups, link, scatter_by_allreduce=scatter_by_allreduce
        )
        communication, messages = communication + data.communication, messages + data.messages
        shard_messages = data.messages
    return Prediction(
        "tensor",
        devices,
        compute,
        communication,
        messages=messages,
        shard_messages=shard_messages,
        collectives=calls,
        turns=turns,
        layout=layout,
    )


def with_message_cost(prediction: Prediction, per_message: float) -> Prediction:
    """The prediction with `per_message` seconds more communication for each of its messages."""
    if not per_message or not prediction.messages:
        return prediction
    return replace(prediction, communication=prediction.communication + prediction.messages * per_message)


def fit_message_cost(measured_seconds: float, prediction: Prediction) -> float:
    """The cost per message that makes `prediction` (made without one) take the measured step: what the link
    alone does not account for, shared over the step's messages (over its collectives, each `turns` times, where
    it counts them: tensor's cost is per collective, at one process per core); never negative."""
    if not prediction.messages or not math.isfinite(prediction.step_seconds):
        return 0.0
    shared = prediction.collectives * prediction.turns if prediction.collectives else prediction.messages
    return max(0.0, (measured_seconds - prediction.step_seconds) / shared)


def priced(prediction: Prediction, costs: Mapping[str, float]) -> Prediction:
    """The prediction with its strategy's cost per message; tensor's (every layout's) is per collective, times
    the turns of processes per core, and FSDP2's messages on a (data, tensor) mesh are priced at `sharded`'s cost
    per message where one is known (copies around each collective, as there), else at tensor's."""
    own = costs.get(prediction.strategy, 0.0)
    if not prediction.collectives:
        return with_message_cost(prediction, own)
    extra = prediction.collectives * prediction.turns * own + prediction.shard_messages * costs.get(
        "sharded", own
    )
    return replace(prediction, communication=prediction.communication + extra)


def choose(
    predictions: Dict[str, Prediction], *, fits: Optional[Dict[str, bool]] = None
) -> Optional[Prediction]:
    """The fastest prediction among the strategies that fit in memory (all, when `fits` is None)."""
    candidates = [p for name, p in predictions.items() if fits is None or fits.get(name, False)]
    return min(candidates, key=lambda p: p.step_seconds, default=None)
