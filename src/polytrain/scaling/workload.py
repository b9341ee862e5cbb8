"""What the cost model needs, measured in this process in a few seconds: the model's sizes, one device's
forward + backward at the slice sizes N devices would run, the optimizer update, and the link between two
ranks (gloo over loopback between two process groups of this process; on GPUs, a copy between two GPUs).

Where the N "devices" are CPU processes of this machine they share its cores: each gets cores/N threads
(polytrain's workers do the same), and beyond one process per core they take turns. The N slices are timed
at once, in N threads, under those conditions, so the prediction for N processes is for this machine.
"""
from __future__ import annotations

import dataclasses
import datetime
import statistics
import threading
import time
from contextlib import contextmanager
from functools import partial
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.nn as nn

from ..runtime.hostenv import usable_cores
from ..plan.costmodel import Link, Prediction, Workload, predict_all
from ..plan.pipeline import default_microbatches

LINK_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)
ASSUMED_GPU_LINK = Link(alpha=10e-6, beta=100e9)        # NVLink-class; used only where no link can be measured


def sample_batch(dataset, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """`count` training samples as model input (floats) and targets, repeating the set if it is smaller."""
    if hasattr(dataset, "sample_batch"):             # a Dataset: its inputs as the model gets them
        x, y = dataset.sample_batch(min(count, len(dataset.train)))
    else:
        x, y = dataset.sample_inputs(count), dataset.train_y[:count]
    repeats = -(-count // len(x))
    return torch.cat([x] * repeats)[:count], torch.cat([y] * repeats)[:count]


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def parameter_layers(model: nn.Module) -> int:
    """Modules holding parameters of their own: FSDP2 gathers each separately."""
    return sum(1 for m in model.modules() if any(p is not None for p in m._parameters.values())) or 1


@torch.no_grad()
def boundary_bytes(model: nn.Module, sample: torch.Tensor) -> Tuple[float, ...]:
    """Bytes per sample of the activations crossing each cut between consecutive layers of a Sequential
    (empty for a model the pipeline cannot split)."""
    from ..strategies.layers import flatten_layers
    try:
        layers = flatten_layers(model)
    except Exception:
        return ()
    was_training = model.training
    model.eval()
    sizes, x = [], sample[:1]
    try:
        for _, layer in layers[:-1]:
            x = layer(x)
            sizes.append(float(x.numel() * x.element_size()))
    finally:
        model.train(was_training)
    return tuple(sizes)


@contextmanager
def threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, count))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cpu_threads(devices: int, cores: Optional[int] = None) -> int:
    """Threads each of `devices` worker processes on this machine gets (as hostenv.share_cores gives)."""
    return max(1, (cores or usable_cores()) // devices)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_passes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, objective, *, device: torch.device,
                repeats: int = 5, channels_last: bool = False, warm: bool = True) -> Tuple[float, float]:
    """Median seconds of (forward + backward, SGD-with-momentum update) of `model` on one batch, after one
    untimed step (`warm`)."""
    model = model.to(device)
    x, y = x.to(device), y.to(device)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    passes, updates = [], []
    for _ in range(repeats + (1 if warm else 0) or 1):
        _synchronize(device)
        began = time.perf_counter()
        loss = objective.loss_sum(model(x), y) / len(y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        _synchronize(device)
        middle = time.perf_counter()
        optimizer.step()
        _synchronize(device)
        passes.append(middle - began)
        updates.append(time.perf_counter() - middle)
    skip = 1 if warm else 0
    return statistics.median(passes[skip:]), statistics.median(updates[skip:])


def time_concurrently(model: nn.Module, x: torch.Tensor, y: torch.Tensor, objective, *, copies: int,
                      repeats: int = 5, channels_last: bool = False) -> float:
    """Forward + backward of `copies` replicas at once, each in its own thread on its own batch, as that many
    CPU processes would run them on this machine's shared cores (contending for cores, caches and memory
    bandwidth, and taking turns beyond one per core): the slowest replica's median, which a synchronous step
    waits for. Torch's operators release the GIL, so the threads compute in parallel."""
    import copy
    start, times, errors = threading.Barrier(copies), [None] * copies, []

    def replica(index: int) -> None:
        try:
            own = copy.deepcopy(model)
            for _ in range(repeats + 1):
                start.wait(timeout=120)
                times[index] = times[index] or []
                times[index].append(time_passes(own, x, y, objective, device=torch.device("cpu"), repeats=0,
                                                channels_last=channels_last, warm=False)[0])
        except Exception as error:              # reported below, in the measuring thread
            errors.append(error)
            start.abort()

    workers = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(copies)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return max(statistics.median(t[1:]) for t in times)


def measure_workload(model: nn.Module, dataset, objective, *, batch_size: int, device: torch.device,
                     devices: Iterable[int], repeats: int = 5, channels_last: bool = False,
                     plain: bool = False) -> Workload:
    """One device's step at `batch_size`, and each count's replica slice and pipeline micro-batch, timed as
    they would run: on CPU processes, all slices at once on the cores they share. With `channels_last` and
    `plain`, the same again in the default memory format (`Workload.plain`), for the strategies that train in it."""
    measure = partial(_measure_format, model, dataset, objective, batch_size=batch_size, device=device,
                      devices=list(devices), repeats=repeats)
    work = measure(channels_last=channels_last)
    return dataclasses.replace(work, plain=measure(channels_last=False)) if channels_last and plain else work


def _measure_format(model: nn.Module, dataset, objective, *, batch_size: int, device: torch.device,
                    devices: Iterable[int], repeats: int, channels_last: bool) -> Workload:
    import copy
    model = copy.deepcopy(model)
    x, y = sample_batch(dataset, batch_size)
    whole, update = time_passes(model, x, y, objective, device=device, repeats=repeats, channels_last=channels_last)
    replica, micro = {}, {}
    for n in sorted(set(devices)):
        if n < 2:
            continue
        m = default_microbatches(batch_size, n)
        if device.type == "cpu":
            with threads(cpu_threads(n)):
                timed = partial(time_concurrently, model, objective=objective, copies=n, repeats=repeats,
                                channels_last=channels_last)
                if batch_size % n == 0:
                    replica[n] = timed(x[:batch_size // n], y[:batch_size // n])
                micro[n] = timed(x[:batch_size // m], y[:batch_size // m])
        else:                                  # each GPU computes alone
            timed = partial(time_passes, model, objective=objective, device=device, repeats=repeats,
                            channels_last=channels_last)
            if batch_size % n == 0:
                replica[n] = timed(x[:batch_size // n], y[:batch_size // n])[0]
            micro[n] = timed(x[:batch_size // m], y[:batch_size // m])[0]
    return Workload(compute_seconds=whole + update, parameter_bytes=parameter_bytes(model), batch_size=batch_size,
                    update_seconds=update, layers=parameter_layers(model),
                    boundary_bytes=boundary_bytes(model.to("cpu", memory_format=torch.contiguous_format), x[:1].cpu()),
                    replica_seconds=replica, microbatch_seconds=micro)


def turns(devices: int, *, device_type: str, cores: Optional[int] = None) -> float:
    """How many CPU processes take turns on each core (1 where there are no more processes than cores, and on
    GPUs)."""
    return max(1.0, devices / (cores or usable_cores())) if device_type == "cpu" else 1.0


def link_for(link: Link, devices: int, *, device_type: str, cores: Optional[int] = None) -> Link:
    """The link as `devices` ranks see it: CPU processes beyond one per core take turns on the cores, so each
    message waits for its receiver to be scheduled (latency grows by devices / cores)."""
    return Link(alpha=link.alpha * turns(devices, device_type=device_type, cores=cores), beta=link.beta)


def predictions_for(work: Workload, link: Link, *, devices: int, kind: str,
                    message_costs: Optional[dict] = None) -> Dict[str, Prediction]:
    """Every strategy's predicted step on `devices` of `kind`, as this machine's processes or GPUs run it."""
    from ..strategies import contiguous_strategies
    return predict_all(work, devices, link_for(link, devices, device_type=kind),
                       microbatches=default_microbatches(work.batch_size, devices), contiguous=contiguous_strategies(),
                       scatter_by_allreduce=kind == "cpu", message_costs=message_costs)


def measure_link(device: torch.device, *, repeats: int = 8) -> Tuple[Link, str]:
    """The link between two ranks, fitted to timed messages, and how it was obtained."""
    if device.type == "cuda":
        if torch.cuda.device_count() < 2:
            return ASSUMED_GPU_LINK, ("assumed (one GPU here, no link to measure): "
                                      f"{ASSUMED_GPU_LINK.alpha * 1e6:.0f} us, {ASSUMED_GPU_LINK.beta / 1e9:.0f} GB/s")
        return _fit(_gpu_copies(repeats)), "measured: copies between GPU 0 and GPU 1"
    return _fit(_gloo_allreduces(repeats), two_rank_allreduce=True), "measured: gloo all-reduce over loopback"


def _fit(samples: Dict[int, float], *, two_rank_allreduce: bool = False) -> Link:
    fitted = Link.fit(list(samples), list(samples.values()), relative=True)
    # a two-rank ring all-reduce takes S/B + 2 alpha: the fitted intercept is two messages' latency
    return Link(alpha=fitted.alpha / 2, beta=fitted.beta) if two_rank_allreduce else fitted


def _gloo_allreduces(repeats: int) -> Dict[int, float]:
    import torch.distributed as dist
    store, results, errors = dist.HashStore(), {}, []

    def rank(index: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, index, 2, datetime.timedelta(seconds=60))
            timings = {}
            for size in LINK_SIZES:
                tensor = torch.ones(size // 4)
                for _ in range(2):
                    group.allreduce([tensor]).wait()
                times = []
                for _ in range(repeats):
                    began = time.perf_counter()
                    group.allreduce([tensor]).wait()
                    times.append(time.perf_counter() - began)
                timings[size] = statistics.median(times)
            results[index] = timings
        except Exception as error:          # reported below, in the measuring thread
            errors.append(error)

    workers = [threading.Thread(target=rank, args=(i,), daemon=True) for i in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    if errors or len(results) < 2:
        raise RuntimeError(f"measuring the loopback link failed: {errors[0] if errors else 'timed out'}")
    return {size: max(results[0][size], results[1][size]) for size in LINK_SIZES}


def _gpu_copies(repeats: int) -> Dict[int, float]:
    timings = {}
    for size in LINK_SIZES:
        source = torch.ones(size // 4, device="cuda:0")
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize("cuda:0")
            began = time.perf_counter()
            source.to("cuda:1")
            torch.cuda.synchronize("cuda:1")
            times.append(time.perf_counter() - began)
        timings[size] = statistics.median(times[1:])
    return timings
