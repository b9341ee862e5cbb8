"""Timings that a busy machine does not distort: every quantity the cost model needs is timed in rounds,
the rounds of all quantities interleaved (a burst of other load then slows each of them alike instead of
one), and the fastest round of each is kept (`low`). Other programs only ever add time: a median of three
steps taken in a row put one device's 30 ms step at 64 to 484 ms on a loaded 2-core machine.

`Step` times one model on one batch; `Together` runs one callable per thread, all started at once each round
(replicas sharing the cores as CPU processes would, or the two ranks of a loopback link).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence

import torch
import torch.nn as nn

TIMEOUT = 120.0  # seconds a round may take before the measurement gives up


def low(times: Sequence[float]) -> float:
    """What a quantity's repeated timings come to: the fastest, the nearest to the work alone."""
    return min(times)


def low_by_key(rounds: Sequence[Dict[Hashable, float]]) -> Dict[Hashable, float]:
    """`low` of each key of timings taken as one dictionary per round (message bytes -> seconds)."""
    return {key: low([r[key] for r in rounds]) for key in rounds[0]}


def interleave(
    probes: Dict[Hashable, Callable[[], Any]],
    *,
    rounds: int,
    warm: int = 1,
    min_seconds: float = 0.0,
    most_rounds: Optional[int] = None,
) -> Dict[Hashable, List[Any]]:
    """Each probe's results, one per round: every round calls every probe once, in turn, after `warm` untimed
    rounds. At least `rounds` rounds, more until `min_seconds` have passed (at most `most_rounds`), so that the
    rounds span a burst of other load rather than fall inside it."""
    for _ in range(warm):
        for probe in probes.values():
            probe()
    results = {key: [] for key in probes}
    began, done = time.perf_counter(), 0
    while True:
        for key, probe in probes.items():
            results[key].append(probe())
        done += 1
        if done >= rounds and (
            time.perf_counter() - began >= min_seconds or done >= (most_rounds or math.inf)
        ):
            return results


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Step:
    """`model` trained on one batch, one timed step per call: (forward + backward, SGD-with-momentum update)
    seconds. The model is moved to `device` (and channels-last) in place."""

    def __init__(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        objective,
        *,
        device: torch.device,
        channels_last: bool = False,
    ):
        self.model, self.x, self.y = model.to(device), x.to(device), y.to(device)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
            self.x = self.x.contiguous(memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-6, momentum=0.9)
        self.objective, self.device = objective, device

    def __call__(self) -> tuple:
        _synchronize(self.device)
        began = time.perf_counter()
        loss = self.objective.loss_sum(self.model(self.x), self.y) / len(self.y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        _synchronize(self.device)
        middle = time.perf_counter()
        self.optimizer.step()
        _synchronize(self.device)
        return middle - began, time.perf_counter() - middle


class Together:
    """`count` threads, each running what `setup(index)` returned (set up in its own thread) once per call,
    all started at once; a call returns every thread's result. Torch's operators and gloo release the GIL, so
    the threads run in parallel. Use as a context manager: leaving it ends the threads."""

    def __init__(self, count: int, setup: Callable[[int], Callable[[Any], Any]]):
        self.start, self.done = threading.Barrier(count + 1), threading.Barrier(count + 1)
        self.results: List[Any] = [None] * count
        self.errors: List[BaseException] = []
        self.argument, self.closed = None, False
        self.threads = [
            threading.Thread(target=self._run, args=(i, setup), daemon=True) for i in range(count)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, index: int, setup) -> None:
        try:
            work = setup(index)
            while True:
                self.start.wait()
                if self.closed:
                    return
                self.results[index] = work(self.argument)
                self.done.wait()
        except threading.BrokenBarrierError:
            return
        except Exception as error:  # raised again in the calling thread
            self.errors.append(error)
            self.start.abort()
            self.done.abort()

    def __call__(self, argument: Any = None) -> List[Any]:
        self.argument = argument
        try:
            self.start.wait(timeout=TIMEOUT)
            self.done.wait(timeout=TIMEOUT)
        except threading.BrokenBarrierError:
            if self.errors:
                raise self.errors[0] from None
            raise RuntimeError(f"a timed round took over {TIMEOUT:.0f} s") from None
        return list(self.results)

    def __enter__(self) -> "Together":
        return self

    def __exit__(self, *exc) -> None:
        self.closed = True
        try:
            self.start.wait(timeout=5)
        except threading.BrokenBarrierError:
            pass
        for thread in self.threads:
            thread.join(timeout=5)


def gloo_pair(sizes: Sequence[int]) -> Together:
    """Two ranks of a gloo group over loopback in this process; a call all-reduces one message of each size
    and returns, per size, the slower rank's seconds."""
    import datetime

    import torch.distributed as dist

    store = dist.HashStore()

    def setup(index: int):
        group = dist.ProcessGroupGloo(store, index, 2, datetime.timedelta(seconds=60))
        tensors = {size: torch.ones(size // 4) for size in sizes}

        def round_(_) -> Dict[int, float]:
            timings = {}
            for size, tensor in tensors.items():
                began = time.perf_counter()
                group.allreduce([tensor]).wait()
                timings[size] = time.perf_counter() - began
            return timings

        return round_

    return Together(2, setup)


def gpu_copies(sizes: Sequence[int]) -> Callable[[], Dict[int, float]]:
    """A call copies one tensor of each size from GPU 0 to GPU 1: seconds per size."""
    sources = {size: torch.ones(size // 4, device="cuda:0") for size in sizes}

    def round_() -> Dict[int, float]:
        timings = {}
        for size, source in sources.items():
            torch.cuda.synchronize("cuda:0")
            began = time.perf_counter()
            source.to("cuda:1")
            torch.cuda.synchronize("cuda:1")
            timings[size] = time.perf_counter() - began
        return timings

    return round_
