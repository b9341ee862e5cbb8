"""The command line: `polytrain train | evaluate | predict | verify`. The only place that parses arguments."""
from __future__ import annotations

import argparse
import difflib
import os
import sys

from . import __version__
from .config import replicas, DEVICES, LR_SCALES, OPTIMIZERS, PRECISIONS, SCHEDULES, TrainConfig
from .data import DATASETS, datasets_using, unused_dataset_options
from .errors import UserError
from .models import MODELS
from .plan.pipeline import DEFAULT_SCHEDULE as DEFAULT_PIPELINE_SCHEDULE, SCHEDULES as PIPELINE_SCHEDULES
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
    data.add_argument("--dataset", metavar="NAME",
                      help=f"one of {', '.join(DATASETS)} (default: {d.dataset}, 10,000 real MNIST digits shipped with polytrain)")
    data.add_argument("--data-dir", metavar="DIR", help="folder holding the dataset files (IDX or CIFAR binary), or "
                                                        "the image folder of --dataset folder")
    data.add_argument("--image-size", type=int, metavar="S",
                      help="--dataset folder: resize every image to S x S (default: keep, all must share one size)")
    data.add_argument("--val-fraction", type=float, metavar="F",
                      help="--dataset folder with <class>/ folders only: hold out the last F of each class's "
                           "sorted files for validation")
    data.add_argument("--skip-bad", action="store_true", default=None,
                      help="--dataset folder: skip unreadable images and report how many (default: stop, naming "
                           "the file)")
    data.add_argument("--download", action="store_true", default=None,
                      help="fetch missing files into --data-dir or ~/.cache/polytrain (checksum-verified)")
    data.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                      help="random crop (4-pixel shifts), plus mirroring for cifar10, as batched ops on the "
                           "device (default: on for cifar10, off for digits)")
    data.add_argument("--synthetic-size", type=int, metavar="N",
                      help=f"training samples of --dataset synthetic (default: {d.synthetic_size})")
    data.add_argument("--synthetic-shape", type=_shape, metavar="C,H,W",
                      help="image shape of --dataset synthetic (default: 1,28,28)")
    model = parser.add_argument_group("model and optimisation")
    model.add_argument("--model", metavar="NAME",
                       help=f"one of {', '.join(MODELS)} (default: {d.model})")
    model.add_argument("--epochs", type=int, metavar="N", help=f"default: {d.epochs}")
    model.add_argument("--batch-size", type=int, default=None, metavar="N",
                       help=f"GLOBAL batch, split across --devices (default: {d.batch_size})")
    model.add_argument("--per-device-batch-size", type=int, default=None, metavar="N",
                       help="alternatively, the batch of each device; the global batch is N x --devices (with --strategy "
                            "pipeline, N x the number of pipelines: the devices of one pipeline share a batch)")
    model.add_argument("--optimizer", metavar="{" + ",".join(OPTIMIZERS) + "}",
                       help=f"default: {d.optimizer}")
    model.add_argument("--lr", type=float, metavar="X", help=f"peak learning rate (default: {d.lr})")
    model.add_argument("--lr-scale", metavar="{" + ",".join(LR_SCALES) + "}",
                       help="linear: multiply --lr by --devices (the linear scaling rule, for a global batch "
                            "that grows with the devices); default: none")
    model.add_argument("--momentum", type=float, metavar="X", help=f"default: {d.momentum}")
    model.add_argument("--weight-decay", type=float, metavar="X",
                       help=f"default: {d.weight_decay}")
    model.add_argument("--schedule", metavar="{" + ",".join(SCHEDULES) + "}",
                       help=f"learning-rate schedule after warm-up (default: {d.schedule})")
    model.add_argument("--warmup-epochs", type=float, metavar="X",
                       help=f"linear warm-up length (default: {d.warmup_epochs})")
    model.add_argument("--label-smoothing", type=float, metavar="X",
                       help=f"default: {d.label_smoothing}")
    model.add_argument("--precision", metavar="{" + ",".join(PRECISIONS) + "}",
                       help="bf16 runs the forward pass under autocast (use on GPUs); default: fp32")
    model.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    model.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                       help="channels-last memory format (default: on for convolutional models)")
    model.add_argument("--seed", type=int, metavar="N", help=f"default: {d.seed}")
    model.add_argument("--logger", metavar="tensorboard,csv",
                       help="also log to TensorBoard (RUN_DIR/tensorboard; pip install 'polytrain[tensorboard]') "
                            "and/or RUN_DIR/metrics.csv, beside metrics.jsonl")
    devices = parser.add_argument_group("devices")
    devices.add_argument("--device", metavar="{auto,cpu,cuda}",
                         help="auto: CUDA GPUs if present, else CPU processes (default: auto)")
    devices.add_argument("--devices", type=int, metavar="N",
                         help="GPUs, or CPU processes sharing the cores (default: 1)")
    devices.add_argument("--strategy", metavar="{" + ",".join(("auto", *STRATEGIES)) + "}",
                         help="auto: single for one device; for several, the one the cost model predicts fastest "
                              "that fits in memory (a few seconds of measurement, or --plan); data: replicas + "
                              "all-reduce; "
                              "pipeline: the model split into stages over the devices; sharded: each device holds a "
                              "shard of the weights and optimizer state (FSDP2); parameter-server: master weights on "
                              "server ranks, workers push gradients and pull weights")
    devices.add_argument("--plan", metavar="BENCH_JSON",
                         help="with --strategy auto: choose from this polytrain bench result instead of measuring")
    server = parser.add_argument_group("parameter server (with --strategy parameter-server)")
    server.add_argument("--servers", type=int, metavar="K",
                        help="server roles the parameters are split over by size, on ranks 0..K-1 (default: 1)")
    server.add_argument("--server-device", metavar="{cpu,same}",
                        help="where the master weights and optimizer state live: cpu (host memory, default) "
                             "or same (the server rank's device)")
    server.add_argument("--staleness", type=int, metavar="S",
                        help="asynchronous: servers apply each worker's gradient as it arrives; a worker runs at "
                             "most S updates ahead of the slowest (default: 0, synchronous, equal to one device)")
    sharded = parser.add_argument_group("sharded (with --strategy sharded)")
    sharded.add_argument("--cpu-offload", action="store_true", default=None,
                         help="keep parameter, gradient and optimizer shards in host memory; the GPU holds only "
                              "the layer in use (FSDP2's offload policy)")
    pipe = parser.add_argument_group("pipeline (with --strategy pipeline)")
    pipe.add_argument("--microbatches", type=int, metavar="M",
                      help="micro-batches each step's batch is cut into; 1: plain model parallelism "
                           "(default: 4 per stage, or fewer that divide the batch)")
    pipe.add_argument("--pipeline-schedule", metavar="{" + ",".join(PIPELINE_SCHEDULES) + "}",
                      help=f"order of forward and backward passes (default: {DEFAULT_PIPELINE_SCHEDULE})")
    pipe.add_argument("--split", metavar="auto|I1,I2,...",
                      help="auto: balance the stages by each layer's measured time; or the index of the first "
                           "layer of every stage after the first (default: auto)")
    pipe.add_argument("--pipeline-stages", type=int, metavar="S",
                      help="stages per pipeline; --devices / S pipelines then run data-parallel on a 2-D mesh "
                           "(default: --devices, one pipeline)")
    pipe.add_argument("--timeline", action="store_true", default=None,
                      help="record when each rank ran each micro-batch for a few steps; draws pipeline.png "
                           "and prints the measured bubble")


EXAMPLES = """examples:
  polytrain train                          # LeNet on 10,000 real MNIST digits, run folder under runs/
  polytrain train --devices 2              # the same on 2 processes/GPUs, the strategy predicted fastest
  polytrain evaluate runs/LATEST           # runs/LATEST: the newest run folder under runs/
  polytrain predict runs/LATEST --show 25
  polytrain train --resume runs/LATEST     # continue an interrupted run where it stopped
  polytrain verify --devices 2             # prove N devices train like one
  polytrain bench --devices 1,2,4          # what each device spent its time on, and what N would do
  polytrain train --strategy pipeline --devices 2 --microbatches 1   # LeNet split over 2 devices

polytrain train trains classifiers of images: a model that maps (N, C, H, W) images to (N, classes) scores,
on integer labels 0..classes-1 (--dataset folder: your own images in class folders). From Python,
polytrain.fit also takes torch Datasets and any loss (regression, multi-label, segmentation)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polytrain", description="Train PyTorch models on every device you have, with results proven "
        "equal to one device. Start with: polytrain train", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"polytrain {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}

    def command(name, **kwargs):
        parser.commands[name] = commands.add_parser(name, allow_abbrev=False, **kwargs)
        return parser.commands[name]

    train = command("train", help="train a model and save a run folder",
                    description="Train an image classifier (images (N, C, H, W) with integer labels; the model "
                                "gives (N, classes) scores, trained with cross-entropy); writes config.json, "
                                "metrics.jsonl, model.pt, checkpoint.pt and curves.png into the run folder. "
                                "Ctrl-C or SIGTERM stops at a checkpoint; --resume continues from it.")
    add_training_flags(train)
    run = train.add_argument_group("run folder")
    run.add_argument("--out", metavar="DIR", help="run folder (default: a new folder under runs/)")
    run.add_argument("--resume", metavar="RUN_DIR",
                     help="continue a run from its checkpoint, on the devices it had unless --device/--devices "
                          "say otherwise (runs/LATEST: the newest run)")
    run.add_argument("--checkpoint-every", type=int, metavar="STEPS",
                     help="also checkpoint every STEPS steps (always at each epoch end, and on Ctrl-C/SIGTERM)")
    run.add_argument("--max-steps", type=int, metavar="N",
                     help="stop after N steps in all, with a checkpoint to --resume from (default: 0, all epochs)")
    run.add_argument("--hang-timeout", type=float, metavar="SECONDS",
                     help="with several devices, report the rank that makes no progress for this long, with "
                          f"its stack, and stop (default: {DEFAULTS.hang_timeout:g})")
    run.add_argument("--max-restarts", type=int, metavar="R",
                     help="restart failed workers up to R times from the last checkpoint (default: 0)")
    evaluate = command("evaluate", help="validation loss and accuracy of a run's model")
    evaluate.add_argument("run_dir", metavar="RUN_DIR", help="a run folder; runs/LATEST: the newest run")
    evaluate.add_argument("--device", default="auto", choices=DEVICES)
    predict = command("predict", help="predictions on validation images, optionally as a picture")
    predict.add_argument("run_dir", metavar="RUN_DIR", help="a run folder; runs/LATEST: the newest run")
    predict.add_argument("--show", type=int, default=0, metavar="N",
                         help="draw N validation images spread evenly over the validation set (so a set sorted "
                              "by class shows every class) with predicted and true labels into "
                              "RUN_DIR/predictions.png, mistakes in red; without it, 10 are listed")
    predict.add_argument("--device", default="auto", choices=DEVICES)
    verify = command("verify", help="train a few steps on 1 and on N devices and compare",
                     description="Runs a short training on one device and with --strategy on --devices devices; "
                                 "prints per-step losses and the largest parameter difference; exits 1 if they "
                                 "diverge.")
    add_training_flags(verify)
    verify.add_argument("--steps", type=int, default=20, metavar="N", help="steps to compare (default: 20)")
    verify.add_argument("--tolerance", type=float, default=1e-5, metavar="X",
                        help="largest allowed parameter difference (default: 1e-5)")
    add_bench_flags(command("bench", help="time every strategy on 1..N devices; explain, predict, pick",
                            description=BENCH_DESCRIPTION))
    return parser


BENCH_DESCRIPTION = (
    "Runs each combination of --device, --batch-sizes, --strategies and --devices for --steps steps after "
    "--warmup steps and prints samples/s, step time, speedup and efficiency against one device, memory per "
    "rank, and the split of a step into compute, communication, data and idle, measured on every rank; "
    "explains every combination that loses to fewer devices; writes bench.json and bench.png. --predict N,M "
    "projects larger counts with the cost model and names the strategy it would pick.")


def parse_list(text, flag: str, *, counts: bool = False) -> tuple:
    """`--devices 1,2,4` as (1, 2, 4), `--strategies data,sharded` as names; a malformed list is one line."""
    if isinstance(text, tuple):
        return text
    parts = tuple(part.strip() for part in str(text).split(",") if part.strip())
    if not counts:
        if not parts:
            raise UserError(f"{flag} takes names separated by commas, got {text!r}")
        return parts
    try:
        numbers = tuple(int(part) for part in parts)
    except ValueError:
        numbers = ()
    if not numbers or min(numbers) < 1:
        raise UserError(f"{flag} takes positive whole numbers separated by commas such as 1,2,4, got {text!r}")
    return numbers


def add_bench_flags(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("--model", default=DEFAULTS.model, metavar="NAME", help=f"one of {', '.join(MODELS)}")
    bench.add_argument("--dataset", default=DEFAULTS.dataset, metavar="NAME", help=f"one of {', '.join(DATASETS)}")
    bench.add_argument("--data-dir", metavar="DIR", help="folder holding the dataset files")
    bench.add_argument("--devices", default=(1, 2), metavar="N,M,...",
                       help="device counts to run (default: 1,2); one device always runs as the baseline")
    bench.add_argument("--strategies", default=tuple(STRATEGIES), metavar="S,T,...",
                       help=f"default: all of {','.join(STRATEGIES)}")
    bench.add_argument("--batch-sizes", default=(64,), metavar="B,C,...",
                       help="global batch sizes (default: 64)")
    bench.add_argument("--device", default=None, metavar="cpu,cuda",
                       help="device kinds, side by side (default: cuda if a GPU is present, else cpu)")
    bench.add_argument("--steps", type=int, default=20, metavar="N", help="measured steps (default: 20)")
    bench.add_argument("--warmup", type=int, default=10, metavar="N", help="steps before measuring (default: 10)")
    bench.add_argument("--repeats", type=int, default=1, metavar="R",
                       help="run every combination R times, interleaved, and keep each one's median (default: 1)")
    bench.add_argument("--predict", default=(), metavar="N,M,...",
                       help="also predict these device counts with the cost model and name the pick")
    bench.add_argument("--seed", type=int, default=DEFAULTS.seed, metavar="N")
    bench.add_argument("--out", metavar="DIR", help="where bench.json and bench.png go (default: runs/bench-<time>)")


def parse(argv=None):
    """Parse `argv`, matching flags exactly; an unknown flag is an error under its subcommand's own usage
    line, with the nearest known flag. `args.given` holds the settings given explicitly."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        where = parser.commands.get(args.command, parser)
        flag = next((word for word in unknown if word.startswith("-")), unknown[0])
        known = [option for action in where._actions for option in action.option_strings]
        nearest = difflib.get_close_matches(flag.split("=", 1)[0], known, n=1, cutoff=0.6)
        hint = f"; did you mean {nearest[0]}?" if nearest else f"; see polytrain {args.command or ''} --help"
        where.error(f"unrecognized argument {flag}{hint}".replace("  ", " "))
    args.given = frozenset(name for name, value in vars(args).items()
                           if value is not None and name in TrainConfig.__dataclass_fields__)
    return parser, args


def flag_list(names) -> str:
    """Setting names as the command line spells them: `batch_size` -> `--batch-size`, comma-separated."""
    return ", ".join("--" + name.replace("_", "-") for name in names)


def config_from_args(args) -> TrainConfig:
    from .hostenv import launcher_env
    values = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__ and v is not None}
    launcher = launcher_env()              # under torchrun/srun the device count is its world size
    if launcher is not None:
        values["devices"] = launcher.world_size
    if args.per_device_batch_size is not None:
        if args.batch_size is not None:
            raise UserError("give either --batch-size (global) or --per-device-batch-size, not both")
        if args.per_device_batch_size <= 0:
            raise UserError(f"--per-device-batch-size must be positive, got {args.per_device_batch_size}")
        devices = values.get("devices", DEFAULTS.devices)
        values["batch_size"] = args.per_device_batch_size * replicas(devices, values.get("strategy", "auto"),
                                                                     values.get("pipeline_stages"))
    config = TrainConfig(**values)
    unused = unused_dataset_options(config.dataset, args.given)
    if unused:
        raise UserError(f"{flag_list(unused)} {'is' if len(unused) == 1 else 'are'} not used by --dataset "
                        f"{config.dataset}; "
                        f"drop {'it' if len(unused) == 1 else 'them'}, or choose a dataset that uses "
                        f"{'it' if len(unused) == 1 else 'them'} ({', '.join(datasets_using(unused[0]))})")
    return config


def main(argv=None) -> int:
    code = run_command(argv)
    leave_without_teardown(code)
    return code


def leave_without_teardown(code: int) -> None:
    """In a worker of torchrun or srun, end the process here, once its output is flushed.

    DistributedDataParallel keeps the gloo process group alive after `destroy_process_group()`, so gloo's
    threads still run while the interpreter tears down, which can abort the finished worker with "terminate
    called without an active exception" (seen once after a torchrun restart on a loaded machine; upstream:
    pytorch issue 190489, and PR 179291 for the teardown race). The worker's files are written and its
    result reported: nothing is lost by skipping that teardown.
    """
    from .hostenv import launcher_env
    try:
        launched = launcher_env() is not None
    except UserError:
        launched = False
    if launched:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_command(argv=None) -> int:
    parser, args = parse(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from .commands import COMMANDS
    from .hostenv import keep_freed_memory
    from .launch import WorkerFailed
    from .stopping import TrainingInterrupted

    keep_freed_memory()                    # this process is ours: see hostenv.keep_freed_memory
    try:
        return COMMANDS[args.command](args)
    except TrainingInterrupted as stop:
        print(f"polytrain: {stop}", file=sys.stderr)
        return stop.exit_code
    except UserError as error:
        print(f"polytrain: error: {error}", file=sys.stderr)
        return 2
    except WorkerFailed as error:
        print(f"polytrain: error: {error}", file=sys.stderr)
        return 2 if error.user_error else 1
    except KeyboardInterrupt:
        print("polytrain: interrupted", file=sys.stderr)
        return 130
