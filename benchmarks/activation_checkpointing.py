"""Activation checkpointing: the memory a training step keeps for its backward pass, and the time it takes, for
--activation-checkpointing none, full, selective (keep matmul outputs) and selective:2 (every second block in
full), side by side in one process on one CPU.

Run (about 2 minutes on an idle 2-core CPU):

    python benchmarks/activation_checkpointing.py --batch-size 32 --rounds 5 --steps 5

For `--model gpt` and `--model llama` at their default shapes (4 blocks of width 128, context 64; vocabulary 65,
Shakespeare's characters), float32, one intra-op thread (`--threads`), random token ids. Two figures of memory,
each over one forward pass of the batch:

  held      the bytes the forward pass leaves allocated besides its output, from the allocator (the profiler's
            memory events): what the step holds until its backward pass, including what selective
            checkpointing keeps in its own cache.
  saved     the bytes autograd's saved-tensor hooks see (as `pipeline/layers.py` `layer_memory` counts them,
            parameters that ops save included). Checkpointing saves each block's input through them and keeps
            the rest out of them, so for `selective` this count misses the matmul outputs it keeps: read `held`.

Step time: forward, backward and an AdamW step; the modes run interleaved (none, full, selective, selective:2,
none, ...) for `--rounds` rounds of `--steps` timed steps after one warm-up step each; the table gives each
mode's median step and its ratio to none's.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from polytrain.models import MODELS, build_model
from polytrain.parallel.activation_checkpoint import apply_activation_checkpointing

MODES = ("none", "full", "selective", "selective:2")
VOCAB = 65


def held_bytes(model, x) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as run:
        out = model(x)
    return sum(event.self_cpu_memory_usage for event in run.events()) - out.numel() * out.element_size()


def saved_bytes(model, x) -> int:
    saved = {}

    def keep(tensor):
        saved[(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(x)
    return sum(saved.values())


def step_seconds(model, optimizer, x, y) -> float:
    began = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    return time.perf_counter() - began


def measure(name: str, *, batch_size: int, rounds: int, steps: int) -> list:
    torch.manual_seed(0)
    base = build_model(name, (64,), VOCAB, {})
    context = base.context
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (batch_size, context), generator=generator)
    y = torch.randint(0, VOCAB, (batch_size, context), generator=generator)
    runs = {}
    for mode in MODES:
        model = copy.deepcopy(base)
        blocks = apply_activation_checkpointing(model, mode)
        runs[mode] = dict(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), blocks=blocks
        )
        runs[mode].update(held=held_bytes(model, x), saved=saved_bytes(model, x), times=[])
    for _ in range(rounds):
        for mode in MODES:
            run = runs[mode]
            step_seconds(run["model"], run["optimizer"], x, y)  # warm-up
            run["times"] += [step_seconds(run["model"], run["optimizer"], x, y) for _ in range(steps)]
    rows = []
    for mode in MODES:
        run = runs[mode]
        rows.append(
            dict(
                model=name,
                mode=mode,
                blocks=len(run["blocks"]),
                held=run["held"],
                saved=run["saved"],
                step=statistics.median(run["times"]),
                fastest=min(run["times"]),
            )
        )
    return rows


def table(rows: list) -> str:
    lines = [
        "| model | mode | blocks checkpointed | held (MiB) | vs none | saved, hooks (MiB) | step (ms, median) "
        "| vs none |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    none = {row["model"]: row for row in rows if row["mode"] == "none"}
    for row in rows:
        ref = none[row["model"]]
        lines.append(
            f"| {row['model']} | {row['mode']} | {row['blocks']} | {row['held'] / 2**20:.2f} | "
            f"{row['held'] / ref['held']:.2f}x | {row['saved'] / 2**20:.2f} | {row['step'] * 1e3:.1f} | "
            f"{row['step'] / ref['step']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default=",".join(m for m in ("gpt", "llama") if m in MODELS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        rows += measure(name, batch_size=args.batch_size, rounds=args.rounds, steps=args.steps)
        print(table(rows), flush=True)
    print(f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch_size}")


if __name__ == "__main__":
    main()
