"""`TrainConfig`: the whole of one run's settings (every group of settings.py), validated at construction.

Every check raises `ConfigError` with a message that names the flag and the fix, so the command line can
print it on one line. The per-value checks (choices, ranges, which strategy owns an option) come from the
declarations; what is left here relates settings to each other.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Optional

from ..errors import ConfigError
from ..parallel.layout import Layout, check_microbatches, flag_of
from ..parallel.presets import layout_of, layout_or_none, settings_in
from .declare import check_value, declared, flag_name, unset
from .model_defaults import BALANCE_IN_TRACED_STAGES, mixture_of
from .registry_names import check_tensorboard, parse_loggers
from .settings import GROUP_CLASSES, INPUTS


def replicas(values: dict) -> int:
    """How many replicas split each global batch: the layout's data degree (every device, except in a pipeline,
    where the devices of one pipeline share one slice, and with tensor or context parallelism, where the devices
    of one tensor or context group read the same slice); before validation, `--devices` where the settings make
    no layout."""
    layout = _layout_or_none(values)
    return values.get("devices", DEFAULTS.devices) if layout is None else layout.data_degree


def apply_inputs(values: dict) -> None:
    """The other ways to say a setting (`INPUTS`), in `values`, turned into the settings they stand for:
    --per-device-batch-size into --batch-size, then --micro-batch-size into --accumulate."""
    per_device = values.pop("per_device_batch_size", None)
    if per_device is not None:
        check_value("per_device_batch_size", INPUTS["per_device_batch_size"], per_device)
        values["batch_size"] = per_device * replicas(values)
    micro = values.pop("micro_batch_size", None)
    if micro is not None:
        apply_micro_batch_size(values, micro)


def apply_micro_batch_size(values: dict, micro_batch_size: int, *, flag=flag_name) -> None:
    """`--micro-batch-size N` (samples per pass per replica) said as --accumulate, or for a pipeline as its
    micro-batches; refused in one line where the settings do not multiply out."""
    check_value("micro_batch_size", INPUTS["micro_batch_size"], micro_batch_size)
    batch = values.get("batch_size", DEFAULTS.batch_size)
    shares = replicas(values)
    layout = _layout_or_none(values)
    per_replica, pipeline = batch // shares, layout is not None and layout.pipeline > 1
    per_pass = per_replica // (values.get("microbatches") or 1) if pipeline else per_replica
    if per_replica * shares != batch or micro_batch_size > per_pass or per_pass % micro_batch_size:
        raise ConfigError(
            f"{flag('micro_batch_size')} {micro_batch_size} does not divide the {per_pass} samples "
            f"each replica computes per step ({flag('batch_size')} {batch} over {shares} "
            f"replica{'s' * (shares != 1)}); use a divisor of {per_pass}"
        )
    passes = per_pass // micro_batch_size
    if "accumulate" in values and values["accumulate"] != passes:
        raise ConfigError(
            f"{flag('micro_batch_size')} {micro_batch_size} means {flag('accumulate')} {passes} "
            f"with {flag('batch_size')} {batch}, not {values['accumulate']}; give only one of them"
        )
    if pipeline and not values.get("microbatches"):
        values["microbatches"] = passes  # a pipeline's passes are its micro-batches
    else:
        values["accumulate"] = passes


def _layout_or_none(values: dict) -> Optional[Layout]:
    return layout_or_none(
        values.get("strategy", "auto"), values.get("devices", DEFAULTS.devices), **settings_in(values)
    )


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass
class TrainConfig(*reversed(GROUP_CLASSES)):
    """All settings of a run, flat (`config.batch_size`), as `config.json` records them."""

    def __post_init__(self) -> None:
        # in this order, so that of several mistakes the same one is named first
        self._check_values()
        check_optimizer_settings(self)
        self._check_together()

    def _check_values(self) -> None:
        """Each setting's declared check (and which strategy owns it), the learning rate and the momentum."""
        self.synthetic_shape = tuple(self.synthetic_shape)
        if isinstance(self.split, (list, tuple)):  # the Python API may give split=(4, 7), or split=3
            self.split = ",".join(str(point) for point in self.split)
        elif isinstance(self.split, int) and not isinstance(self.split, bool):
            self.split = str(self.split)
        for name, meta in SETTINGS.items():
            if meta.strategies and self.strategy not in meta.strategies and not unset(getattr(self, name)):
                owner = meta.strategies[0]
                raise ConfigError(
                    f"{flag_name(name)} applies to --strategy {' or '.join(meta.strategies)} only; "
                    f"add --strategy {owner} or drop it"
                )
            check_value(name, meta, getattr(self, name))
        # None: the optimizer's own default (an optimizer given by name keeps torch's defaults)
        _need(self.lr is None or self.lr > 0, f"--lr must be greater than 0, got {self.lr!r}; try --lr 0.05")
        _need(self.lr is None or self.lr < 1e6, f"--lr {self.lr!r} is far too large to train; try --lr 0.05")
        _need(
            self.momentum is None or self.momentum < 1,
            f"--momentum must be below 1, got {self.momentum!r}; try --momentum 0.9",
        )
        _need(
            self.lr is not None or self.lr_scale == "none",
            "--lr-scale linear multiplies --lr by the replicas; give --lr (the optimizer's default is not "
            "scaled silently)",
        )

    def _check_together(self) -> None:
        """The values left, then the settings against each other: the layout, the batch, the pipeline."""
        mixture_of(
            self.experts,
            self.experts_per_token,
            self.shared_experts,
            self.moe_every,
            self.experts_renormalise,
            self.router_aux_loss,
        )
        _need(not (self.router_aux_loss and self.split_at), BALANCE_IN_TRACED_STAGES)
        for name in ("lora_alpha", "lora_dropout", "lora_targets"):
            _need(
                self.lora is not None or getattr(self, name) is None,
                f"{flag_name(name)} describes LoRA adapters; add --lora R (their rank, e.g. --lora 8)",
            )
        _need(self.label_smoothing < 1, f"--label-smoothing must be below 1, got {self.label_smoothing!r}")
        _need(
            len(self.synthetic_shape) == 3
            and all(isinstance(d, int) and d > 0 for d in self.synthetic_shape),
            f"--synthetic-shape must be three positive sizes C,H,W, got {self.synthetic_shape!r}",
        )
        if "tensorboard" in parse_loggers(self.logger):
            check_tensorboard()
        # validates the degrees (parallel/layout.py): one line where they do not multiply out
        layout = self.layout
        layout.check_model(experts=self.experts or 0)
        if self.pack:
            self._check_packing(layout)
        if layout.pipeline > 1:
            self._check_pipeline(layout)
        _need(
            self.plan is None or self.strategy == "auto",
            f"--plan chooses for --strategy auto; drop --plan or --strategy {self.strategy}",
        )
        _need(
            self.plan is None or self.devices > 1,
            "--plan chooses a strategy for several devices; add --devices N (2 or more) or drop --plan",
        )
        shares, across = self.data_parallel_size, f"--devices {self.devices}"
        if layout.pipeline > 1:
            across = f"the {shares} pipeline replicas"
        _need(
            self.batch_size % shares == 0,
            f"--batch-size {self.batch_size} (the global batch) does not divide evenly across "
            f"{across}; use a multiple of {shares}, e.g. "
            f"--batch-size {shares * -(-self.batch_size // shares)}, or give "
            f"--per-device-batch-size instead",
        )
        self._check_gradient_knobs(self.batch_size // shares)
        if layout.pipeline > 1 and self.microbatches is not None:
            check_microbatches(
                self.microbatches,
                per_replica_batch=self.batch_size // shares,
                replicas=shares,
                batch_size=self.batch_size,
            )

    def _check_gradient_knobs(self, per_replica: int) -> None:
        _need(
            self.accumulate <= per_replica,
            f"--accumulate {self.accumulate} makes more passes than the {per_replica} samples each replica gets "
            f"of --batch-size {self.batch_size}; use at most --accumulate {per_replica}",
        )
        _need(
            self.clip_grad_norm is None or self.clip_grad_value is None,
            "give either --clip-grad-norm or --clip-grad-value, not both",
        )
        for name in ("clip_grad_norm", "clip_grad_value"):
            _need(
                getattr(self, name) != 0,
                f"{flag_name(name)} 0 would zero every gradient; give a positive "
                f"bound such as {flag_name(name)} 1.0, or leave it out",
            )
        asynchronous = bool(self.staleness)  # (a parameter-server setting)
        _need(
            not (asynchronous and (self.clip_grad_norm or self.clip_grad_value or self.precision == "fp16")),
            "--staleness applies each worker's gradient on its own, so there is no global gradient to clip or "
            "to check for fp16 overflow; drop --staleness (synchronous servers), or the clipping / fp16",
        )

    def _check_packing(self, layout) -> None:
        """--pack's layouts: those whose ranks take whole windows through the whole model (models/packing.py)."""
        _need(
            layout.pipeline == 1,
            "--pack does not take --strategy pipeline yet (a pipeline's stages run micro-batches out of turn, and "
            "packed rows' positions are not passed along them); pad the rows (drop --pack), or use --strategy "
            "data, sharded or tensor",
        )

    def _check_pipeline(self, layout: Layout) -> None:
        _need(
            self.split is None or isinstance(self.split, str),
            f"--split must be 'auto' or increasing layer indices like 4,7; got {self.split!r}",
        )
        _need(
            not (self.compile and self.split_at),
            "--compile does not combine with --split-at (traced stages) yet; drop --compile, or write the model "
            "as an nn.Sequential (stages split by --split)",
        )
        # traced stages run whole on their ranks, with copies of the pipeline beside them: nothing else splits them
        split = [name for name in layout.named() if name not in ("replicate", "pipeline")]
        if self.split_at and (split or self.data_parallel == "shard"):
            flag = flag_name(flag_of(split[0])) if split and split[0] != "shard" else "--data-parallel shard"
            raise ConfigError(
                f"--split-at (traced stages) does not combine with {flag}; split the model by --split instead (an "
                f"nn.Sequential, or --model gpt or llama), or drop {flag.split()[0]}"
            )

    def with_strategy(self, strategy: str, **changes) -> "TrainConfig":
        """These settings under another strategy; options of the others are dropped."""
        values = dict(self.to_dict(), strategy=strategy, **changes)
        values.update(options_of_other_strategies(strategy))
        return TrainConfig.from_dict(values)

    @property
    def layout(self) -> Layout:
        """The degrees of parallelism these settings name (parallel/layout.py)."""
        return layout_of(self.strategy, self.devices, **settings_in(self))

    @property
    def pipeline_ranks(self) -> int:
        """Pipeline stages per replica (ranks each micro-batch passes through); 1 without a pipeline."""
        return self.layout.pipeline

    @property
    def data_parallel_size(self) -> int:
        """Replicas that split each global batch between them (the T ranks of a tensor group read one slice)."""
        return self.layout.data_degree

    @property
    def effective_lr(self) -> Optional[float]:
        """The learning rate after `--lr-scale linear`: lr grows with the global batch relative to 64 per replica
        (None: the optimizer's default)."""
        if self.lr_scale == "linear":
            return self.lr * self.data_parallel_size
        return self.lr

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        """Settings from a mapping that may hold more (a run's config.json records what ran, too)."""
        return cls(**{k: v for k, v in values.items() if k in SETTINGS})


def check_optimizer_settings(config: TrainConfig) -> None:
    """The optimizer and schedule by name, their arguments, the interval: the one check that needs torch.optim,
    imported here so that importing `polytrain.config` imports no torch."""
    from ..optim import check_settings

    check_settings(config)


def _declared_defaults() -> TrainConfig:
    """`TrainConfig()` without its optimizer's check, which needs torch (tests/test_config_imports.py checks
    that `TrainConfig()` passes it and equals this)."""
    defaults = object.__new__(TrainConfig)
    for f in fields(TrainConfig):
        setattr(defaults, f.name, f.default_factory() if f.default is MISSING else f.default)
    defaults._check_values()
    defaults._check_together()
    return defaults


# Derived from the declarations: nothing below names a setting.
SETTINGS = {name: meta for group in GROUP_CLASSES for name, meta in declared(group).items()}
DEFAULTS = _declared_defaults()
STRATEGY_OPTIONS = {}  # strategy -> the options only it reads
for _name, _meta in SETTINGS.items():
    for _owner in _meta.strategies:
        STRATEGY_OPTIONS[_owner] = (*STRATEGY_OPTIONS.get(_owner, ()), _name)
STRATEGY_FLAGS = tuple(name for name, meta in SETTINGS.items() if meta.strategies)
RESUMABLE = tuple(name for name, meta in SETTINGS.items() if meta.resume == "change")
RESUMABLE_FLAGS = tuple(name for name in RESUMABLE if SETTINGS[name].flag != "none")  # (the command line's)
REPLANNING = tuple(name for name, meta in SETTINGS.items() if meta.replans)


def options_of_other_strategies(strategy: str) -> dict:
    """The options of every strategy but `strategy`, at their unset values."""
    return {
        name: unset_value(name)
        for name, meta in SETTINGS.items()
        if meta.strategies and strategy not in meta.strategies
    }


def unset_value(name: str):
    """What a setting holds when nobody set it: its default where that is unset (None, False)."""
    value = getattr(DEFAULTS, name)
    return value if unset(value) else None


assert [f.name for f in fields(TrainConfig)] == list(SETTINGS), (
    "TrainConfig lists its groups' settings in order"
)
