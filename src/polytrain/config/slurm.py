"""What SLURM tells one task started by ``srun``: its rank, its peers, and where to meet them.

Pure functions of an environment mapping (no torch, no os.environ) so callers can test and reuse them.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import List, Mapping, Optional

_BALANCED = re.compile(r"[^\[\]]*(?:\[[^\[\]]*\][^\[\]]*)*")
# [0-9], not \d or str.isdigit: those accept digits int() rejects or that SLURM never writes
_DIGITS = re.compile(r"[0-9]+")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASKS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
_JOB = re.compile(r"([0-9]+)(?:_([0-9]+))?")
_PORT_SPAN = 65535 - 15000 + 1


def _expand_group(text: str, group: str) -> List[str]:
    out = []
    for item in group.split(","):
        m = _RANGE.fullmatch(item.strip())
        if not m:
            raise ValueError(f"host list {text!r}: {item!r} is not a number or a range N-M of digits")
        first, last = m.group(1), m.group(2) or m.group(1)
        if int(last) < int(first):
            raise ValueError(f"host list {text!r}: range {item!r} ends below its start")
        # SLURM pads every number to the width of the range's first number, as written
        out += [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    return out


def expand_nodelist(text: str) -> List[str]:
    """Expand a compressed host list such as ``node[01-04,07],gpu5`` into host names, in order."""
    if not text.strip():
        raise ValueError(f"host list {text!r} is empty")
    if not _BALANCED.fullmatch(text):
        raise ValueError(f"host list {text!r}: unbalanced or nested brackets")
    hosts = []
    # split only at commas outside brackets: those not followed by a ']' before the next '['
    for pattern in re.split(r",(?![^\[]*\])", text.strip()):
        pattern = pattern.strip()
        if not pattern:
            raise ValueError(f"host list {text!r}: empty host name between commas")
        # re.split with a capturing group alternates literal text and bracket contents
        pieces = re.split(r"\[([^\]]*)\]", pattern)
        choices = [[p] if i % 2 == 0 else _expand_group(text, p) for i, p in enumerate(pieces)]
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def tasks_per_node(text: str) -> List[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` such as ``4(x2),3`` into one task count per node: ``[4, 4, 3]``."""
    counts = []
    for item in text.strip().split(","):
        m = _TASKS.fullmatch(item.strip())
        if not m:
            raise ValueError(f"tasks per node {text!r}: {item!r} is not N or N(xM)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def port_for_job(job_id: str) -> int:
    """A rendezvous port every task of a job computes alike, as PyTorch Lightning does.

    Rule: for ``JOB`` or ``JOB_TASK`` (digits only), port = 15000 + (int(last four digits of JOB) + int(TASK or 0))
    modulo 50536, so the result is always within 15000..65535. Without an array suffix this is exactly
    Lightning's ``15000 + int(job_id[-4:])``; the array task id is added so array tasks differ.
    """
    m = _JOB.fullmatch(job_id.strip())
    if not m:
        raise ValueError(f"job id {job_id!r} is not JOB or JOB_TASK (digits)")
    return 15000 + (int(m.group(1)[-4:]) + int(m.group(2) or 0)) % _PORT_SPAN


@dataclass(frozen=True)
class SlurmTask:
    """One task's place in a multi-task srun step and the address its group meets at."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    restart_count: int


def _int(env: Mapping[str, str], name: str, default: Optional[int] = None) -> int:
    value = env.get(name)
    if value is None and default is not None:
        return default
    if value is None or not _DIGITS.fullmatch(value.strip()):
        raise ValueError(f"{name}={value!r} is not a non-negative integer: fix or unset {name}")
    return int(value)


def _parse(env: Mapping[str, str], name: str, parse, fix: str):
    """parse(env[name]), with a failure's message naming the variable and the fix."""
    try:
        return parse(env[name])
    except ValueError as e:
        raise ValueError(f"{name}: {e}; {fix}") from None


def _first_host(env: Mapping[str, str]) -> str:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            return _parse(env, name, expand_nodelist, "set MASTER_ADDR")[0]
    raise ValueError("no SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST: set MASTER_ADDR")


def _local_world_size(env: Mapping[str, str], node_rank: int, world_size: int) -> int:
    if _DIGITS.fullmatch(env.get("SLURM_NTASKS_PER_NODE", "").strip()):
        return int(env["SLURM_NTASKS_PER_NODE"])
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = _parse(env, name, tasks_per_node, "set SLURM_NTASKS_PER_NODE")
            if node_rank >= len(counts):
                raise ValueError(
                    f"{name}={env[name]!r} lists {len(counts)} nodes but SLURM_NODEID is {node_rank}"
                )
            return counts[node_rank]
    return world_size


def slurm_task(env: Mapping[str, str]) -> Optional[SlurmTask]:
    """This task's settings inside a multi-task srun step; None anywhere else (no SLURM, a batch script or an
    salloc shell without srun, one task)."""
    # srun sets SLURM_STEP_NUM_TASKS for the tasks of a step; sbatch and salloc do not. A batch script run
    # without srun sees SLURM_NTASKS of the whole allocation but is one process: it must not wait for peers.
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None
    world_size, rank = _int(env, "SLURM_STEP_NUM_TASKS"), _int(env, "SLURM_PROCID")
    if world_size <= 1:  # srun -n 1 behaves as a plain machine: --devices N starts its own workers
        return None
    if rank >= world_size:
        raise ValueError(
            f"SLURM_PROCID={rank} is not below SLURM_STEP_NUM_TASKS={world_size}: fix the srun options"
        )
    node_rank = _int(env, "SLURM_NODEID", 0)
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
        if not 1 <= port <= 65535:
            raise ValueError(f"MASTER_PORT={port} is not a port (1..65535): set MASTER_PORT to one")
    elif env.get("SLURM_JOB_ID"):
        port = _parse(env, "SLURM_JOB_ID", port_for_job, "set MASTER_PORT")
    else:
        raise ValueError("SLURM_JOB_ID is not set: set MASTER_PORT")
    return SlurmTask(
        rank,
        world_size,
        _int(env, "SLURM_LOCALID", 0),
        _local_world_size(env, node_rank, world_size),
        node_rank,
        env.get("MASTER_ADDR") or _first_host(env),
        port,
        _int(env, "SLURM_RESTART_COUNT", 0),
    )
