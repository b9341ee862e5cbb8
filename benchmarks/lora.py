"""A LoRA fine-tune of a 1.0e8-parameter Llama on 2 CPU processes: `polytrain train --init-from CKPT --lora 16`
with the defaults a user gets, against the same fine-tune written by hand with transformers + peft + DDP;
tokens per second, peak resident memory per process, the loss after the steps, and what each writes.

    python benchmarks/lora.py                            # 2 rounds of 8 steps, context 128, global batch 8
    python benchmarks/lora.py --shape tiny --steps 3 --rounds 1      # the same path in a minute

The checkpoint: benchmarks/fine_tune.py's (transformers builds a LlamaForCausalLM of 12 blocks of width 768, 12
heads over 4 key/value heads, SwiGLU 2560, vocabulary 8192, untied head, seeded, and `save_pretrained` writes it
in files of 100 MB); nothing reaches the network. The data: Tiny Shakespeare's characters (ids below 65),
windows of `--context` + 1 tokens. Each round runs, one after the other:

  polytrain  `polytrain train --init-from CKPT --dataset shakespeare --context C --batch-size 8 --lora 16
             --devices 2 --epochs E` (E: the steps asked): the layout `--strategy auto` chooses, AdamW at 5e-5
             (polytrain's rate for loaded weights), cosine, clipping at 1.0; tokens/s the epoch's record in
             metrics.jsonl. Then `polytrain export RUN --format peft`.
  hand       torchrun (`--standalone`, gloo) of 2 ranks: `AutoModelForCausalLM.from_pretrained(CKPT)`,
             `peft.get_peft_model` with the same LoraConfig (r 16, alpha 8, q k v o gate up down projections), DDP,
             AdamW (lr 5e-5, betas 0.9/0.99, weight decay 0.1, fused), gradient clipping at 1.0, each rank its half
             of the global batch of 8 windows in a seeded order, the loss the cross-entropy of the logits against
             the next characters (reported: the mean over the steps, as polytrain's epoch record); `--steps` steps
             timed from the first to the last. Its adapters saved with
             `save_pretrained`.

Peak memory: each worker's VmHWM polled from /proc every 0.2 s (billion.py's PeakWatch), the largest rank's.
Targets: polytrain's tokens/s at least 0.95x the hand loop's, its peak per process at most the hand loop's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fine_tune import SHAPES, save_checkpoint  # noqa: E402
from sharded_fsdp import epoch_tokens_per_second, finish_hand_worker, hand_result, watched  # noqa: E402

BATCH = 8
RANK, ALPHA = 16, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def steps_per_epoch(context: int) -> int:
    from polytrain.data import load_dataset

    return (len(load_dataset("shakespeare", context=context).train_tokens) - 1) // context // BATCH


def size_of(path: Path) -> int:
    return (
        sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        if path.is_dir()
        else path.stat().st_size
    )


def run_polytrain(checkpoint: Path, context: int, steps: int, folder: Path) -> dict:
    out = folder / "polytrain"
    epochs = steps / steps_per_epoch(context)
    command = [sys.executable, "-m", "polytrain", "train", "--init-from", str(checkpoint), "--dataset"]
    command += ["shakespeare", "--context", str(context), "--batch-size", str(BATCH), "--lora", str(RANK)]
    command += ["--devices", "2", "--epochs", f"{epochs:.8f}", "--out", str(out)]
    log = folder / "polytrain.log"
    seconds, code, peak = watched(command, log)
    if code:
        raise SystemExit(f"polytrain failed: {log.read_text()[-2000:]}")
    text = log.read_text()
    layout = next((line for line in text.splitlines() if line.startswith("--strategy auto")), "")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loss = next(r for r in records if "train_loss" in r)["train_loss"]
    subprocess.check_call(
        [
            sys.executable,
            "-m",
            "polytrain",
            "export",
            str(out),
            "--format",
            "peft",
            "--out",
            str(folder / "peft"),
        ],
        stdout=subprocess.DEVNULL,
    )
    written = {"run folder": size_of(out), "checkpoint": size_of(out / "checkpoint.pt")}
    written.update({"shards": sum(size_of(p) for p in out.glob("checkpoint-*"))})
    written["peft export"] = size_of(folder / "peft")
    return {
        "tokens_per_second": epoch_tokens_per_second(out),
        "peak_rss": peak,
        "wall": seconds,
        "loss": loss,
        "layout": layout,
        "written": written,
    }


def run_hand(checkpoint: Path, context: int, steps: int, folder: Path) -> dict:
    result = folder / "hand.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(Path(__file__).resolve()), "--worker", "--checkpoint", str(checkpoint)]
    command += ["--context", str(context), "--steps", str(steps), "--result", str(result)]
    got = hand_result(command, folder / "hand.log", result, what="the LoRA fine-tune")
    got["written"] = {"peft save_pretrained": size_of(folder / "hand-peft")}
    return got


def worker(checkpoint: str, context: int, steps: int, result: str) -> None:
    """One rank of the hand-written fine-tune (started by torchrun)."""
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    from polytrain.data import load_dataset

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    tokens = load_dataset("shakespeare", context=context).train_tokens
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = get_peft_model(
        model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    )
    ddp = DistributedDataParallel(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=5e-5, betas=(0.9, 0.99), weight_decay=0.1, fused=True)
    generator = torch.Generator().manual_seed(1)
    order = torch.randperm((len(tokens) - 1) // context, generator=generator)
    mine, span = BATCH // world, torch.arange(context + 1)
    dist.barrier()
    start, losses = time.perf_counter(), torch.zeros(())
    for step in range(steps):
        index = order[step * BATCH + rank * mine : step * BATCH + (rank + 1) * mine]
        window = tokens[index[:, None] * context + span]
        logits = ddp(input_ids=window[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), window[:, 1:].reshape(-1))
        loss.backward()
        losses += loss.detach()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        model.save_pretrained(Path(result).parent / "hand-peft")
    # the mean of the steps' losses, as polytrain's epoch record gives it
    finish_hand_worker(losses / steps, result, tokens=steps * BATCH * context, start=start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="100m", choices=sorted(SHAPES))
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.checkpoint, args.context, args.steps, args.result)
    rows = {"polytrain": [], "hand": []}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        save_checkpoint(SHAPES[args.shape], checkpoint)
        print(f"checkpoint: {size_of(checkpoint) / 2**20:,.0f} MiB", flush=True)
        for round_ in range(args.rounds):
            folder = Path(tmp) / f"round{round_}"
            folder.mkdir()
            for run in rows:
                runner = run_polytrain if run == "polytrain" else run_hand
                got = runner(checkpoint, args.context, args.steps, folder)
                rows[run].append(got)
                print(
                    f"round {round_ + 1}, {run}: {got['tokens_per_second']:,.0f} tokens/s, peak "
                    f"{got['peak_rss'] / 2**20:,.0f} MiB, loss {got['loss']:.4f}, wrote "
                    + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in got["written"].items())
                    + (f"; {got['layout']}" if got.get("layout") else ""),
                    flush=True,
                )
    print(
        "\n| run | tokens/s (median) | per round | peak RSS MiB (largest rank, max) | loss after the steps |"
    )
    print("| --- | --- | --- | --- | --- |")
    for run, got in rows.items():
        each = ", ".join(f"{r['tokens_per_second']:,.0f}" for r in got)
        losses = ", ".join(f"{r['loss']:.4f}" for r in got)
        print(
            f"| {run} | {statistics.median(r['tokens_per_second'] for r in got):,.0f} | {each} "
            f"| {max(r['peak_rss'] for r in got) / 2**20:,.0f} | {losses} |"
        )
    ratios = [
        a["tokens_per_second"] / b["tokens_per_second"] for a, b in zip(rows["polytrain"], rows["hand"])
    ]
    print(
        f"\npolytrain / hand, tokens/s: {statistics.median(ratios):.3f} ({', '.join(f'{r:.3f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
