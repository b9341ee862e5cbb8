"""`--context-parallel C` on CPU processes: peak memory per process against the memory check's prediction, step
time against C = 1 on the same process count, and a context that one process's memory limit does not hold.

    python benchmarks/context_parallel.py                                  # about 40 min on 2 busy cores
    python benchmarks/context_parallel.py --contexts 2048 --rounds 1 --limit-context 0     # a quick look
    python benchmarks/context_parallel.py --parts limit --steps 2 --width 256 --heads 8 --kv-heads 4 \\
        --limit-context 8192 --limit-gib 0.34                       # the limit part of docs/benchmarks.md
    python benchmarks/context_parallel.py --contexts 2048,4096 --rounds 1 --parts table,time   # ~15 min
    python benchmarks/context_parallel.py --contexts 4096 --processes 1,2 --rounds 3 --steps 5 --parts table,time
    python benchmarks/context_parallel.py --contexts 8192,16384 --processes 2,4 --rounds 1 --parts table \
        --limit-context 0 --give-back                 # the tensors held at once against the check, ~15 min

Each configuration is what a user gets from (N processes, C ranks per sequence):

    polytrain train --model llama --dataset shakespeare --layers 2 --width 128 --heads 4 --kv-heads 2 \\
        --context T --batch-size 4 [--strategy sharded --devices N [--context-parallel C]] --max-steps 3

run through `polytrain.fit` with the same keywords (the defaults of `--model llama`: AdamW, cosine schedule,
clipping at 1.0, float32, no activation checkpointing) and one callback on rank 0 that notes the time of each
step's end and, after each step and at the end, the peak resident memory (VmHWM) of every worker process (the
children of rank 0's parent, the forkserver; on one process, the process itself). The configurations are

    1 process | sharded 2 | sharded 2, cp 2 | sharded 4 | sharded 4, cp 2 (2 shards x cp 2) | sharded 4, cp 4

at each context, interleaved: round 1 runs them all at every context, then round 2 again (A B C ... A B C).
All read the same global batch of 4 sequences, so on N processes every process holds 4T/N tokens whichever
way they are split: C = 1 splits the batch, C > 1 each sequence.

- **Activation memory per process** = a process's peak RSS at context T minus the peak RSS of the same
  configuration (same processes, batch, model and optimizer) at context 64 (`--baseline-context`): what the
  tokens add (activations saved for the backward, the gathered keys and values, logits, the step's
  temporaries, and what the allocator keeps of them), not torch, gloo or the training state, which do not grow
  with T. Beside it, the memory check's prediction for the same layout, worked out as `check_fits` does
  (scaling/fits.py): `measured_activations` on the meta model at T, `memory_per_rank(layout_for(
  config, "sharded"))` with and without the activations (on a context rank: its part of each sequence, and what
  the ring holds beyond it, planning/context.py `context_part`). A process's heap keeps freed blocks for the
  next step and fragments, so its peak RSS is the tensors it held at once plus what the heap kept (up to 0.8x the
  activations, docs/benchmarks.md); with `--give-back` every worker gives freed blocks over 1 MiB back at once,
  as polytrain does where a heap keeping them would not fit, and its peak RSS is the tensors it held at once.
- **Step time**: the median over rounds of each run's median step (the steps after the first), and its ratio
  to C = 1 on the same number of processes in the same round. With `--parts time`, beside it the cost model's
  step at the largest context (planning/context.py `context_parallel`, `sharded` where C = 1): from the workload
  and link `--strategy auto` measures in this process (scaling/workload.py `measure`, the model materialised),
  without a cost per message, attention's share of a pass taken from its FLOPs and, beside it, timed (its
  layers' forward + backward alone against the measured pass).
- **A context one process cannot hold** (`--limit-context`, `--limit-gib`): the memory check has no setting
  for a memory limit (it reads the host's MemAvailable / processes), so the limit is given to it by replacing
  `polytrain.scaling.fits.available_per_rank` in this process: its one line for 1 process, and whether it
  passes 4 processes with --context-parallel 4. Then both train, batch 1, the limit enforced on every process
  by `prlimit --as` (address space: the limit plus each configuration's address space at the baseline
  context, so that what the tokens add is what is limited), then again without it; the peaks are reported
  against the limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 2**20

# (label, processes, context-parallel degree); the C = 1 row each C > 1 row is compared with comes first
CONFIGS = (
    ("1 process", 1, 1),
    ("sharded 2", 2, 1),
    ("sharded 2, cp 2", 2, 2),
    ("sharded 4", 4, 1),
    ("sharded 4, cp 2", 4, 2),
    ("sharded 4, cp 4", 4, 4),
)


def status(pid) -> dict:
    """VmHWM, VmRSS and VmPeak (bytes) of process `pid` ({} where it has gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        key = line.split(":", 1)[0]
        if key in ("VmHWM", "VmRSS", "VmPeak"):
            fields[key] = int(line.split()[1]) * 1024
    return fields


class Probe:
    """A callback on rank 0: each step's end time, and every worker's VmHWM / VmPeak after each step and at
    the end, written to `path` as JSON."""

    def __init__(self, path: str, processes: int):
        self.path, self.processes = path, processes
        self.ends, self.start, self.peaks = [], None, {}

    def workers(self) -> list:
        if self.processes == 1:
            return [os.getpid()]
        parent = os.getppid()
        try:
            return [int(p) for p in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
        except OSError:
            return [os.getpid()]

    def read(self) -> None:
        for pid in self.workers():
            now = status(pid)
            if now:
                seen = self.peaks.setdefault(str(pid), {"VmHWM": 0, "VmPeak": 0})
                seen["VmHWM"] = max(seen["VmHWM"], now["VmHWM"])
                seen["VmPeak"] = max(seen["VmPeak"], now["VmPeak"])

    def on_epoch_start(self, trainer):
        if self.start is None:
            self.start = time.perf_counter()

    def on_step_end(self, trainer):
        self.ends.append(time.perf_counter())
        self.read()

    def on_fit_end(self, trainer):
        self.read()
        Path(self.path).write_text(json.dumps({"start": self.start, "ends": self.ends, "peaks": self.peaks}))


def shape_of(args, context: int) -> dict:
    return dict(
        layers=args.layers, width=args.width, heads=args.heads, kv_heads=args.kv_heads, context=context
    )


def command_line(shape: dict, batch: int, processes: int, cp: int, steps: int) -> str:
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in shape.items())
    layout = f" --strategy sharded --devices {processes}" if processes > 1 else ""
    layout += f" --context-parallel {cp}" if cp > 1 else ""
    return (
        f"polytrain train --model llama --dataset shakespeare {flags} --batch-size {batch}{layout} "
        f"--max-steps {steps}"
    )


def one_run(spec: dict) -> None:
    """(in a fresh process) train one configuration through polytrain.fit with the Probe on rank 0."""
    from context_parallel import Probe as ImportableProbe  # by its module's name, so the workers unpickle it

    import polytrain

    layout = {}
    if spec["processes"] > 1:
        layout = dict(strategy="sharded", devices=spec["processes"])
        if spec["cp"] > 1:
            layout["context_parallel"] = spec["cp"]
    if spec.get("give_back"):  # as the memory check decides where a heap keeping freed blocks would not fit
        from polytrain.scaling.fits import Fit

        Fit.gives_back_memory = lambda self: True
    polytrain.fit(
        "llama", "shakespeare", **spec["shape"], batch_size=spec["batch"], max_steps=spec["steps"],
        out=spec["out"], verbose=False, callbacks=[ImportableProbe(spec["result"], spec["processes"])], **layout,
        activation_checkpointing=spec.get("checkpointing", "none"),
    )  # fmt: skip


def train(spec: dict, folder: Path, name: str, limit_as: int = 0) -> dict:
    """Run one configuration in a fresh process (under `prlimit --as` where `limit_as`); its Probe's figures,
    or {"error": the log's tail}."""
    spec = dict(spec, out=str(folder / name), result=str(folder / f"{name}.json"))
    command = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(spec)]
    if limit_as:
        command = ["prlimit", f"--as={limit_as}", "--"] + command
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    log = folder / f"{name}.log"
    with open(log, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if code or not Path(spec["result"]).exists():
        return {"error": log.read_text()[-1500:], "code": code}
    probe = json.loads(Path(spec["result"]).read_text())
    ends = [probe["start"]] + probe["ends"]
    steps = [b - a for a, b in zip(ends, ends[1:])]
    peaks = probe["peaks"]
    return {
        "steps": steps,
        "step": statistics.median(steps[1:]) if len(steps) > 1 else steps[0],
        "hwm": sorted(p["VmHWM"] for p in peaks.values()),
        "vm": sorted(p["VmPeak"] for p in peaks.values()),
    }


def predicted(shape: dict, batch: int, processes: int, cp: int, checkpointing: str = "none") -> tuple:
    """(bytes per rank, of which activations) as `check_fits` counts them for this layout."""
    import torch

    from polytrain.data import load_dataset
    from polytrain.models import build_model_on_meta
    from polytrain.parallel.presets import plain_layout
    from polytrain.planning.memory import memory_per_rank
    from polytrain.scaling.fits import layout_for, measured_activations, model_workload

    data = load_dataset("shakespeare", context=shape["context"])
    model = build_model_on_meta("llama", data.input_shape, data.num_classes, shape)
    config = config_of(batch, processes, cp)
    strategy = "sharded" if processes > 1 else "single"
    layout = layout_for(config, strategy) or plain_layout(strategy, processes)  # (as check_fits takes it)
    work = model_workload(model, batch_size=batch, **measured_activations(model, data, torch.device("cpu")))
    whole = memory_per_rank(work, layout, optimizer_slots=2, checkpointing=checkpointing)
    bare = memory_per_rank(dataclasses.replace(work, activation_bytes=0.0), layout, optimizer_slots=2)
    return whole, whole - bare


def predicted_steps(args, context: int) -> dict:
    """The cost model's step (seconds) of each configuration at `context`: {label: (with attention's share of
    one device's pass taken from the FLOPs, with it measured: its layers' forward + backward timed alone)}."""
    import torch

    from polytrain.data import load_dataset
    from polytrain.models import build_model
    from polytrain.objective import Objective
    from polytrain.planning.context import attention_share, context_parallel
    from polytrain.scaling.workload import link_for, measure

    shape = shape_of(args, context)
    data = load_dataset("shakespeare", context=context)
    torch.manual_seed(0)
    model = build_model("llama", data.input_shape, data.num_classes, shape)
    work, (link, _) = measure(
        model, data, Objective(kind="language"), batch_size=args.batch_size, device=torch.device("cpu"),
        devices=sorted({n for _, n, _ in CONFIGS if n > 1}), repeats=3, link=True,
    )  # fmt: skip
    shares = attention_share(work), timed_share(model, data, work.attention, args.batch_size)
    steps = {"1 process": (work.compute_seconds,) * 2}
    for label, n, cp in CONFIGS[1:]:
        seen = link_for(link, n, device_type="cpu")
        steps[label] = tuple(
            context_parallel(work, n, seen, context=cp, scatter_by_allreduce=True, share=share).step_seconds
            for share in shares
        )
    print(
        f"cost model at T={context}: one device {work.compute_seconds:.2f} s, replica passes "
        f"{ {n: round(s, 2) for n, s in work.replica_seconds.items()} }, attention's share "
        f"{shares[0]:.2f} of the FLOPs, {shares[1]:.2f} of the pass; link alpha {link.alpha * 1e6:.0f} us beta "
        f"{link.beta / 1e9:.2f} GB/s",
        flush=True,
    )
    return {"steps": steps, "shares": shares}


def timed_share(model, data, shape, batch: int, rounds: int = 4) -> float:
    """Attention's share of one device's forward + backward: its layers alone (random queries, keys and values
    of their shapes) against the whole model's pass, interleaved, the fastest of `rounds` each."""
    import torch
    import torch.nn.functional as F

    from polytrain.objective import Objective
    from polytrain.scaling.workload import sample_batch

    x, y = sample_batch(data, batch)
    sizes = [(batch, heads, shape.context, shape.head_dim) for heads in (shape.heads, shape.kv_heads)]
    q, k, v = (torch.randn(sizes[i > 0], requires_grad=True) for i in range(3))

    def attention():
        for _ in range(shape.layers):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    def whole():
        model.zero_grad()
        Objective(kind="language").loss_sum(model(x), y).backward()

    fastest = [float("inf")] * 2
    for _ in range(rounds):
        for i, work in enumerate((attention, whole)):
            began = time.perf_counter()
            work()
            fastest[i] = min(fastest[i], time.perf_counter() - began)
    return fastest[0] / fastest[1]


def config_of(batch: int, processes: int, cp: int, checkpointing: str = "none"):
    """The settings `check_fits` and `layout_for` read."""
    return types.SimpleNamespace(
        devices=processes, batch_size=batch, accumulate=1, activation_checkpointing=checkpointing,
        context_parallel=cp if cp > 1 else None, pipeline_stages=None, tensor_parallel=None,
        data_parallel=None, replicas=None,
    )  # fmt: skip


def check_line(shape: dict, batch: int, processes: int, cp: int, limit: float) -> str:
    """The memory check's verdict with `limit` bytes per process: its line, or that it passes."""
    import torch

    import polytrain.scaling.fits as fits
    from polytrain.data import load_dataset
    from polytrain.errors import UserError
    from polytrain.models import build_model_on_meta

    data = load_dataset("shakespeare", context=shape["context"])
    model = build_model_on_meta("llama", data.input_shape, data.num_classes, shape)
    original = fits.available_per_rank
    fits.available_per_rank = lambda device, devices: limit  # no setting gives the check a limit
    try:
        fits.check_fits(
            config_of(batch, processes, cp), model, "sharded" if processes > 1 else "single", name="llama",
            device=torch.device("cpu"), slots=2, dataset=data,
        )  # fmt: skip
        return "passes"
    except UserError as error:
        return f"refuses: {error}"
    finally:
        fits.available_per_rank = original


def mib(value: float) -> str:
    return f"{value / MIB:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="2048,4096,8192")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="global batch, sequences")
    parser.add_argument(
        "--steps", type=int, default=3, help="--max-steps of each run (the first is not timed)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--processes", default="1,2,4", help="only the configurations on these process counts"
    )
    parser.add_argument("--baseline-context", type=int, default=64, help="the tiny context (a multiple of 8)")
    parser.add_argument("--limit-context", type=int, default=16384, help="0: skip the memory-limit part")
    parser.add_argument(
        "--limit-gib", type=float, default=0.0, help="default: halfway between the 2 predictions"
    )
    parser.add_argument(
        "--parts",
        default="table,limit",
        help="table, limit, time (the cost model's steps beside the table's)",
    )
    parser.add_argument("--activation-checkpointing", default="none", help="of every run of the table")
    parser.add_argument(
        "--give-back",
        action="store_true",
        help="every worker gives freed blocks over 1 MiB back at once (as polytrain does where a heap keeping "
        "them would not fit), so that its peak RSS is the tensors it holds at once, not what its heap keeps",
    )
    parser.add_argument("--json", type=Path, help="write every figure here too")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return one_run(json.loads(args.one))
    import torch

    global CONFIGS
    CONFIGS = tuple(c for c in CONFIGS if str(c[1]) in args.processes.split(","))
    contexts = [int(c) for c in args.contexts.split(",")]
    batch, steps, mode = args.batch_size, args.steps, args.activation_checkpointing
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M %Z')}", flush=True
    )
    for label, n, cp in CONFIGS:
        print(f"  {label}: {command_line(shape_of(args, 'T'), batch, n, cp, steps)}")
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "baseline": {}, "runs": {}, "predicted": {}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="context-parallel-") as tmp:
        folder = Path(tmp)
        for label, n, cp in CONFIGS if "table" in args.parts else ():  # what they hold at a tiny context
            spec = dict(shape=shape_of(args, args.baseline_context), batch=batch, processes=n, cp=cp, steps=2)
            base = train(dict(spec, checkpointing=mode, give_back=args.give_back), folder, f"base-{n}-{cp}")
            if "error" in base:
                raise SystemExit(f"{label} at the baseline context failed:\n{base['error']}")
            record["baseline"][label] = base
            print(f"baseline {label}: peak RSS {[mib(h) for h in base['hwm']]} MiB", flush=True)
        for context in contexts if "table" in args.parts else ():
            for label, n, cp in CONFIGS:
                record["predicted"][f"{context} {label}"] = predicted(
                    shape_of(args, context), batch, n, cp, mode
                )
        if "time" in args.parts:
            record["steps"] = predicted_steps(args, max(contexts))
        for round_ in range(args.rounds if "table" in args.parts else 0):
            for context in contexts:
                for label, n, cp in CONFIGS:
                    spec = dict(shape=shape_of(args, context), batch=batch, processes=n, cp=cp, steps=steps)
                    run = train(
                        dict(spec, checkpointing=mode, give_back=args.give_back),
                        folder,
                        f"r{round_}-{context}-{n}-{cp}",
                    )
                    record["runs"].setdefault(f"{context} {label}", []).append(run)
                    if "error" in run:
                        print(f"round {round_ + 1} T={context} {label}: FAILED\n{run['error']}", flush=True)
                        continue
                    print(
                        f"round {round_ + 1} T={context} {label}: steps "
                        f"{', '.join(f'{s:.2f}' for s in run['steps'])} s; peak RSS "
                        f"{', '.join(mib(h) for h in run['hwm'])} MiB  ({time.perf_counter() - started:.0f} s)",
                        flush=True,
                    )
        if "table" in args.parts:
            table(record, contexts, batch)
        if "table" in args.parts and "time" in args.parts:
            step_table(record, max(contexts))
        if "limit" in args.parts and args.limit_context:
            limit_part(args, folder, record)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1, default=str))


def step_table(record: dict, context: int) -> None:
    """The cost model's step against the measured one at `context` (median over rounds), and both ratios to
    C = 1 on the same processes."""
    measured = {}
    for label, _, _ in CONFIGS:
        runs = [r for r in record["runs"][f"{context} {label}"] if "error" not in r]
        measured[label] = statistics.median(r["step"] for r in runs) if runs else float("nan")
    predicted = record["steps"]["steps"]
    record["step_table"] = {"measured": measured}
    flops, timed = record["steps"]["shares"]
    print(
        f"\nT={context}: step seconds, measured against the cost model with attention's share of a pass "
        f"from its FLOPs ({flops:.2f}) and timed ({timed:.2f}); ratios to C = 1 on the same processes"
    )
    print("| configuration | measured s | predicted s (FLOPs, timed) | measured / C=1 | predicted / C=1 |")
    print("| --- | --- | --- | --- | --- |")
    reference = {}
    for label, n, cp in CONFIGS:
        if cp == 1:
            reference[n] = label
        base = reference[n]
        ratios = [f"{mine / theirs:.2f}" for mine, theirs in zip(predicted[label], predicted[base])]
        print(
            f"| {label} | {measured[label]:.2f} | {', '.join(f'{s:.2f}' for s in predicted[label])} | "
            f"{measured[label] / measured[base]:.2f} | {', '.join(ratios)} |"
        )


def table(record: dict, contexts: list, batch: int) -> None:
    print(
        f"\nbatch {batch}; activations = peak RSS minus the same configuration's peak at the baseline context; "
        "step: median over rounds of each run's median step after the first; ratio: to C = 1 on the same "
        "processes, per round"
    )
    print(
        "| T | configuration | peak RSS MiB per process | activations MiB per process (measured) | "
        "predicted activations MiB | measured / predicted | step s | step / C=1 by round |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for context in contexts:
        references = {}
        for label, n, cp in CONFIGS:
            runs = [r for r in record["runs"][f"{context} {label}"] if "error" not in r]
            if not runs:
                print(f"| {context} | {label} | failed | | | | | |")
                continue
            hwm = [max(r["hwm"][i] for r in runs) for i in range(len(runs[0]["hwm"]))]
            # each process against the process of the same place in the baseline's sorted peaks (rank 0, which
            # holds the data and the run's records, is the largest in both)
            measured = [h - b for h, b in zip(hwm, record["baseline"][label]["hwm"])]
            _, activations = record["predicted"][f"{context} {label}"]
            step = statistics.median(r["step"] for r in runs)
            if cp == 1:
                references[n] = record["runs"][f"{context} {label}"]
            ratios = [
                f"{a['step'] / b['step']:.2f}"
                for a, b in zip(record["runs"][f"{context} {label}"], references.get(n, []))
                if "error" not in a and "error" not in b
            ]
            print(
                f"| {context} | {label} | {', '.join(mib(h) for h in hwm)} | "
                f"{', '.join(mib(m) for m in measured)} | {mib(activations)} | "
                f"{max(measured) / activations:.2f} | {step:.2f} | {', '.join(ratios) if cp > 1 else '1'} |"
            )


def limit_part(args, folder: Path, record: dict) -> None:
    """One process against 4 with --context-parallel 4 at a context whose activations one process cannot hold
    within the limit: the memory check's verdicts, both trained under `prlimit --as`, then both without a limit
    for their peaks."""
    context = args.limit_context
    shape = shape_of(args, context)
    print(f"\nT={context}, batch 1:", flush=True)
    cases = (("cp 4", 4, 4, "sharded 4, cp 4"), ("1 process", 1, 1, "1 process"))
    plans = {label: predicted(shape, 1, n, cp) for label, n, cp, _ in cases}
    limit = args.limit_gib * 2**30 or (plans["1 process"][0] + plans["cp 4"][0]) / 2
    print(
        f"  predicted per process: 1 process {mib(plans['1 process'][0])} MiB, 4 processes with "
        f"--context-parallel 4 {mib(plans['cp 4'][0])} MiB; limit {mib(limit)} MiB per process",
        flush=True,
    )
    record["limit"] = {"context": context, "limit": limit, "predicted": plans}
    for label, n, cp, _ in reversed(cases):
        verdict = check_line(shape, 1, n, cp, limit)
        record["limit"][f"check {label}"] = verdict
        print(f"  memory check, {command_line(shape, 1, n, cp, args.steps)}: {verdict}", flush=True)
    for label, n, cp, base_label in cases:
        if base_label not in record["baseline"]:
            spec = dict(
                shape=shape_of(args, args.baseline_context), batch=args.batch_size, processes=n, cp=cp
            )
            record["baseline"][base_label] = train(dict(spec, steps=2), folder, f"base-{n}-{cp}")
        base = record["baseline"][base_label]
        limit_as = int(max(base["vm"]) + limit)
        spec = dict(shape=shape, batch=1, processes=n, cp=cp, steps=args.steps)
        for limited in (limit_as, 0):
            run = train(spec, folder, f"limit-{n}-{cp}-{limited}", limit_as=limited)
            record["limit"][f"run {label} {'limited' if limited else 'unlimited'}"] = run
            how = f"under prlimit --as={limited}" if limited else "without a limit"
            if "error" in run:
                last = [line for line in run["error"].splitlines() if line.strip()][-2:]
                print(f"  {label} {how}: FAILED (exit {run['code']}): {' / '.join(last)[-400:]}", flush=True)
                continue
            above = [h - b for h, b in zip(run["hwm"], sorted(base["hwm"]))]
            print(
                f"  {label} {how}: trained; steps {', '.join(f'{s:.1f}' for s in run['steps'])} s; peak RSS "
                f"{', '.join(mib(h) for h in run['hwm'])} MiB, above the baseline {', '.join(mib(a) for a in above)}"
                f" MiB (limit {mib(limit)})",
                flush=True,
            )


if __name__ == "__main__":
    main()
