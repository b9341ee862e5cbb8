"""What the Ctrl-C/SIGTERM agreement costs a training step (polytrain.runtime.stopping.StopSignal).

Run (about 30 seconds on a 2-core CPU):

    python benchmarks/stop_vote.py --steps 300 --repeats 2

Two gloo processes on this machine, one thread each, run `--steps` iterations of a stand-in step (matrix
products, ~8 ms on a 2-core EPYC VM), alternately without and with `StopSignal.should_stop()` after each
step, and print the time per step of each. The vote itself runs only about every `VOTE_SECONDS`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from polytrain.runtime.stopping import StopSignal


def run(rank: int, world_size: int, init_file: str, steps: int, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    stop = StopSignal(exit_on_repeat=False)
    stop.connect(world_size)
    x = torch.randn(256, 256)
    for repeat in range(repeats):
        for with_vote in (False, True):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(steps):
                for _ in range(20):
                    x @ x
                if with_vote:
                    stop.should_stop()
            dist.barrier()
            per_step = (time.perf_counter() - started) / steps * 1e3
            if rank == 0:
                print(
                    f"repeat {repeat + 1}  vote {'on ' if with_vote else 'off'}  {per_step:.3f} ms per step  "
                    f"(steps between votes now: {stop.interval})",
                    flush=True,
                )
    stop.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(run, args=(2, os.path.join(folder, "rendezvous"), args.steps, args.repeats), nprocs=2)


if __name__ == "__main__":
    main()
