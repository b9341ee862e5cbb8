"""How long training stops for a checkpoint of shards: written at once (`--checkpoint-every`) or in the background
(`--async-checkpoint`), on CPU processes with gloo.

    python benchmarks/checkpoint_stall.py --processes 2 --width 2048 --layers 8

Each process holds its FSDP2 shards of an MLP (`layers` Linear layers of width x width, float32) and Adam's two
moments, so the checkpoint is 3 x the parameters' size in all. It times a few plain steps, then a step followed by
a synchronous save (runtime/shards.py `save`), then a step followed by `save_async` (the stall: the snapshot and
the start of the write) and the steps that run while the write goes on, until `result()`. Printed per mode, by
rank 0: the step time, the stall, and for async the seconds until the folder was complete.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn


def step(model, optimizer, x) -> None:
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(function) -> float:
    dist.barrier()
    start = time.perf_counter()
    function()
    dist.barrier()
    return time.perf_counter() - start


def worker(rank: int, args, folder: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from polytrain.runtime import shards

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(folder, "store"), args.processes)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.processes)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width)
    group = dist.new_group(backend="gloo")  # background writes' own process group, as Checkpointer makes it
    step(model, optimizer, x)  # optimizer state exists
    plain = statistics.median(timed(lambda: step(model, optimizer, x)) for _ in range(args.steps))

    def state():
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    sync = timed(lambda: shards.save(state(), Path(folder), "sync", is_main=rank == 0))
    pending = []
    stall = timed(lambda: pending.append(shards.save_async(state(), Path(folder), "async", group=group)))
    start, overlapped = time.perf_counter(), []
    while not pending[0].done():
        overlapped.append(timed(lambda: step(model, optimizer, x)))
    pending[0].result()
    dist.barrier()
    complete = time.perf_counter() - start + stall
    if rank == 0:
        size = sum(f.stat().st_size for f in Path(folder, "sync").iterdir()) / 2**20
        during = statistics.median(overlapped) if overlapped else float("nan")
        print(
            f"{args.processes} processes, checkpoint {size:,.0f} MiB (model + Adam), torch {torch.__version__}"
        )
        print(f"  step without checkpoint   {plain * 1000:8.0f} ms (median)")
        print(f"  synchronous save          {sync * 1000:8.0f} ms of training stopped")
        print(f"  async save: stall         {stall * 1000:8.0f} ms (snapshot, start of the write)")
        print(
            f"  async save: complete in   {complete * 1000:8.0f} ms; {len(overlapped)} steps ran meanwhile "
            f"({during * 1000:.0f} ms each, median)"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.spawn(worker, args=(args, folder), nprocs=args.processes)


if __name__ == "__main__":
    main()
