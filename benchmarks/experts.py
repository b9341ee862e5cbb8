"""A mixture of experts on CPU processes: `--expert-parallel N` against each rank holding every expert (DDP, and
FSDP2 over all the ranks), and against a hand-written loop of the same model with the same all-to-all; tokens per
second and peak resident memory per process.

    python benchmarks/experts.py                                   # 3 rounds on 2 and 4 processes
    python benchmarks/experts.py --processes 2 --rounds 1 --steps 4     # a quick look

The model: `--model llama --experts 8 --experts-per-token 2` (4 blocks of width 256, 8 heads, 4 key/value
heads, context 128, each block's feed-forward a mixture of 8 SwiGLU experts of width 704, 2 per token). Each round
runs, on N processes, one after the other (interleaved):

  data       `polytrain train --model llama --experts 8 ... --strategy data --devices N`: every rank all the
             experts, DDP.
  sharded    `--strategy sharded --devices N`: FSDP2 over the N ranks, each rank 1/N of every expert's weights,
             gathered for each block.
  expert     `--strategy sharded --devices N --expert-parallel N`: each rank 8/N whole experts, its tokens sent
             to the ranks of their experts and back by all-to-all.
  hand       the same model class from the same seed, written directly against torch and started by torchrun
             (`--standalone`, gloo): each rank keeps rows r 8/N .. (r + 1) 8/N - 1 of every mixture's stacked
             expert weights; a mixture's (token, choice) pairs are sorted by expert, their counts exchanged by
             `all_to_all_single`, the pairs sent by torch's `all_to_all_single_autograd`, each expert's rows
             computed as one matrix product, sent back the same way, weighed and added to their tokens; the rest
             of each block sharded by `fully_shard` (the experts left out with `ignored_params`), the experts'
             gradients divided by N (the mean over ranks that the rest's FSDP2 takes), gradient clipping at 1.0
             over the whole model (squared sums all-reduced), AdamW (lr 3e-3, betas 0.9/0.99, weight decay 0.1 on
             matrices only, as polytrain's recipe; fused, as polytrain steps DTensors on CPUs), windows of the same
             token ids in a seeded order, each rank its part of the global batch of 8; `--steps` steps timed from
             the first to the last.

polytrain's runs use the defaults a user gets; their tokens/s is the epoch's record in metrics.jsonl (`--steps`
steps; validation after the epoch is in the memory, not the time). Peak memory: each worker's VmHWM polled from
/proc every 0.2 s (billion.py's PeakWatch), the largest rank's. Targets: the expert run holds less per process
than data; polytrain's expert run / hand >= 0.95 in tokens/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sharded_fsdp import (  # noqa: E402
    epoch_tokens_per_second,
    finish_hand_worker,
    hand_result,
    shape_flags,
    steps_per_epoch,
    watched,
)

SHAPE = dict(
    model="llama", layers=4, width=256, heads=8, kv_heads=4, context=128, experts=8, experts_per_token=2
)
BATCH = 8
RUNS = ("data", "sharded", "expert", "hand")


def run_polytrain(run: str, processes: int, steps: int, folder: Path) -> dict:
    out = folder / f"{run}-{processes}"
    epochs = steps / steps_per_epoch(SHAPE["context"])
    command = [sys.executable, "-m", "polytrain", "train", "--model", "llama", "--dataset", "shakespeare"]
    command += shape_flags(SHAPE) + ["--batch-size", str(BATCH), "--devices", str(processes)]
    command += ["--strategy", "data" if run == "data" else "sharded"]
    command += ["--expert-parallel", str(processes)] if run == "expert" else []
    command += ["--epochs", f"{epochs:.8f}", "--out", str(out)]
    log = folder / f"{run}-{processes}.log"
    seconds, code, peak = watched(command, log)
    if code:
        raise SystemExit(f"polytrain failed ({run}, {processes}): {log.read_text()[-2000:]}")
    return {"tokens_per_second": epoch_tokens_per_second(out), "peak_rss": peak, "wall": seconds}


def run_hand(processes: int, steps: int, folder: Path) -> dict:
    result = folder / f"hand-{processes}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(processes),
    ]
    command += [str(Path(__file__).resolve()), "--worker", "--steps", str(steps), "--result", str(result)]
    return hand_result(command, folder / f"hand-{processes}.log", result, what=f"{processes} processes")


def exchanged(module, tokens, chosen, weights):
    """The hand loop's forward of a mixture's experts (GroupedExperts.forward's arguments), this rank holding
    `module.local` of them (rows rank x local onwards): the pairs to their experts' ranks and back by all-to-all."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    world, local = dist.get_world_size(), module.local
    picks = chosen.flatten()
    order = torch.argsort(picks, stable=True)
    owner = order // chosen.shape[1]
    sent = torch.bincount(picks, minlength=world * local).view(world, local)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent)
    send_sizes, receive_sizes = sent.sum(dim=1).tolist(), received.sum(dim=1).tolist()
    arrived = funcol.all_to_all_single_autograd(tokens[owner], receive_sizes, send_sizes, dist.group.WORLD)
    sizes = received.flatten().tolist()  # from rank s for my expert j: sizes[s * local + j]
    chunks, outputs = arrived.split(sizes), [None] * len(sizes)
    for j in range(local):
        mine = [s * local + j for s in range(world)]
        rows = torch.cat([chunks[i] for i in mine])
        done = (F.silu(rows @ module.w1[j].T) * (rows @ module.w3[j].T)) @ module.w2[j].T
        for i, part in zip(mine, done.split([sizes[i] for i in mine])):
            outputs[i] = part
    back = funcol.all_to_all_single_autograd(torch.cat(outputs), send_sizes, receive_sizes, dist.group.WORLD)
    return torch.zeros_like(tokens).index_add_(0, owner, back * weights.flatten()[order, None])


def worker(steps: int, result: str) -> None:
    """One rank of the hand-written loop (started by torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from polytrain.data import load_dataset
    from polytrain.models import build_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    context = SHAPE["context"]
    tokens = load_dataset("shakespeare", context=context).train_tokens
    torch.manual_seed(0)
    model = build_model("llama", (context,), 65, {k: v for k, v in SHAPE.items() if k != "model"})
    local = SHAPE["experts"] // world
    experts = []
    for module in model.modules():
        if hasattr(module, "w1") and isinstance(module.w1, nn.Parameter) and module.w1.dim() == 3:
            for key in ("w1", "w2", "w3"):
                whole = module._parameters[key]
                module._parameters[key] = nn.Parameter(whole.data[rank * local : (rank + 1) * local].clone())
                experts.append(module._parameters[key])
            module.local = local
            module.forward = types.MethodType(exchanged, module)
    mesh, held = init_device_mesh("cpu", (world,)), set(experts)
    for block in list(model.children())[1:-2]:  # the transformer blocks (embedding, final norm, head apart)
        fully_shard(block, mesh=mesh, ignored_params={p for p in block.parameters() if p in held})
    fully_shard(model, mesh=mesh, ignored_params=held)
    rest = [p for p in model.parameters() if p not in held]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
            {"params": experts, "weight_decay": 0.1},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.99),
        fused=True,  # (as polytrain steps DTensors on CPUs: one kernel per group)
    )
    generator = torch.Generator().manual_seed(1)
    order = torch.randperm((len(tokens) - 1) // context, generator=generator)
    mine, span = BATCH // world, torch.arange(context + 1)
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        index = order[step * BATCH + rank * mine : step * BATCH + (rank + 1) * mine]
        window = tokens[index[:, None] * context + span]
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), window[:, 1:].reshape(-1))
        loss.backward()
        for p in experts:
            p.grad.div_(world)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        squares = sum(
            (g.to_local() if isinstance(g, DTensor) else g).pow(2).sum() for g in grads
        )  # disjoint parts on every rank: FSDP2's shards, each rank's experts
        dist.all_reduce(squares)
        scale = torch.clamp(1.0 / (squares.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finish_hand_worker(loss, result, tokens=steps * BATCH * context, start=start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="2,4", help="comma-separated process counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps, args.result)
    counts = [int(n) for n in args.processes.split(",")]
    rows = {(n, run): [] for n in counts for run in RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            folder = Path(tmp) / f"round{round_}"
            folder.mkdir()
            for n in counts:
                for run in RUNS:
                    got = (
                        run_hand(n, args.steps, folder)
                        if run == "hand"
                        else run_polytrain(run, n, args.steps, folder)
                    )
                    rows[n, run].append(got)
                    print(
                        f"round {round_ + 1}, {n} processes, {run}: {got['tokens_per_second']:,.0f} tokens/s, "
                        f"peak {got['peak_rss'] / 2**20:,.0f} MiB",
                        flush=True,
                    )
    print(
        "\n| processes | run | tokens/s (median) | per round | peak RSS MiB (largest rank, max) | expert / hand |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for n in counts:
        hand = rows[n, "hand"]
        for run in RUNS:
            got = rows[n, run]
            ratio = ""
            if run == "expert":
                each = [a["tokens_per_second"] / b["tokens_per_second"] for a, b in zip(got, hand)]
                ratio = f"{statistics.median(each):.3f} ({', '.join(f'{r:.3f}' for r in each)})"
            each = ", ".join(f"{r['tokens_per_second']:,.0f}" for r in got)
            print(
                f"| {n} | {run} | {statistics.median(r['tokens_per_second'] for r in got):,.0f} "
                f"| {each} "
                f"| {max(r['peak_rss'] for r in got) / 2**20:,.0f} | {ratio} |"
            )


if __name__ == "__main__":
    main()
