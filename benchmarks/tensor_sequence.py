"""The built-in Llama's tensor plan with its norms on parts of the sequence (sequence parallelism, the default
where the context splits evenly) against the same plan with them whole: activation memory per process and step
time on CPU processes.

    python benchmarks/tensor_sequence.py                        # about 6 min on 2 cores
    python benchmarks/tensor_sequence.py --context 2048 --rounds 1

Each configuration is what a user gets from

    polytrain train --model llama --dataset shakespeare --layers 4 --width 256 --heads 8 --kv-heads 4 \\
        --context T --batch-size 2 --strategy tensor --devices 2 --max-steps 4

run through `polytrain.fit`; the norms whole by replacing `polytrain.strategies.tensor._cuts_sequence` in the
launching process (which makes the plan every worker applies). Every worker gives freed blocks over 1 MiB back at
once (as polytrain does where a heap keeping them would not fit), so its peak RSS is the tensors it holds at once
(docs/benchmarks.md); activations = that peak less the same configuration's at context 64, beside what the memory
check counts (planning/activations.py `tensor_part`). Rounds interleave the two (A B A B). Step: the median of each
run's steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 2**20


def one_run(spec: dict) -> None:
    """(in a fresh process) train one configuration with the Probe of context_parallel.py on rank 0."""
    from context_parallel import Probe  # by its module's name, so the workers unpickle it

    import polytrain
    from polytrain.scaling.fits import Fit

    Fit.gives_back_memory = lambda self: True
    if not spec["sequence"]:
        import polytrain.strategies.tensor as tensor

        tensor._cuts_sequence = lambda *args: False
    polytrain.fit(
        "llama", "shakespeare", **spec["shape"], batch_size=spec["batch"], max_steps=spec["steps"],
        strategy="tensor", devices=spec["devices"], out=spec["out"], verbose=False,
        callbacks=[Probe(spec["result"], spec["devices"])],
    )  # fmt: skip


def train(spec: dict, folder: Path, name: str) -> dict:
    spec = dict(spec, out=str(folder / name), result=str(folder / f"{name}.json"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    log = folder / f"{name}.log"
    with open(log, "w") as out:
        command = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(spec)]
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if code or not Path(spec["result"]).exists():
        raise SystemExit(f"{name} failed:\n{log.read_text()[-2000:]}")
    probe = json.loads(Path(spec["result"]).read_text())
    ends = [probe["start"]] + probe["ends"]
    steps = [b - a for a, b in zip(ends, ends[1:])]
    return {"step": statistics.median(steps[1:]), "hwm": sorted(p["VmHWM"] for p in probe["peaks"].values())}


def predicted(shape: dict, batch: int, devices: int, sequence: bool) -> float:
    """The activations per process the memory check counts for this run (scaling/fits.py `check_fits`: the
    model's activation figures on fake tensors, a tensor rank's part of them, planning/activations.py
    `tensor_part`)."""
    import dataclasses

    import torch

    from polytrain.config import TrainConfig
    from polytrain.data import load_dataset
    from polytrain.models import build_model_on_meta
    from polytrain.parallel.layout import Layout
    from polytrain.planning.memory import memory_per_rank
    from polytrain.scaling.fits import _tensor_split, measured_activations, model_workload

    data = load_dataset("shakespeare", context=shape["context"])
    model = build_model_on_meta("llama", data.input_shape, data.num_classes, dict(shape))
    config = TrainConfig(model="llama", strategy="tensor", devices=devices, batch_size=batch, **shape)
    split = dict(_tensor_split(config, model, devices), **({} if sequence else {"sequence_splits": ()}))
    work = model_workload(
        model, batch_size=batch, **split, **measured_activations(model, data, torch.device("cpu"))
    )
    layout = Layout(tensor=devices)
    whole = memory_per_rank(work, layout, optimizer_slots=2)
    bare = dataclasses.replace(work, activation_bytes=0.0)
    return whole - memory_per_rank(bare, layout, optimizer_slots=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return one_run(json.loads(args.one))
    import torch

    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M %Z')}", flush=True
    )
    shape = dict(layers=args.layers, width=args.width, heads=args.heads, kv_heads=args.kv_heads)
    base = dict(batch=args.batch_size, devices=args.devices)
    labels = {True: "norms on parts of the sequence", False: "norms whole"}
    runs = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="tensor-sequence-") as tmp:
        folder = Path(tmp)
        baseline = {
            sequence: train(dict(base, shape=dict(shape, context=64), steps=2, sequence=sequence), folder, f"b{sequence}")
            for sequence in (True, False)
        }  # fmt: skip
        for round_ in range(args.rounds):
            for sequence in (True, False):
                spec = dict(
                    base, shape=dict(shape, context=args.context), steps=args.steps, sequence=sequence
                )
                run = train(spec, folder, f"r{round_}-{sequence}")
                runs[sequence].append(run)
                print(
                    f"round {round_ + 1}, {labels[sequence]}: step {run['step']:.2f} s, peak RSS "
                    f"{', '.join(f'{h / MIB:.0f}' for h in run['hwm'])} MiB",
                    flush=True,
                )
    print(f"\nT={args.context}, batch {args.batch_size}, {args.devices} tensor ranks")
    print(
        "| plan | activations MiB per process | memory check's MiB | measured / counted | step s (median) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for sequence in (True, False):
        peaks = [max(r["hwm"][i] for r in runs[sequence]) for i in range(args.devices)]
        held = [p - b for p, b in zip(peaks, baseline[sequence]["hwm"])]
        step = statistics.median(r["step"] for r in runs[sequence])
        counted = predicted(dict(shape, context=args.context), args.batch_size, args.devices, sequence)
        print(
            f"| {labels[sequence]} | {', '.join(f'{h / MIB:.0f}' for h in held)} | {counted / MIB:.0f} | "
            f"{max(held) / counted:.2f} | {step:.2f} |"
        )


if __name__ == "__main__":
    main()
