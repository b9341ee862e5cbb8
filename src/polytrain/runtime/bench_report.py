"""What `polytrain bench` prints and writes: the table, one line of explanation for every combination that
loses to fewer devices, the projections to larger counts, bench.json and bench.png.

Everything here reads numbers only (rows, workloads, links), so it is tested on rows made by hand.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict
from pathlib import Path
from typing import List

import torch

from ..pipeline.plan import default_microbatches
from ..planning.costmodel import bubble, tensor_collectives
from ..planning.experts import ALL_TO_ALL
from ..report import save_figure
from ..run_dir import atomic_write_bytes
from ..strategy_registry import STRATEGIES
from .bench import PHASES, BenchResult, Row
from .hostenv import usable_cores

MB = 1e6


def _mib(nbytes) -> str:
    return "" if not nbytes else f"{nbytes / 2**20:.2f}"


def table(rows: List[Row]) -> List[str]:
    text = any(math.isfinite(row.tokens_per_second) for row in rows)  # a language model: tokens/s as well
    counted = any(math.isfinite(row.peak_fraction) for row in rows)  # FLOPs counted: their share of the peak
    header = (
        f"{'device':<6} {'strategy':<16} {'n':>2} {'batch':>5} {'samples/s':>10} "
        + (f"{'tokens/s':>10} " if text else "")
        + (f"{'% peak':>6} " if counted else "")
        + f"{'ms/step':>8} "
        f"{'speedup':>7} {'eff.':>5} {'MiB/rank':>8}  {'compute':>7} {'comm.':>6} {'a2a':>5} {'data':>5} "
        f"{'idle':>5} "
        f"{'predicted':>14}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        what = f"{row.device:<6} {row.label:<16} {row.devices:>2} {row.batch_size:>5} "
        if row.skipped:
            lines.append(what + f"skipped: {row.skipped}")
            continue
        shares = "  ".join(f"{row.phases.get(p, 0.0) / row.step_seconds:>5.0%}" for p in PHASES)
        predicted = ""
        if math.isfinite(row.predicted_seconds):
            error = row.predicted_seconds / row.step_seconds - 1
            predicted = f"{row.predicted_seconds * 1e3:.1f} ({'fitted' if row.fitted else f'{error:+.0%}'})"
        memory = row.peak_bytes or row.held_bytes
        tokens = f"{row.tokens_per_second:>10,.0f} " if text else ""
        tokens += f"{100 * row.peak_fraction:>6.1f} " if counted else ""
        lines.append(
            what + f"{row.samples_per_second:>10,.0f} {tokens}{row.step_seconds * 1e3:>8.2f} "
            f"{row.speedup:>6.2f}x {row.efficiency:>5.0%}{'!' if row.warning else ' '}"
            f"{_mib(memory):>8}  {shares} {predicted:>14}"
        )
    routed = [row for row in rows if not row.skipped and math.isfinite(row.imbalance)]
    if routed:
        lines.append("")
    for (
        row
    ) in routed:  # experts split over ranks: the exchanges' time, and how evenly the tokens reached them
        lines.append(
            f"{row.label} on {row.devices} {row.device}, batch {row.batch_size}: all-to-all "
            f"{row.phases.get('all-to-all', 0.0) * 1e3:.1f} ms per step; the busiest expert rank computed "
            f"{row.imbalance:.2f}x the mean rank's (token, choice) pairs"
        )
    flagged = [row for row in rows if row.warning and not row.skipped]
    if flagged:
        lines.append("")
    for row in flagged:
        lines.append(f"! {row.strategy} on {row.devices} {row.device}, batch {row.batch_size}: {row.warning}")
    return lines


def _losing(rows: List[Row]):
    """Rows on several devices that are slower than the same device kind and batch on fewer devices (the
    same strategy, or one device), with the fastest such row."""
    done = [r for r in rows if not r.skipped]
    for row in done:
        if row.devices < 2:
            continue
        fewer = [
            r
            for r in done
            if r.key == row.key and r.devices < row.devices and (r.strategy == row.strategy or r.devices == 1)
        ]
        best = min(fewer, key=lambda r: r.step_seconds, default=None)
        if best is not None and best.step_seconds < row.step_seconds:
            yield row, best


def _bigger_batch(row: Row, target: float = 0.2):
    """The smallest global batch (the current one times 2, 4, ... 64) at which communication would be at
    most `target` of a step, if the other phases grow with the batch; and that share."""
    comm = row.phases["communication"]
    rest = row.step_seconds - comm - row.phases["idle"]
    for factor in (2, 4, 8, 16, 32, 64):
        share = comm / (comm + rest * factor + row.phases["idle"])
        if share <= target or factor == 64:
            return row.batch_size * factor, share


def explain(rows: List[Row], workloads: dict, *, cores: int = 0) -> List[str]:
    """One line per combination that loses to fewer devices: the phase that grew, in numbers, and what to
    change."""
    lines = []
    cores = cores or usable_cores()
    for row, best in _losing(rows):
        work = workloads.get(row.key)
        share = {p: row.phases.get(p, 0.0) / row.step_seconds for p in PHASES}
        label = f"{row.label} on {row.devices} {row.device}, batch {row.batch_size}"
        against = (
            f"({row.step_seconds * 1e3:.1f} ms/step against {best.step_seconds * 1e3:.1f} ms on "
            f"{best.devices} device{'s' * (best.devices > 1)})"
        )
        overhead = max(("communication", "idle", "data"), key=lambda p: share[p])
        slice_ = row.batch_size // row.devices
        if overhead == "communication" and share["communication"] >= 0.15 and row.layout.tensor > 1 and work:
            reason = (
                f"communication is {share['communication']:.0%} of each step: "
                f"{collectives(work, row)}; they grow with the batch as the compute does, so "
                f"tensor parallelism pays off only where a layer's compute outweighs its activations' "
                f"collectives (wider layers, faster links)"
            )
        elif overhead == "communication" and share["communication"] >= 0.15:
            nbytes = (
                f"{work.parameter_bytes / MB:.1f} MB of {'weights and gradients' if row.layout.shard > 1 else 'gradients'}"
                if work
                else "the exchanged tensors"
            )
            batch, after = _bigger_batch(row)
            reason = (
                f"communication is {share['communication']:.0%} of each step: {nbytes} per {slice_}-sample "
                f"slice; a global batch of {batch} would make it {after:.0%}"
            )
        elif overhead == "idle" and share["idle"] >= 0.15 and row.layout.pipeline > 1:
            m = default_microbatches(row.batch_size, row.devices)
            gap = bubble(row.devices, m)
            if share["idle"] <= 2 * gap:  # the schedule's bubble is the waiting: more micro-batches shrink it
                more = next((c for c in (4 * m, 2 * m) if row.batch_size % c == 0), m)
                reason = (
                    f"idle is {share['idle']:.0%} of each step: the pipeline bubble (p-1)/(m+p-1) is "
                    f"{gap:.2f} with {m} micro-batches; "
                    + (
                        f"--microbatches {more} would make it {bubble(row.devices, more):.2f}"
                        if more != m
                        else "a larger batch allows more micro-batches"
                    )
                )
            else:  # waiting on transfers, one per micro-batch: more would add to it
                # as few as one per stage (every torch runs that), dividing the batch
                fewer = next((c for c in range(row.devices, m) if row.batch_size % c == 0), None)
                reason = (
                    f"idle is {share['idle']:.0%} of each step against a pipeline bubble (p-1)/(m+p-1) of "
                    f"{gap:.2f} with {m} micro-batches: the rest is stages waiting for each other's activations "
                    f"and gradients, exchanged once per micro-batch, so more micro-batches add waits"
                    + (f" and fewer (--microbatches {fewer}) remove some" if fewer else "")
                    + "; a pipeline pays off where a stage's compute outweighs its transfers (a larger model "
                    "or batch)"
                )
        elif overhead == "idle" and share["idle"] >= 0.15 and STRATEGIES[row.strategy].waits_on_servers:
            reason = (
                f"waiting on the server is {share['idle']:.0%} of each step: every worker's pull waits for "
                f"the server's update; --servers {row.devices} spreads it, or --strategy data has no server"
            )
        elif overhead == "idle" and share["idle"] >= 0.15:
            reason = (
                f"idle is {share['idle']:.0%} of each step: ranks wait for the slowest one; look for a rank "
                f"with more work or a busier core"
            )
        elif overhead == "data" and share["data"] >= 0.15:
            reason = (
                f"loading data is {share['data']:.0%} of each step; keep the data in memory (an ArrayDataset "
                f"or a registry dataset) or give the loader more workers (num_workers=)"
            )
        else:
            one = best.phases["compute"] if best.devices == 1 else math.nan
            compute = row.phases["compute"] * 1e3
            if row.device == "cpu":
                reason = (
                    f"compute is {compute:.1f} ms per step against {one * 1e3:.1f} ms on one device: "
                    f"{row.devices} processes share {cores} cores, so each computes its 1/{row.devices} of "
                    f"the batch on at most 1/{min(row.devices, cores)} of them; more processes help only with "
                    f"more cores or GPUs"
                )
            else:
                reason = (
                    f"compute is {compute:.1f} ms per step against {one * 1e3:.1f} ms on one device: a "
                    f"{slice_}-sample slice keeps a GPU busy no shorter than the whole batch (launch-bound); "
                    f"a global batch of {row.batch_size * row.devices} keeps each slice at {row.batch_size}"
                )
        lines.append(f"  {label} is slower {against}: {reason}")
    return lines


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**10:.0f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.1f} MiB"


def collectives(work, row: Row) -> str:
    """The collectives one step of a tensor-parallel row makes, as the cost model counts them."""
    tensor = row.layout.tensor
    sent = tensor_collectives(work, row.devices, tensor)
    gloo = " (all-reduces on gloo)" if row.device == "cpu" else ""
    parts = []
    for kind, sizes in sent.items():
        if not sizes:
            continue
        plural = f"{len(sizes)} {kind}{'s' if len(sizes) != 1 else ''}"
        if kind == "small all-reduce":
            parts.append(f"{plural} of the norms' gradients")
        else:
            parts.append(f"{plural}{gloo if kind == 'reduce-scatter' else ''} of up to {_size(max(sizes))}")
    how = (
        "sequence-parallel"
        if "reduce-scatter" in sent
        else "all-reduces after each row-wise layer in forward and before each column-wise one in backward"
    )
    how += ", the scores of a head split by the vocabulary gathered whole" if work.tensor_gathers else ""
    line = f"{', '.join(parts) or 'no collectives'} per step over each group of {tensor} ({how})"
    groups = row.devices // tensor
    if groups > 1:
        line += (
            f"; FSDP2 over {groups} data shards: 2 all-gathers and a reduce-scatter per layer ({work.layers}) "
            f"of each rank's {_size(work.tensor_rank_bytes(tensor))} of weights"
        )
    return line


def tensor_lines(result: BenchResult) -> List[str]:
    """One line per tensor-parallel row: which collectives a step makes, and how many."""
    return [
        f"  {row.label} on {row.devices} {row.device}, batch {row.batch_size}: "
        f"{collectives(result.workloads[row.key], row)}"
        for row in result.rows
        if row.layout.tensor > 1
        and not row.skipped
        and row.key in result.workloads
        and result.workloads[row.key].tensor_splits
    ]


def projection_lines(result: BenchResult) -> List[str]:
    lines = []
    for kind, batch, n, predictions, chosen in result.projections:
        if not predictions:
            lines.append(
                f"  {n} {kind}, batch {batch}: not projected: a global batch of {batch} does not split into "
                f"{n} equal slices; give --batch-sizes a multiple of {n}"
            )
            continue
        work = result.workloads[(kind, batch)]
        finite = {name: p for name, p in predictions.items() if math.isfinite(p.step_seconds)}
        parts = ", ".join(
            f"{name} {work.compute_seconds / p.step_seconds:.3g}x" for name, p in finite.items()
        )
        where = "processes sharing this machine's cores" if kind == "cpu" else "GPUs like this one"
        pick = f"would pick {chosen}" if chosen else "nothing fits"
        slower = (
            " (slower than one device)"
            if chosen and finite[chosen].step_seconds > work.compute_seconds
            else ""
        )
        lines.append(f"  {n} {kind} ({where}), batch {batch}: {pick}{slower}; speedup {parts}")
    return lines


def report(result: BenchResult) -> List[str]:
    lines = table(result.rows)
    why = explain(result.rows, result.workloads)
    if why:
        lines += ["", "where more devices lose:"] + why
    tensor = tensor_lines(result)
    if tensor:
        lines += ["", "tensor rows (groups of T ranks split the plan's layers, the rest runs whole on each):"]
        lines += tensor
    for kind, peak in result.peaks.items():
        if math.isfinite(result.flops_per_sample):
            lines.append(
                f"% peak ({kind}): {result.flops_per_sample / 1e6:,.1f} MFLOP per sample (forward and "
                f"backward, as torch's FlopCounterMode counts them) x samples/s, over a 1024 x 1024 float32 "
                f"matmul's {peak / 1e9:,.1f} GFLOP/s"
                + (f" on {torch.get_num_threads()} threads" if kind == "cpu" else " per GPU")
            )
    for kind, (link, how) in result.links.items():
        lines.append(
            f"link ({kind}): {link.alpha * 1e6:.0f} us per message, {link.beta / 1e9:.2f} GB/s; {how}"
        )
        costs = result.message_costs.get(kind)
        if costs:
            each = ", ".join(
                f"{name} {seconds * 1e3:.2f} ms"
                + (" per collective" if name == "tensor" else " per call" if name == ALL_TO_ALL else "")
                for name, seconds in costs.items()
            )
            lines.append(
                f"  and per message inside a step ({kind}), fitted to each strategy's row marked "
                f"'fitted': {each}"
            )
    if result.projections:
        lines += ["", "predicted (cost model, from the measurements above):"] + projection_lines(result)
    return lines


def _workload_dict(work) -> dict:
    return dict(
        asdict(work),
        replica_seconds={str(k): v for k, v in work.replica_seconds.items()},
        microbatch_seconds={str(k): v for k, v in work.microbatch_seconds.items()},
        tensor_seconds={f"{n}/{t}": v for (n, t), v in work.tensor_seconds.items()},
        plain=_workload_dict(work.plain) if work.plain is not None else None,
    )


def write_json(result: BenchResult, path: Path) -> None:
    document = {
        "options": asdict(result.options),
        "machine": {
            "cores": usable_cores(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        },
        "links": {
            kind: {
                "alpha": link.alpha,
                "beta": link.beta,
                "how": how,
                "message_costs": result.message_costs.get(kind, {}),
            }
            for kind, (link, how) in result.links.items()
        },
        "workloads": [
            dict(_workload_dict(work), device=kind) for (kind, _), work in result.workloads.items()
        ],
        "rows": [row.to_dict() for row in result.rows],
        "flops": {"per_sample": result.flops_per_sample, "matmul_peak_per_second": result.peaks},
        "projections": [
            {
                "device": kind,
                "batch_size": batch,
                "devices": n,
                "chosen": chosen,
                "step_seconds": {
                    name: p.step_seconds for name, p in predictions.items() if math.isfinite(p.step_seconds)
                },
            }
            for kind, batch, n, predictions, chosen in result.projections
        ],
    }
    atomic_write_bytes(path, (json.dumps(document, indent=1, default=str) + "\n").encode())


def draw(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in result.rows if not r.skipped]
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 0.32 * len(done) + 3.5))
    lines = {}
    for row in done:
        if row.devices > 1 and math.isfinite(row.speedup):  # one device: the point (1, 1) of each
            lines.setdefault((row.device, row.batch_size, row.label), []).append((row.devices, row.speedup))
    most = max([r.devices for r in done], default=1)
    for (kind, batch, strategy), points in lines.items():
        xs, ys = zip(*sorted([(1, 1.0)] + points))
        left.plot(xs, ys, "o-", label=f"{strategy}, {kind}, batch {batch}")
    left.plot([1, most], [1, most], "k--", label="ideal")
    left.set_xticks(sorted({1, *(r.devices for r in done)}))
    left.set_xlabel("devices")
    left.set_ylabel("speedup over one device")
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    colours = {
        "compute": "#4c72b0",
        "communication": "#dd8452",
        "all-to-all": "#c44e52",
        "data": "#55a868",
        "idle": "#c7c7c7",
    }
    labels = [f"{r.label} x{r.devices} {r.device} b{r.batch_size}" for r in done]
    starts = [0.0] * len(done)
    for phase in PHASES:
        widths = [r.phases.get(phase, 0.0) * 1e3 for r in done]
        right.barh(range(len(done)), widths, left=starts, color=colours[phase], label=phase)
        starts = [s + w for s, w in zip(starts, widths)]
    right.set_yticks(range(len(done)), labels, fontsize=7)
    right.invert_yaxis()
    right.set_xlabel("milliseconds per step (mean over ranks)")
    right.legend(fontsize=7)
    save_figure(figure, path)
