"""`--strategy sharded` against a hand-written FSDP2 loop: tokens per second and peak resident memory per process.

    python benchmarks/sharded_fsdp.py                          # 3 rounds of the three shapes, 2 processes
    python benchmarks/sharded_fsdp.py --shapes llama-small --rounds 1 --steps 4     # a quick look

Each round runs, for each shape, one after the other (interleaved):
  polytrain  `polytrain train --model M --dataset shakespeare <shape> --batch-size 8 --strategy sharded
             --devices 2 --epochs F` with the defaults a user gets (F: `--steps` steps of an epoch), its
             tokens/s from the epoch's record in metrics.jsonl (every step of the epoch, the first included;
             validation after the epoch is not counted in it but is in the memory).
  hand       the same model class, built from the same seed, sharded as torchtitan shards a transformer
             (`fully_shard` on each block, then on the root), trained by a loop written directly against
             torch: started by torchrun (`--standalone`, gloo), `torch.set_num_threads(cores // 2)`, AdamW
             (lr 3e-3, betas 0.9/0.99, weight decay 0.1 on matrices only, as polytrain's recipe for these
             models), gradient clipping at 1.0 over the whole model, windows of the same token ids in a seeded
             order, each rank its half of the global batch; `--steps` steps timed from the first to the last,
             as polytrain's epoch is.
Peak memory is each worker's VmHWM, polled from /proc every 0.2 s (billion.py's PeakWatch), the largest rank.
Target: polytrain / hand >= 1.0 in tokens/s, <= 1.0 in peak memory per process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SHAPES = {
    "gpt": dict(model="gpt", layers=4, width=256, heads=8, context=128),
    "llama-small": dict(model="llama", layers=4, width=256, heads=8, kv_heads=4, context=128),
    "llama-large": dict(model="llama", layers=8, width=512, heads=8, kv_heads=4, context=256),
    # (not in the default rounds) the shape of benchmarks/fine_tune.py's Llama but for its vocabulary: 8.9e7
    "llama-100m": dict(model="llama", layers=12, width=768, heads=12, kv_heads=4, context=128),
}
DEFAULT_SHAPES = ("gpt", "llama-small", "llama-large")
BATCH = 8


def shape_flags(shape: dict) -> list:
    flags = []
    for key, value in shape.items():
        if key != "model":
            flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


def steps_per_epoch(context: int) -> int:
    from polytrain.data import load_dataset

    data = load_dataset("shakespeare", context=context)
    return (len(data.train_tokens) - 1) // context // BATCH


def watched(command: list, log: Path, env=None) -> tuple:
    """Run `command`; (seconds, return code, the largest worker's peak resident bytes)."""
    from billion import PeakWatch

    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        watch = PeakWatch(process.pid, log.parent)
        watch.start()
        code = process.wait()
        watch.done.set()
        watch.join()
    return time.perf_counter() - start, code, max(watch.peaks.values(), default=0)


def run_polytrain(name: str, shape: dict, steps: int, folder: Path) -> dict:
    epochs = steps / steps_per_epoch(shape["context"])
    out = folder / f"polytrain-{name}"
    command = [
        sys.executable,
        "-m",
        "polytrain",
        "train",
        "--model",
        shape["model"],
        "--dataset",
        "shakespeare",
    ]
    command += shape_flags(shape) + ["--batch-size", str(BATCH), "--strategy", "sharded", "--devices", "2"]
    command += ["--epochs", f"{epochs:.8f}", "--out", str(out)]
    seconds, code, peak = watched(command, folder / f"polytrain-{name}.log")
    if code:
        raise SystemExit(
            f"polytrain failed on {name}: {(folder / f'polytrain-{name}.log').read_text()[-2000:]}"
        )
    return {"tokens_per_second": epoch_tokens_per_second(out), "peak_rss": peak, "wall": seconds}


def epoch_tokens_per_second(out: Path) -> float:
    """The tokens/s of the first epoch a polytrain run folder's metrics.jsonl records."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if "tokens_per_second" in r)["tokens_per_second"]


ABORT_WORDS = (
    "malloc",
    "free()",
    "corrupted",
    "Fatal Python error",
    "double free",
    "Segmentation",
    "Aborted",
    "terminate called",
)


def run_hand(name: str, shape: dict, steps: int, folder: Path) -> dict:
    result = folder / f"hand-{name}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [
        str(Path(__file__).resolve()),
        "--worker",
        name,
        "--steps",
        str(steps),
        "--result",
        str(result),
    ]
    return hand_result(command, folder / f"hand-{name}.log", result, what=name)


def hand_result(command: list, log: Path, result: Path, *, what: str) -> dict:
    """Run a hand loop's torchrun `command`: the figures its rank 0 wrote to `result`, with its largest worker's
    peak resident bytes and the seconds it took."""
    seconds, code, peak = watched(command, log)
    text = log.read_text()
    if code and result.exists() and "terminate called without an active exception" in text:
        # measured on torch 2.13 (gloo, 2 ranks): a rank of this plain torch loop aborts in 3 of 8 runs while the
        # process group is torn down, after the timed steps and the result: the figures stand, and we say so
        print(f"  (the hand loop's rank aborted at teardown on {what}, after writing its result)", flush=True)
        code = 0
    if code:
        # a rank that aborts says why early in the log, before torchrun's summary (the tail)
        why = [line for line in text.splitlines() if any(word in line for word in ABORT_WORDS)]
        raise SystemExit(f"the hand loop failed on {what}: " + "\n".join(why[:20]) + "\n..." + text[-2000:])
    return dict(json.loads(result.read_text()), peak_rss=peak, wall=seconds)


def finish_hand_worker(loss, result: str, *, tokens: int, start: float) -> None:
    """The end of a hand loop's rank, after its timed steps (from `start`, `tokens` in all): the last loss averaged
    over the ranks, rank 0 writing the tokens/s and it to `result`; then the ranks leave the group together."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    loss = loss.detach()
    dist.all_reduce(loss)
    seconds = time.perf_counter() - start
    if rank == 0:
        Path(result).write_text(
            json.dumps({"tokens_per_second": tokens / seconds, "loss": float(loss) / world})
        )
    dist.barrier()  # (a rank that tears down while its peer still sends aborts in gloo's threads)
    dist.destroy_process_group()


def worker(name: str, steps: int, result: str) -> None:
    """One rank of the hand-written loop (started by torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from polytrain.data import load_dataset
    from polytrain.models import build_model

    shape = SHAPES[name]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    context = shape["context"]
    tokens = load_dataset("shakespeare", context=context).train_tokens
    options = {k: v for k, v in shape.items() if k != "model"}
    torch.manual_seed(0)
    model = build_model(shape["model"], (context,), 65, options)
    mesh = init_device_mesh("cpu", (world,))
    for block in list(model.children())[1:-2]:  # the transformer blocks (embeddings, final norm, head apart)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.99),
    )
    generator = torch.Generator().manual_seed(1)
    windows = (len(tokens) - 1) // context
    order = torch.randperm(windows, generator=generator)
    mine = BATCH // world
    span = torch.arange(context + 1)
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        index = order[step * BATCH + rank * mine : step * BATCH + (rank + 1) * mine]
        window = tokens[index[:, None] * context + span]
        x, y = window[:, :-1], window[:, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finish_hand_worker(loss, result, tokens=steps * BATCH * context, start=start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", default=",".join(DEFAULT_SHAPES), help="comma-separated: " + ", ".join(SHAPES)
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.result)
    names = args.shapes.split(",")
    rows = {name: {"polytrain": [], "hand": []} for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name in names:
                folder = Path(tmp) / f"round{round_}"
                folder.mkdir(exist_ok=True)
                mine = run_polytrain(name, SHAPES[name], args.steps, folder)
                hand = run_hand(name, SHAPES[name], args.steps, folder)
                rows[name]["polytrain"].append(mine)
                rows[name]["hand"].append(hand)
                print(
                    f"round {round_ + 1} {name}: polytrain {mine['tokens_per_second']:,.0f} tokens/s "
                    f"{mine['peak_rss'] / 2**20:,.0f} MiB; hand {hand['tokens_per_second']:,.0f} tokens/s "
                    f"{hand['peak_rss'] / 2**20:,.0f} MiB; ratio {mine['tokens_per_second'] / hand['tokens_per_second']:.3f}",
                    flush=True,
                )
    print(
        "\n| shape | polytrain tokens/s | hand tokens/s | ratio per round | peak RSS MiB polytrain / hand |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        mine, hand = rows[name]["polytrain"], rows[name]["hand"]
        ratios = [a["tokens_per_second"] / b["tokens_per_second"] for a, b in zip(mine, hand)]
        print(
            f"| {name} | {statistics.median(r['tokens_per_second'] for r in mine):,.0f} "
            f"| {statistics.median(r['tokens_per_second'] for r in hand):,.0f} "
            f"| {', '.join(f'{r:.3f}' for r in ratios)} "
            f"| {max(r['peak_rss'] for r in mine) / 2**20:,.0f} / {max(r['peak_rss'] for r in hand) / 2**20:,.0f} |"
        )


if __name__ == "__main__":
    main()
