"""What this process does with its surroundings (read in config/host.py, which the settings and the run folder
ask too): its share of the cores as torch threads, how many CPU workers are worth starting, the C allocator."""

from __future__ import annotations

import contextlib
import ctypes
import sys

import torch

from ..config.host import LauncherEnv, launcher_env, usable_cores  # noqa: F401 (asked here by the workers)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def most_cpu_processes() -> int:
    """The most CPU worker processes worth starting here: beyond 4 per core they only take turns on the cores,
    and every synchronous step waits for the last of them."""
    return max(4, 4 * usable_cores())


def share_cores(processes_on_this_machine: int) -> int:
    """Give this worker its share of the usable cores as torch intra-op threads; return the count."""
    threads = max(1, usable_cores() // processes_on_this_machine)
    torch.set_num_threads(threads)
    return threads


LARGE_MODEL = 2**30  # bytes of parameters from which a process gives freed memory back at once


_OWNED = []  # not empty while this process runs a command of polytrain's (`own_process`)


@contextlib.contextmanager
def own_process():
    """Within: this process is polytrain's own (the command line's), whose C allocator it may set (a worker is
    known by its launcher's environment instead); never a process that calls fit()."""
    _OWNED.append(True)
    try:
        yield
    finally:
        _OWNED.pop()


def allocator_is_ours() -> bool:
    """Whether this process runs a command of polytrain's (`own_process`), whose C allocator it sets."""
    return bool(_OWNED)


def keep_freed_memory(*, model_bytes: int = 0, give_back: bool = False) -> bool:
    """Stop glibc from returning and re-mapping activation buffers on every step.

    By default glibc serves blocks over 128 KB with mmap and gives them back on free, so each training step
    page-faults its activations in again (measured: ~30k faults and 90-100 ms per step instead of 61-70 ms,
    LeNet at batch 512 on 2 threads; docs/benchmarks.md). Fixed thresholds keep the memory in the heap.
    For a model of `LARGE_MODEL` bytes or more, or where asked (`give_back`: the memory check found that a heap
    keeping freed blocks would outgrow what the process has, scaling/fits.py `Fit.gives_back_memory`), the
    opposite: blocks over 1 MB are mapped on their own and given back when freed, since a heap that keeps up to a
    GiB per process of freed gathered layers and optimizer temporaries is what makes 8 processes of a
    1e9-parameter model run out of memory (measured), and a fragmented heap holds up to 0.8x a step's
    activations beyond them, 1.5x with full activation checkpointing (benchmarks/memory_check.py). Only for
    processes polytrain owns (the command line and its workers); a no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    large = give_back or model_bytes >= LARGE_MODEL
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, (1 if large else 32) * 1024 * 1024)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, (64 if large else 1024) * 1024 * 1024)
        )
    except (OSError, AttributeError):
        return False
