"""The layout of a run's devices: independent degrees of parallelism whose product is the world size.

`Layout(replicate=2, tensor=2)` is 2 data-parallel replicas of 2 tensor ranks each. The degrees are
torchtitan's `ParallelDims`: data-parallel replicate (whole copies that all-reduce gradients), data-parallel
shard (FSDP2 ranks that each keep a shard), pipeline (stages), context (each sequence's tokens split), tensor
(each layer split). The device mesh is laid out in that order, the tensor dimension innermost, so a tensor group is
consecutive ranks (one machine's devices), and a context group the ranks next to them. The expert degree (each
mixture's experts split over `expert` ranks) multiplies nothing: as torchtitan's, its ranks are borrowed from those
that hold the same parameters (`expert_holders`: those FSDP2 shards over, or DDP's whole copies), consecutive among
them (experts.py).

What a layout means is asked of it: how the global batch is cut (`data_degree`), over how many replicas the
gradient is averaged, the mesh's shape and names, the words that describe it. The strategy names users give
(`--strategy data|sharded|pipeline|tensor`, with `--tensor-parallel`, `--pipeline-stages`, `--data-parallel`,
`--replicas` and `--context-parallel`) are presets of degrees (presets.py `layout_of`). The parameter server is a different algorithm, not a layout: its workers
are replicas.

Pure: numbers in, numbers out (no torch), so a layout for hundreds of devices is planned anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from ..errors import ConfigError


def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def experts_not_divided(ranks: int, experts: int) -> str:
    """The one line for --expert-parallel P that does not divide a mixture's E experts."""
    return f"--expert-parallel {ranks} must divide the {experts} experts of each mixture; give a divisor of {experts}"


def check_microbatches(microbatches: int, *, per_replica_batch: int, replicas: int, batch_size: int) -> None:
    where = f"--batch-size {batch_size}" + (f" over {replicas} pipeline replicas" if replicas > 1 else "")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"--microbatches must be a positive whole number, got {microbatches!r}")
    if microbatches > per_replica_batch or per_replica_batch % microbatches:
        choices = ", ".join(map(str, divisors(per_replica_batch)))
        problem = "is larger than" if microbatches > per_replica_batch else "does not divide"
        raise ConfigError(
            f"--microbatches {microbatches} {problem} the batch of {per_replica_batch} each "
            f"pipeline gets ({where}); use one of {choices}"
        )


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
# the degrees borrowed from the ranks of the others, multiplying nothing (as torchtitan's expert degree, over the
# ranks that hold the same parameters): each by its name in `--layout` and a plan's JSON (after the mesh's) and in
# words; its flag is `--NAME-parallel` (`flag_of`)
BORROWED = {"expert": "ep"}
BORROWED_WORDS = {"expert": "experts over {} ranks"}


def flag_of(degree: str) -> str:
    """The setting that gives `degree` (`expert_parallel` for --expert-parallel)."""
    return f"{degree}_parallel"


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
    # the ranks each mixture's experts are split over, borrowed from those that hold the same parameters (the FSDP2
    # ranks, or DDP's copies: `expert_holders`; not a factor of the world)
    expert: int = 1

    def __post_init__(self) -> None:
        for name in DEGREES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"the {name} degree must be a whole number of at least 1, got {value!r}")
        if self.context_in not in ("shard", "replicate"):
            raise ConfigError(f"context_in must be 'shard' or 'replicate', got {self.context_in!r}")
        if not isinstance(self.expert, int) or isinstance(self.expert, bool) or self.expert < 1:
            raise ConfigError(f"the expert degree must be a whole number of at least 1, got {self.expert!r}")
        if self.expert > 1 and (self.expert_holders < 2 or self.expert_holders % self.expert):
            raise ConfigError(self._experts_unsplit())
        if self.context == 1:  # (one description per layout: equal layouts compare equal)
            object.__setattr__(self, "context_in", "shard")

    def check_model(self, *, experts: int = 0) -> None:
        """One line where a model does not split over this layout: each mixture's `experts` over the expert
        degree. (What a degree needs of a model's layers, the heads or the sequence, is checked where its step
        meets them.)"""
        if experts and experts % self.expert:
            raise ConfigError(experts_not_divided(self.expert, experts))

    def _experts_unsplit(self) -> str:
        """The line for an expert degree that does not divide the ranks it is borrowed from."""
        if self.data_parallel == "shard" and self.fsdp_ranks > 1:
            return (
                f"--expert-parallel {self.expert} splits the experts over ranks that FSDP2 shards over, and must "
                f"divide them ({self.fsdp_ranks} here: the shards, with their context ranks); use a divisor of "
                f"{self.fsdp_ranks}"
            )
        if self.data_parallel == "replicate" and self.context > 1 and self.pipeline == 1:
            return (
                f"--expert-parallel {self.expert} borrows its ranks from DDP's copies beside no context ranks so far; "
                f"with --context-parallel use --strategy sharded (FSDP2 over the shards and context ranks)"
            )
        if self.expert_holders > 1:
            return (
                f"--expert-parallel {self.expert} splits the experts over the data-parallel copies, and must divide "
                f"them ({self.expert_holders} here); use a divisor of {self.expert_holders}"
            )
        return (
            f"--expert-parallel {self.expert} splits the experts over ranks that hold the same parameters, and this "
            f"layout has none to borrow from; use --strategy data or sharded, --strategy tensor with "
            f"{self.expert} tensor groups or more (--devices {self.expert} x --tensor-parallel), or --strategy "
            f"pipeline --data-parallel shard"
        )

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
        plan's slices, experts split over ranks): its state is gathered and cut back, and its checkpoints are each
        rank's parts."""
        return self.data_parallel == "shard" or self.tensor > 1 or bool(self.borrowed())

    @property
    def expert_holders(self) -> int:
        """The ranks an expert degree borrows from, which hold the same parameters: those FSDP2 shards over
        (`fsdp_ranks`), or DDP's whole copies where one model is neither split nor sharded (`replicate`: not a
        pipeline's copies, nor context ranks beside them); 0 where there are none."""
        if self.data_parallel == "shard":
            return self.fsdp_ranks
        plain = self.data_parallel == "replicate" and self.pipeline == 1 and self.context == 1
        return self.replicate if plain else 0

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

    @property
    def fsdp_ranks(self) -> int:
        """Over how many ranks FSDP2 cuts each parameter where the layout shards (`data_parallel == "shard"`): the
        shard ranks and the context ranks beside them, which hold the same parameters (torchtitan's dp_shard_cp;
        `sharding.shard`)."""
        return self.shard * self.context

    @property
    def expert_span(self) -> int:
        """How many consecutive ranks one expert group spans (`expert` of the FSDP2 ranks, innermost in the
        flattened (dp_shard, cp) dimension, or of DDP's copies): the tensor ranks lie between its ranks, and the
        pipeline stages too where it reaches past one context group."""
        return self.expert * self.tensor * (self.pipeline if self.expert > self.context else 1)

    @property
    def stage_ranks(self) -> int:
        """The ranks that compute one slice of the batch through one pipeline stage together: the tensor ranks of
        each context rank (consecutive in the mesh)."""
        return self.context * self.tensor

    def tokens_per_rank(self, sequence: float) -> float:
        """The tokens of each `sequence`-token sample a rank computes: its part of the sequence (also of
        anything counted per sample that grows with its tokens)."""
        return sequence / self.context

    def degrees(self) -> Dict[str, int]:
        """Every degree above 1, in mesh order (empty on one device)."""
        return {name: getattr(self, name) for name in DEGREES if getattr(self, name) > 1}

    def named(self) -> Dict[str, int]:
        """Every degree above 1 by name, in mesh order, then the degrees borrowed from them (the expert degree,
        over the shard ranks): how a plan's JSON names the layout."""
        return {**self.degrees(), **self.borrowed()}

    def borrowed(self) -> Dict[str, int]:
        """Every degree borrowed from the others' ranks (`BORROWED`) above 1, by name."""
        return {name: getattr(self, name) for name in BORROWED if getattr(self, name) > 1}

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
        """In words: '2 replicas x 2 tensor ranks'; 'one device'; ', experts over 2 ranks' with an expert degree."""
        parts = [f"{size} {WORDS[name]}s" for name, size in self.degrees().items()]
        borrowed = "".join(f", {BORROWED_WORDS[name].format(size)}" for name, size in self.borrowed().items())
        return (" x ".join(parts) if parts else "one device") + borrowed

    def words(self) -> str:
        """`dp_shard=8,tp=8`: the layout in its mesh names, as `--layout` takes it ('single' on one device; the
        expert degree `ep=P` last)."""
        named = [f"{name}={size}" for name, size in zip(self.mesh_names, self.mesh_shape)]
        named += [f"{BORROWED[name]}={size}" for name, size in self.borrowed().items()]
        return ",".join(named) or "single"


def parse_layout(text: str, devices: int) -> Layout:
    """`--layout dp_replicate=2,dp_shard=8,pp=4,cp=2,tp=4` (`Layout.words`) as a Layout of `devices`; one line where it
    is not one."""
    names = {mesh: name for name, mesh in {**MESH_NAMES, **BORROWED}.items()}
    degrees = {}
    for part in filter(None, text.replace(" ", "").split(",") if text.strip() != "single" else ()):
        key, _, value = part.partition("=")
        if key not in names or not value.isdigit() or int(value) < 1:
            raise ConfigError(
                f"--layout {text!r}: {part!r} is not NAME=SIZE with NAME one of {', '.join(names)}; e.g. "
                f"--layout dp_shard=8,tp=8"
            )
        degrees[names[key]] = int(value)
    # where no rank shards, the context ranks hold whole copies as the presets make them (pipelines of copies,
    # data's DDP); `cp=C` alone is FSDP2 over the context ranks, as --strategy sharded --context-parallel C
    get = degrees.get
    copies = get("shard", 1) == 1 and (
        get("pipeline", 1) > 1 or (get("tensor", 1) == 1 and get("replicate", 1) > 1)
    )
    lent = any(get(name, 1) > 1 for name in BORROWED)  # (a borrowed degree needs ranks that shard)
    layout = Layout(**degrees, context_in="replicate" if copies and not lent else "shard")
    if layout.world_size != devices:
        raise ConfigError(
            f"--layout {text} makes {layout.world_size} ranks, and --devices is {devices}; give degrees whose "
            f"product is {devices}"
        )
    return layout
