"""Typed, validated settings for one training run.

Every check raises `ConfigError` with a message that names the flag and the fix, so the command line can
print it on one line. Only `cli.py` parses arguments; the Python API builds the same dataclass.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

from .errors import ConfigError
from .loggers import check_tensorboard, parse_loggers
from .plan.pipeline import SCHEDULES as PIPELINE_SCHEDULES, PipelineLayout, check_microbatches

OPTIMIZERS = ("sgd", "adam", "rmsprop")
SCHEDULES = ("constant", "cosine", "onecycle")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
LR_SCALES = ("none", "linear")


def replicas(devices: int, strategy: str, pipeline_stages: Optional[int] = None) -> int:
    """How many replicas split each global batch: every device, except in a pipeline, where the devices of
    one pipeline share one slice (so a "per-device" batch is a per-pipeline batch)."""
    if strategy != "pipeline" or not isinstance(devices, int):
        return devices
    stages = pipeline_stages or devices
    return devices // stages if isinstance(stages, int) and stages > 0 else devices


STRATEGY_OPTIONS = {"pipeline": ("microbatches", "pipeline_schedule", "split", "pipeline_stages", "timeline"),
                    "sharded": ("cpu_offload",),
                    "parameter-server": ("servers", "server_device", "staleness")}


STRATEGY_FLAGS = tuple(name for names in STRATEGY_OPTIONS.values() for name in names)


def options_of_other_strategies(strategy: str) -> dict:
    """The options of every strategy but `strategy`, at their unset values."""
    return {name: (False if name in ("timeline", "cpu_offload") else None)
            for owner, names in STRATEGY_OPTIONS.items() if owner != strategy for name in names}


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass
class TrainConfig:
    dataset: str = "mnist-sample"
    data_dir: Optional[str] = None
    download: bool = False
    model: str = "lenet"
    epochs: int = 5
    batch_size: int = 64
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "onecycle"
    warmup_epochs: float = 0.5
    label_smoothing: float = 0.0
    precision: str = "fp32"
    compile: bool = False
    channels_last: Optional[bool] = None   # None: on for convolutional models
    seed: int = 0
    device: str = "auto"
    devices: int = 1
    strategy: str = "auto"
    microbatches: Optional[int] = None     # pipeline only; None: four per pipeline stage, or fewer that divide
    pipeline_schedule: Optional[str] = None   # pipeline only; None: 1f1b
    split: Optional[str] = None            # pipeline only: "auto" (balanced by measured time) or "4,7"
    pipeline_stages: Optional[int] = None  # pipeline only; None: every device is a stage (one replica)
    timeline: bool = False                 # pipeline only: record a few steps and draw pipeline.png
    cpu_offload: bool = False              # sharded only: keep the shards in host memory (GPUs)
    servers: Optional[int] = None          # parameter-server only; None: 1
    server_device: Optional[str] = None    # parameter-server only: "cpu" (default) or "same"
    staleness: Optional[int] = None        # parameter-server only; None or 0: synchronous
    lr_scale: str = "none"
    augment: Optional[bool] = None
    out: Optional[str] = None
    checkpoint_every: int = 0
    max_steps: int = 0                # stop (with a checkpoint) after this many steps in all; 0: run all epochs
    max_restarts: int = 0
    hang_timeout: float = 60.0
    synthetic_size: int = 2048
    synthetic_shape: tuple = field(default=(1, 28, 28))
    image_size: Optional[int] = None       # --dataset folder: resize every image to this square size
    val_fraction: Optional[float] = None   # --dataset folder without train/ and val/: the share held out
    skip_bad: bool = False                 # --dataset folder: skip unreadable images (counted), not fail
    num_workers: Optional[int] = None      # loader processes per rank for Datasets; None: from the cores
    logger: Optional[str] = None           # comma-separated: tensorboard, csv
    plan: Optional[str] = None             # --strategy auto: a bench.json to choose from instead of measuring

    def __post_init__(self) -> None:
        self.synthetic_shape = tuple(self.synthetic_shape)
        if isinstance(self.split, (list, tuple)):         # the Python API may give split=(4, 7)
            self.split = ",".join(str(point) for point in self.split)
        _need(isinstance(self.epochs, int) and self.epochs > 0,
              f"--epochs must be a positive whole number, got {self.epochs!r}; try --epochs 5")
        _need(isinstance(self.batch_size, int) and self.batch_size > 0,
              f"--batch-size must be a positive whole number, got {self.batch_size!r}; try --batch-size 64")
        _need(self.optimizer in OPTIMIZERS,
              f"unknown --optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        _need(self.schedule in SCHEDULES,
              f"unknown --schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        _need(self.precision in PRECISIONS,
              f"unknown --precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        _need(self.device in DEVICES, f"unknown --device {self.device!r}; choose one of {', '.join(DEVICES)}")
        _need(self.lr_scale in LR_SCALES,
              f"unknown --lr-scale {self.lr_scale!r}; choose one of {', '.join(LR_SCALES)}")
        for flag, value in (("--lr", self.lr), ("--momentum", self.momentum),
                            ("--weight-decay", self.weight_decay), ("--label-smoothing", self.label_smoothing),
                            ("--warmup-epochs", self.warmup_epochs), ("--hang-timeout", self.hang_timeout)):
            _need(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
                  f"{flag} must be a finite number >= 0, got {value!r}; see polytrain train --help for the default")
        _need(self.lr > 0, f"--lr must be greater than 0, got {self.lr!r}; try --lr 0.05")
        _need(self.lr < 1e6, f"--lr {self.lr!r} is far too large to train; try --lr 0.05")
        _need(self.momentum < 1, f"--momentum must be below 1, got {self.momentum!r}; try --momentum 0.9")
        _need(self.label_smoothing < 1, f"--label-smoothing must be below 1, got {self.label_smoothing!r}")
        _need(isinstance(self.devices, int) and self.devices > 0,
              f"--devices must be a positive whole number, got {self.devices!r}; try --devices 1")
        _need(isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0,
              f"--checkpoint-every must be a whole number >= 0, got {self.checkpoint_every!r}")
        _need(isinstance(self.max_steps, int) and self.max_steps >= 0,
              f"--max-steps must be a whole number >= 0, got {self.max_steps!r}")
        _need(isinstance(self.max_restarts, int) and self.max_restarts >= 0,
              f"--max-restarts must be a whole number >= 0, got {self.max_restarts!r}")
        _need(self.hang_timeout > 0, f"--hang-timeout must be greater than 0 seconds, got {self.hang_timeout!r}")
        _need(self.synthetic_size > 0, f"--synthetic-size must be positive, got {self.synthetic_size!r}")
        _need(len(self.synthetic_shape) == 3 and all(isinstance(d, int) and d > 0 for d in self.synthetic_shape),
              f"--synthetic-shape must be three positive sizes C,H,W, got {self.synthetic_shape!r}")
        _need(self.image_size is None or (isinstance(self.image_size, int) and self.image_size > 0),
              f"--image-size must be a positive whole number of pixels, got {self.image_size!r}; try --image-size 32")
        _need(self.val_fraction is None or (isinstance(self.val_fraction, (int, float)) and 0 < self.val_fraction < 1),
              f"--val-fraction must lie strictly between 0 and 1, got {self.val_fraction!r}; try --val-fraction 0.1")
        _need(self.num_workers is None or (isinstance(self.num_workers, int) and self.num_workers >= 0),
              f"--num-workers must be a whole number >= 0, got {self.num_workers!r} (0: load in the training process)")
        if "tensorboard" in parse_loggers(self.logger):
            check_tensorboard()
        self._check_pipeline()
        _need(self.plan is None or self.strategy == "auto",
              f"--plan chooses for --strategy auto; drop --plan or --strategy {self.strategy}")
        _need(self.plan is None or self.devices > 1,
              "--plan chooses a strategy for several devices; add --devices N (2 or more) or drop --plan")
        _need(not self.cpu_offload or self.strategy == "sharded",
              "--cpu-offload applies to --strategy sharded only; add --strategy sharded or drop it")
        _need(self.staleness is None or (isinstance(self.staleness, int) and self.staleness >= 0),
              f"--staleness must be a whole number >= 0, got {self.staleness!r}")
        for name in ("servers", "server_device", "staleness"):
            _need(getattr(self, name) is None or self.strategy == "parameter-server",
                  f"--{name.replace('_', '-')} applies to --strategy parameter-server only; add --strategy "
                  f"parameter-server or drop it")
        shares, across = self.data_parallel_size, f"--devices {self.devices}"
        if self.strategy == "pipeline":
            across = f"the {shares} pipeline replicas"
        _need(self.batch_size % shares == 0,
              f"--batch-size {self.batch_size} (the global batch) does not divide evenly across "
              f"{across}; use a multiple of {shares}, e.g. "
              f"--batch-size {shares * -(-self.batch_size // shares)}, or give "
              f"--per-device-batch-size instead")
        if self.strategy == "pipeline" and self.microbatches is not None:
            check_microbatches(self.microbatches, per_replica_batch=self.batch_size // shares,
                               replicas=shares, batch_size=self.batch_size)

    PIPELINE_OPTIONS = STRATEGY_OPTIONS["pipeline"]

    def _check_pipeline(self) -> None:
        if self.strategy != "pipeline":
            given = [name for name in self.PIPELINE_OPTIONS if getattr(self, name) not in (None, False)]
            _need(not given, f"--{given[0].replace('_', '-') if given else ''} applies to --strategy pipeline "
                             f"only; add --strategy pipeline or drop it")
            return
        _need(self.pipeline_schedule in (None, *PIPELINE_SCHEDULES),
              f"unknown --pipeline-schedule {self.pipeline_schedule!r}; choose one of {', '.join(PIPELINE_SCHEDULES)}")
        _need(self.pipeline_stages is None or (isinstance(self.pipeline_stages, int) and self.pipeline_stages > 0),
              f"--pipeline-stages must be a positive whole number, got {self.pipeline_stages!r}")
        _need(self.split is None or isinstance(self.split, str),
              f"--split must be 'auto' or increasing layer indices like 4,7; got {self.split!r}")
        _need(not self.compile, "--compile is not supported with --strategy pipeline yet; drop --compile")
        PipelineLayout(self.devices, self.pipeline_ranks)      # validates the mesh

    def with_strategy(self, strategy: str, **changes) -> "TrainConfig":
        """These settings under another strategy; options of the others are dropped."""
        values = dict(self.to_dict(), strategy=strategy, **changes)
        values.update(options_of_other_strategies(strategy))
        return TrainConfig.from_dict(values)

    @property
    def pipeline_ranks(self) -> int:
        """Pipeline stages per replica (ranks each micro-batch passes through); 1 without a pipeline."""
        if self.strategy != "pipeline":
            return 1
        return self.pipeline_stages or self.devices

    @property
    def data_parallel_size(self) -> int:
        """Replicas that split each global batch between them."""
        return self.devices // self.pipeline_ranks

    @property
    def effective_lr(self) -> float:
        """The learning rate after `--lr-scale linear`: lr grows with the global batch relative to 64 per replica."""
        if self.lr_scale == "linear":
            return self.lr * self.data_parallel_size
        return self.lr

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})
