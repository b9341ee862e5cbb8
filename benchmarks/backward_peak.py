"""What a training pass holds at its peak, beside its weights and their gradients, against the memory check's count:
torch's MemTracker on a real forward and backward of the built-in models on this CPU, one process, against what
the forward keeps (`kept_bytes`, the count before 2026-12-08) and that plus what the backward holds on top at its
peak (`peak_bytes`, with `backward_bytes` measured on fake tensors: scaling/activation_memory.py `backward_peak`).

    python benchmarks/backward_peak.py      # about 30 s on 2 cores

Prints one Markdown row per model, T, batch and precision (fp32, and bf16 under autocast); results of 2026-12-08:
docs/benchmarks.md, "The backward's peak in the memory check and the plan".
"""

from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from polytrain.models import build_model, build_model_on_meta
from polytrain.objective import Objective
from polytrain.planning.activations import kept_bytes, peak_bytes
from polytrain.planning.costmodel import Workload
from polytrain.scaling.activation_memory import activation_profile

VOCAB = 65
CASES = [
    ("gpt", dict(layers=2, width=128, heads=4, context=4096), 2),
    ("llama", dict(layers=2, width=128, heads=4, kv_heads=2, context=4096), 2),
    ("llama", dict(layers=2, width=128, heads=4, kv_heads=2, context=8192), 2),
    ("llama", dict(layers=2, width=128, heads=4, kv_heads=2, context=8192), 1),
    ("llama", dict(layers=4, width=256, heads=8, kv_heads=2, context=2048), 4),
]


def measure(name: str, shape: dict, batch: int, precision: str) -> tuple:
    """(bytes MemTracker measured at the peak of a real forward and backward beside the weights and their
    gradients, what the count says the forward keeps, what it says the pass peaks at) for `batch` sequences."""
    context = shape["context"]
    x = torch.zeros(batch, context, dtype=torch.long)
    model = build_model_on_meta(name, (context,), VOCAB, shape)
    figures = activation_profile(model, Objective(kind="language"), x, x, precision=precision)
    work = Workload(compute_seconds=1.0, parameter_bytes=0.0, batch_size=batch, **figures)
    torch.manual_seed(0)
    real = build_model(name, (context,), VOCAB, shape).train()
    tracker = MemTracker()
    tracker.track_external(real)
    with tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = Objective(kind="language").loss_sum(real(x), x)
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    measured = sum(peak.get(kind, 0) for kind in (_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.OTH))
    return measured, kept_bytes(work) * batch, peak_bytes(work) * batch


def row(name: str, shape: dict, batch: int, precision: str) -> str:
    measured, kept, counted = measure(name, shape, batch, precision)
    mib = 2**20
    return (
        f"| {name} {shape['layers']} x {shape['width']}, T {shape['context']}, batch {batch}, {precision} | "
        f"{measured / mib:.1f} | {kept / mib:.1f} ({kept / measured:.2f}) | {counted / mib:.1f} "
        f"({counted / measured:.2f}) |"
    )


def main() -> None:
    print("| model, T, batch | measured MiB | kept by the forward | kept + the backward's peak |")
    print("| --- | --- | --- | --- |")
    for precision in ("fp32", "bf16"):
        for name, shape, batch in CASES:
            print(row(name, shape, batch, precision), flush=True)


if __name__ == "__main__":
    main()
