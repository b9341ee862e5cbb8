"""How worker processes start: in this process, under an external torchrun, or started by torch's elastic
agent (the machinery behind torchrun) on this machine, forked from a forkserver where it can (forkserver.py).
Strategies know nothing of this.
"""

from __future__ import annotations

import ast
import logging
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Optional

import torch

from ..errors import ConfigError, UserError
from .checkpoint import read_progress
from .forkserver import start_method, with_this_output
from .hostenv import launcher_env, most_cpu_processes, usable_cores
from .stopping import TrainingInterrupted, interrupted_message
from .worker import Job, WorkerResult, train_worker


class WorkerFailed(Exception):
    """A spawned worker failed; `str()` names the rank and its error."""

    def __init__(self, message: str, *, user_error: bool = False):
        super().__init__(message)
        self.user_error = user_error


def check_devices(devices: int, device: str) -> None:
    wants_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but PyTorch sees no CUDA GPU; use --device cpu")
    if wants_cuda and devices > torch.cuda.device_count():
        raise ConfigError(
            f"--devices {devices} is more than the {torch.cuda.device_count()} GPU(s) present; "
            f"use --devices {torch.cuda.device_count()} or fewer"
        )
    most = most_cpu_processes()
    if not wants_cuda and devices > most:
        raise ConfigError(
            f"--devices {devices}: this machine has {usable_cores()} cores, and more than {most} CPU "
            f"processes would only take turns on them; use --devices {most} or fewer (polytrain bench "
            f"--predict {devices} projects larger counts)"
        )


def check_main_guard(devices: int) -> None:
    """Refuse, before anything starts, a call from the top level of the script that Python runs (outside
    `if __name__ == "__main__":`): every spawned worker imports that script again and would start training
    again inside it, which ends in a page of multiprocessing tracebacks."""
    where = unguarded_main_call()
    if where is not None:
        raise UserError(
            f"polytrain trains on devices={devices} in worker processes that import your script again, "
            f"and {where} would start training again in each of them; put the code that trains under "
            f'`if __name__ == "__main__":`'
        )


def unguarded_main_call() -> Optional[str]:
    """'script.py:LINE' where the running `__main__` script, at its top level and outside an `if __name__ ...`
    block, made the call that led here; None if there is none or spawned processes would not re-run it."""
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return None  # `python -m package`: multiprocessing does not re-run a package's __main__
    path = getattr(main, "__file__", None)
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if path is None or frame is None:
        return None  # an interactive session or notebook: nothing is imported again
    try:  # bytes: the parser honours the script's own coding line
        tree = ast.parse(Path(frame.f_code.co_filename).read_bytes(), frame.f_code.co_filename)
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    if any(
        _is_main_guard(node.test) and node.body[0].lineno <= line <= (node.body[-1].end_lineno or line)
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
    ):
        return None
    return f"{Path(frame.f_code.co_filename).name}:{line}"


def _is_main_guard(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = (test.left, test.comparators[0])
    return any(
        isinstance(a, ast.Name)
        and a.id == "__name__"
        and isinstance(b, ast.Constant)
        and b.value == "__main__"
        for a, b in (sides, sides[::-1])
    )


def spawns_workers(devices: int) -> bool:
    """Whether training on `devices` starts worker processes here (not under torchrun or srun): every strategy
    on several devices runs a process per device; one device trains in the caller's process."""
    return launcher_env() is None and devices > 1


def run_job(job: Job) -> WorkerResult:
    """Run `job` on `job.config.devices` processes and return rank 0's result."""
    return spawn_workers(job) if spawns_workers(job.config.devices) else train_worker(job)


def spawn_workers(job: Job) -> WorkerResult:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = job.config
    check_main_guard(config.devices)  # fit() checked it before writing anything; bench and verify here
    loopback = {"local_addr": "127.0.0.1"} if "local_addr" in LaunchConfig.__dataclass_fields__ else {}
    with tempfile.TemporaryDirectory(prefix="polytrain-agent-") as agent_files:
        method = start_method()
        launch = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=config.devices,
            run_id=f"polytrain-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            max_restarts=config.max_restarts,
            monitor_interval=0.1,
            start_method=method,
            **loopback,
            **_logs_in(agent_files),
        )
        # polytrain reports a failed worker or a signal itself (one line, or its traceback); the agent's own
        # log would say it a second time. Its loggers set their own levels, so each is quietened.
        quiet = [
            logging.getLogger(name)
            for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]
            if name.startswith("torch.distributed.elastic")
        ]
        levels = [logger.level for logger in quiet]
        for logger in quiet:
            logger.setLevel(logging.CRITICAL)
        try:
            entry, arguments = with_this_output(train_worker, job, method)
            results = elastic_launch(launch, entry)(*arguments)
        except ChildFailedError as failed:
            raise worker_failure(failed, agent_files) from None
        except SignalException as caught:
            # The agent passed the signal on to the workers and waited for them: they stopped at an agreed
            # step and wrote a checkpoint there (see stopping.py).
            raise interrupted(int(caught.sigval), job.run_dir) from None
        finally:
            for logger, level in zip(quiet, levels):
                logger.setLevel(level)
    return results[0]


def interrupted(signal_number: int, run_dir) -> TrainingInterrupted:
    progress = read_progress(run_dir) if run_dir else None
    where = progress.where() if progress is not None else None
    return TrainingInterrupted(
        interrupted_message(signal_number, run_dir, where), signal_number=signal_number
    )


def _logs_in(folder: str) -> dict:
    """The agent's per-run log and error files go into `folder` (removed afterwards), not /tmp."""
    try:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    except ImportError:
        return {}
    return {"logs_specs": DefaultLogsSpecs(log_dir=folder)}


def exit_words(code: int) -> str:
    """How a worker process ended, in words: killed by a signal where the code is negative (SIGKILL, most
    often the system's out-of-memory killer)."""
    if code is None or code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if name == "SIGKILL":
        return (
            "killed by SIGKILL, most often the system running out of memory; use more devices, "
            "--strategy sharded, --activation-checkpointing full or a smaller batch"
        )
    return f"killed by {name}"


# how a collective fails on a rank whose peer died (gloo's words, and the hint torch adds to them; NCCL's)
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "remote process exit",
)


def recorded_failures(folder) -> dict:
    """{rank: ProcessFailure} of each worker whose error file the launcher's log folder holds (`_logs_in`), from
    the latest attempt (a restarted run's earlier attempts are past)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def attempt(path: Path) -> int:
        number = path.parent.parent.name.rpartition("_")[2]
        return int(number) if number.isdigit() else -1

    files = [p for p in Path(folder).glob("*/attempt_*/*/error.json") if p.parent.name.isdigit()]
    latest = max(map(attempt, files), default=-1)
    return {
        int(p.parent.name): ProcessFailure(
            local_rank=int(p.parent.name), pid=0, exitcode=1, error_file=str(p)
        )
        for p in files
        if attempt(p) == latest
    }


def _record(failure) -> dict:
    """A launcher failure's record: its error file's dict, or its message in one."""
    return failure.message if isinstance(failure.message, dict) else {"message": failure.message}


def _message(record: dict) -> str:
    return str(record.get("message") or "").strip()


def _no_error_of_its_own(message: str) -> bool:
    """A worker ended without an error of its own: by a signal, or with nothing recorded."""
    return message == "" or message.startswith("Signal") or message == "<N/A>"


def root_failure(failures: dict) -> tuple:
    """(rank, failure) of the worker that failed first and made the others fail. Which failure the launcher
    notices first depends on how soon it hears of each death, and it times failures to the second; so the
    cause is taken first among a rank's own error, then a rank ended by a signal (the out-of-memory killer),
    then a rank whose collective failed because a peer was gone; within each, the earliest, then the lowest
    rank."""

    def order(item):
        rank, failure = item
        text = _message(_record(failure))
        if any(words in text for words in PEER_GONE):
            kind = 2
        elif _no_error_of_its_own(text):
            kind = 1
        else:
            kind = 0
        return kind, failure.timestamp, rank

    return min(failures.items(), key=order)


def worker_failure(failed, folder=None) -> WorkerFailed:
    """The failing rank's error (`root_failure` of the launcher's failures and the error files in its log
    `folder`), as one line for a user mistake, else with its traceback."""
    found = recorded_failures(folder) if folder else {}
    rank, failure = root_failure({**found, **failed.failures})
    record = _record(failure)
    message = _message(record)
    trace = str(record.get("extraInfo", {}).get("py_callstack", ""))
    if _no_error_of_its_own(message):
        return WorkerFailed(f"worker rank {rank} failed: {exit_words(failure.exitcode)}")
    error_class = message.split(":", 1)[0]
    if error_class == "WorkerHang":
        return WorkerFailed(f"worker hang: {message.split(':', 1)[-1].strip()}")
    user_error = any(cls.__name__ == error_class for cls in _user_error_classes())
    if user_error:
        return WorkerFailed(f"worker rank {rank}: {message.split(':', 1)[-1].strip()}", user_error=True)
    return WorkerFailed(f"worker rank {rank} failed: {message}\n{trace}".rstrip())


def _user_error_classes():
    pending, seen = [UserError], []
    while pending:
        cls = pending.pop()
        seen.append(cls)
        pending.extend(cls.__subclasses__())
    return seen
