"""What each subcommand does with its parsed arguments; output for people."""

from __future__ import annotations

import copy
import math
from functools import partial
from pathlib import Path

import torch

from .api import evaluate, predict, spread_indices, train_run
from .config import (
    REPLANNING,
    RESUMABLE,
    RESUMABLE_FLAGS,
    SETTINGS,
    STRATEGY_OPTIONS,
    TrainConfig,
    options_of_other_strategies,
    unset_value,
)
from .config.declare import flag_name
from .config.flags import config_from_args, flag_list, parse_list
from .config.model_defaults import MODEL_SETTINGS, defaults_words
from .data import ArrayDataset
from .data.order import global_batch_order
from .errors import UserError
from .models import build_model_on_meta, text_vocabulary
from .optim.schedules import length_free
from .optim.steps import planned_steps
from .parallel.presets import kept_on_new_devices, settings_in
from .run_dir import read_config, refuse_if_training, resolve_run_dir, write_config
from .runtime.checkpoint import read_progress
from .runtime.launch import check_devices, run_job
from .runtime.plan_report import plan_command
from .runtime.sampling import generate_text
from .runtime.verify_limits import DEFAULT_TOLERANCE
from .runtime.worker import Job, choose_device, resolved_device_type
from .sources import as_dataset, make_objective
from .strategy_registry import make_plan, resolve_strategy_name

# What a resume may change about how the run trains, recorded in its config.json (the run folder and
# reliability settings belong to this invocation only; --plan is spent on choosing the recorded strategy).
RECORDED_ON_RESUME = (
    "epochs",
    *(name for name in RESUMABLE if SETTINGS[name].group != "reliability" and name != "plan"),
)


def _resumed_strategy(old: str, args, settings: dict) -> str:
    """A resumed run keeps its strategy; new --devices pick one again, unless its preset stays
    (`kept_on_new_devices`) with the layout settings it had and those this command gives."""
    if "strategy" in args.given:
        return args.strategy
    if "devices" in args.given:
        given = {name: value for name, value in settings_in(args).items() if name in args.given}
        keeps = kept_on_new_devices(old, {**settings_in(settings), **given})
        return old if keeps and args.devices > 1 else "auto"
    return old


def _devices_phrase(config: TrainConfig) -> str:
    if resolved_device_type(config.device) == "cuda":
        return f"{config.devices} GPU{'s' if config.devices > 1 else ''}"
    return f"{config.devices} CPU process{'es' if config.devices > 1 else ''}"


def same_setting(given, saved) -> bool:
    """Whether a flag's value is the one a run's config.json records: equal, as a list or tuple alike, or a
    path to the same place."""
    if isinstance(given, (list, tuple)) and isinstance(saved, (list, tuple)):
        return tuple(given) == tuple(saved)
    if isinstance(given, str) and isinstance(saved, str) and given != saved:
        return Path(given).exists() and Path(given).resolve() == Path(saved).resolve()
    return given == saved


def resume_settings(args):
    """The config a `--resume` continues with, and what to say first; or None, with the message, when the
    run has nothing left to do."""
    run_dir = str(resolve_run_dir(args.resume))
    refuse_if_training(run_dir)  # before its config.json is rewritten for this resume
    settings = read_config(run_dir)
    # the run's own command may be given again: a flag is refused only where its value differs from the run's
    fixed = sorted(
        name
        for name in args.given - set(RESUMABLE) - {"epochs"}
        if not same_setting(getattr(args, name), settings.get(name, unset_value(name)))
    )
    if fixed:
        given = ", ".join(f"{flag_name(name)} {getattr(args, name)}" for name in fixed)
        had = ", ".join(f"{flag_name(name)} {settings.get(name, unset_value(name))}" for name in fixed)
        raise UserError(
            f"--resume continues a run with its own settings: it was trained with {had}, and this command gives "
            f"{given}; drop {flag_list(fixed)}, or start a new run (only "
            f"{flag_list(RESUMABLE_FLAGS)} may change, and --epochs on a schedule that does not depend on it)"
        )
    if settings.get("custom_model") or settings.get("custom_data"):
        raise UserError(
            f"{run_dir} was trained from Python on a custom model or in-memory data; resume it "
            f"there: polytrain.fit(model, data, resume={run_dir!r}, ...)"
        )
    before = dict(settings)
    settings["device"] = settings.get("device_type") or settings.get("device", "auto")  # the kind it ran on
    settings["strategy"] = _resumed_strategy(settings.get("strategy", "auto"), args, settings)
    settings.update(options_of_other_strategies(settings["strategy"]))
    if set(REPLANNING) & args.given:
        # the split and micro-batches were chosen for the old layout: plan them anew unless given
        settings.update({name: unset_value(name) for name in STRATEGY_OPTIONS["pipeline"]})
    settings.update(max_steps=0, out=run_dir)
    settings.update({name: getattr(args, name) for name in args.given})
    try:
        config = TrainConfig.from_dict(settings)
    except TypeError:
        raise UserError(f"{run_dir}/config.json does not hold polytrain settings; restore it") from None
    progress = read_progress(run_dir)
    extendable = length_free(config.schedule)
    if config.epochs != before.get("epochs") and not extendable:
        raise UserError(
            f"--epochs: this run's {config.schedule} learning-rate schedule is laid out over its "
            f"{before.get('epochs')} epochs, so a new length would change steps already taken; start "
            f"a new run with --epochs {config.epochs} (runs on --schedule constant, or a "
            f"torch.optim.lr_scheduler class, can be extended)"
        )
    if progress is not None and progress.steps_done >= planned_steps(config.epochs, progress.steps_per_epoch):
        last = final_figures(progress.history[-1]) if progress.history else "no validation recorded"
        return None, (
            f"{run_dir} already finished its {config.epochs:g} epochs ({last}); "
            f"nothing to resume. To train longer, start a new run"
            + (f", or pass --epochs N above {config.epochs:g}" if extendable else "")
        )
    if progress is not None and config.max_steps and config.max_steps <= progress.steps_done:
        raise UserError(
            f"--max-steps {config.max_steps}: this run has already done {progress.steps_done} steps; "
            f"give more than {progress.steps_done}, or leave --max-steps out to finish the run"
        )
    was = dict(before, device=settings["device"])
    changed = [
        f"{flag_name(name)} {getattr(config, name)} (was {was.get(name)})"
        for name in RECORDED_ON_RESUME
        if name in args.given and getattr(config, name) != was.get(name)
    ]
    at = progress.where() if progress is not None else "from the start (it has no checkpoint yet)"
    kept = f"; changed: {', '.join(changed)}" if changed else " as the run had"
    line = f"resuming {run_dir} {at} on {_devices_phrase(config)}{kept}"
    record = dict(before, **{name: getattr(config, name) for name in RECORDED_ON_RESUME})
    record.update(
        strategy=resolve_strategy_name(config.strategy, config.devices),
        device_type=resolved_device_type(config.device),
    )
    return (config, run_dir, record), line


def final_figures(record: dict) -> str:
    """How a run's last validation reads: its accuracy, or a language model's loss and perplexity."""
    if "val_acc" in record:
        return f"validation accuracy {record['val_acc']:.4f}"
    words = f"validation loss {record['val_loss']:.4f}"
    return words + (f" (perplexity {record['perplexity']:.2f})" if "perplexity" in record else "")


def train_command(args) -> int:
    if args.dry_run is not None:
        if args.resume:
            raise UserError("--dry-run checks a new run before it starts; drop --resume, or drop --dry-run")
        from .runtime.dry_run import dry_run

        return dry_run(config_from_args(args), args.dry_run)
    if args.resume:
        if args.config:
            raise UserError(
                "--resume continues a run with its own settings, so it reads no --config file; give "
                "what may change (--devices, --strategy, ...) as flags"
            )
        resumed, line = resume_settings(args)
        print(line)
        if resumed is None:
            return 0
        config, run_dir, record = resumed
        write_config(Path(run_dir), {k: v for k, v in record.items() if k != "versions"})
        history, _, run_dir = train_run(config, resume_dir=run_dir, return_weights=False)
    else:
        config = config_from_args(args)
        if args.model_defaults:
            print(
                defaults_words(config.model, args.model_defaults, pretrained=config.init_from is not None),
                flush=True,
            )
        history, _, run_dir = train_run(config, return_weights=False)
    if history is not None and run_dir is not None:
        if history.stopped:
            pass  # said already: early stopping, or a callback
        elif config.max_steps and len(history.epochs) < config.epochs:
            partial = history.validations[-1] if history.validations else {}
            loss = f" (train loss {partial['train_loss']:.4f})" if partial.get("partial") else ""
            print(
                f"stopped after {config.max_steps} steps{loss}; continue with: polytrain train --resume {run_dir}"
            )
        elif history.epochs:
            best, said = history.best, ""
            if best:
                at = f"epoch {best['epoch']}" + (f", step {best['step']}" if best.get("step") else "")
                said = f"; best {best['metric']} {best['value']:.4g} at {at} (best.pt)"
            print(f"done: {final_figures(history.last)}{said}; run folder {run_dir}")
        skipped = read_config(run_dir).get("skipped_files", 0)
        if skipped:
            print(
                f"skipped {skipped} unreadable image file{'s' * (skipped != 1)} (--skip-bad); they are listed "
                f"in {Path(run_dir) / 'skipped.txt'}"
            )
    return 0


def evaluate_command(args) -> int:
    result = evaluate(resolve_run_dir(args.run_dir), device=args.device, weights=args.weights)
    figures = (
        f"accuracy {result['acc']:.4f}" if "acc" in result else f"perplexity {math.exp(result['loss']):.2f}"
    )
    print(
        f"validation loss {result['loss']:.4f}  {figures}  ({result['count']} samples"
        + (", best.pt)" if args.weights == "best" else ")")
    )
    return 0


def predict_command(args) -> int:
    if args.show < 0:
        raise UserError(f"--show must be 0 or more, got {args.show}")
    args.run_dir = resolve_run_dir(args.run_dir)
    everything = predict(args.run_dir, device=args.device, weights=args.weights)
    classes = everything.pop("classes") or read_config(args.run_dir).get("classes")

    def name(label: int):
        return classes[label] if classes else label

    wrong = int((everything["predicted"] != everything["true"]).sum())
    print(f"{len(everything['true'])} validation samples, {wrong} wrong")
    index = spread_indices(len(everything["true"]), args.show or 10)
    shown = {key: None if value is None else value[index] for key, value in everything.items()}
    for i, sample in enumerate(shown["index"].tolist()):
        predicted, true = int(shown["predicted"][i]), int(shown["true"][i])
        print(
            f"sample {sample}: predicted {name(predicted)}, true {name(true)}"
            + ("  <- wrong" if predicted != true else "")
        )
    if args.show and shown["images"] is None:
        print("(a text classifier's samples: no picture drawn)")
    elif args.show:
        from .report import prediction_grid

        path = Path(args.run_dir) / "predictions.png"
        prediction_grid(shown["images"], shown["predicted"], shown["true"], path, classes=classes)
        print(f"wrote {path}")
    return 0


def verify_command(args) -> int:
    from .runtime.verify import (
        compares_in_float64,
        in_float64,
        judge,
        reference_passes,
        step_differences,
    )

    config = config_from_args(args)
    if args.steps <= 0:
        raise UserError(f"--steps must be positive, got {args.steps}")
    if args.tolerance is not None and args.tolerance <= 0:
        raise UserError(f"--tolerance must be positive, got {args.tolerance:g}")
    auto = config.strategy == "auto" and config.devices > 1
    strategy = resolve_strategy_name(config.strategy if config.strategy != "auto" else "data", config.devices)
    check_devices(config.devices, config.device)
    float64 = compares_in_float64(
        args.compare_in, precision=config.precision, device=choose_device(config.device, 0)
    )
    if float64 and config.precision != "fp32":
        raise UserError(
            f"--compare-in float64 trains both sides in float64, which --precision {config.precision} "
            f"does not; use --compare-in as-trained (the default for {config.precision})"
        )
    full = as_dataset(config.dataset, config)
    # the samples of the first --steps batches, and as many to validate: verify compares the steps, and the
    # whole validation split (read at the epoch's end) would cost more than they do
    if hasattr(full, "head"):  # text and rows of tokens
        data = full.head(args.steps * config.batch_size)
    else:
        size = min(len(full.train_y), args.steps * config.batch_size)
        subset = global_batch_order(len(full.train_y), epoch=-1, seed=config.seed)[
            :size
        ]  # files may be sorted
        data = ArrayDataset(
            full.name,
            full.train_x[subset],
            full.train_y[subset],
            full.val_x[: args.steps * config.batch_size],
            full.val_y[: args.steps * config.batch_size],
            num_classes=full.num_classes,
            augment=full.augment,
        )
    config = TrainConfig.from_dict(dict(config.to_dict(), epochs=1, augment=False))
    torch.manual_seed(config.seed)
    # built without storage, as train builds it: both sides materialise their parts of the same initial values
    model = build_model_on_meta(
        config.model, data.input_shape, data.num_classes, config, vocabulary=text_vocabulary(data)
    )
    if config.freeze:  # both sides train the same parameters, as train would
        from .optim.freeze import freeze

        print(f"  {freeze(model, config.freeze)}")
    if float64:
        model, data = in_float64(model, data)
    objective = make_objective(config, kind=getattr(data, "kind", "classification"))
    split = f" ({config.layout.sequence_words[2:]})" if config.layout.sequence_words else ""
    if len(config.layout.degrees()) > 1:  # a mesh: its degrees in words
        split += f" ({config.layout.describe()})"
    print(
        f"verify: {config.model} on {data.name}, global batch {config.batch_size}, "
        f"1 device vs {config.devices} device(s) with strategy {strategy!r}{split}"
        + (
            " (--strategy auto, the default, is verified as data: give --strategy to verify another)"
            if auto
            else ""
        )
        + ", "
        + ("both in float64" if float64 else f"both as trained ({config.precision})")
    )
    channels_last = (
        config.channels_last
        if config.channels_last is not None
        else any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    )
    common = dict(verbose=False, record_steps=True, channels_last=channels_last, objective=objective)
    plan = make_plan(strategy, config, model, data, device=choose_device(config.device, 0))
    if plan is not None:
        print(f"  plan: {plan.describe(config.layout)}")
    passes = reference_passes(model, config, strategy, plan, float64=float64)
    if passes > 1:
        print(
            f"  reference: 1 device in {passes} passes per step (BatchNorm normalises over each micro-batch)"
        )

    def one_device(accumulate: int):
        return run_job(
            Job(
                config.with_strategy(
                    "single", devices=1, accumulate=accumulate, activation_checkpointing="none"
                ),
                "single",
                data,
                copy.deepcopy(model),
                **common,
            )
        )

    # accumulation and activation checkpointing never change the trajectory: the reference takes each step in
    # one pass and keeps every activation
    one = one_device(passes)
    many = run_job(Job(config, strategy, data, copy.deepcopy(model), plan=plan, **common))
    differences = step_differences(one.steps, many.steps)
    floor = None
    if not float64:  # the noise floor: the same steps on one device, each batch in two passes
        floor = step_differences(one.steps, one_device(2).steps)
    print(
        f"{'step':>5} {'loss (1 device)':>16} {'loss (' + str(config.devices) + ' devices)':>18} "
        f"{'param diff':>11}" + (f" {'noise floor':>12}" if floor else "")
    )
    for step, ((loss_a, _), (loss_b, _)) in enumerate(zip(one.steps, many.steps), 1):
        print(
            f"{step:>5} {loss_a:>16.6f} {loss_b:>18.6f} {differences[step - 1]:>11.3e}"
            + (f" {floor[step - 1]:>12.3e}" if floor else "")
        )
    verdict = judge(
        differences,
        steps_match=len(one.steps) == len(many.steps),
        tolerance=args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE,
        floor_differences=floor,
    )
    print(verdict.line())
    return 0 if verdict.passed else 1


def bench_command(args) -> int:
    import time

    from .runtime.bench import BenchOptions, run_bench
    from .runtime.bench_report import draw, report, write_json

    kinds = (
        parse_list(args.device, "--device")
        if args.device
        else (("cuda",) if torch.cuda.is_available() else ("cpu",))
    )
    options = BenchOptions(
        model=args.model,
        dataset=args.dataset,
        data_dir=args.data_dir,
        devices=parse_list(args.devices, "--devices", counts=True),
        strategies=parse_list(args.strategies, "--strategies"),
        batch_sizes=parse_list(args.batch_sizes, "--batch-sizes", counts=True),
        device_kinds=kinds,
        warmup=args.warmup,
        steps=args.steps,
        predict=parse_list(args.predict, "--predict", counts=True) if args.predict else (),
        seed=args.seed,
        repeats=args.repeats,
        **{key: getattr(args, key, None) for key in MODEL_SETTINGS},
    )
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}").expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a folder for bench.json and bench.png")
    result = run_bench(options, progress=lambda line: print(line, flush=True))
    print("\n".join(report(result)))
    out.mkdir(parents=True, exist_ok=True)
    write_json(result, out / "bench.json")
    draw(result, out / "bench.png")
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


def generate_command(args) -> int:
    print(
        generate_text(
            resolve_run_dir(args.run_dir),
            prompt=args.prompt,
            tokens=args.tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            device=args.device,
            weights=args.weights,
        )
    )
    return 0


def export_command(args) -> int:
    from .runtime.export import export_run
    from .runtime.export_peft import export_peft

    how = dict(weights=args.weights, out=args.out, max_shard_size=args.max_shard_size, merge=args.merge)
    export = export_peft if args.format == "peft" else partial(export_run, format=args.format)
    path, count, size = export(resolve_run_dir(args.run_dir), **how)
    tokenizer = "its tokenizer" if (Path(path) / "tokenizer.json").is_file() else "no tokenizer"
    merged = ", the adapters merged" if args.merge else ""
    what = {
        "hf": f"a Hugging Face checkpoint: config.json and weights{merged}, {tokenizer}",
        "peft": PEFT_FILES,
    }
    print(f"wrote {path}: {count} tensors, {size / 2**20:,.2f} MiB ({what.get(args.format, args.format)})")
    return 0


PEFT_FILES = "LoRA adapters for peft: adapter_config.json and adapter_model.safetensors"


def tokenize_command(args) -> int:
    from .data.corpus import next_command, tokenize_corpus

    manifest = tokenize_corpus(
        args.paths,
        args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        glob=args.glob,
        shard_tokens=args.shard_tokens,
        text_key=args.text_key,
        end_of_text=args.end_of_text,
    )
    train, val, tokenizer = manifest["train"], manifest["val"], manifest["tokenizer"]
    shards = len(train["shards"]) + len(val["shards"])
    print(
        f"wrote {args.out}: {train['tokens']:,} training and {val['tokens']:,} validation tokens "
        f"({manifest['dtype']}) in {shards} shard{'s' if shards != 1 else ''}, from "
        f"{manifest['corpus']['documents']:,} documents; a tokenizer of {tokenizer['vocab_size']:,} tokens "
        f"({tokenizer['source']}). Train with: {next_command(args.out, args.tokenizer)}"
    )
    if not val["tokens"] and args.val_fraction != 0:
        print(
            f"note: the corpus is too small to hold out any text for validation "
            f"({manifest['corpus']['val_fraction']} of it); give more"
        )
    return 0


COMMANDS = {
    "train": train_command,
    "evaluate": evaluate_command,
    "predict": predict_command,
    "verify": verify_command,
    "bench": bench_command,
    "generate": generate_command,
    "export": export_command,
    "tokenize": tokenize_command,
    "plan": plan_command,
}
