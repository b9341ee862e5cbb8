"""`polytrain bench`: every combination of device kind, global batch, strategy and device count runs a fixed
number of steps after a warm-up; each rank times what it spent each step on (scaling/stepclock.py). The rows, the
cost model's prediction for each, and projections to larger counts go to bench_report.py for the table, the
explanations, bench.json and bench.png.

Any strategy in the registry can be benchmarked: the bench only asks it to train, and reads the phases it
reports (`Strategy.phases`, `Strategy.settle_phases`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch

from ..config import TrainConfig
from ..config.declare import flag_name
from ..config.model_defaults import MODEL_SETTINGS, apply_model_defaults, check_model_settings
from ..errors import ConfigError, UserError, first_line
from ..models import MODELS, build_model, build_model_on_meta
from ..objective import Objective
from ..parallel.layout import Layout
from ..parallel.presets import flags_of, label, layout_of, plain_layout
from ..planning import costmodel
from ..scaling.bench_predict import fit_message_costs, predict_rows, project
from ..scaling.flops import flops_per_sample, matmul_peak
from ..scaling.whole_model import check_bench
from ..scaling.workload import measure_link, measure_workload, turns
from ..sources import as_dataset
from ..strategy_registry import STRATEGIES, contiguous_strategies, make_plan
from .hostenv import most_cpu_processes, usable_cores
from .launch import WorkerFailed, check_devices, check_main_guard, run_job
from .worker import Job, choose_device

PHASES = ("compute", "communication", "all-to-all", "data", "idle")
DEVICE_KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class BenchOptions:
    model: str = "lenet"
    dataset: str = "mnist-sample"
    data_dir: Optional[str] = None
    devices: Tuple[int, ...] = (1, 2)
    strategies: Tuple[str, ...] = ("single", "data")
    batch_sizes: Tuple[int, ...] = (64,)
    device_kinds: Tuple[str, ...] = ("cpu",)
    warmup: int = 10
    steps: int = 20
    predict: Tuple[int, ...] = ()
    seed: int = 0
    repeats: int = 1  # interleaved rounds; each row keeps its median round
    # the model's own settings (--layers, --heads, --width, --context of --model gpt and llama, and llama's
    # --size, --kv-heads, ...); None: its defaults
    layers: Optional[int] = None
    heads: Optional[int] = None
    width: Optional[int] = None
    context: Optional[int] = None
    size: Optional[str] = None
    kv_heads: Optional[int] = None
    ffn_width: Optional[int] = None
    vocab_size: Optional[int] = None
    rope_theta: Optional[float] = None
    norm_eps: Optional[float] = None
    qkv_bias: Optional[bool] = None
    head_dim: Optional[int] = None
    qk_norm: Optional[bool] = None
    tie_embeddings: Optional[bool] = None
    dropout: Optional[float] = None
    gelu: Optional[str] = None
    positions: Optional[int] = None
    experts: Optional[int] = None
    experts_per_token: Optional[int] = None
    shared_experts: Optional[int] = None
    moe_every: Optional[int] = None
    experts_renormalise: Optional[bool] = None
    router_aux_loss: Optional[float] = None

    @property
    def model_options(self) -> dict:
        """The model settings given (checked in `__post_init__` against the model that reads them)."""
        return {
            key: getattr(self, key, None) for key in MODEL_SETTINGS if getattr(self, key, None) is not None
        }

    def __post_init__(self):
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ConfigError(
                f"--strategies: unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}"
            )
        if self.model not in MODELS:
            raise ConfigError(f"--model: unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        bad = [k for k in self.device_kinds if k not in DEVICE_KINDS]
        if bad:
            raise ConfigError(f"--device: unknown device kind {bad[0]!r}; give cpu, cuda or cpu,cuda")
        for flag, values in (
            ("--devices", self.devices),
            ("--batch-sizes", self.batch_sizes),
            ("--predict", self.predict),
        ):
            if any(not isinstance(v, int) or v < 1 for v in values):
                raise ConfigError(
                    f"{flag} takes positive whole numbers separated by commas, got "
                    f"{','.join(map(str, values))}"
                )
        if self.repeats < 1:
            raise ConfigError(f"--repeats must be at least 1, got {self.repeats}")
        if self.steps < 1 or self.warmup < 0:
            raise ConfigError(
                f"--steps must be at least 1 and --warmup at least 0 (got {self.steps}, {self.warmup})"
            )
        most = most_cpu_processes()
        if "cpu" in self.device_kinds and max(self.devices) > most:
            raise ConfigError(
                f"--devices {max(self.devices)}: this machine has {usable_cores()} cores, and more than "
                f"{most} CPU processes would only take turns on them; project larger counts with "
                f"--predict {max(self.devices)}"
            )
        if self.device_kinds == ("cuda",) and not torch.cuda.is_available():
            raise ConfigError("--device cuda: PyTorch sees no CUDA GPU here; use --device cpu")
        for key in COUNTS:
            value = getattr(self, key, None)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{flag_name(key)} must be a positive whole number, got {value!r}")
        check_model_settings(self.model, self.model_options)


# the model settings that are sizes (positive whole numbers)
COUNTS = ("layers", "heads", "width", "context", "kv_heads", "ffn_width", "vocab_size")


@dataclass
class Row:
    device: str
    strategy: str
    devices: int
    batch_size: int
    skipped: str = ""  # why this combination did not run
    step_seconds: float = math.nan  # median over measured steps, data and waiting included
    samples_per_second: float = math.nan
    tokens_per_second: float = math.nan  # text: samples/s times the tokens each sample predicts
    peak_fraction: float = math.nan  # counted FLOPs per second over the devices' float32 matmul peak
    # experts split over ranks: the (token, choice) pairs the busiest rank's experts computed over the mean's
    imbalance: float = math.nan
    speedup: float = math.nan  # against `single` on one device of the same kind and batch
    efficiency: float = math.nan  # speedup / devices
    phases: Dict[str, float] = field(default_factory=dict)  # seconds per step, mean over ranks
    held_bytes: int = 0  # most any rank keeps between steps (weights, grads, optimizer)
    peak_bytes: Optional[int] = None  # most any GPU rank allocated (CUDA only)
    predicted_seconds: float = math.nan  # the cost model's step time for this combination
    fitted: bool = False  # its strategy's cost per message was fitted to this row
    ranks: list = field(default_factory=list)  # per rank: threads, reference, held and peak bytes, phases
    link: dict = field(default_factory=dict)  # message bytes -> seconds of an all-reduce over the ranks
    warning: str = ""  # why its figures cannot be right (see `impossible`)
    # the degrees this row ran (parallel/layout.py): its strategy's plain layout on its devices where not given;
    # written into bench.json whole, so that a reader takes the row's layout, not a label parsed back
    layout: Optional[Layout] = None

    def __post_init__(self):
        if self.layout is None:
            self.layout = plain_layout(self.strategy, self.devices)

    @property
    def key(self) -> Tuple[str, int]:
        return self.device, self.batch_size

    @property
    def label(self) -> str:
        """The strategy on its layout, as the cost model prints it (`tensor 2x2`: 2 groups of 2 on a 2-D mesh;
        `sharded 2x2`: 2 copies of 2 shards; `data ep2`: the experts split over 2 ranks)."""
        return label(self.strategy, self.layout)

    def to_dict(self) -> dict:
        return asdict(self)


def combinations(options: BenchOptions, *, tensor: bool = True) -> List[Row]:
    """Every row the bench runs, baseline (`single` on 1 device) first within each device kind and batch.
    Tensor parallelism (where `tensor`: the model has a plan) runs as one group of all the devices and as each
    (data, tensor) mesh of smaller groups (4 devices: also 2 x 2); sharding also as copies of shard groups of
    `costmodel.HYBRID_SHARDS` ranks (4 devices: also 2 copies of 2 shards). A model with mixtures of experts
    (`--experts E`) also runs data and sharded with its experts split over each count of ranks that divides E and
    the devices (`--expert-parallel P`)."""
    rows = []
    for kind in options.device_kinds:
        for batch in options.batch_sizes:
            rows.append(Row(kind, "single", 1, batch))
            for strategy in options.strategies:
                if strategy == "single":
                    continue  # one device is the baseline row
                plain = layout_of(strategy, 2)  # what the preset is: its layout on 2 devices
                if plain.tensor > 1 and not tensor:
                    continue
                for n in options.devices:
                    if n == 1:
                        continue
                    rows.append(Row(kind, strategy, n, batch))
                    if strategy in ("data", "sharded") and options.experts:
                        rows += [
                            Row(kind, strategy, n, batch, layout=replace(plain_layout(strategy, n), expert=p))
                            for p in range(2, n + 1)
                            if n % p == 0 and options.experts % p == 0
                        ]
                    if plain.tensor > 1:
                        rows += [
                            Row(kind, strategy, n, batch, layout=layout_of(strategy, n, tensor_parallel=t))
                            for t in range(2, n)
                            if n % t == 0
                        ]
                    # hybrid sharding, as the cost model projects it (FSDP2 over the data ranks; a tensor strategy's
                    # rows are its (data, tensor) meshes, hybrid ones not measured yet)
                    if plain.data_parallel == "shard":
                        rows += [
                            Row(kind, strategy, n, batch, layout=layout_of(strategy, n, replicas=n // shards))
                            for shards in costmodel.HYBRID_SHARDS
                            if shards < n and n % shards == 0
                        ]
    return rows


def summarize(row: Row, timings: list) -> None:
    """Fill `row` from every rank's StepClock records."""
    strategy = STRATEGIES[row.strategy]
    settled = strategy.settle_phases([rank["steps"] for rank in timings])
    per_rank = []
    for rank, steps in zip(timings, settled):
        sums = dict.fromkeys(PHASES, 0.0)
        for record in steps:
            idle, exchanges = record.get("idle", 0.0), record.get("all-to-all", 0.0)
            if rank["reference"] is not None:
                compute = min(record["step"], rank["reference"])
                communication = max(0.0, record["step"] - compute - idle)
            else:
                communication = record.get("communication", 0.0)
                compute = max(0.0, record["step"] - communication - idle)
            communication = max(0.0, communication - exchanges)  # (the all-to-alls apart)
            for phase, value in zip(PHASES, (compute, communication, exchanges, record["data"], idle)):
                sums[phase] += value
        outside = rank["window"] - sum(r["step"] + r["data"] for r in steps)  # between steps, closing barrier
        sums["idle"] += max(0.0, outside)
        per_rank.append({phase: value / len(steps) for phase, value in sums.items()})
    routed = [sum(record.get("routed", 0) for record in steps) for steps in settled]
    if any(routed):
        row.imbalance = max(routed) / (sum(routed) / len(routed))
    row.step_seconds = timings[0]["window"] / len(timings[0]["steps"])
    row.samples_per_second = row.batch_size / row.step_seconds
    mean = {phase: sum(r[phase] for r in per_rank) / len(per_rank) for phase in PHASES}
    scale = row.step_seconds / (sum(mean.values()) or 1.0)  # a GPU's steps are timed on the device
    row.phases = {phase: value * scale for phase, value in mean.items()}
    row.held_bytes = max(rank["held_bytes"] for rank in timings)
    peaks = [rank["peak_bytes"] for rank in timings if rank["peak_bytes"] is not None]
    row.peak_bytes = max(peaks) if peaks else None
    links = [rank["link"] for rank in timings if rank.get("link")]
    row.link = {size: max(link[size] for link in links) for size in links[0]} if links else {}
    row.ranks = [
        {key: rank[key] for key in ("rank", "device", "threads", "reference", "held_bytes", "peak_bytes")}
        | {"phases": phases}
        for rank, phases in zip(timings, per_rank)
    ]


def link_of(
    rows: List[Row], kind: str, *, cores: Optional[int] = None
) -> Optional[Tuple[costmodel.Link, str]]:
    """The link fitted to the all-reduces timed by the fewest processes that trained on `kind`: as one rank per
    core would see it (`link_for` adds the turns that more CPU processes than cores take)."""
    timed = sorted(
        (r for r in rows if r.device == kind and r.link and not r.skipped), key=lambda r: r.devices
    )
    if not timed:
        return None
    n, samples = timed[0].devices, timed[0].link
    fitted = costmodel.Link.fit(list(samples), list(samples.values()), relative=True)
    # a ring all-reduce over n ranks takes 2(n-1)/n S/B + 2(n-1) alpha
    shared = turns(n, device_type=kind, cores=cores)
    link = costmodel.Link(alpha=fitted.alpha / (2 * (n - 1)) / shared, beta=fitted.beta * 2 * (n - 1) / n)
    return link, f"measured: all-reduces between the {n} {kind} processes of the {timed[0].strategy} run"


def has_tensor_plan(model) -> bool:
    """Whether tensor parallelism has a plan for this registry model (the built-in gpt and mlp)."""
    from ..parallel.tensor_plan import BUILTIN_PLANS

    return f"{type(model).__module__}.{type(model).__qualname__}" in BUILTIN_PLANS


def convolutional(model) -> bool:
    """Registry models with convolutions train channels-last, as `polytrain train` does."""
    return any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


def row_config(options: BenchOptions, row: Row, *, epochs: int, max_steps: int) -> TrainConfig:
    """The training settings of one combination: a constant learning rate (no warm-up), and the model's own
    recipe where it brings one (--model gpt: AdamW, clipping at 1.0), so that each step does what training does."""
    values = dict(
        model=options.model,
        dataset=options.dataset,
        data_dir=options.data_dir,
        batch_size=row.batch_size,
        strategy=row.strategy,
        devices=row.devices,
        device=row.device,
        epochs=epochs,
        max_steps=max_steps,
        schedule="constant",
        warmup_epochs=0,
        seed=options.seed,
        **options.model_options,
    )
    values.update(flags_of(row.strategy, row.layout))  # the settings beside --strategy that give its layout
    apply_model_defaults(values, set(values), options.model)
    return TrainConfig(**values)


def objective_for(dataset) -> Objective:
    """The built-in objective of the data: next-token cross-entropy for text, else classification."""
    return Objective(kind=getattr(dataset, "kind", "classification"))


def run_row(row: Row, options: BenchOptions, dataset, model) -> None:
    """Train the combination for warm-up + measured steps and time it; a combination that cannot run here
    gets the reason instead."""
    if row.device == "cuda" and not torch.cuda.is_available():
        row.skipped = "no CUDA GPU here"
        return
    steps = options.warmup + options.steps
    per_epoch = -(-len(dataset.train_y) // row.batch_size) if hasattr(dataset, "train_y") else steps
    try:
        config = row_config(options, row, epochs=-(-steps // per_epoch), max_steps=steps)
        check_devices(row.devices, row.device)
        plan = make_plan(row.strategy, config, model, dataset, device=choose_device(row.device, 0))
        result = run_job(
            Job(
                config,
                row.strategy,
                dataset,
                model,
                verbose=False,
                channels_last=convolutional(model),
                plan=plan,
                bench=(options.warmup, options.steps),
                objective=objective_for(dataset),
            )
        )
    except (UserError, WorkerFailed) as error:
        row.skipped = first_line(error)
        return
    summarize(row, result.timings)
    if getattr(dataset, "kind", None) == "language":
        row.tokens_per_second = row.samples_per_second * dataset.context


def fill_peak_fraction(row: Row, flops: float, peaks: dict) -> None:
    """The row's counted FLOPs per second (`flops` per sample) over its devices' peak: a GPU's each, while CPU
    processes share the cores whose peak was measured."""
    peak = peaks.get(row.device)
    if not row.skipped and peak and math.isfinite(flops):
        row.peak_fraction = (
            flops * row.samples_per_second / (peak * (row.devices if row.device == "cuda" else 1))
        )


def median_row(runs: List[Row]) -> Row:
    """The round whose step time is the median (the lower one of an even count)."""
    done = sorted((r for r in runs if not r.skipped), key=lambda r: r.step_seconds)
    return done[(len(done) - 1) // 2] if done else runs[0]


def fill_speedups(rows: List[Row]) -> None:
    base = {row.key: row.step_seconds for row in rows if row.devices == 1 and not row.skipped}
    for row in rows:
        if not row.skipped and row.key in base:
            row.speedup = base[row.key] / row.step_seconds
            row.efficiency = row.speedup / row.devices
            row.warning = impossible(row)


def impossible(row: Row) -> str:
    """Why a row's efficiency cannot be right, or "": CPU processes share the cores one device already had, so
    n of them cannot run a step more than n times faster; above 100% the one-device row was slowed (most likely
    by other programs on the machine while it ran)."""
    if row.device != "cpu" or row.devices < 2 or not row.efficiency > 1.0:
        return ""
    return (
        f"efficiency {row.efficiency:.0%} cannot be a real speed-up: {row.devices} CPU processes share the "
        f"cores that one device had to itself, so the one-device row (the baseline) was slowed, most likely by "
        f"other load; run again on an idle machine, or with --repeats 3"
    )


@dataclass
class BenchResult:
    options: BenchOptions
    rows: List[Row]
    workloads: dict  # (device, batch) -> costmodel.Workload
    links: dict  # device kind -> (Link, how it was obtained)
    projections: list  # (device, batch, devices, {strategy: Prediction}, chosen name)
    message_costs: dict = field(default_factory=dict)  # device kind -> {strategy: seconds per message}
    flops_per_sample: float = math.nan  # one sample's training pass, as FlopCounterMode counts
    peaks: dict = field(default_factory=dict)  # device kind -> one device's float32 matmul FLOP/s


def run_bench(options: BenchOptions, *, progress=print) -> BenchResult:
    if max(options.devices) > 1:
        check_main_guard(max(options.devices))  # once, not as the reason on every multi-device row
    config = TrainConfig(
        model=options.model,
        dataset=options.dataset,
        data_dir=options.data_dir,
        seed=options.seed,
        **options.model_options,
    )
    dataset = as_dataset(options.dataset, config)
    shapes = build_model_on_meta(
        options.model, dataset.input_shape, dataset.num_classes, options.model_options
    )
    usable = [kind for kind in options.device_kinds if kind == "cpu" or torch.cuda.is_available()]
    on = [choose_device(kind, 0) for kind in usable]
    check_bench(shapes, devices=max(options.devices), on=on)  # before it is built
    torch.manual_seed(options.seed)
    model = build_model(options.model, dataset.input_shape, dataset.num_classes, options.model_options)
    rounds = [combinations(options, tensor=has_tensor_plan(model)) for _ in range(options.repeats)]
    flops = flops_per_sample(shapes, dataset, objective_for(dataset))
    peaks = {
        kind: matmul_peak(choose_device(kind, 0))
        for kind in options.device_kinds
        if kind == "cpu" or torch.cuda.is_available()
    }
    for number, rows in enumerate(rounds, 1):  # interleaved: a burst of outside load hits all alike
        for index, row in enumerate(rows, 1):
            if number > 1 and rounds[0][index - 1].skipped:
                row.skipped = rounds[0][index - 1].skipped
                continue
            run_row(row, options, dataset, model)
            fill_peak_fraction(row, flops, peaks)
            what = f"{row.label} on {row.devices} {row.device}, batch {row.batch_size}"
            tokens = (
                f", {row.tokens_per_second:,.0f} tokens/s" if math.isfinite(row.tokens_per_second) else ""
            )
            tokens += f", {row.peak_fraction:.1%} of peak" if math.isfinite(row.peak_fraction) else ""
            outcome = (
                f"skipped: {row.skipped}"
                if row.skipped
                else f"{row.samples_per_second:,.0f} samples/s{tokens}, {row.step_seconds * 1e3:.1f} ms/step"
            )
            where = f" (round {number}/{options.repeats})" if options.repeats > 1 else ""
            progress(f"bench {index}/{len(rows)}{where}: {what}: {outcome}")
    rows = [median_row(list(runs)) for runs in zip(*rounds)]
    workloads, links = {}, {}
    counts = sorted(set(options.devices) | set(options.predict))
    for kind in options.device_kinds:
        if kind == "cuda" and not torch.cuda.is_available():
            continue
        device = choose_device(kind, 0)
        links[kind] = link_of(rows, kind) or measure_link(device)
        for batch in options.batch_sizes:
            # as many passes as the rows' measured steps, at least 5: with 5, one slow pass of the replicas timed
            # side by side put the 2-process slice at 156 ms against 98 ms for 4 processes and 88 ms in the rows
            workloads[(kind, batch)] = measure_workload(
                model,
                dataset,
                objective_for(dataset),
                batch_size=batch,
                device=device,
                devices=counts,
                repeats=max(5, options.steps),
                channels_last=convolutional(model),
                plain=bool(options.predict) or bool(set(options.strategies) & set(contiguous_strategies())),
                tensor_devices=options.devices if "tensor" in options.strategies else (),
            )
    fitted_links = {kind: link for kind, (link, _) in links.items()}
    costs = fit_message_costs(rows, workloads, fitted_links)
    predict_rows(rows, workloads, fitted_links, costs)
    fill_speedups(rows)
    projections = project(options, workloads, fitted_links, costs)
    return BenchResult(options, rows, workloads, links, projections, costs, flops, peaks)
