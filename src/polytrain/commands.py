"""What each subcommand does with its parsed arguments; output for people."""
from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from .api import as_dataset, evaluate, predict, spread_indices, train_run
from .cli import config_from_args
from .config import TrainConfig
from .data import ArrayDataset
from .data.loader import global_batch_order
from .errors import UserError
from .launch import check_devices, run_job
from .models import build_model
from .run_dir import read_config
from .strategies import resolve_strategy_name
from .worker import Job


# What may change when a run is resumed: where and how it runs, never what it computes.
RESUME_FLAGS = ("devices", "device", "max_restarts", "max_steps", "checkpoint_every", "hang_timeout")


def resume_config(args) -> TrainConfig:
    from .cli import build_parser
    defaults = vars(build_parser().parse_args(["train"]))
    fixed = [name for name, value in vars(args).items()
             if name not in RESUME_FLAGS + ("resume", "command") and value != defaults.get(name)]
    if fixed:
        flags = ", ".join("--" + name.replace("_", "-") for name in fixed)
        raise UserError(f"--resume continues a run with its own settings; drop {flags} (only "
                        f"{', '.join('--' + f.replace('_', '-') for f in RESUME_FLAGS)} may change)")
    settings = read_config(args.resume)
    if settings.get("custom_model") or settings.get("custom_data"):
        raise UserError(f"{args.resume} was trained from Python on a custom model or in-memory data; resume it "
                        f"there: polytrain.fit(model, data, resume={str(args.resume)!r}, ...)")
    settings["strategy"] = "auto"
    settings.update({name: getattr(args, name) for name in RESUME_FLAGS if getattr(args, name) != defaults[name]})
    settings.update(devices=args.devices, max_steps=args.max_steps, max_restarts=args.max_restarts,
                    out=args.resume)
    try:
        return TrainConfig.from_dict(settings)
    except TypeError:
        raise UserError(f"{args.resume}/config.json does not hold polytrain settings; restore it") from None


def train_command(args) -> int:
    if args.resume:
        config = resume_config(args)
        print(f"resuming {args.resume} on {config.devices} device(s)")
        history, _, run_dir = train_run(config, resume_dir=args.resume)
    else:
        config = config_from_args(args)
        history, _, run_dir = train_run(config)
    if history is not None and run_dir is not None:
        if config.max_steps and len(history.epochs) < config.epochs:
            print(f"stopped after {config.max_steps} steps; continue with: polytrain train --resume {run_dir}")
        elif history.epochs:
            print(f"done: validation accuracy {history.last['val_acc']:.4f}; run folder {run_dir}")
    return 0


def evaluate_command(args) -> int:
    result = evaluate(args.run_dir, device=args.device)
    print(f"validation loss {result['loss']:.4f}  accuracy {result['acc']:.4f}  ({result['count']} samples)")
    return 0


def predict_command(args) -> int:
    if args.show < 0:
        raise UserError(f"--show must be 0 or more, got {args.show}")
    everything = predict(args.run_dir, device=args.device)
    wrong = int((everything["predicted"] != everything["true"]).sum())
    print(f"{len(everything['true'])} validation samples, {wrong} wrong")
    index = spread_indices(len(everything["true"]), args.show or 10)
    shown = {key: value[index] for key, value in everything.items()}
    for i, sample in enumerate(shown["index"].tolist()):
        predicted, true = int(shown["predicted"][i]), int(shown["true"][i])
        print(f"sample {sample}: predicted {predicted}, true {true}" + ("  <- wrong" if predicted != true else ""))
    if args.show:
        from .report import prediction_grid
        path = Path(args.run_dir) / "predictions.png"
        prediction_grid(shown["images"], shown["predicted"], shown["true"], path)
        print(f"wrote {path}")
    return 0


def verify_command(args) -> int:
    config = config_from_args(args)
    if args.steps <= 0:
        raise UserError(f"--steps must be positive, got {args.steps}")
    strategy = resolve_strategy_name(config.strategy if config.strategy != "auto" else "data", config.devices)
    check_devices(config.devices, config.device)
    full = as_dataset(config.dataset, config)
    size = min(len(full.train_y), args.steps * config.batch_size)
    subset = global_batch_order(len(full.train_y), epoch=-1, seed=config.seed)[:size]   # files may be sorted
    data = ArrayDataset(full.name, full.train_x[subset], full.train_y[subset], full.val_x, full.val_y,
                        num_classes=full.num_classes, augment=full.augment)
    config = TrainConfig.from_dict(dict(config.to_dict(), epochs=1, augment=False))
    torch.manual_seed(config.seed)
    model = build_model(config.model, data.input_shape, data.num_classes)
    print(f"verify: {config.model} on {data.name}, global batch {config.batch_size}, "
          f"1 device vs {config.devices} device(s) with strategy {strategy!r}")
    channels_last = config.channels_last if config.channels_last is not None else \
        any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    common = dict(verbose=False, record_steps=True, channels_last=channels_last)
    one = run_job(Job(TrainConfig.from_dict(dict(config.to_dict(), devices=1)), "single", data,
                      copy.deepcopy(model), **common))
    many = run_job(Job(config, strategy, data, copy.deepcopy(model), **common))
    worst = 0.0
    print(f"{'step':>5} {'loss (1 device)':>16} {'loss (' + str(config.devices) + ' devices)':>18} "
          f"{'max |param diff|':>17}")
    for step, ((loss_a, params_a), (loss_b, params_b)) in enumerate(zip(one.steps, many.steps), 1):
        diff = float((params_a - params_b).abs().max())
        worst = max(worst, diff)
        print(f"{step:>5} {loss_a:>16.6f} {loss_b:>18.6f} {diff:>17.3e}")
    ok = worst <= args.tolerance and len(one.steps) == len(many.steps)
    print(f"{'PASS' if ok else 'FAIL'}: largest parameter difference {worst:.3e} "
          f"({'within' if ok else 'beyond'} tolerance {args.tolerance:g})")
    return 0 if ok else 1


COMMANDS = {"train": train_command, "evaluate": evaluate_command, "predict": predict_command,
            "verify": verify_command}
