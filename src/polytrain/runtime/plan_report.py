"""`polytrain plan`: the command, its table, its JSON and its picture (the planning is scaling/cluster_plan.py's).

polytrain plan --model llama --size 8b --devices 64 --gpu h100 --batch-size 256 --context 8192
polytrain plan --model llama --size 70b --devices 512 --layout dp_shard=64,tp=8 --activation-checkpointing full
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List

from ..errors import UserError
from ..parallel.layout import parse_layout
from ..scaling.cluster_plan import (
    GIB,
    LayoutPlan,
    PlanRequest,
    make_plan_table,
    smallest_fit,
)
from ..scaling.gpus import gpu_named

GPT_VOCABULARY = 50257  # --model gpt without --vocab-size: GPT-2's tokenizer


def holds(row: LayoutPlan) -> str:
    """How the ranks that hold the same parameters hold them, in a word."""
    kind = row.layout.data_parallel
    if kind == "shard":
        return "HSDP" if row.layout.replicate > 1 else "FSDP2"
    return "DDP" if kind == "replicate" else "-"


def request_of(args) -> PlanRequest:
    """The plan `args` ask for; one line for a model, size or GPU it does not know."""
    from ..config.model_defaults import preset
    from ..models import build_model_on_meta

    model_name = args.model
    if args.hf_config:
        options = dict(hugging_face_shape(args.hf_config))
        model_name = options.pop("model")
    elif args.model not in ("llama", "gpt"):
        raise UserError(f"polytrain plan sizes --model llama or gpt (transformers), not {args.model!r}")
    else:
        options = preset(args.model, args.size) if args.model == "llama" else {}
    given = {key: getattr(args, key) for key in ("layers", "width", "heads", "kv_heads", "ffn_width")}
    options.update({key: value for key, value in given.items() if value is not None})
    vocabulary = args.vocab_size or options.pop("vocab_size", None) or GPT_VOCABULARY
    options.pop("vocab_size", None)
    positions = options.get("positions")
    options["context"] = context = args.context or options.get("context") or min(positions or 2048, 8192)

    def build():
        return build_model_on_meta(model_name, (context,), vocabulary, options)

    gpu = gpu_named(args.gpu)
    name = f"{model_name} {args.size}" if args.size else args.hf_config or model_name
    return PlanRequest(
        build,
        name,
        args.devices,
        gpu,
        args.batch_size,
        context,
        precision=args.precision,
        checkpointing=args.activation_checkpointing,
        optimizer=args.optimizer,
        gpus_per_node=args.gpus_per_node,
    )


def hugging_face_shape(path) -> dict:
    """polytrain's model and sizes for a Hugging Face config.json (a file, or the folder that holds it: Llama,
    Qwen2 and GPT-2 shapes, as --init-from reads them; no weights needed)."""
    from ..config.pretrained import ARCHITECTURES, gpt2_settings, llama_settings, read_json
    from ..errors import ConfigError

    where = Path(path).expanduser()
    where = where / "config.json" if where.is_dir() else where
    if not where.is_file():
        raise UserError(f"--hf-config: {where} is not a file; give a Hugging Face config.json or its folder")
    config = read_json(where, "config")
    known = [name for name in config.get("architectures") or [] if name in ARCHITECTURES]
    if not known:
        raise UserError(
            f"--hf-config: {where} is none of the architectures polytrain builds ({', '.join(ARCHITECTURES)})"
        )
    try:
        if ARCHITECTURES[known[0]] == "gpt":
            return gpt2_settings(config, str(where))
        return llama_settings(config, known[0], str(where))
    except ConfigError as error:
        raise UserError(str(error).replace("--init-from:", "--hf-config:")) from None


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:6.1f}"


def table(request: PlanRequest, rows: List[LayoutPlan], *, top: int) -> List[str]:
    """The plan's lines: a heading, the layouts that fit fastest first, then those that do not fit with how much
    they exceed, then those the code refused with its line."""
    model = request.build()
    parameters = sum(p.numel() for p in model.parameters())
    gpu = request.gpu
    lines = [
        f"plan: {request.name} ({parameters / 1e9:,.2f}B parameters) on {request.devices} {gpu.name} "
        f"({gpu.memory_gib:.0f} GiB, {request.gpus_per_node} per node); a step of {request.batch_size} sequences "
        f"of {request.context} tokens, {request.precision}, --activation-checkpointing {request.checkpointing}, "
        f"{request.optimizer}",
        f"  {'layout':40} {'holds':5} {'param':>6} {'grad':>6} {'optim':>6} {'activ':>6} {'buffer':>6} "
        f"{'GiB':>6}  {'step s':>7} {'comm s':>7} {'bubble':>7} {'tok/s/GPU':>9} {'MFU':>4}  limit",
    ]
    fit = [row for row in rows if row.fits and not row.refused]
    over = [row for row in rows if not row.fits and not row.refused]
    refused = [row for row in rows if row.refused]
    for row in fit[:top] + over[: max(0, top - len(fit))]:
        exceeds = "" if row.fits else f"; {(row.memory / GIB - gpu.memory_gib):,.1f} GiB over"
        lines.append(
            f"  {row.layout.words():40} {holds(row):5} {_gib(row.parameters)} {_gib(row.gradients)} "
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
            lines.append(
                f"no layout fits {request.devices} x {gpu.memory_gib:.0f} GiB: the smallest need is "
                f"{best.memory / GIB:,.1f} GiB per GPU ({best.layout.words()}); {fix}; or "
                f"--activation-checkpointing full, or a smaller --batch-size"
            )
    for row in refused:
        lines.append(f"  refused {row.layout.words()}: {row.refused}")
    lines.append(
        "memory: parameters, gradients and optimizer state as the code shards them on fake ranks; activations "
        "measured on fake tensors; the CUDA context and the allocator's reserve are not counted"
    )
    return lines


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


def plan_command(args) -> int:
    request = request_of(args)
    layout = parse_layout(args.layout, args.devices) if args.layout else None
    began = time.perf_counter()
    rows = make_plan_table(request, layout)
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
