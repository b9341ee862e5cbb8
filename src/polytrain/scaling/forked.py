"""Independent pieces of work spread over forks of this process, one per CPU it may use: `polytrain plan`'s layouts,
each built at full size on a fake process group of its own.

A fork copies this process as it is, so the work needs no pickling (a plan's model factory may be a user's closure)
and what the work reads is shared, not copied; only each piece's result comes back (pickled). Forks are taken on
Linux only, and not where this process runs other threads of Python (a notebook's kernel): a fork copies a lock
another thread holds, and waits on it for ever. Elsewhere the pieces run here, one after the other.

What lives when the work starts (torch, the inputs of every piece) outlives every piece, so it is frozen out of the
garbage collector's scans while 4 pieces or more run (`gc.freeze`): a plan's layouts each leave cycles of modules and
hooks behind, and full collections scanned all of torch each time (a third of a plan's time in one process).
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Callable, List, Optional, Sequence

# what a fork works from: (the function, the items), set in this process just before it forks
_WORK: Optional[tuple] = None


def fork_count(items: int) -> int:
    """How many processes share `items` pieces: one per CPU this process may use on Linux, where this process runs
    no other thread of Python; 1 (this process alone) elsewhere, and for fewer than 4 pieces."""
    import threading

    if not sys.platform.startswith("linux") or items < 4 or threading.active_count() > 1:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, items // 2))


def _run_forked(index: int):
    function, items = _WORK
    return function(items[index])


def forked_map(function: Callable, items: Sequence, *, workers: int, progress=None) -> List:
    """`[function(item) for item in items]`, in order: here, or spread over `workers` forks of this process.
    `progress(result, done, total)` after each piece, in the order they finish. A fork that dies (out of memory,
    killed) leaves its pieces to this process; Ctrl-C stops the forks with this process."""
    results: List = [None] * len(items)
    done = [False] * len(items)
    # (a few pieces gain nothing from it; what a caller froze itself stays as it froze it)
    ours = len(items) >= 4 and gc.get_freeze_count() == 0
    if ours:
        gc.collect()
        gc.freeze()
    try:
        if workers > 1:
            _in_forks(function, items, workers, results, done, progress)
        for index, item in enumerate(items):
            if not done[index]:
                results[index], done[index] = function(item), True
                if progress:
                    progress(results[index], sum(done), len(items))
    finally:
        if ours:
            gc.unfreeze()
    return results


def _in_forks(function, items, workers: int, results: list, done: list, progress) -> None:
    import concurrent.futures
    import multiprocessing

    global _WORK
    _WORK = (function, items)
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    try:
        futures = {pool.submit(_run_forked, index): index for index in range(len(items))}
        for future in concurrent.futures.as_completed(futures):
            index = futures[future]
            results[index], done[index] = future.result(), True
            if progress:
                progress(results[index], sum(done), len(items))
    except concurrent.futures.process.BrokenProcessPool:
        pass  # (the pieces not yet done are done here)
    except BaseException:  # Ctrl-C: the forks stop with this process, their pieces dropped
        forks = list((getattr(pool, "_processes", None) or {}).values())  # (Python 3.14: terminate_workers)
        pool.shutdown(wait=False, cancel_futures=True)
        for process in forks:
            process.terminate()
        raise
    finally:
        _WORK = None
    pool.shutdown()
