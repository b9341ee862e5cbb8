"""Names a hang: which rank stopped making progress, at which step, and where (its Python stack).

Each worker runs a daemon thread. The trainer beats it after every step (and every validation step); when no
beat comes within the step's allowance the thread records the main thread's stack as this worker's error and
ends the process, so the elastic agent stops every other worker and polytrain exits non-zero with the report.

The allowance (`Allowance`), by default, judges a step against the steps this run has taken: a later step may
take max(60 s, 4 x the slowest interval between beats so far); the first step, which has none to go by, may take
max(90 s, 2 x what the model's size predicts on a slow machine: `predicted_step_seconds`). A model whose steps
take minutes is then never killed as hung, and a small model's hang is still named within a minute. An explicit
--hang-timeout S is a fixed bound instead: S for every step, S + 30 s for the first (10 S + 30 s with --compile).

Ranks blocked in a collective (waiting for the stuck one) wait a grace period before reporting, so the
report names the rank that is really stuck rather than the ones waiting for it.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Optional

from ..callbacks import Callback

WAITING_IN = ("torch/distributed/", "torch/nn/parallel/distributed.py", "torch/autograd/")

FLOOR_SECONDS = 60.0  # the least a step is allowed by default
START_UP_SECONDS = 30.0  # more for the first step: first collectives connect, memory is first touched
COMPILE_FACTOR = 10  # with --compile the first step compiles the model
FIRST_STEP_MULTIPLE = 2.0  # of the first step's prediction, itself made at a slow machine's throughput
LATER_STEP_MULTIPLE = 4.0  # of the slowest interval between beats so far

# The slow machine the first step is predicted on: float32 FLOP/s per CPU core a process has (a core's
# float32 matrix products run at 30-100 GFLOP/s; a 620M-parameter Llama's steps on 8 processes sharing 2 cores
# ran at 4.7 GFLOP/s per core, communication included) and per GPU, and bytes/s of each rank's link (gloo
# between processes of one machine: 1-2 GB/s measured).
SLOW_FLOPS = {"cpu": 2e9, "cuda": 1e12}  # cpu: per core
SLOW_LINK = {"cpu": 1e8, "cuda": 1e9}
EXCHANGED = 4  # the model's parameter bytes each rank's link carries per step at most (FSDP2 on gloo: two
# all-gathers of the weights, and the gradients' reduce-scatter run as an all-reduce, twice the bytes)
UPDATE_FLOPS = 12  # per parameter: an AdamW update
RECOMPUTED = 4 / 3  # activation checkpointing runs each forward twice: forward, forward again, backward (2x)


def predicted_step_seconds(*, flops: float, exchanged_bytes: float, device_type: str, cores: float) -> float:
    """Seconds a rank's step of `flops` that moves `exchanged_bytes` over its link takes on a slow machine
    (`SLOW_FLOPS`, `SLOW_LINK`); `cores`: the CPU cores this process has (a share below 1 where processes
    outnumber the cores; unused on a GPU)."""
    kind = device_type if device_type in SLOW_FLOPS else "cpu"
    speed = SLOW_FLOPS[kind] * (cores if kind == "cpu" else 1.0)
    return flops / speed + exchanged_bytes / SLOW_LINK[kind]


def first_step_work(
    *,
    flops_per_sample: float,
    samples: int,
    parameters: int,
    parameter_bytes: int,
    world: int,
    checkpointing: str,
) -> tuple:
    """(FLOPs, bytes exchanged) of one rank's step over `samples` samples of a model of `parameters`: one
    sample's forward, loss and backward as counted (`flops_per_sample`; where it could not be counted, 6 per
    parameter), again for the recomputed forward under activation checkpointing, and the update; the whole
    model's weights are counted whatever the rank holds, an upper bound."""
    if not math.isfinite(flops_per_sample) or flops_per_sample <= 0:
        flops_per_sample = 6.0 * parameters
    recompute = RECOMPUTED if checkpointing not in (None, "none") else 1.0
    flops = flops_per_sample * samples * recompute + UPDATE_FLOPS * parameters
    return flops, (EXCHANGED * parameter_bytes if world > 1 else 0.0)


@dataclass(frozen=True)
class Allowance:
    """How long a rank may go without progress before it is reported: a step's limit in seconds."""

    fixed: Optional[float] = None  # --hang-timeout given: the bound of every step
    predicted_first: float = 0.0  # seconds the first step takes on a slow machine (predicted_step_seconds)
    compiling: bool = False  # --compile: the first step compiles
    floor: float = FLOOR_SECONDS
    start_up: float = START_UP_SECONDS

    def first_step(self) -> float:
        base = (self.floor if self.fixed is None else self.fixed) * (COMPILE_FACTOR if self.compiling else 1)
        if self.fixed is not None:
            return base + self.start_up
        return max(base + self.start_up, FIRST_STEP_MULTIPLE * self.predicted_first)

    def later_step(self, slowest: float) -> float:
        """The limit once steps were seen, the slowest of them taking `slowest` seconds."""
        return self.fixed if self.fixed is not None else max(self.floor, LATER_STEP_MULTIPLE * slowest)

    @staticmethod
    def grace(limit: float) -> float:
        """How much longer than `limit` a rank waiting in a collective waits for the stuck rank to report."""
        return max(5.0, limit / 2)

    def source(self, first: bool) -> str:
        """Where the limit came from, for the report."""
        if self.fixed is not None:
            return "--hang-timeout"
        if first:
            return "the first step's allowance, from the model's size"
        return f"{LATER_STEP_MULTIPLE:g}x the slowest step so far, at least {self.floor:g}s"


class WorkerHang(Exception):
    """A worker made no progress within its step's allowance."""


class Watchdog(Callback):
    def __init__(self, *, rank: int, allowance: Allowance, poll: float = 0.5):
        self.rank = rank
        self.allowance = allowance
        self.poll = min(poll, allowance.later_step(0.0) / 4)
        self.position = (0, 0)
        self.steps_seen = 0
        self.slowest = 0.0  # the longest interval between two beats so far
        self.last_beat = time.monotonic()
        self.main_thread = threading.main_thread().ident
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="polytrain-watchdog", daemon=True)

    # --- callback interface (the trainer calls these on every rank) ---
    def on_fit_start(self, trainer):
        self.last_beat = time.monotonic()
        self.thread.start()

    def on_epoch_start(self, trainer, epoch):
        self.beat(epoch, trainer.position.step)

    def on_step_end(self, trainer, step):
        self.steps_seen += 1
        self.beat(trainer.position.epoch, step + 1)

    def on_eval_step(self, trainer, step):
        self.beat(*self.position)  # a long validation pass is progress too

    def on_epoch_end(self, trainer, record):
        self.beat(record["epoch"], 0)

    def on_fit_end(self, trainer):
        self.stopped.set()

    def beat(self, epoch: int, step: int) -> None:
        now = time.monotonic()
        self.slowest = max(self.slowest, now - self.last_beat)
        self.position = (epoch, step)
        self.last_beat = now

    # --- the watching thread ---
    def _limit(self) -> float:
        first = self.allowance.first_step()
        return self.allowance.later_step(self.slowest) if self.steps_seen else first

    def _watch(self) -> None:
        while not self.stopped.wait(self.poll):
            silent = time.monotonic() - self.last_beat
            limit = self._limit()
            if silent < limit:
                continue
            stack = self.main_stack()
            waiting = any(marker in stack[-1] for marker in WAITING_IN)  # the innermost frame
            # probably waiting for the stuck rank: let that one report first, also when it is still in its
            # first step (a pipeline's first stage can run a step ahead of a later stage)
            longest = max(limit, self.allowance.first_step())
            if waiting and silent < longest + self.allowance.grace(limit):
                continue
            self.report(silent, stack, waiting, limit)

    def main_stack(self) -> list:
        frame = sys._current_frames().get(self.main_thread)
        return traceback.format_stack(frame) if frame is not None else ["(main thread not found)\n"]

    def describe(self, silent: float, stack: list, waiting: bool, limit: float) -> str:
        epoch, step = self.position
        where = "waiting in a collective operation for another rank" if waiting else "stuck"
        source = self.allowance.source(first=not self.steps_seen)
        return (
            f"rank {self.rank} made no progress for {silent:.0f}s ({where}) in epoch {epoch + 1}, step "
            f"{step + 1} (allowed: {limit:.0f}s, {source}); give --hang-timeout SECONDS if this step is "
            f"legitimately slower. Its stack:\n" + "".join(stack[-12:]).rstrip()
        )

    def report(self, silent: float, stack: list, waiting: bool, limit: float) -> None:
        message = self.describe(silent, stack, waiting, limit)
        try:
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(WorkerHang(message))
        finally:
            print(f"polytrain: {message}", file=sys.stderr, flush=True)
            os._exit(3)
