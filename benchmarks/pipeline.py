"""Pipeline parallelism: its bubble against the theory, its throughput against one device and data parallelism,
and the memory each stage holds against one device.

Run (about 4 minutes on a 2-core CPU; on a machine with 2 GPUs add --device cuda):

    python benchmarks/pipeline.py --device cpu

Part 1, bubble. `polytrain train --strategy pipeline --devices 2 --pipeline-schedule gpipe --timeline` for
M = 1, 2, 4, 8 micro-batches: the measured bubble (idle share of the two ranks between the first forward
and the last backward of steps 2-4, as printed by --timeline) against the theoretical (p-1)/(m+p-1), and
their ratio (target <= 1.10 for M >= 4).

Part 2, throughput. Samples per second of the last epoch of `polytrain train` with --devices 1 (single),
--devices 2 --strategy data, and --devices 2 --strategy pipeline (1f1b, default micro-batches), interleaved
A, B, C, A, B, C over --repeats rounds; the median of each.

Part 3, memory per stage (a computation from measured sizes, not a process's resident memory): for each
stage of the auto split, the bytes of its parameters with their gradients and optimizer state, and of the
activations autograd keeps per micro-batch (measured with saved-tensor hooks), times the micro-batches a
stage holds at once (GPipe: all M; 1F1B: at most p - stage), against one device holding the whole model and
the whole batch's activations.

On CPU both processes share the machine's cores, so a pipeline cannot be faster than one process here: what
part 2 shows on CPU is the cost of the schedule and the send/recv, not the speed-up. The bubble of part 1 is
measured on the same shared cores, where a rank's idle time lets the other rank's threads run.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile

import torch

from polytrain.data import load_dataset
from polytrain.models import build_model
from polytrain.pipeline.balance import balance_by_time, stage_ranges
from polytrain.pipeline.layers import flatten_layers, layer_memory, time_layers

TIMELINE = re.compile(r"bubble measured ([0-9.]+), theoretical .* = ([0-9.]+)")
SPEED = re.compile(r"([0-9,]+) samples/s")


def polytrain(*flags: str) -> str:
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(
            [sys.executable, "-m", "polytrain", "train", "--out", f"{folder}/run", *flags],
            capture_output=True,
            text=True,
            timeout=600,
        )
    if done.returncode:
        raise SystemExit(f"polytrain {' '.join(flags)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


# Equal layers, so that two stages take equal time: the case (p-1)/(m+p-1) describes.
BALANCED = """
import sys, tempfile, torch, polytrain
if __name__ == "__main__":
    width, schedule, m, device = 512, sys.argv[1], int(sys.argv[2]), sys.argv[3]
    body = [module for _ in range(8) for module in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, width), *body, torch.nn.Linear(width, 10))
    with tempfile.TemporaryDirectory() as folder:
        polytrain.fit(model, "mnist-sample", devices=2, strategy="pipeline", pipeline_schedule=schedule,
                      microbatches=m, timeline=True, out=folder + "/run", max_steps=6, epochs=1,
                      batch_size=int(sys.argv[4]), device=device)
"""


def balanced(schedule: str, m: int, args) -> str:
    done = subprocess.run(
        [sys.executable, "-c", BALANCED, schedule, str(m), args.device, str(args.batch_size)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode:
        raise SystemExit(f"balanced model failed:\n{done.stderr[-2000:]}")
    return done.stdout


def bubble(args) -> None:
    for model in ("balanced", args.model):
        print(f"\nPart 1: bubble, gpipe on 2 stages, model {model}, batch {args.batch_size}")
        print(f"{'M':>3} {'measured':>9} {'theory':>7} {'ratio':>6}")
        for m in (1, 2, 4, 8):
            bubble_row(model, m, args)


def bubble_row(model: str, m: int, args) -> None:
    measured = []
    for _ in range(args.repeats):
        if model == "balanced":
            out = balanced("gpipe", m, args)
        else:
            out = polytrain(
                "--strategy",
                "pipeline",
                "--devices",
                "2",
                "--pipeline-schedule",
                "gpipe",
                "--microbatches",
                str(m),
                "--timeline",
                "--max-steps",
                "6",
                "--epochs",
                "1",
                "--model",
                model,
                "--batch-size",
                str(args.batch_size),
                "--device",
                args.device,
            )
        found = TIMELINE.search(out)
        measured.append(float(found.group(1)))
        theory = float(found.group(2))
    value = statistics.median(measured)
    print(
        f"{m:>3} {value:>9.3f} {theory:>7.3f} {value / theory if theory else float('nan'):>6.2f}", flush=True
    )


def throughput(args) -> None:
    ways = {
        "single (1 device)": ("--devices", "1"),
        "data (2 devices)": ("--devices", "2", "--strategy", "data"),
        "pipeline (2 devices)": ("--devices", "2", "--strategy", "pipeline"),
    }
    speeds = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, flags in ways.items():
            out = polytrain(
                *flags,
                "--epochs",
                str(args.epochs),
                "--model",
                args.model,
                "--batch-size",
                str(args.batch_size),
                "--device",
                args.device,
            )
            speeds[name].append(float(SPEED.findall(out)[-1].replace(",", "")))
    print(
        f"\nPart 2: samples/s of the last of {args.epochs} epochs, median of {args.repeats} interleaved rounds"
    )
    base = statistics.median(speeds["single (1 device)"])
    for name, values in speeds.items():
        print(
            f"  {name:<22} {statistics.median(values):>9,.0f}  ({statistics.median(values) / base:.2f} x single)"
        )


def memory(args) -> None:
    data = load_dataset("mnist-sample")
    torch.manual_seed(0)
    model = build_model(args.model, data.input_shape, data.num_classes)
    layers = flatten_layers(model)
    m, p = 4, 2
    micro = data.train_x[: args.batch_size // m].float() / 255
    whole = data.train_x[: args.batch_size].float() / 255
    per_micro = layer_memory(layers, micro, optimizer_slots=1)
    points = balance_by_time(time_layers(layers, micro), stages=p)
    params = [sum(q.numel() * q.element_size() * 3 for q in layer.parameters()) for _, layer in layers]
    one_device = sum(layer_memory(layers, whole, optimizer_slots=1))
    print(
        f"\nPart 3: memory per stage, --model {args.model}, batch {args.batch_size} in {m} micro-batches, "
        f"split {points} (MiB; parameters x3: weights, gradients, momentum)"
    )
    print(f"  one device: {one_device / 2**20:.2f} MiB in all")
    for stage, span in enumerate(stage_ranges(points, layers=len(layers))):
        weights = sum(params[i] for i in span)
        acts = sum(per_micro[i] - params[i] for i in span)
        for schedule, in_flight in (("gpipe", m), ("1f1b", min(m, p - stage))):
            print(
                f"  stage {stage} {schedule:<6} parameters {weights / 2**20:6.2f}  activations "
                f"{acts * in_flight / 2**20:6.2f} ({in_flight} micro-batches)  total "
                f"{(weights + acts * in_flight) / 2**20:6.2f} = {(weights + acts * in_flight) / one_device:.0%} "
                f"of one device"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="1,2,3")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")
    parts = set(args.parts.split(","))
    if "1" in parts:
        bubble(args)
    if "2" in parts:
        throughput(args)
    if "3" in parts:
        memory(args)


if __name__ == "__main__":
    main()
