"""The layout of a pipeline run, as numbers: which rank holds which stage of which replica, how many
micro-batches each step is cut into, and which layers each stage holds.

`--devices 4 --pipeline-stages 2` is a 2 x 2 mesh: replica r holds ranks 2r and 2r+1, and rank 2r+s runs
pipeline rank s. The loader shards each global batch by replica; inside a replica, every pipeline rank
reads the same slice (the first uses the images, the last the labels).

With `--tensor-parallel T` every stage is split over T consecutive ranks (the tensor dimension innermost, as in
TensorPlan.coords): rank (replica x stages + stage) x T + t holds tensor slice t of that stage, so
`--devices 8 --pipeline-stages 2 --tensor-parallel 2` is a 2 x 2 x 2 (data, pipeline, tensor) mesh.

With `--data-parallel shard` the pipelines beside each other are FSDP2 shards instead of replicas: the ranks of a
stage in every pipeline keep one shard each of the stage's weights, gradients and optimizer state (the data
dimension of the mesh is then dp_shard, not dp_replicate); the arithmetic above is the same, with tensor ranks
too: `--devices 8 --pipeline-stages 2 --tensor-parallel 2 --data-parallel shard` is a 2 x 2 x 2 (dp_shard, pp,
tp) mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..errors import ConfigError
from ..parallel.layout import Layout, divisors
from ..parallel.tensor_plan import TensorPlan


def stages_per_rank(schedule: str) -> int:
    """Model chunks each pipeline rank holds: interleaved 1F1B loops every micro-batch through the ranks twice."""
    return 2 if schedule == "interleaved-1f1b" else 1


def pipelines_words(layout: Layout) -> str:
    """The pipelines beside each other (and the context ranks each stage runs on), in words."""
    context = layout.sequence_words
    if layout.replicate > 1 and layout.shard > 1:
        return f"{layout.replicate} replicas of {layout.shard} shards (hybrid sharding, FSDP2){context}"
    return (
        f"{layout.shard} shards (FSDP2)" if layout.shard > 1 else f"{layout.replicate} replica(s)"
    ) + context


def data_words(layout: Layout, data: int) -> str:
    """Where the pipeline at data coordinate `data` stands among those beside it, in words."""
    if layout.replicate > 1 and layout.shard > 1:
        shards = layout.shard
        return f"replica {data // shards + 1}/{layout.replicate}, shard {data % shards + 1}/{shards}"
    if layout.shard > 1:
        return f"shard {data + 1}/{layout.shard}"
    return f"replica {data + 1}/{layout.replicate}"


def last_batch(samples: int, batch_size: int, max_steps: Optional[int]) -> int:
    """The samples of the last batch of an epoch a run trains: the epoch's short last batch, or a whole batch
    where the batch size divides the samples or `max_steps` stops the run before the short one."""
    if max_steps and max_steps <= samples // batch_size:
        return batch_size
    return samples % batch_size or batch_size


def default_microbatches(per_replica_batch: int, ranks: int) -> int:
    """Four micro-batches per pipeline rank (a bubble of about 1/5 with 1F1B), or the largest count below
    that divides the replica's batch."""
    return max(d for d in divisors(per_replica_batch) if d <= 4 * ranks)


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
    """Everything a pipeline worker needs, computed once in the launching process, for the run's `Layout` (which
    it does not hold: its stages, `len(points) + 1`, lie on `ranks` pipeline ranks, which the strategy checks
    against the layout's pipeline degree)."""

    schedule: str
    microbatches: int
    points: Tuple[int, ...]  # first layer of model stages 1..n-1
    layer_names: Tuple[str, ...]  # the flattened layers, by their names in the model
    input_shape: Tuple[int, ...] = ()  # one sample (C, H, W), to work out the shapes stages exchange
    costs: Optional[Tuple[float, ...]] = None  # per layer, measured for --split auto
    cost_unit: str = "seconds"  # "seconds" (forward + backward) or "bytes" (memory held)
    input_dtype: str = "float32"  # of the model's input: token ids reach the first stage as int64
    split_at: Tuple[str, ...] = ()  # --split-at: traced stages begin at these modules (layer_names:
    #                                         the modules each traced stage holds, in order)
    micro_batch: int = 0  # --split-at: samples of a training micro-batch, the traced shape
    tensor: Optional[TensorPlan] = None  # --tensor-parallel: how each stage's layers are split, by their
    #                                         names in the whole model (the layout's tensor ranks per stage)

    def __post_init__(self) -> None:
        if self.tensor is not None:
            check_tensor_cuts(self.tensor.styles, self.layer_names, self.points)

    def micro_batch_passes(self, layout: Layout) -> Optional[int]:
        """The passes in which one device computes what this pipeline computes per micro-batch on `layout`
        (BatchNorm normalises over each): its micro-batches, where one pipeline takes the whole batch; None
        otherwise."""
        whole = layout.data_degree == 1 and layout.tensor == 1 and not self.split_at
        return self.microbatches if whole else None

    def draws_dropout_as_one_device(self, layout: Layout) -> bool:
        """Whether nn.Dropout draws one device's masks on `layout`, each micro-batch its rows of them: not in
        traced stages, nor where tensor ranks split a stage's activations."""
        return layout.tensor == 1 and not self.split_at

    def describe(self, layout: Layout) -> str:
        """The stages, their split and schedule on the run's `layout`."""
        where = (
            f"traced, split before modules {', '.join(self.split_at)}"
            if self.split_at
            else f"split before layers {', '.join(map(str, self.points))}"
        )
        tensor = (
            f"; each stage split over {layout.tensor} tensor ranks: "
            f"{self.tensor.describe(layout).split(': ', 1)[-1]}"
            if self.tensor
            else ""
        )
        return (
            f"pipeline of {layout.pipeline} stages x {pipelines_words(layout)}, schedule "
            f"{self.schedule}, {self.microbatches} micro-batches, {where}{tensor}"
        )

    def record(self) -> dict:
        """The placement, for config.json: each model stage's layers by name, and the pipeline rank holding it
        (and how each stage is split over its tensor ranks)."""
        return {
            "stages": [
                {
                    "stage": stage,
                    "pipeline_rank": stage % self.ranks,
                    "layers": [self.layer_names[i] for i in self.stage_layers(stage)],
                }
                for stage in range(self.model_stages)
            ],
            **(self.tensor.record() if self.tensor else {}),
        }

    @property
    def model_stages(self) -> int:
        """The model's stages: one before each point and one after the last."""
        return len(self.points) + 1

    @property
    def ranks(self) -> int:
        """The pipeline ranks the stages lie on, `stages_per_rank` each: the layout's pipeline degree."""
        return self.model_stages // stages_per_rank(self.schedule)

    def stage_layers(self, stage: int) -> range:
        bounds = (0, *self.points, len(self.layer_names))
        return range(bounds[stage], bounds[stage + 1])

    def stages_of_rank(self, pipeline_rank: int) -> Tuple[int, ...]:
        """Model stages a pipeline rank holds: stage s runs on pipeline rank s mod ranks."""
        return tuple(range(pipeline_rank, self.model_stages, self.ranks))


def check_tensor_cuts(styles, layer_names, points) -> None:
    """One line where a stage would begin between a column-wise layer and the row-wise layer that sums its parts
    (or after a column-wise layer that none sums): the activations between them are split over the tensor ranks,
    and stages exchange whole activations."""

    def layer_of(module: str) -> int:
        return next(
            i for i, name in enumerate(layer_names) if module == name or module.startswith(name + ".")
        )

    opened = None
    for module, style, _ in (*styles, ("", "end", 1)):
        at = len(layer_names) if style == "end" else layer_of(module)
        if opened and style in ("rowwise", "end"):
            cut = [point for point in points if opened[1] < point <= at]
            if cut:
                then = (
                    f"and {module} (rowwise)"
                    if style == "rowwise"
                    else "and the model's end (no rowwise layer)"
                )
                raise ConfigError(
                    f"--tensor-parallel: a pipeline stage begins at layer {cut[0]}, between "
                    f"{opened[0]} (colwise) {then}, whose activations are split over the tensor "
                    f"ranks; give a --split that keeps them on one stage"
                )
            opened = None
        if style == "colwise":
            opened = (module, at)


def check_torch(version: tuple, *, device_type: str, fewest_microbatches: int, ranks: int) -> None:
    """Refuse, in one line, what this torch's pipelining cannot run.

    Before 2.8 a schedule waited on only one of gloo's send/recv handles and could hang (pytorch PR
    152938); 2.7 to 2.10 refuse fewer micro-batches than stages in every single-stage schedule.
    """

    def need(release: str, why: str):
        raise ConfigError(
            f"--strategy pipeline {why} needs torch {release} or newer (this is {'.'.join(map(str, version))}); "
            f"upgrade torch, or use --strategy data"
        )

    if version < (2, 6):
        need("2.6", "")
    if device_type == "cpu" and version < (2, 8):
        need("2.8", "on CPU processes (gloo)")
    if (2, 7) <= version < (2, 11) and fewest_microbatches < ranks:
        need(
            "2.11",
            f"with {fewest_microbatches} micro-batch(es) for {ranks} stages (also a smaller last batch)",
        )
