"""How near the hardware's limit a step runs: the FLOPs of one sample's training pass as torch's
`FlopCounterMode` counts them (matrix products, convolutions, attention; not norms, activations or the optimizer),
against the FLOP/s of a large float32 matrix product on the same device, its practical peak."""

from __future__ import annotations

import math
import time

import torch

from .workload import sample_batch


def flops_per_sample(model, dataset, objective, *, count: int = 2) -> float:
    """FLOPs of one forward, loss and backward per sample, over `count` samples; nan where the objective cannot
    score the outputs alone. Counted on a copy of the model on the meta device (no weights are made, so a model
    of any size is counted, and the model given is not touched; attention runs as its matrix products there,
    which count)."""
    from torch.utils.flop_counter import FlopCounterMode

    from .activation_memory import fake_copy

    try:
        x, y = sample_batch(dataset, count)
        x, y = x.to("meta"), y.to("meta")
        model = fake_copy(model, "meta").train()
        with FlopCounterMode(display=False) as counter:
            objective.loss_sum(model(x), y).backward()
    except Exception:
        return math.nan
    return counter.get_total_flops() / len(x)


def matmul_peak(device: torch.device, *, size: int = 1024, repeats: int = 3) -> float:
    """FLOP/s of the fastest of `repeats` float32 `size` x `size` products on `device` (after an untimed one),
    on the threads this process has."""
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    out = torch.mm(a, b)
    fastest = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        torch.mm(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        fastest = min(fastest, time.perf_counter() - began)
    return 2 * size**3 / fastest
