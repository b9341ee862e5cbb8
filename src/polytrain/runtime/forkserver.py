"""Workers forked from a forkserver: one process, started by the first launch, that imports torch and
polytrain's worker code once and forks a worker for every later launch, so a process that launches many times
(bench's rows, verify, a notebook, a test suite) does not pay torch's import in every worker every time.

A forked worker starts from the forkserver, not from this process, in two ways that matter:
- its environment is the forkserver's: where this process's environment has changed since the forkserver
  started (a variable set for one run), the workers are spawned afresh instead, and see it as it is now;
- its standard output and error are the forkserver's: this process's, as they are at each launch, are handed
  to each worker as it starts (`with_this_output`), so that what the workers print goes where this process
  prints now (a file or capture it redirected its output to since, as a spawned worker's would).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from typing import Callable, Optional, Tuple

# what the forkserver imports once: the workers' code and what it imports, torch._dynamo included (torch imports it
# on first use, in DistributedDataParallel's and every optimizer's constructor: about 2 s of CPU per worker per
# launch on a 2-core machine, more than half of a small run's worker). It was left out while a worker stopped by
# Ctrl-C could hang at its exit (about 1 in 20 stops with it preloaded): that was torch's deadlock in the gloo
# group's destructor, which a worker now avoids (ddp.py `release_reducers`, worker.py `_leave_process_groups`)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "polytrain.runtime.worker", "polytrain.strategies"]
# what a run's workers import where the run uses it (a Hugging Face model or checkpoint, LoRA's adapters, a hub
# dataset), preloaded too where this process has imported it already when the forkserver starts: a notebook or a
# test suite that uses them pays for their import once, not in every worker of every launch (peft with the
# transformers it imports: about 2 s of CPU per worker on a 2-core machine); a process that has not imported them
# pays nothing for them. Last, runtime/fork_ready.py moves all it imported out of the collector's scans, so that
# a worker neither scans those objects nor copies the memory holding them (a forkserver holding transformers and
# peft besides made every launch's workers about 15% slower on the suite's runs without it)
IF_IMPORTED = ("transformers", "peft", "datasets")
_forkserver_environment: Optional[dict] = None  # this process's environment when it started its forkserver


# what this process's environment holds that a worker does not need as it is now: what torch sets in it for
# itself during a run, the launcher's TORCHELASTIC_* (every worker gets the launcher's values for its own run)
# and inductor's default cache folder (the workers work out the same one); and the name of the test pytest is
# in, which it sets at every phase of every test (compared, it would make every launch under pytest spawn)
NOT_COMPARED = ("TORCHELASTIC_", "TORCHINDUCTOR_CACHE_DIR", "PYTEST_CURRENT_TEST")


def _environment() -> dict:
    """This process's environment, less what differs from launch to launch without mattering to a worker
    (`NOT_COMPARED`)."""
    return {key: value for key, value in os.environ.items() if not key.startswith(NOT_COMPARED)}


def start_method() -> str:
    """'forkserver' where this process's forkserver has the environment of this process now (the first launch
    starts it), else 'spawn' (also where this platform has no forkserver, or another caller started it)."""
    global _forkserver_environment
    from multiprocessing import forkserver

    if _forkserver_environment is None:
        server = getattr(forkserver, "_forkserver", None)
        if "forkserver" not in multiprocessing.get_all_start_methods() or getattr(
            server, "_forkserver_pid", None
        ):
            return "spawn"  # (a forkserver that another caller started: its environment is unknown)
        extra = [name for name in IF_IMPORTED if name in sys.modules]
        multiprocessing.set_forkserver_preload(PRELOAD + extra + ["polytrain.runtime.fork_ready"])
        forkserver.ensure_running()
        _forkserver_environment = _environment()
    return "forkserver" if _environment() == _forkserver_environment else "spawn"


def start_ahead(devices) -> bool:
    """Start the forkserver now where `devices` (a count, or counts, as a command line gives them; None: not
    given) asks for workers that this process starts (not torchrun or srun), so that it imports torch beside what
    this process imports before its launch instead of after it; whether it did."""
    from ..config.host import launcher_env
    from ..errors import UserError

    counts = devices if isinstance(devices, (tuple, list)) else (devices,)
    try:
        if not any(isinstance(n, int) and n > 1 for n in counts) or launcher_env() is not None:
            return False
    except UserError:  # (a launcher's environment that does not add up: the launch says so)
        return False
    return start_method() == "forkserver"


def with_this_output(entry: Callable, job, method: str) -> Tuple[Callable, tuple]:
    """(the entry point, its arguments) for torch's launcher: under the forkserver, `entry` runs after the
    worker took this process's standard output and error as they are now (`ThisOutput`)."""
    if method != "forkserver":
        return entry, (job,)  # a spawned worker inherits them as they are
    return _with_output, (entry, job, ThisOutput())


def _with_output(entry: Callable, job, output: "ThisOutput"):
    return entry(job)  # (the output was taken as the arguments were unpickled, before this runs)


class ThisOutput:
    """This process's file descriptors 1 and 2, passed to the process being started as it is pickled for it
    (multiprocessing's `DupFd`); unpickled there, they replace that process's own. Pickled for anything
    else, it carries nothing; a descriptor this process has closed is not passed (the worker keeps its own)."""

    def __reduce__(self):
        from multiprocessing import context, reduction

        if context.get_spawning_popen() is None:
            return ThisOutput, ()
        targets = tuple(fd for fd in (1, 2) if _is_open(fd))
        return _take_output, (targets, *(reduction.DupFd(fd) for fd in targets))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _take_output(targets: tuple, *passed) -> ThisOutput:
    for target, handle in zip(targets, passed):
        stream = sys.stdout if target == 1 else sys.stderr
        if stream is not None:
            stream.flush()
        fd = handle.detach()
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    return ThisOutput()
