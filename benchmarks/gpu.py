"""GPU figures: time to a target validation accuracy on mnist-sample, and training throughput.

Run on a machine with a CUDA GPU (about 3 minutes):

    python benchmarks/gpu.py --epochs 30 --target 0.99

1. Time to target: `polytrain.fit` trains LeNet on the 8,000 mnist-sample training digits (4,000 before 2026-11-23) and validates on
   the fixed 1,000; the time is the sum of the training passes (`epoch_seconds`) up to the first epoch whose
   validation accuracy reaches --target; validation passes are not counted. Several settings are tried.
2. Throughput: LeNet on 60,000 synthetic 28x28 images at a larger batch, fp32, bf16 and compiled, in
   samples per second of the training pass (best epoch of three, after the first, which includes warm-up).
"""

from __future__ import annotations

import argparse
import json

import torch

import polytrain


def time_to_target(name, *, target, epochs, **settings):
    history = polytrain.fit("lenet", "mnist-sample", epochs=epochs, device="cuda", verbose=False, **settings)
    elapsed, reached = 0.0, None
    for record in history.epochs:
        elapsed += record["epoch_seconds"]
        if reached is None and record["val_acc"] >= target:
            reached = (record["epoch"], elapsed)
    best = max(history.epochs, key=lambda r: r["val_acc"])
    row = {
        "setting": name,
        "best_val_acc": best["val_acc"],
        "best_epoch": best["epoch"],
        "train_seconds_all": round(elapsed, 3),
        "reached_target": reached is not None,
        "epoch_at_target": reached[0] if reached else None,
        "seconds_to_target": round(reached[1], 3) if reached else None,
    }
    print(json.dumps(row), flush=True)
    return row


def throughput(name, *, batch_size, **settings):
    data = polytrain.load_dataset("synthetic", synthetic_size=60000)
    history = polytrain.fit(
        "lenet",
        data,
        epochs=3,
        batch_size=batch_size,
        device="cuda",
        verbose=False,
        schedule="constant",
        warmup_epochs=0,
        lr=0.01,
        **settings,
    )
    best = max(r["samples_per_second"] for r in history.epochs[1:])
    row = {
        "setting": name,
        "batch_size": batch_size,
        "samples_per_second": round(best),
        "first_epoch_seconds": round(history.epochs[0]["epoch_seconds"], 3),
    }
    print(json.dumps(row), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--target", type=float, default=0.99)
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    settings = {
        "defaults (sgd, onecycle, lr 0.05, batch 64)": {},
        "defaults + shift augmentation": {"augment": True},
        "adam lr 1e-3, cosine, shift augmentation": {
            "optimizer": "adam",
            "lr": 1e-3,
            "schedule": "cosine",
            "augment": True,
        },
        "batch 128, lr 0.1, shift augmentation": {"batch_size": 128, "lr": 0.1, "augment": True},
    }
    for name, extra in settings.items():
        time_to_target(name, target=args.target, epochs=args.epochs, **extra)
    for name, extra in {
        "fp32": {},
        "bf16": {"precision": "bf16"},
        "fp32 compiled": {"compile": True},
        "bf16 compiled": {"precision": "bf16", "compile": True},
    }.items():
        for batch_size in (64, 512):
            throughput(name, batch_size=batch_size, **extra)


if __name__ == "__main__":
    main()
