"""The run folder: config.json, metrics.jsonl, model.pt, checkpoint.pt, curves.png, and the lock that keeps
two processes from training it at once; and how every file polytrain writes reaches the disk, whole or not at
all (`atomic_write_bytes`: a temporary name in the same folder, flushed, renamed over the old file, the folder
flushed), so a crash leaves the previous file or the new one, never half of one. It imports nothing of
polytrain's but its errors and version: the lowest modules (loggers, callbacks) write through it."""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

try:
    import fcntl
except ImportError:  # Windows: no flock, so run folders are not locked there
    fcntl = None

import torch

from .errors import UserError
from .version import __version__


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda handle: handle.write(data))


def atomic_write(path: Path, write) -> None:
    """`write(handle)` into a temporary file beside `path`, flushed to disk, then renamed over `path`: a crash
    leaves the old file or the new one, never half of one."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def new_run_dir(out: Optional[str], *, root: str = "runs") -> Path:
    """`out` as given (it must not hold another run), or a fresh time-stamped folder under `runs/`."""
    if out is not None:
        path = Path(out).expanduser()
        refuse_if_training(path, fix="choose another folder for the new run, or wait for that one to end")
        if (path / "config.json").exists():
            raise UserError(
                f"--out {path} already holds a run; choose a new folder, or continue it with --resume {path}"
            )
        if path.exists() and not path.is_dir():
            raise UserError(f"--out {path} is a file; give a folder name")
        return path
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, suffix = Path(root) / stamp, 1
    while path.exists():
        suffix += 1
        path = Path(root) / f"{stamp}-{suffix}"
    return path


def write_config(run_dir: Path, settings: dict) -> None:
    record = dict(
        settings,
        versions={"polytrain": __version__, "torch": torch.__version__, "python": platform.python_version()},
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run_dir / "config.json", (json.dumps(record, indent=2) + "\n").encode())


def read_config(run_dir) -> dict:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise UserError(
            f"{run_dir} is not a polytrain run folder (no config.json); pass the --out folder of a run"
        )
    try:
        settings = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{path} is damaged (not JSON); restore it or start a new run") from None
    if not isinstance(settings, dict):
        raise UserError(f"{path} is damaged (not a JSON object); restore it or start a new run")
    settings.pop("versions", None)
    return settings


def resolve_run_dir(text) -> Path:
    """A run folder as given, or for `.../LATEST` (when no such folder exists) the newest run folder beside it."""
    path = Path(text).expanduser()
    if path.name != "LATEST" or path.exists():
        return path
    runs = [folder for folder in path.parent.glob("*") if (folder / "config.json").is_file()]
    if not runs:
        raise UserError(
            f"{path}: there is no run folder in {path.parent}/ yet; train one with polytrain train"
        )
    return max(runs, key=lambda folder: (folder / "config.json").stat().st_mtime_ns)


# Held (flock) by the process that trains the run, for as long as it trains: the process that launches the run,
# or rank 0 under torchrun or srun (the other ranks neither take nor test it). The kernel drops the lock when
# that process ends, however it ends, so a file left behind by a crash never blocks anyone (nor a restarted
# torchrun attempt); the file stays, since removing it could let two processes lock two different files.
LOCK_FILE = ".training.lock"

RESUME_FIX = "wait for it to end, or stop it (Ctrl-C or kill: it saves a checkpoint) and resume then"

# The handles this process holds locked. A forked child (a DataLoader worker, the user's own) shares each with
# this process, and flock releases a lock only when every copy is closed: a child that outlived the training
# (persistent loader workers until the garbage collector takes them) would keep the folder locked after the run
# ended. So a child closes its copies as it starts.
_held: set = set()


def _close_inherited_locks() -> None:
    for handle in _held:
        try:
            os.close(handle)
        except OSError:
            pass
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


def _locks_here() -> bool:
    from .config.host import launcher_env

    launcher = launcher_env()
    return launcher is None or launcher.rank == 0


def _lock(run_dir, mode: int, fix: str) -> Optional[int]:
    """The lock file's handle, locked in `mode`; None where nothing can be locked (no flock, a folder that cannot
    take the file, a file system without locks). Another process's lock is one line."""
    if fcntl is None or run_dir is None or not _locks_here():
        return None
    try:
        handle = os.open(Path(run_dir) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(handle, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.pread(handle, 32, 0).decode(errors="replace").strip()
        os.close(handle)
        holder = f"pid {pid}" if pid.isdigit() else "pid unknown"
        raise UserError(f"{run_dir} is being trained by another process ({holder}); {fix}") from None
    except OSError:
        os.close(handle)
        return None
    return handle


@contextmanager
def training(run_dir, *, fix: str = RESUME_FIX):
    """Hold `run_dir`'s lock while the body trains it (nothing for `run_dir` None)."""
    handle = _lock(run_dir, fcntl.LOCK_EX if fcntl else 0, fix)
    if handle is not None:
        os.ftruncate(handle, 0)
        os.pwrite(handle, str(os.getpid()).encode(), 0)  # for the line another process gets
        _held.add(handle)
    try:
        yield
    finally:
        if handle is not None:
            _held.discard(handle)
            os.close(handle)  # releases the lock


def refuse_if_training(run_dir, *, fix: str = RESUME_FIX) -> None:
    """One line if another process is training `run_dir` now; called before anything is written to it. A shared
    lock, so that processes asking at once do not take each other for trainers."""
    if fcntl is not None and (Path(run_dir) / LOCK_FILE).is_file():
        handle = _lock(run_dir, fcntl.LOCK_SH, fix)
        if handle is not None:
            os.close(handle)


def in_training(run_dir) -> bool:
    """Whether another process is training `run_dir` now."""
    try:
        refuse_if_training(run_dir)
    except UserError:
        return True
    return False


def forget_unstarted_run(run_dir: Path, *, whole_folder: bool) -> None:
    """After a run failed before its first checkpoint, remove what it wrote (the folder, if it made it), so
    that the same command can be tried again; a run with a checkpoint is kept for --resume, and a folder that
    another process is training is left to it."""
    if (run_dir / "checkpoint.pt").exists() or in_training(run_dir):
        return
    if whole_folder:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    # (base.json: runtime/base_apart.py; steps.jsonl: the steps' log, begun before the first checkpoint)
    for name in ("config.json", "skipped.txt", "base.json", "steps.jsonl", LOCK_FILE):
        (run_dir / name).unlink(missing_ok=True)
