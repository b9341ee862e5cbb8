"""The layout of a pipeline run, as numbers: which rank holds which stage of which replica, how many
micro-batches each step is cut into, and which layers each stage holds.

`--devices 4 --pipeline-stages 2` is a 2 x 2 mesh: replica r holds ranks 2r and 2r+1, and rank 2r+s runs
pipeline rank s. The loader shards each global batch by replica; inside a replica, every pipeline rank
reads the same slice (the first uses the images, the last the labels).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
DEFAULT_SCHEDULE = "1f1b"


def stages_per_rank(schedule: str) -> int:
    """Model chunks each pipeline rank holds: interleaved 1F1B loops every micro-batch through the ranks twice."""
    return 2 if schedule == "interleaved-1f1b" else 1


def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class PipelineLayout:
    devices: int
    ranks: int               # pipeline ranks per replica (--pipeline-stages)

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ConfigError(f"--strategy pipeline needs at least 2 pipeline stages, got {self.ranks}; use "
                              f"--devices 2 or more (or --strategy data for replicas only)")
        if self.devices % self.ranks:
            raise ConfigError(f"--pipeline-stages {self.ranks} does not divide --devices {self.devices}; use one "
                              f"of {', '.join(str(d) for d in divisors(self.devices) if d > 1)}")

    @property
    def replicas(self) -> int:
        return self.devices // self.ranks

    def coords(self, rank: int) -> Tuple[int, int]:
        """(replica, pipeline rank) of a global rank."""
        return divmod(rank, self.ranks)

    def mesh_shape(self) -> Tuple[int, int]:
        """(replicas, pipeline ranks): the shape of the 2-D device mesh, pipeline ranks innermost."""
        return self.replicas, self.ranks


def default_microbatches(per_replica_batch: int, ranks: int) -> int:
    """Four micro-batches per pipeline rank (a bubble of about 1/5 with 1F1B), or the largest count below
    that divides the replica's batch."""
    return max(d for d in divisors(per_replica_batch) if d <= 4 * ranks)


def check_microbatches(microbatches: int, *, per_replica_batch: int, replicas: int, batch_size: int) -> None:
    where = f"--batch-size {batch_size}" + (f" over {replicas} pipeline replicas" if replicas > 1 else "")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"--microbatches must be a positive whole number, got {microbatches!r}")
    if microbatches > per_replica_batch or per_replica_batch % microbatches:
        choices = ", ".join(map(str, divisors(per_replica_batch)))
        problem = "is larger than" if microbatches > per_replica_batch else "does not divide"
        raise ConfigError(f"--microbatches {microbatches} {problem} the batch of {per_replica_batch} each "
                          f"pipeline gets ({where}); use one of {choices}")


def microbatches_for(samples: int, wanted: int, *, schedule: str, ranks: int) -> int:
    """Micro-batches for a batch of `samples` (the smaller last batch of an epoch, too): the largest count
    <= `wanted` that cuts it into equal parts, so every micro-batch has one shape; the gradient is the same
    for any count. Interleaved 1F1B also needs the count to be a multiple of its rounds."""
    for count in range(min(wanted, samples), 0, -1):
        if samples % count:
            continue
        rounds = max(1, count // ranks)
        if schedule == "interleaved-1f1b" and count % rounds:
            continue
        return count
    return 1


def runnable_schedule(schedule: str, microbatches: int, ranks: int) -> str:
    """1F1B needs at least one micro-batch per stage; with fewer, every rank's warm-up covers them all and
    GPipe's order runs the same micro-batches."""
    if schedule == "1f1b" and microbatches < ranks:
        return "gpipe"
    return schedule


@dataclass(frozen=True)
class PipelinePlan:
    """Everything a pipeline worker needs, computed once in the launching process."""
    layout: PipelineLayout
    schedule: str
    microbatches: int
    points: Tuple[int, ...]                 # first layer of model stages 1..n-1
    layer_names: Tuple[str, ...]            # the flattened layers, by their names in the model
    input_shape: Tuple[int, ...] = ()       # one sample (C, H, W), to work out the shapes stages exchange
    costs: Optional[Tuple[float, ...]] = None     # per layer, measured for --split auto
    cost_unit: str = "seconds"              # "seconds" (forward + backward) or "bytes" (memory held)
    input_dtype: str = "float32"            # of the model's input: token ids reach the first stage as int64
    split_at: Tuple[str, ...] = ()          # --split-at: traced stages begin at these modules (layer_names:
    #                                         the modules each traced stage holds, in order)
    micro_batch: int = 0                    # --split-at: samples of a training micro-batch, the traced shape

    def describe(self) -> str:
        where = (f"traced, split before modules {', '.join(self.split_at)}" if self.split_at else
                 f"split before layers {', '.join(map(str, self.points))}")
        return (f"pipeline of {self.layout.ranks} stages x {self.layout.replicas} replica(s), schedule "
                f"{self.schedule}, {self.microbatches} micro-batches, {where}")

    def record(self) -> dict:
        """The placement, for config.json: each model stage's layers by name, and the pipeline rank holding it."""
        return {"stages": [{"stage": stage, "pipeline_rank": stage % self.layout.ranks,
                            "layers": [self.layer_names[i] for i in self.stage_layers(stage)]}
                           for stage in range(self.model_stages)]}

    @property
    def model_stages(self) -> int:
        return self.layout.ranks * stages_per_rank(self.schedule)

    def stage_layers(self, stage: int) -> range:
        bounds = (0, *self.points, len(self.layer_names))
        return range(bounds[stage], bounds[stage + 1])

    def stages_of_rank(self, pipeline_rank: int) -> Tuple[int, ...]:
        """Model stages a pipeline rank holds: stage s runs on pipeline rank s mod ranks."""
        return tuple(range(pipeline_rank, self.model_stages, self.layout.ranks))
