"""A real fine-tune, end to end: a pretrained-shaped Llama checkpoint in, a tokenized corpus, 4 sharded CPU
processes with activation checkpointing, a Hugging Face checkpoint out, reloaded by transformers.

    python benchmarks/fine_tune.py                     # 1.0e8 parameters, 4 processes, 16 steps
    python benchmarks/fine_tune.py --shape tiny --steps 4      # the same path in a minute

Phases, each timed, each a command a user runs (a GPU box runs the same commands with --device cuda):
  1. checkpoint  transformers builds a LlamaForCausalLM of the shape (seeded) and `save_pretrained` writes it
                 in shards of 100 MB with its index, beside the tokenizer.json of step 2 (as a Hub folder holds
                 one). This stands in for a downloaded checkpoint: nothing here reaches the network.
  2. tokenizer   `polytrain tokenize` trains a byte-level BPE of the shape's vocabulary on Tiny Shakespeare
                 (only to have a tokenizer to put in the checkpoint folder).
  3. tokenize    `polytrain tokenize CORPUS --tokenizer CHECKPOINT --out TOKENS`: the corpus in the checkpoint's
                 own tokens.
  4. fine-tune   `polytrain train --init-from CHECKPOINT --dataset tokens --data-dir TOKENS --strategy sharded
                 --devices 4 --activation-checkpointing full --context C --batch-size B --max-steps S`, the
                 recipe otherwise the defaults a user gets (AdamW, lr 5e-5 for loaded weights, cosine);
                 every worker's peak resident memory (VmHWM, polled every 0.2 s) against its share of the
                 training state (parameters, gradients, 2 AdamW slots: 16 bytes a parameter, / 4).
  5. export      `polytrain export RUN --format hf`.
  6. reload      transformers' `AutoModelForCausalLM.from_pretrained` of the export: its loss on the run's
                 first validation windows against the loss polytrain's own evaluation of the run gives (the
                 same weights: they must agree), and the largest logit difference against polytrain's model.
The loss curve is the run's metrics.jsonl (a validation every steps/4) and its progress lines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from billion import PeakWatch  # noqa: E402

SHAPES = {
    # 12 blocks of width 768 (12 heads, 4 key/value heads), SwiGLU 2560, vocabulary 8192, untied head: 1.0e8
    "100m": dict(layers=12, width=768, heads=12, kv_heads=4, ffn_width=2560, vocab_size=8192),
    "tiny": dict(layers=2, width=64, heads=4, kv_heads=2, ffn_width=128, vocab_size=512),
}
SHAKESPEARE = HERE.parent / "src" / "polytrain" / "data" / "shakespeare" / "input.txt"


def parameters(shape: dict) -> int:
    width, head_dim = shape["width"], shape["width"] // shape["heads"]
    attention = 2 * width * width + 2 * width * shape["kv_heads"] * head_dim
    block = attention + 3 * width * shape["ffn_width"] + 2 * width
    return 2 * shape["vocab_size"] * width + shape["layers"] * block + width


def polytrain(*args, log: Path) -> float:
    started = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call([sys.executable, "-m", "polytrain", *map(str, args)], stdout=out, stderr=out)
    if code != 0:
        raise SystemExit(
            f"polytrain {' '.join(map(str, args))} failed ({code}); see:\n{log.read_text()[-3000:]}"
        )
    return time.perf_counter() - started


def save_checkpoint(shape: dict, folder: Path, tokenizer=None) -> None:
    """A seeded LlamaForCausalLM of `shape` saved by `save_pretrained` in shards of 100 MB, with `tokenizer`
    (a tokenizer.json) beside it where given."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["width"],
        intermediate_size=shape["ffn_width"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=2048,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="100MB")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, folder / "tokenizer.json")


def reload(run: Path, export: Path, context: int, windows: int) -> dict:
    """transformers' loss and polytrain's on the first validation windows of the run, and their logits."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from polytrain.data.token_shards import load_token_shards
    from polytrain.runtime.inference import load_run

    settings = json.loads((run / "config.json").read_text())
    data = load_token_shards(settings["data_dir"], context=context)
    rows = data.val_tokens.windows([i * context for i in range(windows)], context + 1)
    x, y = rows[:, :-1], rows[:, 1:]
    hf = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32).eval()
    ours = load_run(run)[2].eval()
    with torch.no_grad():
        a, b = hf(x).logits, ours(x)
    return dict(
        hf_loss=float(F.cross_entropy(a.flatten(0, 1), y.flatten())),
        polytrain_loss=float(F.cross_entropy(b.flatten(0, 1), y.flatten())),
        max_logit_difference=float((a - b).abs().max()),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=SHAPES, default="100m")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--copies", type=int, default=4, help="copies of Tiny Shakespeare in the corpus")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temporary folder)")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    count = parameters(shape)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.keep or scratch)
        root.mkdir(parents=True, exist_ok=True)
        corpus = root / "corpus.txt"
        corpus.write_text(SHAKESPEARE.read_text() * args.copies)
        times = {}
        times["tokenizer"] = polytrain(
            "tokenize", SHAKESPEARE, "--out", root / "trained", "--vocab-size", shape["vocab_size"],
            log=root / "tokenizer.log",
        )  # fmt: skip
        started = time.perf_counter()
        save_checkpoint(shape, root / "checkpoint", root / "trained" / "tokenizer.json")
        times["checkpoint"] = time.perf_counter() - started
        times["tokenize"] = polytrain(
            "tokenize",
            corpus,
            "--tokenizer",
            root / "checkpoint",
            "--out",
            root / "tokens",
            log=root / "tokenize.log",
        )
        run = root / "run"
        command = [
            sys.executable, "-m", "polytrain", "train", "--init-from", root / "checkpoint", "--dataset", "tokens",
            "--data-dir", root / "tokens", "--strategy", "sharded", "--devices", args.devices,
            "--activation-checkpointing", "full", "--context", args.context, "--batch-size", args.batch_size,
            "--max-steps", args.steps, "--val-every", max(1, args.steps // 4), "--out", run,
        ]  # fmt: skip
        started = time.perf_counter()
        with open(root / "train.log", "w") as out:
            process = subprocess.Popen([str(a) for a in command], stdout=out, stderr=subprocess.STDOUT)
            watch = PeakWatch(process.pid, run)
            watch.start()
            code = process.wait()
            watch.done.set()
            watch.join()
        times["fine-tune"] = time.perf_counter() - started
        if code != 0:
            raise SystemExit(f"training failed ({code}):\n{(root / 'train.log').read_text()[-3000:]}")
        times["export"] = polytrain(
            "export", run, "--format", "hf", "--out", root / "export", log=root / "export.log"
        )
        started = time.perf_counter()
        check = reload(run, root / "export", args.context, windows=8)
        times["reload"] = time.perf_counter() - started
        records = [
            json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()
        ]
        share = 16 * count / args.devices / 2**30
        peaks = sorted(p / 2**30 for p in watch.peaks.values() if p > 0.2 * share * 2**30)[-args.devices :]
        print(
            f"Llama of {count / 1e6:.1f}M parameters ({shape}), {args.devices} processes, sharded, full checkpointing"
        )
        print(
            f"corpus: {corpus.stat().st_size / 1e6:.1f} MB; context {args.context}, batch {args.batch_size}"
        )
        print("phase seconds: " + ", ".join(f"{name} {seconds:.1f}" for name, seconds in times.items()))
        print(
            f"peak RSS per worker: {', '.join(f'{p:.2f}' for p in peaks)} GiB; training state per worker "
            f"(16 bytes a parameter / {args.devices}): {share:.2f} GiB"
        )
        print(
            f"reload in transformers: loss {check['hf_loss']:.4f} vs polytrain's {check['polytrain_loss']:.4f}; "
            f"largest logit difference {check['max_logit_difference']:.2e}"
        )
        print("loss curve (validation every steps/4; the training loss of the steps before it):")
        for record in records:
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}
            print(
                "  "
                + str({k: v for k, v in shown.items() if k in ("epoch", "step", "train_loss", "val_loss")})
            )
        print("\n".join(line for line in (root / "train.log").read_text().splitlines() if " step " in line))


if __name__ == "__main__":
    main()
