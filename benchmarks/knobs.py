"""What accumulation saves and what clipping costs.

Run (about 4 minutes on a 2-core CPU):

    python benchmarks/knobs.py --batch-size 256 --repeats 3

1. Activation memory per pass, `--accumulate K` for K = 1, 2, 4, 8: LeNet on mnist-sample, one device,
   polytrain's own training step. Measured as the bytes of every tensor autograd saves for the backward pass
   during one forward pass (`torch.autograd.graph.saved_tensors_hooks`): they are all alive until that pass's
   backward, and freed before the next pass, so the largest pass is the peak of activation memory. Saved
   weights (the parameters' own storage), gradients and optimizer state do not change with K and are not
   counted.
2. Time per step with and without `--clip-grad-norm 1.0` on every strategy at 2 CPU processes: samples per
   second of `polytrain train --epochs 1` (the epoch's own figure), interleaved rounds, median of `--repeats`.
   By design clipping adds no collective on one device or under DDP (the all-reduced gradient is whole on
   every rank), one all-reduce of one number per step on pipeline stages and parameter servers, and FSDP2's
   norm over its shards (DTensor's reduction of one number).
3. What clipping adds to one step, timed directly: `Gradients.step` over LeNet's gradients with and without
   `clip_norm`, one thread, 200 steps after 20 of warm-up, interleaved twice (whole runs of a few seconds on
   processes sharing 2 cores swing too much to resolve it).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from polytrain.data import load_dataset
from polytrain.data.order import Batch
from polytrain.models import build_model
from polytrain.optim import make_optimizer, make_scheduler
from polytrain.strategies import Strategy

SPEED = re.compile(r"([0-9,]+) samples/s")


def activation_bytes(batch_size: int, accumulate: int) -> int:
    """The largest number of bytes saved for backward by one forward pass of one polytrain step."""
    data = load_dataset("mnist-sample")
    torch.manual_seed(0)
    model = build_model("lenet", data.input_shape, data.num_classes)
    strategy = Strategy(device=torch.device("cpu"), accumulate=accumulate)
    strategy.setup(
        model,
        lambda named: make_optimizer(named, name="sgd", lr=0.05, momentum=0.9),
        lambda optimizer: make_scheduler(optimizer, kind="constant", total_steps=1, warmup_steps=0),
    )
    saved, passes = [0], []
    weights = {p.untyped_storage().data_ptr() for p in strategy.model.parameters()}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:  # a saved weight is no activation
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    def starts_a_pass(module, inputs):
        passes.append(saved[0])
        saved[0] = 0

    model.register_forward_pre_hook(starts_a_pass)
    x = (data.train_x[:batch_size].float() / 255 - 0.13) / 0.31
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        strategy.train_step(Batch(x, data.train_y[:batch_size], batch_size, 0))
    passes.append(saved[0])
    return max(passes)


def clip_milliseconds(clip, steps: int = 200) -> float:
    from polytrain.strategies.gradients import Gradients

    model = build_model("lenet", (1, 28, 28), 10)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.SGD(params, lr=0.0, momentum=0.9, foreach=True)
    gradients = Gradients(device=torch.device("cpu"), clip_norm=clip)
    for _ in range(20):
        gradients.step(optimizer, params)
    began = time.perf_counter()
    for _ in range(steps):
        gradients.step(optimizer, params)
    return (time.perf_counter() - began) / steps * 1e3


def samples_per_second(strategy: str, clip: bool, batch_size: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        argv = [
            sys.executable,
            "-m",
            "polytrain",
            "train",
            "--devices",
            "2",
            "--strategy",
            strategy,
            "--epochs",
            "1",
            "--batch-size",
            str(batch_size),
            "--device",
            "cpu",
            "--out",
            f"{folder}/run",
        ]
        if strategy == "pipeline":
            argv += ["--microbatches", "4"]
        if clip:
            argv += ["--clip-grad-norm", "1.0"]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return float(SPEED.findall(out)[-1].replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategies", default="data,sharded,pipeline,parameter-server")
    args = parser.parse_args()
    base = activation_bytes(args.batch_size, 1)
    print(f"activation memory per pass, LeNet, batch {args.batch_size}, one device")
    for k in (1, 2, 4, 8):
        size = activation_bytes(args.batch_size, k)
        print(f"  --accumulate {k}: {size / 2**20:7.2f} MiB  ({base / size:.2f}x less than one pass)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    timed = [(clip, clip_milliseconds(clip)) for clip in (None, 1.0, None, 1.0)]
    torch.set_num_threads(threads)
    print(
        "one step's gradient handling, LeNet: "
        + ", ".join(f"{'--clip-grad-norm 1.0' if clip else 'no clipping'} {ms:.3f} ms" for clip, ms in timed)
    )
    print(f"samples/s of one epoch at 2 CPU processes, batch {args.batch_size}, median of {args.repeats}")
    results = {(s, c): [] for s in args.strategies.split(",") for c in (False, True)}
    for _ in range(args.repeats):
        for key in results:
            results[key].append(samples_per_second(*key, args.batch_size))
    for strategy in args.strategies.split(","):
        plain, clipped = (statistics.median(results[(strategy, c)]) for c in (False, True))
        print(
            f"  {strategy:>16}: {plain:8,.0f} without clipping, {clipped:8,.0f} with --clip-grad-norm 1.0 "
            f"({clipped / plain:.3f}x)"
        )


if __name__ == "__main__":
    main()
