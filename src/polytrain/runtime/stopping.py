"""Stopping cleanly on Ctrl-C (SIGINT) or SIGTERM, what schedulers send before they pre-empt a job.

The first signal asks for a stop: every rank finishes its step, all ranks agree on the same last step, a
checkpoint is written there and training ends with `TrainingInterrupted` (exit code 128 + signal). Ranks
agree through a small all-reduce on a gloo side group (a vote), issued after a step and read at the next
vote: the answer is long there when it is read, so agreeing costs no wait and no GPU synchronisation. A
vote costs about 0.5-1 ms of CPU time on two CPU processes, so ranks vote about every `VOTE_SECONDS`, not
every step: each vote also carries the time since the last one, and every rank derives the same number of
steps to the next vote from the reduced sum. A stop therefore lands within about 2 x `VOTE_SECONDS` plus
a step.

A callback's request (`trainer.should_stop = True`, on the main rank) travels with the same vote and stops
every rank the same way, without the signal's exit.

A second signal stops at once. A Ctrl-C reaches every process of the terminal's group and the launcher
passes it on once more, so a repeat within `REPEAT_WINDOW` seconds counts as the same request.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import UserError

REPEAT_WINDOW = 2.0
VOTE_SECONDS = 0.2
MAX_VOTE_INTERVAL = 100  # steps
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(UserError):
    """Training stopped on a signal, after writing a checkpoint where it stopped (when it has a run folder)."""

    def __init__(self, message: str, *, signal_number: int):
        super().__init__(message)
        self.signal_number = int(signal_number)

    @property
    def exit_code(self) -> int:
        return 128 + self.signal_number


def interrupted_message(signal_number: int, run_dir: Optional[str], where: Optional[str]) -> str:
    name = signal.Signals(signal_number).name
    if run_dir is None:
        return f"stopped by {name}{' ' + where if where else ''}; nothing was saved (no run folder: give out=DIR)"
    if where is None:
        return f"stopped by {name} before the first checkpoint; start the run again"
    return f"stopped by {name} {where}, checkpoint saved; continue with: polytrain train --resume {run_dir}"


class StopSignal:
    """Catches SIGINT/SIGTERM while training runs; `should_stop()` says when every rank is to stop."""

    def __init__(self, *, exit_on_repeat: bool):
        self.exit_on_repeat = exit_on_repeat  # a worker process of ours: leave at once; else raise
        self.received: Optional[int] = None
        self.first_at = 0.0
        self.previous = {}
        self.group = None
        self.world_size = 1
        self.pending = None  # the vote in flight, and the number of steps it covers
        self.vote = None
        self.covered = 1
        self.interval = 1  # steps from one vote to the next; the same on every rank
        self.steps = 0
        self.voted_at = 0.0
        self.signalled = False  # the agreed stop came from a signal (not only from a request)

    def install(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            self.previous = {number: signal.signal(number, self._handle) for number in SIGNALS}
        return self

    def uninstall(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}

    def _handle(self, number, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self.first_at = number, now
            return
        if now - self.first_at < REPEAT_WINDOW:
            return
        if self.exit_on_repeat:
            print(
                f"polytrain: second {signal.Signals(number).name}, stopping at once",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + number)
        raise KeyboardInterrupt

    def connect(self, world_size: int) -> None:
        """On every rank, once the process group exists: the side group the votes travel on."""
        if world_size > 1 and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")
            self.world_size = world_size
            self.voted_at = time.monotonic()

    def should_stop(self, requested: bool = False) -> bool:
        """Called by every rank after every step: True on all ranks at the same step. `requested`: this rank
        asks for a stop without a signal (a callback set `trainer.should_stop`); `signalled` then says whether
        a signal was part of the stop."""
        if self.group is None:
            self.signalled = self.received is not None
            return self.signalled or bool(requested)
        self.steps += 1
        if self.steps < self.interval:
            return False
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            wanted, asked, seconds = self.vote.tolist()  # identical on every rank, so are the decisions
            if wanted > 0 or asked > 0:
                self.signalled = wanted > 0
                return True
            step_seconds = seconds / self.world_size / self.covered
            self.interval = max(1, min(MAX_VOTE_INTERVAL, int(VOTE_SECONDS / max(step_seconds, 1e-6))))
        now = time.monotonic()
        signalled = 0.0 if self.received is None else 1.0
        self.vote = torch.tensor(
            [signalled, float(bool(requested)), now - self.voted_at], dtype=torch.float64
        )
        self.pending = dist.all_reduce(self.vote, group=self.group, async_op=True)
        self.covered, self.steps, self.voted_at = self.steps, 0, now
        return False

    def close(self) -> None:
        if self.pending is not None:  # every rank issued it: it completes
            self.pending.wait()
            self.pending = None
        self.uninstall()
