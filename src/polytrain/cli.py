"""The command line: `polytrain train | evaluate | predict | verify | bench | generate | export`. The only
place that parses arguments.

    python -m polytrain.cli > docs/cli.md     # the command-line reference, rendered from this parser
"""

from __future__ import annotations

import argparse
import os
import sys

from .config import DEFAULTS, SETTINGS
from .config.flags import add_model_flags, add_setting_flags, given_settings, unknown_flag
from .config.model_defaults import MODEL_SETTINGS
from .config.registry_names import DATASET_NAMES, MODEL_NAMES, STRATEGY_NAMES
from .errors import UserError
from .runtime.verify_limits import COMPARE_HELP, TOLERANCE_HELP
from .version import __version__

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
on integer labels 0..classes-1 (--dataset folder: your own images in class folders), and character-level
language models (polytrain train --model gpt --dataset shakespeare, then polytrain generate RUN_DIR). From
Python, polytrain.fit also takes torch Datasets and any loss (regression, multi-label, segmentation)."""


class Parser(argparse.ArgumentParser):
    """argparse's parser with one-line errors: `polytrain train: error: ...; see polytrain train --help` (argparse
    prints its whole usage first, some thirty lines above the one that matters). Subcommands' parsers are of
    this class too (argparse makes them of their parent's)."""

    def error(self, message: str):
        self.refuse(f"{message}; see {self.prog} --help")

    def refuse(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="polytrain",
        description="Train PyTorch models on every device you have, with results proven "
        "equal to one device. Start with: polytrain train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"polytrain {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}

    def command(name, **kwargs):
        parser.commands[name] = commands.add_parser(name, allow_abbrev=False, **kwargs)
        return parser.commands[name]

    train = command(
        "train",
        help="train a model and save a run folder",
        description="Train a model on a dataset: an image classifier (cross-entropy over integer labels), a "
        "language model (--model gpt or llama on text or token shards: next-token cross-entropy), or a "
        "Hugging Face checkpoint fine-tuned (--init-from DIR); writes config.json, metrics.jsonl, model.pt, "
        "checkpoint.pt and curves.png into the run folder. "
        "Ctrl-C or SIGTERM stops at a checkpoint; --resume continues from it.",
    )
    add_setting_flags(train, "train")
    train.add_argument(
        "--dry-run",
        nargs="?",
        const="",
        default=None,
        metavar="GPU",
        help="check the run at its --devices without training: its layout built at full size on fake ranks, "
        "memory per GPU and the step predicted as `polytrain plan` does, on GPU (default: this machine's, "
        "else h100); exits 1 where it does not fit",
    )
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run from its checkpoint, on the devices it had unless --device/--devices "
        "say otherwise (runs/LATEST: the newest run)",
    )
    evaluate = command("evaluate", help="validation loss and accuracy of a run's model")
    evaluate.add_argument("run_dir", metavar="RUN_DIR", help="a run folder; runs/LATEST: the newest run")
    evaluate.add_argument("--device", default="auto", choices=SETTINGS["device"].choices)
    evaluate.add_argument("--weights", default="final", choices=("final", "best"), help=WEIGHTS_HELP)
    predict = command("predict", help="predictions on validation images, optionally as a picture")
    predict.add_argument("run_dir", metavar="RUN_DIR", help="a run folder; runs/LATEST: the newest run")
    predict.add_argument(
        "--show",
        type=int,
        default=0,
        metavar="N",
        help="draw N validation images spread evenly over the validation set (so a set sorted "
        "by class shows every class) with predicted and true labels into "
        "RUN_DIR/predictions.png, mistakes in red; without it, 10 are listed",
    )
    predict.add_argument("--device", default="auto", choices=SETTINGS["device"].choices)
    predict.add_argument("--weights", default="final", choices=("final", "best"), help=WEIGHTS_HELP)
    generate = command("generate", help="text sampled from a language model run (--model gpt or llama)")
    generate.add_argument("run_dir", metavar="RUN_DIR", help="a run folder; runs/LATEST: the newest run")
    generate.add_argument("--prompt", default="\n", help="the text to continue (default: a new line)")
    generate.add_argument(
        "--tokens",
        type=int,
        default=300,
        metavar="N",
        help="tokens to sample: characters of a character-level run (default: 300)",
    )
    generate.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        metavar="T",
        help="below 1: safer, above 1: wilder, 0: always the likeliest (default: 1.0)",
    )
    generate.add_argument(
        "--top-k",
        type=int,
        default=None,
        metavar="K",
        help="sample only from the K likeliest tokens (default: all)",
    )
    generate.add_argument(
        "--seed", type=int, default=0, metavar="N", help="same seed, same text (default: 0)"
    )
    generate.add_argument("--device", default="auto", choices=SETTINGS["device"].choices)
    generate.add_argument("--weights", default="final", choices=("final", "best"), help=WEIGHTS_HELP)
    export = command(
        "export",
        help="write a run's weights as one file (safetensors or .pt), or as a Hugging Face checkpoint folder",
        description="Writes the run's weights as one file by the one-device parameter names, also when "
        "they were saved as shards by every rank (--strategy sharded): read and written one tensor at a "
        "time, so it never holds more than the largest tensor. --format hf writes a folder that "
        "transformers' AutoModelForCausalLM.from_pretrained loads (a --model llama or gpt run: config.json "
        "and safetensors files, with the run's tokenizer where it has one).",
    )
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument(
        "--format",
        default="safetensors",
        choices=("safetensors", "pt", "hf", "peft"),
        help="safetensors; pt: a state dict for torch.load; hf: a Hugging Face checkpoint folder of a "
        "--model llama run, LlamaForCausalLM (Qwen2ForCausalLM with --qkv-bias, Qwen3ForCausalLM with --qk-norm; "
        "with --experts MixtralForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM), or of a --model gpt run, "
        "GPT2LMHeadModel; peft: a --lora run's adapters as the folder peft's PeftModel.from_pretrained(base, "
        "folder) loads onto its --init-from checkpoint (default: %(default)s)",
    )
    merged = "--format hf of a --lora run: each adapted weight with its adapter merged in (W + alpha/R B A)"
    export.add_argument(
        "--merge", action="store_true", help=merged + ", a checkpoint that loads without peft"
    )
    export.add_argument(
        "--out",
        metavar="PATH",
        help="where to write it (default: RUN_DIR/model.safetensors, RUN_DIR/model-export.pt, RUN_DIR/hf/, "
        "RUN_DIR/peft/; best-*, hf-best/, peft-best/)",
    )
    export.add_argument("--weights", default="final", choices=("final", "best"), help=WEIGHTS_HELP)
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="--format hf: the largest safetensors file, e.g. 500MB or 2GiB; larger models are cut into "
        "files listed in model.safetensors.index.json (default: %(default)s)",
    )
    tokenize = command(
        "tokenize",
        help="write text files as token shards for --dataset tokens, training a tokenizer or using one",
        description="Streams text files (a document each; .jsonl: a document per line) through a "
        "Hugging Face tokenizer into DIR: token shards (uint16 where the vocabulary allows), a held-out "
        "validation split, tokenizer.json and manifest.json with every shard's checksum. Without --tokenizer "
        "it first trains a byte-level BPE tokenizer on the corpus. Memory stays flat whatever the corpus's "
        "size; an interrupted run leaves nothing a later run would read. Then: polytrain train --model gpt "
        "(or --init-from the checkpoint whose tokenizer it took) --dataset tokens --data-dir DIR",
    )
    tokenize.add_argument(
        "paths",
        nargs="+",
        metavar="FILES_OR_FOLDER",
        help="text files, each read whatever its name, or folders: their files that --glob matches and whose "
        "start is UTF-8 text, hidden files and folders (.git) skipped",
    )
    tokenize.add_argument(
        "--glob",
        metavar="PATTERN",
        help="the files to read in each folder, a pattern inside it, e.g. '**/*.py' (** is any depth of "
        "folders); default: every file",
    )
    tokenize.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new, or empty)")
    tokenize.add_argument(
        "--tokenizer",
        metavar="FILE_OR_FOLDER",
        help="a tokenizer.json, or a checkpoint folder holding one (the tokenizer of the model you will "
        "--init-from); default: train one on the corpus",
    )
    tokenize.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="tokens of the tokenizer trained here (default: 8192; GPT-2 has 50,257)",
    )
    tokenize.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        metavar="F",
        help="the last F of the corpus's bytes, held out for validation (default: a tenth of a corpus under "
        "10 MiB, 1 MiB of one up to 200 MiB, 0.005 of a larger one)",
    )
    tokenize.add_argument(
        "--shard-tokens",
        type=int,
        default=100_000_000,
        metavar="N",
        help="the most tokens in one shard file (default: %(default)s)",
    )
    tokenize.add_argument(
        "--text-key", default="text", metavar="KEY", help="the text field of .jsonl lines (default: text)"
    )
    tokenize.add_argument(
        "--end-of-text",
        metavar="TOKEN",
        help="the special token that separates documents (default: the tokenizer's <|endoftext|>, "
        "<|end_of_text|> or </s>)",
    )
    verify = command(
        "verify",
        help="train a few steps on 1 and on N devices and compare",
        description="Runs a short training on one device and with --strategy on --devices devices; "
        "prints per-step losses and the largest parameter difference; exits 1 if they "
        "diverge.",
    )
    add_setting_flags(verify, "verify")
    verify.add_argument("--steps", type=int, default=20, metavar="N", help="steps to compare (default: 20)")
    verify.add_argument("--tolerance", type=float, default=None, metavar="X", help=TOLERANCE_HELP)
    verify.add_argument(
        "--compare-in", choices=("auto", "float64", "as-trained"), default="auto", help=COMPARE_HELP
    )
    add_bench_flags(
        command(
            "bench",
            help="time every strategy on 1..N devices; explain, predict, pick",
            description=BENCH_DESCRIPTION,
        )
    )
    add_plan_flags(
        command(
            "plan",
            help="the layouts a model trains in on N GPUs you do not have, built at full size, ranked",
            description=PLAN_DESCRIPTION,
        )
    )
    return parser


PLAN_DESCRIPTION = (
    "Builds each layout of --devices GPUs (dp_replicate x dp_shard x cp x tp, or the one --layout names) with the "
    "code a run uses, at its full world size on torch's fake process group and the meta device, in this process; "
    "prints each layout's memory per GPU (parameters, gradients, optimizer state, activations, FSDP2's buffers) "
    "and its predicted step, tokens per second per GPU and MFU, fastest first, and what limits it. A layout the code "
    "refuses at full size is refused here with the same line."
)


def add_plan_flags(plan: argparse.ArgumentParser) -> None:
    from .scaling.gpus import GPUS

    plan.add_argument("--model", default="llama", metavar="NAME", help="llama or gpt (default: llama)")
    plan.add_argument("--size", default=None, metavar="NAME", help="--model llama: tiny, 8b, 70b or 405b")
    families = "a Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE or GPT-2"
    shape = f"a Hugging Face config.json (or its folder) of {families}: its shape, no weights needed"
    plan.add_argument("--hf-config", default=None, metavar="PATH", help=shape)
    for flag in ("layers", "width", "heads", "kv-heads", "ffn-width", "vocab-size"):
        plan.add_argument(
            f"--{flag}", type=int, default=None, metavar="N", help=f"the model's {flag} (its --size's)"
        )
    for flag, words in (
        ("experts", "--model llama: a mixture of N experts in the blocks (as polytrain train)"),
        ("experts-per-token", "--model llama --experts: the experts each token goes to (default: 2)"),
        ("shared-experts", "--model llama --experts: a shared expert of N times --ffn-width"),
        ("moe-every", "--model llama --experts: every Nth block has the mixture (default: 1)"),
        ("lora", "a LoRA fine-tune: rank-N adapters, the rest frozen (as polytrain train --lora)"),
    ):
        plan.add_argument(f"--{flag}", type=int, default=None, metavar="N", help=words)
    plan.add_argument(
        "--context", type=int, default=None, metavar="T", help="tokens per sequence (the size's)"
    )
    plan.add_argument("--devices", type=int, required=True, metavar="N", help="GPUs in the run")
    plan.add_argument(
        "--gpu", default="h100", metavar="NAME", help=f"one of {', '.join(GPUS)} (default: h100)"
    )
    plan.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs per node (default: 8)")
    plan.add_argument(
        "--batch-size", type=int, required=True, metavar="B", help="sequences per step (global)"
    )
    plan.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="default: bf16")
    plan.add_argument(
        "--activation-checkpointing",
        default="auto",
        metavar="MODE",
        help="none, selective, full or selective:K; auto: on each layout the least recomputation that fits "
        "(none, then selective, then full; default: auto)",
    )
    plan.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"), help="default: adamw")
    plan.add_argument(
        "--layout",
        default=None,
        metavar="DEGREES",
        help="one layout: dp_replicate=R,dp_shard=S,pp=P,cp=C,tp=T",
    )
    plan.add_argument(
        "--strategy",
        default=None,
        choices=("data", "sharded", "tensor", "pipeline"),
        help="one layout, as `polytrain train` names it (with the flags below)",
    )
    for flag, words in (
        ("tensor-parallel", "ranks that split each layer"),
        ("pipeline-stages", "pipeline stages"),
        ("context-parallel", "ranks that split each sequence"),
        ("replicas", "copies of the shard groups"),
    ):
        plan.add_argument(f"--{flag}", type=int, default=None, metavar="N", help=f"with --strategy: {words}")
    plan.add_argument("--data-parallel", default=None, choices=("shard",), help="with --strategy pipeline")
    plan.add_argument("--top", type=int, default=15, metavar="N", help="layouts shown (default: 15)")
    plan.add_argument("--json", default=None, metavar="FILE", help="write one object per layout")
    plan.add_argument("--png", default=None, metavar="FILE", help="draw the memory split per layout")


WEIGHTS_HELP = (
    "final: the run's last weights (model.pt); best: those of its best validation of --monitor "
    "(best.pt); default: %(default)s"
)

BENCH_DESCRIPTION = (
    "Runs each combination of --device, --batch-sizes, --strategies and --devices for --steps steps after "
    "--warmup steps and prints samples/s, step time, speedup and efficiency against one device, memory per "
    "rank, and the split of a step into compute, communication, data and idle, measured on every rank; "
    "explains every combination that loses to fewer devices; writes bench.json and bench.png. --predict N,M "
    "projects larger counts with the cost model and names the strategy it would pick."
)


def add_bench_flags(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "--model", default=DEFAULTS.model, metavar="NAME", help=f"one of {', '.join(MODEL_NAMES)}"
    )
    bench.add_argument(
        "--dataset", default=DEFAULTS.dataset, metavar="NAME", help=f"one of {', '.join(DATASET_NAMES)}"
    )
    bench.add_argument("--data-dir", metavar="DIR", help="folder holding the dataset files")
    bench.add_argument(
        "--devices",
        default=(1, 2),
        metavar="N,M,...",
        help="device counts to run (default: 1,2); one device always runs as the baseline",
    )
    bench.add_argument(
        "--strategies",
        default=STRATEGY_NAMES,
        metavar="S,T,...",
        help=f"default: {','.join(STRATEGY_NAMES)} (tensor: where the model has a tensor plan, one group "
        f"of all the devices and each data x tensor mesh the count allows)",
    )
    bench.add_argument(
        "--batch-sizes", default=(64,), metavar="B,C,...", help="global batch sizes (default: 64)"
    )
    bench.add_argument(
        "--device",
        default=None,
        metavar="cpu,cuda",
        help="device kinds, side by side (default: cuda if a GPU is present, else cpu)",
    )
    bench.add_argument("--steps", type=int, default=20, metavar="N", help="measured steps (default: 20)")
    bench.add_argument(
        "--warmup", type=int, default=10, metavar="N", help="steps before measuring (default: 10)"
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="R",
        help="run every combination R times, interleaved, and keep each one's median (default: 1)",
    )
    bench.add_argument(
        "--predict",
        default=(),
        metavar="N,M,...",
        help="also predict these device counts with the cost model and name the pick",
    )
    bench.add_argument("--seed", type=int, default=DEFAULTS.seed, metavar="N")
    # the model's settings as train takes them (with --experts, data and sharded also run with the experts split)
    add_model_flags(bench, MODEL_SETTINGS)
    bench.add_argument(
        "--out", metavar="DIR", help="where bench.json and bench.png go (default: runs/bench-<time>)"
    )


def parse(argv=None):
    """Parse `argv`, matching flags exactly; an unknown flag is one line naming its subcommand, with the nearest
    known flag or polytrain's name for it. `args.given` holds the settings given explicitly."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        where = parser.commands.get(args.command, parser)
        flag = next((word for word in unknown if word.startswith("-")), unknown[0])
        known = [option for action in where._actions for option in action.option_strings]
        where.refuse(unknown_flag(flag, known, args.command))
    args.given = frozenset(given_settings(args))
    return parser, args


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
    from .runtime.hostenv import launcher_env

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
    if args.command in ("train", "verify", "bench"):  # its forkserver imports torch beside this process
        from .runtime.forkserver import start_ahead

        start_ahead(getattr(args, "devices", None))
    from .commands import COMMANDS
    from .runtime.hostenv import keep_freed_memory, own_process
    from .runtime.launch import WorkerFailed
    from .runtime.stopping import TrainingInterrupted

    keep_freed_memory()  # this process is ours: see hostenv.keep_freed_memory
    try:
        with own_process():
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


if __name__ == "__main__":  # docs/cli.md (config/reference.py renders it from the parser)
    from .config.reference import markdown

    print(markdown(build_parser()), end="")
