"""How close the GPT's training step comes to the CPU's practical peak, and cheap changes that could raise it.

Run (about 2 minutes on an idle 2-core CPU; `--compile` adds torch.compile's minute or more of compiling):

    python benchmarks/gpt_flops.py --threads 1,2 --json gpt_flops.json

The model is `--model gpt`'s default (4 layers, 4 heads, width 128, context 64, tied head, vocabulary 65 of the
`shakespeare` text) at its default batch of 8 windows, trained as polytrain trains it: cross-entropy, backward,
clipping by the global norm at 1.0 (`clip_grad_norm_(foreach=True)`), AdamW with `foreach=True` in two parameter
groups (no decay on 1-D tensors).

  FLOPs   counted once with `torch.utils.flop_counter.FlopCounterMode` over one forward, loss and backward (the
          matrix products and the attention; the norms, activations and the optimizer's few per-weight operations
          are not counted, as is usual).
  peak    the best of `--peak-repeats` products of two float32 N x N matrices (N = 1024 and 2048, 2 N^3 FLOPs each)
          on the same threads: what this CPU reaches in practice.
  step    the median of `--steps` timed steps (after `--warmup` untimed ones) of each way, the ways interleaved
          A, B, C, ... `--repeats` times, each from a deepcopy of one seeded model on the same batches.

The fraction is (FLOPs per step / median step seconds) / peak. The ways beside the baseline (`foreach`):
`fused` (AdamW with `fused=True`, one kernel on CPU too), `math-attention` (scaled_dot_product_attention on its
reference "math" kernel instead of the one torch chooses, to see that choice's worth) and, with `--compile`,
`compiled` (`torch.compile` of each block). Each way's loss after its steps is printed beside its time: the same to
rounding means the way computes the same thing. The load average before and after is printed: other processes
on the cores show as a higher one and a slower step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F
from interleaved import save  # benchmarks/interleaved.py (run as python benchmarks/...)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from polytrain.config.model_defaults import MODEL_DEFAULTS
from polytrain.data.text import SHAKESPEARE, tokenise
from polytrain.models import build_model

RECIPE = MODEL_DEFAULTS["gpt"]


def batches(tokens: torch.Tensor, *, count: int, batch_size: int, context: int, seed: int) -> list:
    """`count` batches of (inputs, next tokens) from random windows of `tokens`."""
    generator = torch.Generator().manual_seed(seed)
    span = torch.arange(context + 1)
    found = []
    for _ in range(count):
        starts = torch.randint(0, len(tokens) - context - 1, (batch_size,), generator=generator)
        windows = tokens[starts[:, None] + span]
        found.append((windows[:, :-1], windows[:, 1:]))
    return found


def loss_of(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, -2), y.flatten())


def counted_flops(model, x, y) -> int:
    """FLOPs of one forward, loss and backward, as FlopCounterMode counts them."""
    model = copy.deepcopy(model)
    with FlopCounterMode(display=False) as counter:
        loss_of(model, x, y).backward()
    return counter.get_total_flops()


def matmul_peak(*, sizes=(1024, 2048), repeats: int) -> float:
    """FLOP/s of the fastest float32 N x N product on the current threads."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        c = torch.empty(n, n)
        torch.mm(a, b, out=c)  # warm-up
        for _ in range(repeats):
            began = time.perf_counter()
            torch.mm(a, b, out=c)
            best = max(best, 2 * n**3 / (time.perf_counter() - began))
    return best


def optimizer_for(model, **speed) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() > 1]
    other = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.AdamW(
        [{"params": decay}, {"params": other, "weight_decay": 0.0}],
        lr=RECIPE["lr"],
        betas=RECIPE["betas"],
        weight_decay=RECIPE["weight_decay"],
        **speed,
    )


def compiled_blocks(model):
    for index in range(1, len(model) - 2):
        model[index] = torch.compile(model[index])
    return model


# way -> (how the model is prepared, the optimizer's speed options, a context for every step)
WAYS = {
    "foreach": (lambda model: model, {"foreach": True}, contextlib.nullcontext),
    "fused": (lambda model: model, {"fused": True}, contextlib.nullcontext),
    "math-attention": (lambda model: model, {"foreach": True}, lambda: sdpa_kernel(SDPBackend.MATH)),
    "compiled": (compiled_blocks, {"foreach": True}, contextlib.nullcontext),
}


def train(way: str, base, data: list, *, warmup: int) -> tuple:
    """(seconds of each timed step, the last step's loss, the weights after the first step and after the last),
    the first `warmup` steps untimed."""
    prepare, speed, around = WAYS[way]
    model = prepare(copy.deepcopy(base))
    optimizer = optimizer_for(model, **speed)
    seconds, loss, first = [], None, None
    model.train()
    for step, (x, y) in enumerate(data):
        began = time.perf_counter()
        with around():
            loss = loss_of(model, x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE["clip_grad_norm"], foreach=True)
        optimizer.step()
        if step >= warmup:
            seconds.append(time.perf_counter() - began)
        if step == 0:
            first = [p.detach().clone() for p in model.parameters()]
    return seconds, loss.item(), (first, [p.detach().clone() for p in model.parameters()])


def measure(
    threads: int, ways: list, base, data: list, flops: int, *, warmup: int, repeats: int, peak_repeats: int
) -> dict:
    torch.set_num_threads(threads)
    peak = matmul_peak(repeats=peak_repeats)
    seconds = {way: [] for way in ways}
    losses, weights = {}, {}
    for _ in range(repeats):
        for way in ways:
            times, losses[way], weights[way] = train(way, base, data, warmup=warmup)
            seconds[way] += times
    print(f"\n{threads} thread(s): float32 matmul peak {peak / 1e9:.1f} GFLOP/s")
    print(
        f"{'way':<15} {'median ms':>9} {'min ms':>7} {'GFLOP/s':>8} {'% of peak':>9} {'(fastest)':>9}  "
        f"loss after {len(data)} steps; largest weight difference from {ways[0]}'s after 1 step, after {len(data)}"
    )
    rows = {}
    for way in ways:
        median, fastest = statistics.median(seconds[way]), min(seconds[way])
        rate = flops / median
        apart = [
            max((mine - theirs).abs().max().item() for mine, theirs in zip(these, those))
            for these, those in zip(weights[way], weights[ways[0]])
        ]
        rows[way] = dict(
            median_seconds=median,
            min_seconds=fastest,
            flops_per_second=rate,
            fraction_of_peak=rate / peak,
            fraction_of_peak_fastest=flops / fastest / peak,
            loss=losses[way],
            weight_difference_first_step=apart[0],
            weight_difference=apart[1],
        )
        print(
            f"{way:<15} {median * 1e3:9.2f} {fastest * 1e3:7.2f} {rate / 1e9:8.2f} {100 * rate / peak:8.1f}% "
            f"{100 * flops / fastest / peak:8.1f}%  {losses[way]:.7f}; {apart[0]:.1e}, {apart[1]:.1e}"
        )
    baseline = rows[ways[0]]["median_seconds"]
    for way in ways[1:]:
        print(f"{way} / {ways[0]} = {rows[way]['median_seconds'] / baseline:.3f} (median step time)")
    return dict(threads=threads, peak_flops_per_second=peak, ways=rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2", help="intra-op thread counts, e.g. 1,2 (default: 1,2)")
    parser.add_argument("--batch-size", type=int, default=RECIPE["batch_size"])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (default: 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each way (default: 3)")
    parser.add_argument("--peak-repeats", type=int, default=5, help="timed products per size (default: 5)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of each block")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)

    data = tokenise(SHAKESPEARE.read_text(encoding="utf-8"), name="shakespeare", context=RECIPE["context"])
    torch.manual_seed(args.seed)
    base = build_model("gpt", data.input_shape, data.num_classes)
    steps = batches(
        data.train_tokens,
        count=args.warmup + args.steps,
        batch_size=args.batch_size,
        context=RECIPE["context"],
        seed=args.seed,
    )
    flops = counted_flops(base, *steps[0])
    ways = [way for way in WAYS if way != "compiled" or args.compile]
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, GPT {sum(p.numel() for p in base.parameters()):,} parameters, batch "
        f"{args.batch_size} x {RECIPE['context']} tokens: {flops / 1e9:.3f} GFLOP per step (forward + backward); "
        f"load average {load[0]:.2f}"
    )
    results = [
        measure(
            int(threads),
            ways,
            base,
            steps,
            flops,
            warmup=args.warmup,
            repeats=args.repeats,
            peak_repeats=args.peak_repeats,
        )
        for threads in args.threads.split(",")
    ]
    after = os.getloadavg()
    print(f"\nload average {load[0]:.2f} before, {after[0]:.2f} after")
    return save(
        dict(
            torch=torch.__version__,
            batch_size=args.batch_size,
            context=RECIPE["context"],
            flops_per_step=flops,
            steps=args.steps,
            warmup=args.warmup,
            repeats=args.repeats,
            load_average=[load[0], after[0]],
            threads=results,
        ),
        args.json,
    )


if __name__ == "__main__":
    main()
