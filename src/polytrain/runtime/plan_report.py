"""`polytrain plan`: the command, its table, its JSON and its picture (the planning is scaling/cluster_plan.py's).

polytrain plan --model llama --size 8b --devices 64 --gpu h100 --batch-size 256 --context 8192
polytrain plan --model llama --size 70b --devices 512 --layout dp_shard=64,tp=8 --activation-checkpointing full
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List

from ..errors import UserError
from ..parallel.layout import parse_layout
from ..parallel.presets import settings_in, settings_of
from ..scaling.cluster_plan import (
    GIB,
    LayoutPlan,
    PlanRequest,
    idle_expert_parameters,
    make_plan_table,
    reference_model,
    smallest_fit,
)
from ..scaling.gpus import gpu_named


def _check_request(devices, batch_size, context, gpus_per_node, checkpointing) -> None:
    """One line for a number or a mode a plan cannot take, before anything is built."""
    from ..config.declare import CHECKS

    count, must = CHECKS["count"]
    given = (
        ("devices", devices),
        ("batch_size", batch_size),
        ("gpus_per_node", gpus_per_node),
        ("context", context),
    )
    for name, value in given:
        if value is not None or name != "context":
            if not count(value):
                raise UserError(f"--{name.replace('_', '-')} must be {must}, got {value!r}")
    test, words = CHECKS["checkpointing"]
    if checkpointing != "auto" and not test(checkpointing):
        raise UserError(f"--activation-checkpointing {checkpointing!r}: give auto, or {words}")


GPT_VOCABULARY = 50257  # --model gpt without --vocab-size: GPT-2's tokenizer
# the model's shape beside its --size (and the llama's mixture of experts)
SHAPE = ("layers", "width", "heads", "kv_heads", "ffn_width", "experts", "experts_per_token", "shared_experts",
         "moe_every", "lora")  # fmt: skip


def holds(row: LayoutPlan) -> str:
    """How the ranks that hold the same parameters hold them, in a word."""
    layout = row.layout
    if layout.data_parallel == "shard" and layout.fsdp_ranks == 1:  # FSDP2 over whole copies of DTensors
        return "copies" if layout.replicate > 1 else "-"
    if layout.data_parallel == "shard":
        return "HSDP" if layout.replicate > 1 else "FSDP2"
    return "DDP" if layout.data_parallel == "replicate" else "-"


def request_of(args) -> PlanRequest:
    """The plan `args` ask for; one line for a model, size or GPU it does not know."""
    given = {key: getattr(args, key) for key in SHAPE}
    return make_request(
        args.hf_config or args.model,
        size=args.size,
        shape={key: value for key, value in given.items() if value is not None},
        vocab_size=args.vocab_size,
        context=args.context,
        devices=args.devices,
        gpu=args.gpu,
        batch_size=args.batch_size,
        precision=args.precision,
        activation_checkpointing=args.activation_checkpointing,
        optimizer=args.optimizer,
        gpus_per_node=args.gpus_per_node,
        from_file=bool(args.hf_config),
    )


def make_request(
    model,
    *,
    devices: int,
    batch_size: int,
    size=None,
    shape=None,
    vocab_size=None,
    context=None,
    gpu="h100",
    precision="bf16",
    activation_checkpointing="auto",
    optimizer="adamw",
    gpus_per_node=8,
    from_file=None,
) -> PlanRequest:
    """A plan's request: `model` a built-in name (llama, gpt: `size` and the `shape` keywords over its
    defaults), a Hugging Face config.json or its folder, or a function that builds the model (called on the meta
    device; its forward takes (batch, context) token ids and gives logits)."""
    import torch.nn as nn

    from ..config.model_defaults import preset
    from ..models import build_model_on_meta

    _check_request(devices, batch_size, context, gpus_per_node, activation_checkpointing)
    if isinstance(model, nn.Module):
        raise UserError(
            f"polytrain.plan() builds the model on the meta device itself: give the class ({type(model).__name__}) "
            f"or a function that builds it, not a built model"
        )
    if callable(model):
        if not context:
            raise UserError("polytrain.plan(a function, ...) needs context=T, the tokens per sequence")

        def build_given():
            import torch

            with torch.device("meta"):
                built = model()
            if not isinstance(built, nn.Module):
                raise UserError(
                    f"polytrain.plan(): the function given as the model returned {type(built).__name__}, not an "
                    f"nn.Module"
                )
            return built

        name = getattr(model, "__name__", "your model")
        return PlanRequest(
            build_given, name, devices, gpu_named(gpu), batch_size, context, precision=precision,
            checkpointing=activation_checkpointing, optimizer=optimizer, gpus_per_node=gpus_per_node,
        )  # fmt: skip
    if from_file is None:
        from_file = model not in ("llama", "gpt") and Path(str(model)).expanduser().exists()
    model_name = str(model)
    if from_file:
        options = dict(hugging_face_shape(model))
        model_name = options.pop("model")
    elif model not in ("llama", "gpt"):
        raise UserError(
            f"polytrain plan sizes --model llama or gpt (transformers), a Hugging Face config.json, or from Python a "
            f"function that builds the model; not {model!r}"
        )
    else:
        if size is not None and model != "llama":
            raise UserError(
                f"--size names a shape of --model llama; --model {model} takes --layers, --width, ..."
            )
        options = preset(model, size) if model == "llama" else {}
    options.update(shape or {})  # (a mixture the model cannot build is refused by the model's own checks)
    vocabulary = vocab_size or options.pop("vocab_size", None) or GPT_VOCABULARY
    options.pop("vocab_size", None)
    positions = options.get("positions")
    options["context"] = context = context or options.get("context") or min(positions or 2048, 8192)

    def build():
        return build_model_on_meta(model_name, (context,), vocabulary, options)

    name = f"{model_name} {size}" if size else str(model) if from_file else model_name
    return PlanRequest(
        build,
        name,
        devices,
        gpu_named(gpu),
        batch_size,
        context,
        precision=precision,
        checkpointing=activation_checkpointing,
        optimizer=optimizer,
        gpus_per_node=gpus_per_node,
    )


def plan(
    model="llama",
    *,
    devices: int,
    batch_size: int,
    size=None,
    context=None,
    gpu="h100",
    layout=None,
    vocab_size=None,
    precision="bf16",
    activation_checkpointing="auto",
    optimizer="adamw",
    gpus_per_node=8,
    workers=None,
    **shape,
) -> list:
    """`polytrain plan` from Python: every layout of `devices` GPUs (or the one `layout` names: a Layout, or
    its words, 'dp_shard=8,tp=8') built at full size on the fake process group, fitting layouts first, fastest
    first; one dict per layout, the objects `--json` writes (`layout`, `memory_gib`, `memory_split_gib`,
    `tokens_per_second_per_device`, `mfu`, `fits`, `limit`, ...).

    `model`: "llama" (`size`: tiny, 8b, 70b, 405b) or "gpt", with `layers=`, `width=`, `heads=`, `kv_heads=`,
    `ffn_width=` over the size's (and `experts=`, `experts_per_token=`, `shared_experts=`, `moe_every=`; `lora=`: a
    LoRA fine-tune of rank R); a Hugging Face config.json or its folder; or a function that builds the model,
    called on the meta device (its forward takes (batch, context) token ids and gives logits; give `context`).
    `workers`: the processes that build the layouts (default: one per CPU on Linux; 1: this process alone)."""
    from ..parallel.layout import Layout

    unknown = set(shape) - set(SHAPE)
    if unknown:
        raise UserError(
            f"polytrain.plan() got {', '.join(sorted(unknown))}; the model's shape is "
            f"{', '.join(f'{key}=' for key in SHAPE)}"
        )
    request = make_request(
        model, devices=devices, batch_size=batch_size, size=size, shape=shape, vocab_size=vocab_size,
        context=context, gpu=gpu, precision=precision, activation_checkpointing=activation_checkpointing,
        optimizer=optimizer, gpus_per_node=gpus_per_node,
    )  # fmt: skip
    if isinstance(
        layout, dict
    ):  # a row's "layout" as this returns it: its degrees by name, read as its words
        layout = Layout(**{name: size for name, size in layout.items() if name != "single"}).words()
    if layout is not None and not isinstance(layout, Layout):
        layout = parse_layout(str(layout), devices)
    return [row.as_json(request.gpu) for row in make_plan_table(request, layout, workers=workers)]


def hugging_face_shape(path) -> dict:
    """polytrain's model and sizes for a Hugging Face config.json (a file, or the folder that holds it: Llama,
    Qwen2 and GPT-2 shapes, as --init-from reads them, and Mixtral's and Qwen2-MoE's; no weights needed)."""
    from ..config.pretrained import ARCHITECTURES, MOE_ARCHITECTURES, architecture_settings, read_json
    from ..errors import ConfigError

    where = Path(path).expanduser()
    where = where / "config.json" if where.is_dir() else where
    if not where.is_file():
        raise UserError(f"--hf-config: {where} is not a file; give a Hugging Face config.json or its folder")
    config = read_json(where, "config")
    builds = [*ARCHITECTURES, *MOE_ARCHITECTURES]
    known = [name for name in config.get("architectures") or [] if name in builds]
    if not known:
        raise UserError(
            f"--hf-config: {where} is none of the architectures polytrain builds ({', '.join(builds)})"
        )
    try:
        return architecture_settings(config, str(where))
    except ConfigError as error:
        raise UserError(str(error).replace("--init-from:", "--hf-config:")) from None


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:6.1f}"


def checkpointing_words(mode: str) -> str:
    if mode == "auto":
        return "on each layout the least activation checkpointing that fits (ckpt)"
    return f"--activation-checkpointing {mode}"


def amount_words(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:,.1f} MiB"


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:,.2f}B" if parameters >= 1e8 else f"{parameters / 1e6:,.2f}M"


def table(request: PlanRequest, rows: List[LayoutPlan], *, top: int, advise: bool = True) -> List[str]:
    """The plan's lines: a heading, the layouts that fit fastest first, then those that do not fit with how much
    they exceed, then those the code refused with its line."""
    model = reference_model(request)
    parameters = sum(p.numel() for p in model.parameters())
    idle = idle_expert_parameters(model)
    active = f", {_count(int(parameters - idle))} active per token" if idle else ""
    gpu = request.gpu
    lines = [
        f"plan: {request.name} ({_count(parameters)} parameters{active}) on {request.devices} {gpu.name} "
        f"({gpu.memory_gib:.0f} GiB, {request.gpus_per_node} per node); a step of {request.batch_size} sequences "
        f"of {request.context} tokens, {request.precision}, {checkpointing_words(request.checkpointing)}, "
        f"{request.optimizer}",
        f"  {'layout':40} {'holds':6} {'ckpt':9} {'param':>6} {'grad':>6} {'optim':>6} {'activ':>6} {'buffer':>6} "
        f"{'GiB':>6}  {'step s':>7} {'comm s':>7} {'bubble':>7} {'tok/s/GPU':>9} {'MFU':>4}  limit",
    ]
    fit = [row for row in rows if row.fits and not row.refused]
    over = [row for row in rows if not row.fits and not row.refused]
    refused = [row for row in rows if row.refused]
    for row in fit[:top] + over[: max(0, top - len(fit))]:
        exceeds = "" if row.fits else f"; {(row.memory / GIB - gpu.memory_gib):,.1f} GiB over"
        lines.append(
            f"  {row.layout.words():40} {holds(row):6} {row.checkpointing:9} {_gib(row.parameters)} {_gib(row.gradients)} "
            f"{_gib(row.optimizer)} {_gib(row.activations)} {_gib(row.buffers)} {_gib(row.memory)}  "
            f"{row.step_seconds:7.2f} {sum(row.communication.values()):7.2f} {row.bubble:7.2f} "
            f"{row.tokens_per_second_per_device:9,.0f} {row.mfu:4.0%}  {row.limit}{exceeds}"
        )
    shown = len(fit[:top] + over[: max(0, top - len(fit))])
    if len(rows) - len(refused) > shown:
        lines.append(
            f"  ... {len(rows) - len(refused) - shown} more (--top N shows more; --json FILE has all)"
        )
    if not fit:
        best = min(over, key=lambda row: row.memory, default=None)
        if best is not None:
            more = smallest_fit(request)
            fix = (
                f"the fewest GPUs that fit are {more.layout.world_size} ({more.layout.words()}, "
                f"{more.memory / GIB:,.1f} GiB each)"
                if more is not None
                else "no layout of up to 64 times as many GPUs fits either"
            )
            what = (
                f"{best.layout.words()} does not fit {request.devices} x {gpu.memory_gib:.0f} GiB: it needs "
                f"{best.memory / GIB:,.1f} GiB per GPU (`polytrain plan` without a layout ranks the other layouts of "
                f"{request.devices} GPUs)"
                if len(rows) == 1
                else f"no layout fits {request.devices} x {gpu.memory_gib:.0f} GiB: the smallest need is "
                f"{best.memory / GIB:,.1f} GiB per GPU ({best.layout.words()})"
            )
            lines.append(
                f"{what}; {fix}; or "
                f"{'' if best.checkpointing == 'full' else '--activation-checkpointing full, or '}a smaller "
                f"--batch-size"
            )
    if fit and advise:
        lines.append(f"train the first with: {train_flags(fit[0].layout)}")
    for row in refused:
        lines.append(f"  refused {row.layout.words()}: {row.refused}")
    lines.append(
        "memory: parameters, gradients and optimizer state as the code shards them on fake ranks; activations "
        "measured on fake tensors; the CUDA context and the allocator's reserve are not counted"
    )
    return lines


def train_flags(layout) -> str:
    """The `polytrain train` flags that give `layout` (`--strategy tensor --tensor-parallel 8 --devices 64`)."""
    settings = settings_of(layout)
    words = [f"--strategy {settings.pop('strategy')}"]
    words += [f"--{name.replace('_', '-')} {value}" for name, value in settings.items()]
    return " ".join(words + [f"--devices {layout.world_size}"])


def draw(request: PlanRequest, rows: List[LayoutPlan], path: Path, *, top: int) -> None:
    """Memory per GPU of each layout shown, split by what holds it, beside the GPU's memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [row for row in rows if not row.refused][:top]
    figure, axes = plt.subplots(figsize=(10, 0.32 * len(shown) + 2))
    parts = ("parameters", "gradients", "optimizer", "activations", "buffers")
    starts = [0.0] * len(shown)
    for part in parts:
        widths = [getattr(row, part) / GIB for row in shown]
        axes.barh(range(len(shown)), widths, left=starts, label=part)
        starts = [s + w for s, w in zip(starts, widths)]
    axes.axvline(request.gpu.memory_gib, color="k", linestyle="--", label=f"{request.gpu.name} memory")
    labels = [f"{row.layout.words()} ({row.tokens_per_second_per_device:,.0f} tok/s)" for row in shown]
    axes.set_yticks(range(len(shown)), labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("GiB per GPU")
    axes.set_title(f"{request.name} on {request.devices} {request.gpu.name}", fontsize=9)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def layout_asked(args):
    """The one layout `--layout` or `--strategy` with its flags names (as `polytrain train` takes them); None:
    every layout."""
    given = settings_in(args)
    if args.layout and (args.strategy or given):
        raise UserError("--layout names the layout whole; drop --strategy and its flags, or drop --layout")
    if given and not args.strategy:
        raise UserError(
            f"--{next(iter(given)).replace('_', '-')} describes a layout with --strategy; add --strategy "
            f"sharded, tensor or pipeline, or --layout"
        )
    if args.strategy:  # through the run's own settings: train's checks and lines
        from ..config.train import TrainConfig

        return TrainConfig(
            strategy=args.strategy, devices=args.devices, batch_size=args.batch_size, **given
        ).layout
    return parse_layout(args.layout, args.devices) if args.layout else None


def _writable(path, suffix: str = "") -> None:
    """One line, before planning, where a file cannot be written where asked."""
    where = Path(path).expanduser()
    if not where.parent.is_dir():
        raise UserError(f"{path}: the folder {where.parent} does not exist; create it, or write elsewhere")
    if suffix and where.suffix.lower() != suffix:
        raise UserError(f"--png {path}: the picture is a PNG file; give a name ending in {suffix}")


def _building(row, built: int, layouts: int) -> None:
    """The progress line on a terminal while the layouts are built (a second or so each at 64 GPUs)."""
    words = row.layout.words() or "one device"
    print(
        f"\r\033[Kbuilt {built} of {layouts} layouts at full size ({words})",
        end="",
        file=sys.stderr,
        flush=True,
    )


def planned(request, layout=None) -> list:
    """`make_plan_table`, with a progress line on a terminal, cleared before the table is printed."""
    shown = sys.stderr.isatty()
    rows = make_plan_table(request, layout, progress=_building if shown else None)
    if shown:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    return rows


def plan_command(args) -> int:
    request = request_of(args)
    layout = layout_asked(args)
    if args.json:
        _writable(args.json)
    if args.png:
        _writable(args.png, ".png")
    began = time.perf_counter()
    rows = planned(request, layout)
    print("\n".join(table(request, rows, top=args.top)))
    print(
        f"({len(rows)} layout{'s' * (len(rows) > 1)} built at full size in {time.perf_counter() - began:,.0f} s)"
    )
    if args.json:
        path = Path(args.json).expanduser()
        objects = [row.as_json(request.gpu) for row in rows]
        path.write_text(json.dumps(objects, indent=1))
        print(f"wrote {path}")
    if args.png:
        draw(request, rows, Path(args.png).expanduser(), top=args.top)
        print(f"wrote {args.png}")
    return 0
