"""Names a hang: which rank stopped making progress, at which step, and where (its Python stack).

Each worker runs a daemon thread. The trainer beats it after every step; when no beat comes for
`timeout` seconds the thread records the main thread's stack as this worker's error and ends the process,
so the elastic agent stops every other worker and polytrain exits non-zero with the report.

Ranks blocked in a collective (waiting for the stuck one) wait a grace period before reporting, so the
report names the rank that is really stuck rather than the ones waiting for it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from ..callbacks import Callback

WAITING_IN = ("torch/distributed/", "torch/nn/parallel/distributed.py", "torch/autograd/")


class WorkerHang(Exception):
    """A worker made no progress for --hang-timeout seconds."""


class Watchdog(Callback):
    def __init__(self, *, rank: int, timeout: float, first_step_timeout: float = None, poll: float = 0.5):
        self.rank = rank
        self.timeout = timeout
        self.first_step_timeout = first_step_timeout or timeout
        self.poll = min(poll, timeout / 4)
        self.position = (0, 0)
        self.steps_seen = 0
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
        self.last_beat = time.monotonic()  # a long validation pass is progress too

    def on_epoch_end(self, trainer, record):
        self.beat(record["epoch"], 0)

    def on_fit_end(self, trainer):
        self.stopped.set()

    def beat(self, epoch: int, step: int) -> None:
        self.position = (epoch, step)
        self.last_beat = time.monotonic()

    # --- the watching thread ---
    def _limit(self) -> float:
        return self.timeout if self.steps_seen else self.first_step_timeout

    def _watch(self) -> None:
        while not self.stopped.wait(self.poll):
            silent = time.monotonic() - self.last_beat
            if silent < self._limit():
                continue
            stack = self.main_stack()
            waiting = any(marker in stack[-1] for marker in WAITING_IN)  # the innermost frame
            # probably waiting for the stuck rank: let that one report first, also when it is still in its
            # first step (a pipeline's first stage can run a step ahead of a later stage)
            if waiting and silent < max(self._limit(), self.first_step_timeout) + max(5.0, self.timeout / 2):
                continue
            self.report(silent, stack, waiting)

    def main_stack(self) -> list:
        frame = sys._current_frames().get(self.main_thread)
        return traceback.format_stack(frame) if frame is not None else ["(main thread not found)\n"]

    def describe(self, silent: float, stack: list, waiting: bool) -> str:
        epoch, step = self.position
        where = "waiting in a collective operation for another rank" if waiting else "stuck"
        return (
            f"rank {self.rank} made no progress for {silent:.0f}s ({where}) in epoch {epoch + 1}, step "
            f"{step + 1}; raise --hang-timeout if this step is legitimately slow. Its stack:\n"
            + "".join(stack[-12:]).rstrip()
        )

    def report(self, silent: float, stack: list, waiting: bool) -> None:
        message = self.describe(silent, stack, waiting)
        try:
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(WorkerHang(message))
        finally:
            print(f"polytrain: {message}", file=sys.stderr, flush=True)
            os._exit(3)
