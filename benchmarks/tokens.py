"""Token data: `polytrain tokenize`'s throughput against the tokenizers library's own, its memory as the corpus
grows, and the `--dataset tokens` loader's tokens per second against what a Llama training step consumes.

    python benchmarks/tokens.py                      # 2 and 20 copies of Tiny Shakespeare (2.2 and 22 MB)
    python benchmarks/tokens.py --copies 1,4 --vocab-size 4096      # a quick look

1. Tokenizer: a byte-level BPE of --vocab-size tokens, trained by `polytrain tokenize` on the smaller corpus
   (the training pass's own MB/s is printed by the command).
2. For each corpus size, in a process of its own: `polytrain tokenize --tokenizer T` (the CLI, as a user runs
   it): seconds, MB/s, MB/s per core, and the process's peak resident memory (ru_maxrss of the child).
3. Ceiling: the same text in memory, cut into the same pieces, encoded by `Tokenizer.encode_batch` alone in
   batches of the same size (no reading, no writing): MB/s. tokenize / ceiling says what reading, cutting and
   writing cost.
4. Loader: `TokenLoader` over the shards (memory maps) at --context 256, 8 windows per step, one rank: training
   batches per second over a whole epoch's order, as tokens/s; against a Llama step (4 layers, width 256, 8
   heads, 4 key/value heads, AdamW, one process) at the same batch: the tokens/s it consumes. The loader must
   deliver many times what a step consumes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAKESPEARE = Path(__file__).resolve().parents[1] / "src" / "polytrain" / "data" / "shakespeare" / "input.txt"


def tokenize(corpus: Path, out: Path, *extra: str) -> dict:
    code = (
        "import resource, sys\n"
        "from polytrain.cli import run_command\n"
        "code = run_command(sys.argv[1:])\n"
        "print('peak-kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
        "sys.exit(code)\n"
    )
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, "tokenize", str(corpus), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = time.perf_counter() - started
    peak = int(done.stdout.split("peak-kib")[-1].split()[0]) / 1024
    manifest = json.loads((out / "manifest.json").read_text())
    return dict(
        seconds=seconds,
        encode_seconds=manifest["encode_seconds"],
        peak_mib=peak,
        tokens=manifest["train"]["tokens"] + manifest["val"]["tokens"],
        output=done.stdout.strip().splitlines(),
    )


def ceiling(corpus: Path, tokenizer_file: Path) -> float:
    """MB/s of encode_batch alone on the corpus's pieces, held in memory."""
    from polytrain.data import corpus as writer
    from polytrain.data import tokenizer as tokenizers_file

    tokenizer = tokenizers_file.load(tokenizer_file)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    batches = [
        [p.text for p in batch] for batch in writer.batches_of(writer.pieces_of([corpus], text_key="text"))
    ]
    started = time.perf_counter()
    for batch in batches:
        encode(batch, add_special_tokens=False)
    return corpus.stat().st_size / 1e6 / (time.perf_counter() - started)


def loader_rate(folder: Path, context: int, batch: int) -> float:
    from polytrain.data.text import TokenLoader
    from polytrain.data.token_shards import load_token_shards

    data = load_token_shards(str(folder), context=context)
    loader = TokenLoader(data.train_tokens, context=context, batch_size=batch, device="cpu", seed=0)
    started, tokens = time.perf_counter(), 0
    for b in loader.train_batches(0):
        tokens += b.x.numel()
    return tokens / (time.perf_counter() - started)


def step_rate(vocab: int, context: int, batch: int, steps: int = 6) -> float:
    import torch

    from polytrain.config import TrainConfig
    from polytrain.models import build_model

    config = TrainConfig(model="llama", layers=4, width=256, heads=8, kv_heads=4, context=context)
    model = build_model("llama", (context,), vocab, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, vocab, (batch, context))
    for step in range(steps + 1):
        if step == 1:
            started = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps * batch * context / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--copies", default="2,20", help="corpus sizes, in copies of Tiny Shakespeare")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    copies = [int(c) for c in args.copies.split(",")]
    cores = os.cpu_count()
    text = SHAKESPEARE.read_text()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for count in copies:
            (root / f"corpus-{count}.txt").write_text(text * count)
        first = root / f"corpus-{copies[0]}.txt"
        trained = tokenize(first, root / "trained", "--vocab-size", str(args.vocab_size))
        print(f"tokenizer: {args.vocab_size} tokens trained on {first.stat().st_size / 1e6:.1f} MB")
        for line in trained["output"][:2]:
            print(f"  {line}")
        tokenizer = root / "trained" / "tokenizer.json"
        print(f"{cores} cores; MB = 10^6 bytes of input")
        print(
            "corpus MB | tokenize s | MB/s | MB/s per core | encode_batch alone MB/s | tokenize/ceiling | peak RSS MiB"
        )
        for count in copies:
            corpus = root / f"corpus-{count}.txt"
            size = corpus.stat().st_size / 1e6
            run = tokenize(corpus, root / f"out-{count}", "--tokenizer", str(tokenizer))
            top = ceiling(corpus, tokenizer)
            rate = size / run["encode_seconds"]
            print(
                f"{size:9.1f} | {run['seconds']:10.1f} | {rate:4.1f} | {rate / cores:13.2f} | {top:23.1f} | "
                f"{rate / top:16.2f} | {run['peak_mib']:12.0f}"
            )
        folder = root / f"out-{copies[-1]}"
        delivered = loader_rate(folder, args.context, args.batch)
        consumed = step_rate(args.vocab_size, args.context, args.batch)
        print(
            f"loader: {delivered:,.0f} tokens/s (context {args.context}, {args.batch} windows a step, one rank); "
            f"a Llama step (4 layers, width 256) consumes {consumed:,.0f} tokens/s: {delivered / consumed:,.0f}x"
        )


if __name__ == "__main__":
    main()
