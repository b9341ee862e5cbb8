"""The GPT's training step: polytrain against the same loop written by hand, on one CPU.

Run (about 2 minutes on an idle 2-core CPU; on a loaded one, pin it to a core: `taskset -c 1 python ...`):

    python benchmarks/gpt_step.py --repeats 5 --epochs 1 --steps 60

The model is `--model gpt`'s default (4 layers, 4 heads, width 128, context 64, tied head) trained with its
default recipe (batch 32, AdamW (0.9, 0.99), lr 2e-3, weight decay 0.1 on 2-D weights only, a cosine schedule
after 5% warm-up, clipping at 1.0) on the first `--steps` x batch windows of the `shakespeare` text (written to
a temporary file and read as `--dataset text`, so that an epoch is short), two ways, interleaved A, B, A, B, ...:

  polytrain  `polytrain.fit(model, "text", ...)`; the epoch time is `history["epoch_seconds"]` (the training
             pass only, as for `single_device.py`).
  by-hand    the operations polytrain performs, written out: the token ids in memory, the same seeded window
             order and per-epoch offset, cross-entropy summed per window's mean over its tokens, AdamW with
             `foreach=True` in the same two parameter groups, the same `LambdaLR` cosine, clipping by the global
             norm (`clip_grad_norm_(foreach=True)`), loss summed on the device (no per-step `.item()`).

Both start from a deepcopy of one seeded model and time only the training pass of each epoch with
`time.perf_counter`; one untimed warm-up epoch of each runs first. Both print their training loss, which agree
to float rounding (the two ways compute the same thing). Target: polytrain <= 1.00x by-hand (the medians; the
ratio of the fastest epochs is printed beside it).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from interleaved import interleave, report, save  # benchmarks/interleaved.py (run as python benchmarks/...)

import polytrain
from polytrain.config.model_defaults import MODEL_DEFAULTS
from polytrain.data.order import global_batch_order
from polytrain.data.text import SHAKESPEARE, TokenLoader, tokenise
from polytrain.models import build_model
from polytrain.optim import lr_factor

RECIPE = MODEL_DEFAULTS["gpt"]
TARGET = 1.00


def train_polytrain(model, data, *, text_file, epochs, batch_size, seed):
    threads = torch.get_num_threads()
    history = polytrain.fit(
        model,
        "text",
        data_dir=str(text_file),
        context=data.context,
        epochs=epochs,
        batch_size=batch_size,
        optimizer="adamw",
        lr=RECIPE["lr"],
        betas=RECIPE["betas"],
        weight_decay=RECIPE["weight_decay"],
        no_decay_norms_and_biases=True,
        schedule="cosine",
        warmup_epochs=RECIPE["warmup_epochs"],
        clip_grad_norm=RECIPE["clip_grad_norm"],
        seed=seed,
        device="cpu",
        verbose=False,
    )
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return list(zip(history["epoch_seconds"], history["train_loss"]))


def train_by_hand(model, data, *, text_file, epochs, batch_size, seed):
    loader = TokenLoader(
        data.train_tokens, context=data.context, batch_size=batch_size, device="cpu", seed=seed
    )
    tokens, context, n = data.train_tokens, data.context, loader.num_samples
    span = torch.arange(context + 1)
    decay = [p for p in model.parameters() if p.dim() > 1]
    other = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay}, {"params": other, "weight_decay": 0.0}],
        lr=RECIPE["lr"],
        betas=RECIPE["betas"],
        weight_decay=RECIPE["weight_decay"],
        foreach=True,
    )
    steps = -(-n // batch_size)
    warmup = round(RECIPE["warmup_epochs"] * steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, total_steps=epochs * steps, warmup_steps=warmup, kind="cosine"),
    )
    results = []
    for epoch in range(epochs):
        model.train()
        loss_total = torch.zeros((), dtype=torch.float64)
        began = time.perf_counter()
        order = global_batch_order(n, epoch=epoch, seed=seed)
        offset = loader.offset(epoch)  # the seeded start of the epoch's windows
        for start in range(0, n, batch_size):
            windows = tokens[(offset + order[start : start + batch_size] * context)[:, None] + span]
            x, y = windows[:, :-1], windows[:, 1:]
            logits = model(x)
            loss_sum = F.cross_entropy(logits.float().flatten(0, -2), y.flatten(), reduction="sum") / context
            optimizer.zero_grad(set_to_none=True)
            (loss_sum / len(y)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE["clip_grad_norm"], foreach=True)
            optimizer.step()
            scheduler.step()
            loss_total += loss_sum.detach()
        seconds = time.perf_counter() - began
        results.append((seconds, loss_total.item() / n))
    return results


WAYS = {"polytrain": train_polytrain, "by-hand": train_by_hand}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=RECIPE["batch_size"])
    parser.add_argument("--steps", type=int, default=60, help="steps per epoch (default: 60)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per run (default: 1)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs of each way (default: 5)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed warm-up epochs of each way (default: 1)"
    )
    parser.add_argument("--context", type=int, default=RECIPE["context"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)

    text = SHAKESPEARE.read_text(encoding="utf-8")
    # the training split is the first 90%: enough characters for `steps` batches of windows (and a remainder
    # for the shifted windows), the rest of the file's share for validation
    characters = math.ceil(((args.steps * args.batch_size + 1) * args.context + args.context) / 0.9) + 1
    with tempfile.TemporaryDirectory() as folder:
        text_file = Path(folder) / "shakespeare-head.txt"
        text_file.write_text(text[:characters], encoding="utf-8")
        data = tokenise(text_file.read_text(encoding="utf-8"), name="text", context=args.context)
        torch.manual_seed(args.seed)
        base = build_model("gpt", data.input_shape, data.num_classes)
        common = dict(data=data, text_file=text_file, batch_size=args.batch_size, seed=args.seed)
        steps = -(-data.num_train // args.batch_size)
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, GPT "
            f"{sum(p.numel() for p in base.parameters()):,} parameters, vocab {data.num_classes}, "
            f"{data.num_train} windows of {args.context} (batch {args.batch_size}, {steps} steps per epoch)"
        )
        epochs, losses = interleave(
            WAYS, base, repeats=args.repeats, warmup=args.warmup, epochs=args.epochs, **common
        )

    medians, ratios, minima = report(
        epochs, losses, per_epoch=data.num_train * args.context, unit="tokens", targets={"by-hand": TARGET}
    )
    ratio, of_minima = ratios["by-hand"], minima["by-hand"]
    result = dict(
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        batch_size=args.batch_size,
        context=args.context,
        steps=steps,
        epochs=args.epochs,
        repeats=args.repeats,
        epoch_seconds=epochs,
        median_seconds=medians,
        ratio=ratio,
        ratio_of_minima=of_minima,
        train_loss=losses,
    )
    return save(result, args.json)


if __name__ == "__main__":
    main()
