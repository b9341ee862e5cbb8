"""Helpers for multi-process tests: 2 gloo processes on CPU, file rendezvous, a timeout, no hangs."""

import gc
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 120


def _entry(rank, world_size, init_file, fn, args, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, *args, world_size=2, timeout=TIMEOUT_S, method=None):
    """Run `fn(rank, world_size, *args)` in `world_size` processes; return their results by rank. `method`:
    how they start; by default polytrain's `start_method()`, which forks them from the session's forkserver
    (torch imported already) where the environment allows, and spawns them (seconds each) where it does not."""
    if method is None:
        from polytrain.runtime.forkserver import start_method

        method = start_method()
    context = mp.get_context(method)
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(target=_entry, args=(r, world_size, init_file, fn, args, results))
            for r in range(world_size)
        ]
        for process in processes:
            process.start()
        collected = {}
        try:
            for _ in range(world_size):
                rank, status, value = results.get(timeout=timeout)
                if status == "error":
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                collected[rank] = value
        finally:
            for process in processes:
                process.join(timeout=5)
                if process.is_alive():
                    process.kill()
    return [collected[r] for r in range(world_size)]


class MisbehavingModel(torch.nn.Module):
    """A linear classifier whose training forward pass on `rank` misbehaves at its `call`-th call:
    `raise` raises RuntimeError("boom on purpose"); `stall` sleeps (standing in for stuck data loading).
    Calls in eval mode (polytrain's check of the model's output before training) are not counted."""

    def __init__(self, action: str, *, rank: int = 1, call: int = 3):
        super().__init__()
        self.linear = torch.nn.Linear(784, 10)
        self.action, self.rank, self.call = action, rank, call
        self.calls = 0

    def forward(self, x):
        self.calls += self.training
        if self.training and dist.get_rank() == self.rank and self.calls == self.call:
            if self.action == "raise":
                raise RuntimeError("boom on purpose")
            time.sleep(600)
        return self.linear(x.flatten(1))


class SeesTheEnvironment(torch.nn.Module):
    """A linear classifier that records in buffers, at each training forward pass, the number in its worker's
    environment variable POLYTRAIN_SEEN (0 where unset), whether its worker holds `datasets` imported (1.0),
    which no worker of a run on arrays imports itself, and whether objects it holds are out of the collector's
    scans (`gc.freeze`)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(784, 10)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("preloaded", torch.zeros(()))
        self.register_buffer("frozen", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.seen.fill_(float(os.environ.get("POLYTRAIN_SEEN", "0")))
            self.preloaded.fill_(float("datasets" in sys.modules))
            self.frozen.fill_(float(gc.get_freeze_count() > 0))
        return self.linear(x.flatten(1))


class SlowOnRank(torch.nn.Module):
    """A linear classifier whose training forward pass sleeps `seconds` on `rank` (a slow worker)."""

    def __init__(self, *, rank: int = 1, seconds: float = 0.02):
        super().__init__()
        self.linear = torch.nn.Linear(784, 10)
        self.rank, self.seconds = rank, seconds

    def forward(self, x):
        if self.training and dist.is_initialized() and dist.get_rank() == self.rank:
            time.sleep(self.seconds)
        return self.linear(x.flatten(1))
