"""What this process's surroundings say about it, read from the environment: the ranks its launcher gave it
(torchrun, or SLURM's srun) and the cores it may run on.

No torch, and nothing here acts: the settings (under torchrun or srun `--devices` is the world size) and the run
folder (only rank 0 locks it) ask, as the workers do; runtime/hostenv.py acts on the answers (threads, the C
allocator).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..errors import UserError
from .slurm import slurm_task


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
