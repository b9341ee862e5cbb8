"""Memory per rank of --precision bf16 under FSDP2 (`--strategy sharded`): the MixedPrecisionPolicy (bfloat16
parameters for compute and the all-gathers, float32 reduction into float32 master shards) beside autocast alone
(float32 shards gathered in float32, each weight cast to bfloat16 by autocast as an op uses it), and float32.

Run (about a minute on an idle 2-core CPU):

    python benchmarks/mixed_precision_memory.py --layers 4 --width 512 --batch-size 16 --steps 3

Two gloo processes on the CPU train the built-in GPT (context 64, vocabulary 65, AdamW) from the same seed for
`--steps` steps, each configuration in fresh processes. Per rank: the bytes it holds in parameters (its float32
shards), gradients and optimizer state after the steps, and its peak resident memory (`resource.getrusage`,
the process's lifetime peak, imports included) and that peak's growth over the resident memory before the model
was built.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("fp32", "bf16 autocast only", "bf16 policy")


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _rank(rank: int, init_file: str, mode: str, args, results) -> None:
    from polytrain.data.order import Batch
    from polytrain.models import build_model_on_meta
    from polytrain.objective import Objective
    from polytrain.parallel import fsdp
    from polytrain.parallel.layout import Layout
    from polytrain.planning.sharded import ShardedPlan
    from polytrain.strategies import Strategy
    from polytrain.strategies.holdings import local_bytes

    if mode == "bf16 autocast only":  # the behaviour before the policy: autocast over float32 shards
        fsdp.mixed_precision = lambda precision: {}

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    before = _rss()
    sizes = dict(layers=args.layers, width=args.width, heads=args.width // 64)
    model = build_model_on_meta("gpt", (64,), 65, sizes)
    strategy = Strategy(
        device=torch.device("cpu"),
        rank=rank,
        world_size=2,
        layout=Layout(shard=2),
        precision="fp32" if mode == "fp32" else "bf16",
        plan=ShardedPlan(cpu_offload=False),
        objective=Objective(kind="language"),
        seed=0,
    )
    strategy.setup(
        model,
        lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-3),
        lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    )
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randint(0, 65, (args.batch_size, 64), generator=generator)
        y = torch.randint(0, 65, (args.batch_size, 64), generator=generator)
        strategy.train_step(Batch(x, y, args.batch_size * 2, step))
    params = list(strategy.model.parameters())
    state = [t for p in params for t in strategy.optimizer.state[p].values() if t.dim() > 0]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results.put(
        (
            rank,
            local_bytes(params),
            local_bytes(p.grad for p in params if p.grad is not None),
            local_bytes(state),
            peak,
            peak - before,
        )
    )
    dist.destroy_process_group()


def measure(mode: str, args) -> list:
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(target=_rank, args=(r, init_file, mode, args, results)) for r in range(2)
        ]
        for process in processes:
            process.start()
        rows = sorted(results.get(timeout=600) for _ in processes)
        for process in processes:
            process.join()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    mib = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
    print("| mode | rank | parameters MiB | gradients MiB | optimizer MiB | peak RSS MiB | peak growth MiB |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        for rank, params, grads, state, peak, grown in measure(mode, args):
            print(
                f"| {mode} | {rank} | {mib(params)} | {mib(grads)} | {mib(state)} | {mib(peak)} | {mib(grown)} |"
            )


if __name__ == "__main__":
    main()
