"""Data parallelism: the model replicated on every rank, gradients all-reduced by DistributedDataParallel."""

from __future__ import annotations

import contextlib

from .distributed import Distributed


class DataParallel(Distributed):
    name = "data"
    normalises_global_batch = True
    data_parallel = "replicate"  # DDP (parallelize.py apply_ddp)

    def gradient_sync(self, *, last: bool):
        """DDP all-reduces in the last pass of an accumulated step only."""
        return contextlib.nullcontext() if last else self.runner.no_sync()
