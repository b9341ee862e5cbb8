"""Running polytrain as users do (subprocesses), with timeouts that say what every process was doing.

Every process started here runs with PYTHONFAULTHANDLER=1, so SIGABRT makes each one print the Python stack
of all its threads before it ends. When a command outlives its timeout, every process of its tree gets
SIGABRT, and the failure shows the stacks together with the command's output.
"""

import os
import signal
import subprocess
import sys
import threading
import time

ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def children(parent: int) -> list:
    """Process ids whose parent is `parent` (read from /proc; empty where there is none)."""
    found = []
    if not os.path.isdir("/proc"):
        return found
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def descendants(parent: int) -> list:
    found, pending = [], [parent]
    while pending:
        for child in children(pending.pop()):
            found.append(child)
            pending.append(child)
    return found


def command_line(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def abort_tree(root: int, *, include_root: bool = True) -> None:
    """SIGABRT to `root` and all below it: with PYTHONFAULTHANDLER each prints its threads' stacks."""
    for pid in descendants(root) + ([root] if include_root else []):
        try:
            os.kill(pid, signal.SIGABRT)
        except OSError:
            pass


def kill_tree(root: int) -> None:
    for pid in descendants(root) + [root]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def start(argv, *, env=None) -> subprocess.Popen:
    merged = dict(os.environ, **ENV, **(env or {}))
    return subprocess.Popen(
        [str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=merged
    )


def finish(process: subprocess.Popen, *, timeout: float) -> subprocess.CompletedProcess:
    """Wait for `process`; past `timeout`, fail with the stacks of every process in its tree."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        abort_tree(process.pid)
        try:
            out, err = process.communicate(timeout=20)
        finally:
            kill_tree(process.pid)
        raise AssertionError(
            f"{' '.join(map(str, process.args))} ran past {timeout:.0f}s; its output and the "
            f"stack of each of its processes:\n{out}\n{err}"
        ) from None
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def finish_all(processes: list, *, timeout: float) -> list:
    """Wait for every one of `processes` within one `timeout`, reading all their pipes at once (a process whose
    output no one reads stops when its pipe fills, and processes that wait on it wait for ever); past the
    timeout, fail with the output and the stacks of all of them (those that ended, and every process of the
    trees of those that did not): where processes wait on each other, the one that outlives the timeout is seldom
    the one that went astray."""
    outputs = {}

    def drain(process: subprocess.Popen) -> None:
        try:
            outputs[process.pid] = process.communicate()
        except Exception as error:  # (output that is not text): said in place of it, not lost with the thread
            process.wait()
            outputs[process.pid] = ("", f"(its output could not be read: {type(error).__name__}: {error})")

    readers = [threading.Thread(target=drain, args=(process,), daemon=True) for process in processes]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    running = [process for process, reader in zip(processes, readers) if reader.is_alive()]
    if not running:
        return [
            subprocess.CompletedProcess(process.args, process.returncode, *outputs[process.pid])
            for process in processes
        ]
    for process in running:
        abort_tree(process.pid)
    for process, reader in zip(processes, readers):
        reader.join(20)
        if reader.is_alive():
            kill_tree(process.pid)
            reader.join(5)
    reports = []
    for number, process in enumerate(processes):
        out, err = outputs.get(process.pid, ("", "(no output within 20 s of SIGABRT)"))
        state = f"ran past {timeout:.0f}s" if process in running else f"ended ({process.returncode})"
        reports.append(f"--- process {number} {state}; its output and stacks:\n{out}\n{err}")
    raise AssertionError(
        f"{len(running)} of {len(processes)} processes ran past {timeout:.0f}s:\n" + "\n".join(reports)
    )


def polytrain(*args, timeout: float = 240, env=None) -> subprocess.CompletedProcess:
    """`python -m polytrain ARGS`, as a user runs it."""
    return finish(start([sys.executable, "-m", "polytrain", *args], env=env), timeout=timeout)


def wait_for(condition, *, timeout: float, what: str, process: subprocess.Popen = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            out, err = process.communicate()
            raise AssertionError(f"the process ended before {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            if process is not None:
                finish(process, timeout=0.01)
            raise AssertionError(f"no {what} within {timeout:.0f}s")
        time.sleep(0.05)
