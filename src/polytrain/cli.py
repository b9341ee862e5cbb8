"""The command line: `polytrain train | evaluate | predict | verify`. The only place that parses arguments."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import __version__
from .config import DEVICES, LR_SCALES, OPTIMIZERS, PRECISIONS, SCHEDULES, TrainConfig
from .data import DATASETS
from .errors import UserError
from .models import MODELS
from .strategies import STRATEGIES

DEFAULTS = TrainConfig()


def _shape(text: str):
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected C,H,W such as 3,32,32, got {text!r}") from None


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    data = parser.add_argument_group("data")
    data.add_argument("--dataset", default=d.dataset, metavar="NAME",
                      help=f"one of {', '.join(DATASETS)} (default: {d.dataset}, 5,000 real digits, no download)")
    data.add_argument("--data-dir", metavar="DIR", help="folder holding the dataset files (IDX or CIFAR binary)")
    data.add_argument("--download", action="store_true",
                      help="fetch missing files into --data-dir or ~/.cache/polytrain (checksum-verified)")
    data.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                      help="random crop (4-pixel shifts), plus mirroring for cifar10, as batched ops on the "
                           "device (default: on for cifar10, off for digits)")
    data.add_argument("--synthetic-size", type=int, default=d.synthetic_size, metavar="N",
                      help=f"training samples of --dataset synthetic (default: {d.synthetic_size})")
    data.add_argument("--synthetic-shape", type=_shape, default=d.synthetic_shape, metavar="C,H,W",
                      help="image shape of --dataset synthetic (default: 1,28,28)")
    model = parser.add_argument_group("model and optimisation")
    model.add_argument("--model", default=d.model, metavar="NAME",
                       help=f"one of {', '.join(MODELS)} (default: {d.model})")
    model.add_argument("--epochs", type=int, default=d.epochs, metavar="N", help=f"default: {d.epochs}")
    model.add_argument("--batch-size", type=int, default=None, metavar="N",
                       help=f"GLOBAL batch, split across --devices (default: {d.batch_size})")
    model.add_argument("--per-device-batch-size", type=int, default=None, metavar="N",
                       help="alternatively, the batch of each device; the global batch is N x --devices")
    model.add_argument("--optimizer", default=d.optimizer, metavar="{" + ",".join(OPTIMIZERS) + "}",
                       help=f"default: {d.optimizer}")
    model.add_argument("--lr", type=float, default=d.lr, metavar="X", help=f"peak learning rate (default: {d.lr})")
    model.add_argument("--lr-scale", default=d.lr_scale, metavar="{" + ",".join(LR_SCALES) + "}",
                       help="linear: multiply --lr by --devices (the linear scaling rule, for a global batch "
                            "that grows with the devices); default: none")
    model.add_argument("--momentum", type=float, default=d.momentum, metavar="X", help=f"default: {d.momentum}")
    model.add_argument("--weight-decay", type=float, default=d.weight_decay, metavar="X",
                       help=f"default: {d.weight_decay}")
    model.add_argument("--schedule", default=d.schedule, metavar="{" + ",".join(SCHEDULES) + "}",
                       help=f"learning-rate schedule after warm-up (default: {d.schedule})")
    model.add_argument("--warmup-epochs", type=float, default=d.warmup_epochs, metavar="X",
                       help=f"linear warm-up length (default: {d.warmup_epochs})")
    model.add_argument("--label-smoothing", type=float, default=d.label_smoothing, metavar="X",
                       help=f"default: {d.label_smoothing}")
    model.add_argument("--precision", default=d.precision, metavar="{" + ",".join(PRECISIONS) + "}",
                       help="bf16 runs the forward pass under autocast (use on GPUs); default: fp32")
    model.add_argument("--compile", action="store_true", help="torch.compile the model")
    model.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                       help="channels-last memory format (default: on for convolutional models)")
    model.add_argument("--seed", type=int, default=d.seed, metavar="N", help=f"default: {d.seed}")
    devices = parser.add_argument_group("devices")
    devices.add_argument("--device", default=d.device, metavar="{auto,cpu,cuda}",
                         help="auto: CUDA GPUs if present, else CPU processes (default: auto)")
    devices.add_argument("--devices", type=int, default=d.devices, metavar="N",
                         help="GPUs, or CPU processes sharing the cores (default: 1)")
    devices.add_argument("--strategy", default=d.strategy, metavar="{" + ",".join(("auto", *STRATEGIES)) + "}",
                         help="auto: single for one device, data (replicas + all-reduce) for several")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polytrain", description="Train PyTorch models on every device you have, with results proven "
        "equal to one device. Start with: polytrain train", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  polytrain train                          # LeNet on 5,000 real MNIST digits\n"
               "  polytrain train --devices 2              # the same, data-parallel on 2 processes/GPUs\n"
               "  polytrain evaluate runs/LATEST\n  polytrain predict runs/LATEST --show 25\n"
               "  polytrain verify --devices 2             # prove N devices train like one")
    parser.add_argument("--version", action="version", version=f"polytrain {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = commands.add_parser("train", help="train a model and save a run folder",
                                description="Train a model; writes config.json, metrics.jsonl, model.pt, "
                                            "checkpoint.pt and curves.png into the run folder.")
    add_training_flags(train)
    run = train.add_argument_group("run folder")
    run.add_argument("--out", metavar="DIR", help="run folder (default: a new folder under runs/)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its checkpoint")
    run.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                     help="also checkpoint every STEPS steps (always at each epoch end)")
    run.add_argument("--max-steps", type=int, default=0, metavar="N",
                     help="stop after N steps in all, with a checkpoint to --resume from (default: 0, all epochs)")
    run.add_argument("--hang-timeout", type=float, default=DEFAULTS.hang_timeout, metavar="SECONDS",
                     help="with several devices, report the rank that makes no progress for this long, with "
                          f"its stack, and stop (default: {DEFAULTS.hang_timeout:g})")
    run.add_argument("--max-restarts", type=int, default=0, metavar="R",
                     help="restart failed workers up to R times from the last checkpoint (default: 0)")
    evaluate = commands.add_parser("evaluate", help="validation loss and accuracy of a run's model")
    evaluate.add_argument("run_dir", metavar="RUN_DIR")
    evaluate.add_argument("--device", default="auto", choices=DEVICES)
    predict = commands.add_parser("predict", help="predictions on validation images, optionally as a picture")
    predict.add_argument("run_dir", metavar="RUN_DIR")
    predict.add_argument("--show", type=int, default=0, metavar="N",
                         help="draw the first N validation images with predicted and true labels into "
                              "RUN_DIR/predictions.png (mistakes in red)")
    predict.add_argument("--device", default="auto", choices=DEVICES)
    verify = commands.add_parser("verify", help="train a few steps on 1 and on N devices and compare",
                                 description="Runs a short training on one device and with --strategy on "
                                             "--devices devices; prints per-step losses and the largest "
                                             "parameter difference; exits 1 if they diverge.")
    add_training_flags(verify)
    verify.add_argument("--steps", type=int, default=20, metavar="N", help="steps to compare (default: 20)")
    verify.add_argument("--tolerance", type=float, default=1e-5, metavar="X",
                        help="largest allowed parameter difference (default: 1e-5)")
    return parser


def config_from_args(args) -> TrainConfig:
    values = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__ and v is not None}
    if args.per_device_batch_size is not None:
        if args.batch_size is not None:
            raise UserError("give either --batch-size (global) or --per-device-batch-size, not both")
        if args.per_device_batch_size <= 0:
            raise UserError(f"--per-device-batch-size must be positive, got {args.per_device_batch_size}")
        from .hostenv import launcher_env
        launcher = launcher_env()          # under torchrun the device count is its world size
        values["batch_size"] = args.per_device_batch_size * (launcher.world_size if launcher else args.devices)
    return TrainConfig(**values)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from .commands import COMMANDS
    from .hostenv import keep_freed_memory
    from .launch import WorkerFailed

    keep_freed_memory()                    # this process is ours: see hostenv.keep_freed_memory
    try:
        return COMMANDS[args.command](args)
    except UserError as error:
        print(f"polytrain: error: {error}", file=sys.stderr)
        return 2
    except WorkerFailed as error:
        print(f"polytrain: error: {error}", file=sys.stderr)
        return 2 if error.user_error else 1
    except KeyboardInterrupt:
        print("polytrain: interrupted", file=sys.stderr)
        return 130
