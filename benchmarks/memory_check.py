"""What the memory check counts for a step's activations, against the tensors a step really holds at its peak and
against what a CPU process's resident memory grows by.

Run from the repository's root (about 3 minutes on an idle 2-core CPU):

    python benchmarks/memory_check.py                      # both parts
    python benchmarks/memory_check.py --parts allocator    # the second alone

For each model, batch and `--activation-checkpointing` mode, one device, float32:
- *counted*: the activations the memory check counts for the step (`planning/activations.py` `peak_bytes` of the
  figures `scaling/activation_memory.py` measures on fake tensors: what the forward saves, and where each
  checkpointing mode keeps or recomputes it);
- *live peak*: torch's `MemTracker` (`torch.distributed._tools.mem_tracker`) over a forward, backward and AdamW
  step on fake tensors: the activations and temporaries alive together at the step's peak, parameters,
  gradients and optimizer state apart (what a GPU's `max_memory_allocated` sees of them);
- *RSS after 1 / 3 steps*: a fresh process (1 thread, the C allocator set as polytrain's workers set it,
  `runtime/hostenv.py` `keep_freed_memory`) trains the same step on real tensors; its peak resident memory above
  what it held before the first step.

Then (`allocator`), for the Llama without and with full checkpointing, the C allocator's two settings
(`keep_freed_memory`: freed blocks kept in the heap, polytrain's default, or given back at once, for a large model
or where the memory check finds the kept heap would not fit): the median step and, over one step sampled after
every operation, the peaks of what malloc hands out, of its heap with its mapped blocks, and of resident memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MiB = 2**20
CASES = (  # (model, context, batch)
    ("llama", 4096, 4),
    ("gpt", 1024, 16),
)
MODES = ("none", "selective", "full")


def build(name: str, context: int):
    from polytrain.models.gpt import GPT
    from polytrain.models.llama import Llama

    if name == "llama":
        return Llama(65, context=context, layers=2, heads=4, kv_heads=2, width=128)
    return GPT(65, context=context, layers=4, heads=4, width=128)


def prepared(name: str, context: int, batch: int, mode: str, *, threads: int, large: bool = False):
    """In a fresh process: the C allocator as polytrain sets it (for a model of 1 GiB or more where `large`),
    `threads` torch threads, and (model under `mode`'s checkpointing, AdamW, objective, token ids)."""
    import torch

    from polytrain.objective import Objective
    from polytrain.parallel.activation_checkpoint import apply_activation_checkpointing
    from polytrain.runtime.hostenv import LARGE_MODEL, keep_freed_memory

    keep_freed_memory(model_bytes=LARGE_MODEL if large else 0)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build(name, context)
    apply_activation_checkpointing(model, mode)
    optimizer = torch.optim.AdamW(model.parameters())
    return model, optimizer, Objective(kind="language"), torch.randint(0, 65, (batch, context))


def loss_of(objective, model, ids):
    loss = objective.loss_sum(model(ids), ids)
    return loss[0] if isinstance(loss, tuple) else loss


def counted(name: str, context: int, batch: int, mode: str) -> float:
    import torch

    from polytrain.objective import Objective
    from polytrain.planning.activations import peak_bytes
    from polytrain.planning.costmodel import Workload
    from polytrain.scaling.activation_memory import activation_profile

    ids = torch.zeros(batch, context, dtype=torch.long)
    figures = activation_profile(build(name, context), Objective(kind="language"), ids, ids)
    work = Workload(compute_seconds=0.0, parameter_bytes=0.0, batch_size=batch, **figures)
    return peak_bytes(work, mode) * batch


def live_peak(name: str, context: int, batch: int, mode: str) -> float:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from polytrain.objective import Objective
    from polytrain.parallel.activation_checkpoint import apply_activation_checkpointing

    with FakeTensorMode():
        model = build(name, context)
        apply_activation_checkpointing(model, mode)
        optimizer = torch.optim.AdamW(model.parameters())
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            loss_of(
                Objective(kind="language"), model, torch.zeros(batch, context, dtype=torch.long)
            ).backward()
            optimizer.step()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
    kinds = {str(kind).rsplit(".", 1)[-1]: value for kind, value in peak.items()}
    return kinds["ACT"] + kinds["TEMP"]


def resident(name: str, context: int, batch: int, mode: str, steps: int) -> float:
    """Peak resident bytes above the level before the first step, in a fresh process."""
    code = f"""
import json
import benchmarks.memory_check as here
model, optimizer, objective, ids = here.prepared({name!r}, {context}, {batch}, {mode!r}, threads=1)
def status(field):
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) * 1024
before = status("VmRSS")
for _ in range({steps}):
    here.loss_of(objective, model, ids).backward()
    optimizer.step()
    optimizer.zero_grad()
print(json.dumps(status("VmHWM") - before))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def allocator(name: str, context: int, batch: int, mode: str, large: bool, steps: int = 4) -> dict:
    """In a fresh process (2 threads): median step seconds over `steps` steps after the first, and the peaks
    above the start of what glibc's malloc hands out (`mallinfo2`: in-use bytes, and the heap with its mapped
    blocks) and of resident memory, sampled after every operation of the last step; with the C allocator as
    polytrain sets it for a model under 1 GiB (`large` False: freed blocks kept in the heap) or over (True: blocks
    over 1 MiB mapped on their own and given back when freed)."""
    code = f"""
import ctypes, json, statistics, time, torch
from torch.utils._python_dispatch import TorchDispatchMode
import benchmarks.memory_check as here
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
def now():
    info = libc.mallinfo2()
    rss = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
    return dict(in_use=info.uordblks + info.hblkhd, heap=info.arena + info.hblkhd, rss=rss)
model, optimizer, objective, ids = here.prepared({name!r}, {context}, {batch}, {mode!r}, threads=2, large={large})
start, peak, seconds = now(), dict(in_use=0, heap=0, rss=0), []
class Sample(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {{}}))
        for key, value in now().items():
            peak[key] = max(peak[key], value - start[key])
        return out
def step():
    here.loss_of(objective, model, ids).backward()
    optimizer.step()
    optimizer.zero_grad()
for _ in range({steps}):
    began = time.perf_counter()
    step()
    seconds.append(time.perf_counter() - began)
with Sample():
    step()
print(json.dumps(dict(peak, seconds=statistics.median(seconds[1:]))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", default="count,allocator", help="count, allocator, or both (comma-separated)"
    )
    parts = parser.parse_args(argv).parts.split(",")
    if "count" in parts:
        print("| model, T, batch | checkpointing | counted MiB | live peak MiB | live / counted | RSS after 1 step MiB "
              "| RSS after 3 steps MiB | RSS (3) / live |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, context, batch in CASES:
            for mode in MODES:
                count, live = counted(name, context, batch, mode), live_peak(name, context, batch, mode)
                one, three = (resident(name, context, batch, mode, steps) for steps in (1, 3))
                print(
                    f"| {name}, {context}, {batch} | {mode} | {count / MiB:.0f} | {live / MiB:.0f} | {live / count:.2f} "
                    f"| {one / MiB:.0f} | {three / MiB:.0f} | {three / live:.2f} |",
                    flush=True,
                )
    if "allocator" in parts:
        print(
            "| model, T, batch | checkpointing | C allocator | step s | malloc in use MiB | heap MiB | RSS MiB |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, context, batch in CASES[:1]:
            for mode in ("none", "full"):
                for large in (False, True):
                    got = allocator(name, context, batch, mode, large)
                    print(
                        f"| {name}, {context}, {batch} | {mode} | {'mapped over 1 MiB' if large else 'kept'} "
                        f"| {got['seconds']:.2f} | {got['in_use'] / MiB:.0f} | {got['heap'] / MiB:.0f} "
                        f"| {got['rss'] / MiB:.0f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
