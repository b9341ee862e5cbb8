"""The settings of where and how a run is laid out over devices: the device, and each strategy's own
settings (pipeline, sharded, parameter server, tensor). Declared as in settings.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..parallel.presets import SPLITTING_PRESETS
from .declare import setting

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")  # torch.distributed.pipelining's
DEFAULT_SCHEDULE = "1f1b"


@dataclass
class DeviceSettings:
    device: str = setting(
        "auto",
        "auto: CUDA GPUs if present, else CPU processes (default: %(default)s)",
        group="devices",
        choices=("auto", "cpu", "cuda"),
        resume="change",
    )
    devices: int = setting(
        1,
        "GPUs, or CPU processes sharing the cores (default: %(default)s)",
        group="devices",
        metavar="N",
        check="count",
        example=1,
        resume="change",
        replans=True,
    )
    strategy: str = setting(
        "auto",
        "auto: single for one device; for several, the layout the cost model predicts "
        "fastest that fits in memory (a few seconds of measurement, or --plan), meshes included "
        "(sharded --replicas R, tensor --tensor-parallel T); data: replicas "
        "+ all-reduce; pipeline: the model split into stages over the devices; sharded: each "
        "device holds a shard of the weights and optimizer state (FSDP2); parameter-server: "
        "master weights on server ranks, workers push gradients and pull weights; tensor: "
        "every layer split across the devices (DTensor; gpt, llama, mlp, or fit(tensor_plan=))",
        group="devices",
        metavar="{auto,{strategies}}",
        resume="change",
        replans=True,
    )
    context_parallel: Optional[int] = setting(
        None,
        "ranks each sequence's tokens are split across (--model gpt or llama): each holds a head and a tail "
        "chunk of every sequence, so its activations are about 1/C of one device's; keys and values are "
        "gathered over the group for causal attention. --devices / C such groups split the batch (with "
        "--strategy tensor, C tensor groups split each sequence; with --strategy pipeline, each stage runs on C "
        "ranks; default: 1)",
        group="devices",
        metavar="C",
        check="count",
        strategies=SPLITTING_PRESETS,
        resume="change",
        replans=True,
    )
    expert_parallel: Optional[int] = setting(
        None,
        "ranks each mixture of experts' experts are split over (--model llama --experts E; E/P experts each), "
        "borrowed from the ranks that hold the same parameters (--strategy sharded's shards, DDP's copies of "
        "--strategy data, the tensor groups of --strategy tensor): each rank's tokens go to the ranks of their "
        "experts and come back by all-to-all, and the ranks that hold the same experts shard them (FSDP2) or "
        "average their gradients (beside DDP) (default: 1, every rank all the experts)",
        group="devices",
        metavar="P",
        check="count",
        strategies=SPLITTING_PRESETS,
        resume="change",
        replans=True,
    )
    plan: Optional[str] = setting(
        None,
        "with --strategy auto: choose from this polytrain bench result instead of measuring",
        group="devices",
        metavar="BENCH_JSON",
        resume="change",
    )


@dataclass
class PipelineSettings:
    microbatches: Optional[int] = setting(
        None,
        "micro-batches each step's batch is cut into; 1: plain model parallelism (default: 4 per stage, or "
        "fewer that divide the batch)",
        group="pipeline",
        metavar="M",
        strategies=("pipeline",),
        resume="change",
    )
    pipeline_schedule: Optional[str] = setting(
        None,
        f"order of forward and backward passes (default: {DEFAULT_SCHEDULE})",
        group="pipeline",
        choices=PIPELINE_SCHEDULES,
        strategies=("pipeline",),
        resume="change",
        replans=True,
    )
    split: Optional[str] = setting(
        None,
        "auto: balance the stages by each layer's measured time; or the index of the first layer of every "
        "stage after the first (default: auto)",
        group="pipeline",
        metavar="auto|I1,I2,...",
        strategies=("pipeline",),
        resume="change",
    )
    split_at: Optional[str] = setting(
        None,
        "split a model that is not an nn.Sequential with torch's tracer (torch.export): the modules, by "
        "their names in the model, where each stage after the first begins, e.g. transformer.h.2 (instead of "
        "--split)",
        group="pipeline",
        metavar="NAME,...",
        strategies=("pipeline",),
        resume="change",
    )
    pipeline_stages: Optional[int] = setting(
        None,
        "stages per pipeline; --devices / S pipelines then run data-parallel on a 2-D mesh (default: "
        "--devices, one pipeline)",
        group="pipeline",
        metavar="S",
        check="count",
        strategies=("pipeline",),
        resume="change",
        replans=True,
    )
    data_parallel: Optional[str] = setting(
        None,
        "how the --devices / S pipelines of --pipeline-stages S hold their stages: replicate: each a whole "
        "copy, gradients all-reduced; shard: FSDP2 over them, each rank keeps a 1/(devices / S) shard of its "
        "stages' weights, gradients and optimizer state (with --tensor-parallel T, 1/(devices / (S x T)) of its "
        "tensor slice) (default: replicate)",
        group="pipeline",
        choices=("replicate", "shard"),
        strategies=("pipeline",),
        resume="change",
        replans=True,
    )
    timeline: bool = setting(
        False,
        "record when each rank ran each micro-batch for a few steps; draws pipeline.png and prints the "
        "measured bubble",
        group="pipeline",
        flag="switch",
        strategies=("pipeline",),
        resume="change",
    )


@dataclass
class ShardedSettings:
    cpu_offload: bool = setting(
        False,
        "keep parameter, gradient and optimizer shards in host memory; the GPU holds only the layer in use "
        "(FSDP2's offload policy)",
        group="sharded",
        flag="switch",
        strategies=("sharded",),
        resume="change",
    )
    replicas: Optional[int] = setting(
        None,
        "hybrid sharding (HSDP): R copies of the sharded model, each sharded over --devices / R ranks; "
        "gradients are reduce-scattered within a copy and all-reduced across the copies, on a 2-D mesh "
        "(default: 1, every rank one shard of one copy); with --strategy tensor, R copies of the tensor "
        "groups' shards, on a (dp_replicate, dp_shard, tp) mesh; with --strategy pipeline --data-parallel "
        "shard, R copies of the sharding pipelines, on a (dp_replicate, dp_shard, pp[, tp]) mesh",
        group="sharded",
        metavar="R",
        check="count",
        strategies=("sharded", "tensor", "pipeline"),
        resume="change",
    )


@dataclass
class ServerSettings:
    servers: Optional[int] = setting(
        None,
        "server roles the parameters are split over by size, on ranks 0..K-1 (default: 1)",
        group="parameter-server",
        metavar="K",
        strategies=("parameter-server",),
        resume="change",
    )
    server_device: Optional[str] = setting(
        None,
        "where the master weights and optimizer state live: cpu (host memory, default) or same (the server "
        "rank's device)",
        group="parameter-server",
        metavar="{cpu,same}",
        strategies=("parameter-server",),
        resume="change",
    )
    staleness: Optional[int] = setting(
        None,
        "asynchronous: servers apply each worker's gradient as it arrives; a worker runs at most S updates "
        "ahead of the slowest (default: 0, synchronous, equal to one device)",
        group="parameter-server",
        metavar="S",
        check="count0",
        strategies=("parameter-server",),
        resume="change",
    )


@dataclass
class TensorSettings:
    tensor_plan: Optional[dict] = setting(
        None,
        "which layers --strategy tensor splits: {module name or fnmatch pattern: colwise | rowwise | "
        "replicate | colwise:K (K fused parts)}, or a function fn(model, mesh) that splits the model itself "
        "(default: the built-in plan of --model mlp, gpt and llama)",
        group="tensor",
        flag="none",
        strategies=("tensor",),
        resume="change",
    )
    tensor_parallel: Optional[int] = setting(
        None,
        "ranks each layer is split across; --devices / T such groups then split each batch as sharded data "
        "parallelism (FSDP2) on a 2-D mesh (default: --devices, one group); with --strategy pipeline, the ranks each "
        "stage is split across",
        group="tensor",
        metavar="T",
        check="count",
        strategies=("tensor", "pipeline"),
        resume="change",
        replans=True,
    )
