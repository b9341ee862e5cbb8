"""The process's surroundings: what a launcher told it, its share of the cores, the C allocator."""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import UserError
from .slurm import slurm_task

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


@dataclass(frozen=True)
class LauncherEnv:
    """What the launcher that started this process told it: torchrun (or another torch elastic agent), or
    SLURM's srun (one task per device)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    restart_count: int
    max_restarts: int
    rendezvous: Optional[str] = None  # "tcp://host:port" under srun; None: torchrun's environment


def launcher_env() -> Optional[LauncherEnv]:
    """The launcher's settings inside a process started by torchrun or srun; None in a plain process
    (also inside an interactive SLURM allocation with one task, where --devices N starts its own workers)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
        return LauncherEnv(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", "0")),
            int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
        )
    try:
        task = slurm_task(env)
    except ValueError as error:
        raise UserError(f"under srun: {error}") from None
    if task is None:
        return None
    return LauncherEnv(
        task.rank,
        task.world_size,
        task.local_rank,
        task.local_world_size,
        task.restart_count,
        0,
        rendezvous=f"tcp://{task.master_addr}:{task.master_port}",
    )


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), not all cores of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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


def keep_freed_memory(*, model_bytes: int = 0) -> bool:
    """Stop glibc from returning and re-mapping activation buffers on every step.

    By default glibc serves blocks over 128 KB with mmap and gives them back on free, so each training step
    page-faults its activations in again (measured: ~30k faults and 90-100 ms per step instead of 61-70 ms,
    LeNet at batch 512 on 2 threads; docs/benchmarks.md). Fixed thresholds keep the memory in the heap.
    For a model of `LARGE_MODEL` bytes or more the opposite: blocks over 1 MB are mapped on their own and
    given back when freed, since a heap that keeps up to a GiB per process of freed gathered layers and
    optimizer temporaries is what makes 8 processes of a 1e9-parameter model run out of memory (measured).
    Only for processes polytrain owns (the command line and its workers); a no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    large = model_bytes >= LARGE_MODEL
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, (1 if large else 32) * 1024 * 1024)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, (64 if large else 1024) * 1024 * 1024)
        )
    except (OSError, AttributeError):
        return False
