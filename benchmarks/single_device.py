"""Single-device epoch time: polytrain versus the same loop by hand versus the loop most people write.

Run (about 1 minute on a 2-core CPU; on a GPU add --device cuda):

    python benchmarks/single_device.py --repeats 10 --epochs 2 --batch-size 64 --device cpu

LeNet (`build_model("lenet", (1, 28, 28), 10)`) is trained on the 8,000 training digits of `mnist-sample` (4,000 before 2026-11-23)
three ways, interleaved A, B, C, A, B, C, ... so that other load on the machine hits all three alike:

  polytrain  `polytrain.fit(...)`; the epoch time is `history["epoch_seconds"]` (the training pass only).
             A convolutional module passed as an object trains channels-last, as polytrain chooses for any
             module that gives the same outputs in that format (before 2026-11-25 only for models it built
             from a name, which made this benchmark compare two layouts: 1.49x and other losses).
  by-hand    the operations polytrain performs, written out: the same uint8 tensors in memory, the same
             normalisation `x.float() * scale + shift`, the same seeded `global_batch_order` (copied to the
             device once per epoch), SGD with `foreach=True`, loss and correct counts summed on the device
             (no per-step `.item()`), channels-last weights and inputs for convolutional models (polytrain's
             default), and on CUDA `fused=True` SGD.
  naive      a `TensorDataset` of float normalised images, `DataLoader(shuffle=True)`, default
             `torch.optim.SGD`, and `loss.item()` plus an accuracy `.item()` every step.

Every way starts from a deepcopy of one seeded model and uses the same batch size, learning rate, momentum,
weight decay and seed, and times only the training pass of each epoch with `time.perf_counter` (after
`torch.cuda.synchronize` on a GPU). One untimed warm-up epoch of each way runs first (`--warmup`).
Targets: polytrain <= 1.02x by-hand, and <= 0.85x naive.
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

import torch
import torch.nn.functional as F
from interleaved import interleave, report, save  # benchmarks/interleaved.py (run as python benchmarks/...)
from torch.utils.data import DataLoader, TensorDataset

import polytrain
from polytrain.data.loader import global_batch_order
from polytrain.models import MODELS, build_model

LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 5e-4
TARGETS = {"by-hand": 1.02, "naive": 0.85}  # polytrain's epoch time may be at most this times the other's


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def normalisation(dataset, device):
    """(scale, shift) with (x/255 - mean)/std == x * scale + shift, as polytrain's loader computes them."""
    mean, std = dataset.channel_stats()
    shape = (1, -1, 1, 1)
    return (1.0 / (255.0 * std)).reshape(shape).to(device), (-mean / std).reshape(shape).to(device)


def convolutional(model) -> bool:
    return any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


def train_polytrain(model, dataset, *, epochs, batch_size, seed, device):
    threads = torch.get_num_threads()
    history = polytrain.fit(
        model,
        dataset,
        epochs=epochs,
        batch_size=batch_size,
        optimizer="sgd",
        lr=LR,
        momentum=MOMENTUM,
        weight_decay=WEIGHT_DECAY,
        schedule="constant",
        warmup_epochs=0,
        seed=seed,
        device=device.type,
        verbose=False,
    )
    if torch.get_num_threads() != threads:
        # The worker sets the thread count of the calling process; put it back so the other ways get the same.
        print(f"  note: polytrain.fit changed torch threads {threads} -> {torch.get_num_threads()}; restored")
        torch.set_num_threads(threads)
    return list(zip(history["epoch_seconds"], history["train_loss"]))


def train_command(model, dataset, *, epochs, batch_size, seed, device):
    """`polytrain train` on the command line, as a user runs it (its own worker process and seeded LeNet;
    `model` is not used); the epoch times are the training passes it writes to metrics.jsonl."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "-m",
            "polytrain",
            "train",
            "--dataset",
            "mnist-sample",
            "--model",
            "lenet",
        ]
        command += ["--epochs", str(epochs), "--batch-size", str(batch_size), "--optimizer", "sgd"]
        command += ["--lr", str(LR), "--momentum", str(MOMENTUM), "--weight-decay", str(WEIGHT_DECAY)]
        command += ["--schedule", "constant", "--warmup-epochs", "0", "--seed", str(seed)]
        command += ["--device", device.type, "--out", out]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    return [(row["epoch_seconds"], row["train_loss"]) for row in rows]


def train_by_hand(model, dataset, *, epochs, batch_size, seed, device):
    # channels-last weights and inputs for convolutional models, as polytrain chooses
    memory_format = torch.channels_last if convolutional(model) else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    images, labels = dataset.train_x.to(device), dataset.train_y.to(device)
    scale, shift = normalisation(dataset, device)
    # polytrain's choice: one fused kernel on CUDA, multi-tensor foreach kernels on the CPU.
    speed = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.SGD(
        model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, **speed
    )
    n = len(labels)
    results = []
    for epoch in range(epochs):
        model.train()
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        loss_total, correct_total = totals[0], totals[1]
        synchronize(device)
        began = time.perf_counter()
        order = global_batch_order(n, epoch=epoch, seed=seed).to(device)
        for start in range(0, n, batch_size):
            index = order[start : start + batch_size]
            x = torch.addcmul(shift, images[index].float(), scale).contiguous(memory_format=memory_format)
            y = labels[index]
            logits = model(x)
            loss_sum = F.cross_entropy(logits, y, reduction="sum")
            optimizer.zero_grad(set_to_none=True)
            (loss_sum / len(y)).backward()
            optimizer.step()
            loss_total += loss_sum.detach()
            correct_total += (logits.detach().argmax(1) == y).sum()
        synchronize(device)
        seconds = time.perf_counter() - began
        results.append((seconds, loss_total.item() / n))
    return results


def train_naive(model, dataset, *, epochs, batch_size, seed, device):
    model = model.to(device)
    mean, std = dataset.channel_stats()
    x_all = (dataset.train_x.float() / 255 - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    loader = DataLoader(
        TensorDataset(x_all, dataset.train_y),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    criterion = torch.nn.CrossEntropyLoss()
    results = []
    for _ in range(epochs):
        model.train()
        running_loss, correct, seen = 0.0, 0, 0
        synchronize(device)
        began = time.perf_counter()
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            logits = model(x)
            loss = criterion(logits, y)
            loss.backward()
            optimizer.step()
            running_loss += loss.item() * len(y)
            correct += (logits.argmax(1) == y).sum().item()
            seen += len(y)
        synchronize(device)
        seconds = time.perf_counter() - began
        results.append((seconds, running_loss / seen))
    return results


WAYS = {"polytrain": train_polytrain, "by-hand": train_by_hand, "naive": train_naive}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run (default: 2)")
    parser.add_argument("--repeats", type=int, default=10, help="interleaved runs of each way (default: 10)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed warm-up epochs of each way (default: 1)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="lenet",
        help="default: lenet (the benchmark); mlp shows per-step overhead, as its compute is tiny",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--command-line",
        action="store_true",
        help="also time `polytrain train` run as a command (its own process), as a user runs it",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: PyTorch sees no CUDA GPU")

    dataset = polytrain.load_dataset("mnist-sample")
    torch.manual_seed(args.seed)
    base = build_model(args.model, dataset.input_shape, dataset.num_classes)
    common = dict(batch_size=args.batch_size, seed=args.seed, device=device)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f", model {args.model}, {len(dataset.train_y)} training images, batch {args.batch_size}"
    )

    ways = dict(WAYS, **({"command": train_command} if args.command_line else {}))
    epochs, losses = interleave(
        ways, base, repeats=args.repeats, warmup=args.warmup, epochs=args.epochs, dataset=dataset, **common
    )
    medians, ratios, _ = report(
        epochs, losses, per_epoch=len(dataset.train_y), unit="samples", targets=TARGETS
    )
    if args.command_line:
        command = statistics.median(epochs["command"]) / medians["by-hand"]
        fastest = min(epochs["command"]) / min(epochs["by-hand"])
        print(f"command   / by-hand  = {command:.3f}   (ratio of the fastest epochs {fastest:.3f})")
        ratios["command/by-hand"] = command
    result = dict(
        model=args.model,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        device=str(device),
        batch_size=args.batch_size,
        epochs=args.epochs,
        repeats=args.repeats,
        epoch_seconds=epochs,
        median_seconds=medians,
        ratios=ratios,
        train_loss=losses,
    )
    return save(result, args.json)


if __name__ == "__main__":
    main()
