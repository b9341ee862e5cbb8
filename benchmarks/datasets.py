"""Your own Dataset against the device-resident path and against a plain DataLoader loop written by hand.

Run (about 2 minutes on a 2-core CPU):

    python benchmarks/datasets.py --device cpu --epochs 3 --repeats 3 --workers 1

Three ways to train LeNet on mnist-sample (SGD, momentum 0.9, constant learning rate, global batch 64), each
timed over its last epoch, in interleaved rounds, median reported:

- resident:  polytrain.fit("lenet", "mnist-sample"): the whole split on the device as uint8, batches sliced
             there (the default path for built-in and in-memory data);
- dataset:   polytrain.fit(model, train=Dataset, val=Dataset, num_workers=W): the same images as a
             `torch.utils.data.Dataset` of normalised float tensors, read by W loader processes in
             polytrain's global sample order, every sample checked;
- hand loop: the same Dataset through `DataLoader(shuffle=True, num_workers=W, persistent_workers=True,
             pin_memory on a GPU)` and the usual zero_grad / forward / cross_entropy / backward / step,
             with loss and accuracy summed on the device (no per-step host sync), validated once per epoch.

Samples per second count training samples of the timed epoch; validation is timed separately and not
included. The target: the dataset path within 5% of the hand loop.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import polytrain
from polytrain.data import load_dataset
from polytrain.models import build_model


class Normalised(Dataset):
    """MNIST images as (1, 28, 28) float tensors, normalised, held in memory: a typical user Dataset."""

    def __init__(self, images, labels, mean, std):
        self.x = ((images.float() / 255 - mean) / std).contiguous()
        self.y = labels

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def run_polytrain(model, args, **data) -> float:
    history = polytrain.fit(
        model,
        epochs=args.epochs,
        batch_size=args.batch_size,
        schedule="constant",
        warmup_epochs=0,
        device=args.device,
        verbose=False,
        channels_last=False,
        **data,
    )
    return history.last["samples_per_second"]


def hand_loop(model, train, val, args) -> float:
    device = torch.device(args.device)
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, foreach=True)
    common = dict(
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        pin_memory=device.type == "cuda",
        **({"prefetch_factor": 4} if args.workers > 0 else {}),
    )
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, **common)
    val_loader = DataLoader(val, batch_size=1024, **common)
    speed = 0.0
    for _ in range(args.epochs):
        model.train()
        sums = torch.zeros(2, device=device, dtype=torch.float64)
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sums += torch.stack([loss.detach().double() * len(y), (logits.argmax(1) == y).sum().double()])
        sums.tolist()
        speed = len(train) / (time.perf_counter() - began)
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(x.to(device)).argmax(1) == y.to(device)).sum()) for x, y in val_loader)
    print(f"    hand loop validation accuracy {correct / len(val):.4f}", flush=True)
    return speed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    data = load_dataset("mnist-sample")
    mean, std = data.channel_stats()
    mean, std = mean.reshape(1, -1, 1, 1)[0], std.reshape(1, -1, 1, 1)[0]
    train, val = (
        Normalised(data.train_x, data.train_y, mean, std),
        Normalised(data.val_x, data.val_y, mean, std),
    )
    torch.manual_seed(0)
    model = build_model("lenet", data.input_shape, data.num_classes)
    results = {"resident": [], "dataset": [], "hand loop": []}
    for round_ in range(args.repeats):
        results["resident"].append(run_polytrain(copy.deepcopy(model), args, data="mnist-sample"))
        results["dataset"].append(
            run_polytrain(copy.deepcopy(model), args, train=train, val=val, num_workers=args.workers)
        )
        results["hand loop"].append(hand_loop(copy.deepcopy(model), train, val, args))
        print(
            f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in results.items()), flush=True
        )
    hand = statistics.median(results["hand loop"])
    print(
        f"\nLeNet, mnist-sample ({len(train)} training samples), batch {args.batch_size}, {args.workers} loader "
        f"worker(s), {args.device}, median of {args.repeats}, epoch {args.epochs} of {args.epochs}:"
    )
    print(f"{'path':<12}{'samples/s':>12}{'vs hand loop':>14}")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"{name:<12}{median:>12,.0f}{median / hand:>13.2f}x")


if __name__ == "__main__":
    main()
