"""Every setting of a training run, declared once, grouped by concern.

A new setting is one field in its group here (see `declare.setting`) plus the code that reads it: the flag,
`fit()`'s keyword, the check, the resume rule and `config.json` follow from the declaration. Help texts may
name `{datasets}`, `{models}` and `{strategies}`, filled in from the registries when the flags are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .declare import setting, shape_text
from .layout_settings import (
    DeviceSettings,
    PipelineSettings,
    ServerSettings,
    ShardedSettings,
    TensorSettings,
)
from .llama_settings import LlamaSettings
from .lora_settings import LoraSettings
from .optimisation_settings import OptimisationSettings


@dataclass
class DataSettings:
    dataset: str = setting(
        "mnist-sample",
        "default: %(default)s (10,000 real MNIST digits shipped with polytrain); one of {datasets}",
        group="data",
        metavar="NAME",
    )
    data_dir: Optional[str] = setting(
        None,
        "folder holding the dataset files (IDX or CIFAR binary), the image "
        "folder of --dataset folder, the UTF-8 text file or folder of .txt files "
        "of --dataset text, the token shards of --dataset tokens, or the folder save_to_disk wrote (or "
        "parquet, jsonl or arrow files) of --dataset hf",
        group="data",
        metavar="DIR",
    )
    tokenizer: Optional[str] = setting(
        None,
        "--dataset hf: the tokenizer.json (or a folder holding one) that tokenizes its text column "
        "(default: the --init-from folder's)",
        group="data",
        metavar="FILE",
    )
    text_key: str = setting(
        "text",
        "--dataset hf: the column of text to tokenize (default: %(default)s)",
        group="data",
        metavar="COLUMN",
    )
    train_on_prompt: bool = setting(
        False,
        "--dataset hf of instruction rows (messages, or prompt and completion): train on every token, not only "
        "on the answers' (default: the prompt's tokens have no loss)",
        group="data",
        flag="switch",
    )
    pack: bool = setting(
        False,
        "--dataset hf of rows (of ids, or instruction rows): pack short rows into windows of --context tokens, each "
        "row attending to itself only at positions from 0, instead of padding each (the llama and the gpt)",
        group="data",
        flag="switch",
    )
    image_size: Optional[int] = setting(
        None,
        "--dataset folder: resize every image to S x S (default: keep, all must share one size)",
        group="data",
        metavar="S",
        check="count",
        example=32,
        must="must be a positive whole number of pixels",
    )
    val_fraction: Optional[float] = setting(
        None,
        "--dataset folder with <class>/ folders only: hold out the last F "
        "of each class's sorted files for validation; --dataset hf without a validation split: the last F "
        "of its rows (default: 0.1)",
        group="data",
        metavar="F",
        check="fraction",
        example=0.1,
        must="must lie strictly between 0 and 1",
    )
    skip_bad: bool = setting(
        False,
        "--dataset folder: skip unreadable images and report how many (default: stop, naming the file)",
        group="data",
        flag="switch",
    )
    download: bool = setting(
        False,
        "fetch missing files into --data-dir or ~/.cache/polytrain (checksum-verified)",
        group="data",
        flag="switch",
    )
    augment: Optional[bool] = setting(
        None,
        "random crop (4-pixel shifts), plus mirroring for cifar10, as batched "
        "ops on the device (default: on for cifar10 with polytrain's models, off for "
        "digits and for a module of your own)",
        group="data",
        flag="toggle",
    )
    synthetic_size: int = setting(
        2048,
        "training samples of --dataset synthetic (default: %(default)s)",
        group="data",
        metavar="N",
        check="count",
    )
    synthetic_shape: tuple = setting(
        (1, 28, 28),
        "image shape of --dataset synthetic (default: 1,28,28)",
        group="data",
        metavar="C,H,W",
        parse=shape_text,
    )
    eval_batch_size: Optional[int] = setting(
        None,
        "validation batch per device (default: for text and train=/val= Datasets 2 "
        "training passes' samples of a device, at most the larger of --batch-size and "
        "256, so validation holds less than training; for in-memory images the larger "
        "of --batch-size and 1024)",
        group="data",
        metavar="N",
        check="count",
        resume="change",
    )
    num_workers: Optional[int] = setting(
        None,
        "loader processes per rank for train=/val= Datasets (default: from "
        "the cores; 0: load in the training process)",
        group="data",
        check="count0",
        flag="none",
        hint=" (0: load in the training process)",
    )


@dataclass
class ModelSettings:
    model: str = setting("lenet", "one of {models} (default: %(default)s)", group="model", metavar="NAME")
    init_from: Optional[str] = setting(
        None,
        "start from the weights of a Hugging Face checkpoint folder (config.json and model.safetensors, or "
        "shards listed in model.safetensors.index.json) of a LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
        "MixtralForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM (--model llama) or a GPT2LMHeadModel (--model gpt), with the sizes of its config.json, each rank reading only "
        "the slices it holds; or of a polytrain run folder: its model, settings and final weights, as a new "
        "run (--resume continues one)",
        group="model",
        metavar="DIR",
    )
    precision: str = setting(
        "fp32",
        "bf16 runs the forward pass under autocast (use on GPUs); fp16 also scales "
        "the loss dynamically (torch.amp.GradScaler), every rank skipping the same step when "
        "any gradient overflows; default: %(default)s",
        group="model",
        choices=("fp32", "bf16", "fp16"),
    )
    layers: Optional[int] = setting(
        None,
        "--model gpt, llama: transformer blocks (default: 4)",
        group="model",
        metavar="L",
        check="count",
        example=4,
    )
    heads: Optional[int] = setting(
        None,
        "--model gpt, llama: attention heads, dividing --width (default: 4)",
        group="model",
        metavar="H",
        check="count",
        example=4,
    )
    width: Optional[int] = setting(
        None,
        "--model gpt, llama: embedding width (default: 128)",
        group="model",
        metavar="C",
        check="count",
        example=128,
    )
    context: Optional[int] = setting(
        None,
        "--model gpt, llama: tokens the model sees at once, the length of each training sequence (default: 64)",
        group="model",
        metavar="T",
        check="count",
        example=64,
    )
    compile: bool = setting(
        False,
        "torch.compile the model: each block in place, a model without blocks whole",
        group="model",
        flag="switch",
    )
    cuda_graphs: bool = setting(
        True,
        "on one GPU: replay each training pass's forward and backward as CUDA graphs, for models whose steps "
        "wait on kernel launches (the optimizer stays eager; the start-up line says when a model cannot be "
        "captured); --no-cuda-graphs: every pass eager",
        group="model",
        flag="toggle",
        resume="change",
    )
    activation_checkpointing: str = setting(
        "none",
        "recompute activations in the backward pass instead of keeping them (the same numbers, less "
        "memory, more compute), per block (each repeated module of the model's own, e.g. GPT's Block): full: "
        "keep only each block's input; selective: keep the outputs of matrix multiplications, recompute the "
        "rest; selective:K: every K-th block in full (default: %(default)s)",
        group="model",
        metavar="none|full|selective|selective:K",
        check="checkpointing",
        example="full",
        resume="change",
    )
    channels_last: Optional[bool] = setting(
        None,
        "channels-last memory format (default: on for convolutional "
        "models that give the same outputs in it; a module that flattens "
        "with .view() keeps the default format)",
        group="model",
        flag="toggle",
    )


@dataclass
class ValidationSettings:
    val_every: int = setting(
        0,
        "also validate every STEPS optimizer steps within an epoch (default: 0, at epoch ends only)",
        group="validation",
        metavar="STEPS",
        check="count0",
        resume="change",
    )
    monitor: str = setting(
        "val_loss",
        "the validation figure that decides the best weights (best.pt) and early "
        "stopping: val_loss, val_acc, val_<metric> (default: %(default)s)",
        group="validation",
        metavar="METRIC",
    )
    monitor_mode: Optional[str] = setting(
        None,
        "whether lower or higher --monitor is better (default: min for "
        "losses, errors (mae, mse, error, ...) and perplexity, max otherwise)",
        group="validation",
        choices=("min", "max"),
    )
    patience: int = setting(
        0,
        "stop after N validations in a row without improving --monitor (default: 0, never stop early)",
        group="validation",
        metavar="N",
        check="count0",
        resume="change",
    )


@dataclass
class ReliabilitySettings:
    out: Optional[str] = setting(
        None,
        "run folder (default: a new folder under runs/)",
        group="reliability",
        metavar="DIR",
        commands=("train",),
    )
    checkpoint_every: int = setting(
        0,
        "also checkpoint every STEPS steps (always at each epoch end, and on Ctrl-C/SIGTERM)",
        group="reliability",
        metavar="STEPS",
        check="count0",
        resume="change",
        commands=("train",),
    )
    async_checkpoint: bool = setting(
        False,
        "write checkpoints of shards (sharded, tensor, pipeline) in the background while training goes on; "
        "each replaces the previous one once complete",
        group="reliability",
        flag="switch",
        resume="change",
        commands=("train",),
    )
    max_steps: int = setting(
        0,
        "stop after N steps in all, with a checkpoint to --resume from (default: 0, all epochs)",
        group="reliability",
        metavar="N",
        check="count0",
        resume="change",
        commands=("train",),
    )
    hang_timeout: Optional[float] = setting(
        None,
        "with several devices, report a rank that makes no progress for this long, with its stack, and stop: "
        "a fixed bound on every step, the first one 30 s more (10x more with --compile) (default: judged "
        "against the run's own steps: max(60 s, 4x the slowest step so far), the first step max(90 s, 2x "
        "what the model's size predicts); docs/reliability.md)",
        group="reliability",
        metavar="SECONDS",
        check="positive",
        resume="change",
        commands=("train",),
    )
    max_restarts: int = setting(
        0,
        "restart failed workers up to R times from the last checkpoint (default: %(default)s)",
        group="reliability",
        metavar="R",
        check="count0",
        resume="change",
        commands=("train",),
    )


@dataclass
class LoggingSettings:
    logger: Optional[str] = setting(
        None,
        "also log to TensorBoard (RUN_DIR/tensorboard; pip install "
        "'polytrain[tensorboard]') and/or RUN_DIR/metrics.csv, beside metrics.jsonl",
        group="logging",
        metavar="tensorboard,csv",
    )


# The groups TrainConfig is made of, in the order of `--help` (a dataclass lists inherited fields from the
# last base to the first, hence reversed there).
GROUP_CLASSES = (
    DataSettings,
    ModelSettings,
    LlamaSettings,
    OptimisationSettings,
    LoraSettings,
    DeviceSettings,
    PipelineSettings,
    ShardedSettings,
    ServerSettings,
    TensorSettings,
    ValidationSettings,
    ReliabilitySettings,
    LoggingSettings,
)

# Ways to give a setting in other terms: accepted as flags and keywords, turned into the setting they stand
# for (config.json records that one), never stored themselves.
INPUTS = {
    "per_device_batch_size": setting(
        None,
        "alternatively, the batch of each device; the global batch is N x "
        "--devices (with --strategy pipeline, N x the number of pipelines: the devices "
        "of one pipeline share a batch)",
        group="optimisation",
        metavar="N",
        check="count",
    ).metadata["setting"],
    "micro_batch_size": setting(
        None,
        "alternatively to --accumulate: the samples of one pass per replica; "
        "--accumulate is then the replica's batch / N",
        group="optimisation",
        metavar="N",
        check="count",
    ).metadata["setting"],
}
