"""Data-parallel epoch time on one machine: polytrain against plain DDP, and one process against two.

Run (about 4 minutes on a 2-core CPU; with 2 GPUs add --device cuda):

    python benchmarks/data_parallel.py --repeats 6 --epochs 4 --device cpu

Part 1, polytrain versus plain DDP. LeNet on the 8,000 training digits of `mnist-sample` (4,000 before 2026-11-23), global batch 64
(`--batch-size`), two processes on this machine, interleaved A, B, A, B, ...:
  polytrain  `polytrain.fit(model, dataset, devices=2, strategy="data", ...)`: epoch time from
             `history["epoch_seconds"]` of rank 0.
  plain-ddp  a DDP script written directly against torch: started by `torch.distributed.launcher.api.
             elastic_launch` (as torchrun does) with the gloo backend on 127.0.0.1 (nccl with --device cuda),
             `torch.set_num_threads(cores // 2)` in each process, the same uint8 images normalised per batch,
             the same seeded global sample order cut into per-rank halves of each global batch, SGD (momentum
             0.9, weight decay 5e-4, foreach=True), loss and correct counts summed on the device, channels-last
             weights and inputs (polytrain's default for convolutional models); on CUDA fused SGD.
Target: polytrain / plain-ddp <= 1.00.

Part 2, one process against two: polytrain with devices=1 and devices=2 (strategy data) at global batch sizes
64 and 512 (`--scaling-batch-sizes`), interleaved; epoch time and samples per second.

Part 3, communication against compute: the median time of one all-reduce of a LeNet-sized gradient between
two processes, and of one training step in this process (whole batch on all cores' threads, and half the
batch on half the threads, which is what each of two processes computes).

Parts 1 and 2 start every run from a deepcopy of one seeded model. Each run starts fresh worker processes, so
the first epoch of every run (oneDNN kernel selection, first allocations, DDP bucket set-up) is reported
separately and left out of the medians (`--skip-first 1`). Other processes on the machine slow single epochs
by large factors; interleaving spreads that over all ways, and medians over several runs ignore it.

On CPU the results depend on glibc malloc's dynamic mmap/trim thresholds (page faults on every step; see
docs/benchmarks.md). To see the figures without that effect:

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 python benchmarks/data_parallel.py
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
import uuid

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.nn.parallel import DistributedDataParallel

LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 5e-4
TARGET_VS_PLAIN = 1.00


def normalisation(train_x, device):
    """(scale, shift) with (x/255 - mean)/std == x * scale + shift, from the training images' channel statistics.

    The float64 copy of the images (25 MB) is freed on return. That matters on CPU: freeing a large block raises
    glibc's dynamic mmap threshold, so the step's activations (1-3 MB each) are then reused from the heap instead
    of being mmapped and unmapped on every step. Keeping the copy alive costs ~30k extra page faults per rank per
    epoch, measured ~10% of the epoch; polytrain frees such a copy in `ArrayDataset.channel_stats`.
    """
    pixels = train_x.double().div_(255)
    mean, std = pixels.mean(dim=(0, 2, 3)).float(), pixels.std(dim=(0, 2, 3)).float()
    return (1.0 / (255.0 * std)).reshape(1, -1, 1, 1).to(device), (-mean / std).reshape(1, -1, 1, 1).to(
        device
    )


def plain_ddp_worker(model, train_x, train_y, epochs, batch_size, seed, device_kind):
    """One rank of a plain DDP training loop; returns rank 0's (epoch seconds, mean train loss) list.

    Arguments are positional because elastic_launch passes only positional ones.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        # The spawned process received the model's tensors in shared memory: train a private copy.
        # As polytrain does: channels-last weights and inputs for convolutional models.
        channels_last = any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        model = copy.deepcopy(model).to(device, memory_format=memory_format)
        ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
        speed = {"fused": True} if device.type == "cuda" else {"foreach": True}  # as polytrain chooses
        optimizer = torch.optim.SGD(
            ddp.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, **speed
        )
        images, labels = train_x.to(device), train_y.to(device)
        scale, shift = normalisation(train_x, device)
        n = len(labels)
        results = []
        for epoch in range(epochs):
            ddp.train()
            totals = torch.zeros(2, dtype=torch.float64, device=device)
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            order = torch.randperm(n, generator=generator).to(device)
            for start in range(0, n, batch_size):
                index = order[start : start + batch_size].tensor_split(world)[rank]
                x = torch.addcmul(shift, images[index].float(), scale).contiguous(memory_format=memory_format)
                y = labels[index]
                logits = ddp(x)
                loss = F.cross_entropy(logits, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                totals += torch.stack(
                    [loss.detach().double() * len(y), (logits.detach().argmax(1) == y).sum().double()]
                )
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - began
            dist.all_reduce(totals)
            results.append((seconds, totals[0].item() / n))
        return results if rank == 0 else None
    finally:
        dist.destroy_process_group()


def allreduce_worker(numel, iterations, device_kind):
    """Median seconds of one all-reduce of `numel` float32 values (a gradient the size of the model)."""
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    device = torch.device("cuda", local_rank) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        tensor = torch.ones(numel, device=device)
        times = []
        for i in range(iterations + 5):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            dist.all_reduce(tensor)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 5:
                times.append(time.perf_counter() - began)
        return statistics.median(times)
    finally:
        dist.destroy_process_group()


def launch_config(devices: int, name: str) -> LaunchConfig:
    loopback = {"local_addr": "127.0.0.1"} if "local_addr" in LaunchConfig.__dataclass_fields__ else {}
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=devices,
        run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        **loopback,
    )


def run_plain_ddp(model, dataset, *, devices, epochs, batch_size, seed, device_kind):
    launch = elastic_launch(launch_config(devices, "plain"), plain_ddp_worker)
    return launch(model, dataset.train_x, dataset.train_y, epochs, batch_size, seed, device_kind)[0]


def run_polytrain(model, dataset, *, devices, epochs, batch_size, seed, device_kind):
    import polytrain

    threads = torch.get_num_threads()
    history = polytrain.fit(
        model,
        dataset,
        epochs=epochs,
        devices=devices,
        strategy="data" if devices > 1 else "single",
        batch_size=batch_size,
        optimizer="sgd",
        lr=LR,
        momentum=MOMENTUM,
        weight_decay=WEIGHT_DECAY,
        schedule="constant",
        warmup_epochs=0,
        seed=seed,
        device=device_kind,
        verbose=False,
    )
    torch.set_num_threads(threads)  # devices=1 runs in this process and sets its thread count
    return list(zip(history["epoch_seconds"], history["train_loss"]))


def summarise(runs, skip_first: int):
    """Median and minimum of the kept epochs, median first epoch, last run's losses."""
    kept = [seconds for run in runs for seconds, _ in run[skip_first:]]
    first = [run[0][0] for run in runs]
    return dict(
        median=statistics.median(kept),
        min=min(kept),
        max=max(kept),
        first_epoch=statistics.median(first),
        epochs=kept,
        losses=[loss for _, loss in runs[-1]],
    )


def part_vs_plain(base, dataset, args, common) -> dict:
    print(f"\n== part 1: polytrain devices=2 vs plain DDP, global batch {args.batch_size} ==")
    ways = {"polytrain": run_polytrain, "plain-ddp": run_plain_ddp}
    runs = {name: [] for name in ways}
    for repeat in range(args.repeats):
        for name, run in ways.items():
            result = run(copy.deepcopy(base), dataset, devices=2, batch_size=args.batch_size, **common)
            runs[name].append(result)
            print(
                f"  repeat {repeat + 1}/{args.repeats}  {name:<9}  "
                + "  ".join(f"{seconds:.3f}s" for seconds, _ in result)
            )
    summary = {name: summarise(r, args.skip_first) for name, r in runs.items()}
    n = len(dataset.train_y)
    print(
        f"\n{'way':<10} {'median s':>9} {'min s':>8} {'max s':>8} {'1st epoch':>9} {'samples/s':>10}  "
        f"train loss by epoch"
    )
    for name, s in summary.items():
        print(
            f"{name:<10} {s['median']:9.3f} {s['min']:8.3f} {s['max']:8.3f} {s['first_epoch']:9.3f} "
            f"{n / s['median']:10,.0f}  " + " ".join(f"{loss:.4f}" for loss in s["losses"])
        )
    ratio = summary["polytrain"]["median"] / summary["plain-ddp"]["median"]
    verdict = "met" if ratio <= TARGET_VS_PLAIN else "MISSED"
    of_minima = summary["polytrain"]["min"] / summary["plain-ddp"]["min"]
    print(
        f"\npolytrain / plain-ddp = {ratio:.3f}   (target <= {TARGET_VS_PLAIN:.2f}: {verdict}; "
        f"ratio of the fastest epochs {of_minima:.3f})"
    )
    if any(s["max"] > 1.5 * s["median"] for s in summary.values()):
        print(
            "some epochs took over 1.5x the median: other processes competed for the cores; rerun if the "
            "medians and the fastest epochs disagree"
        )
    return dict(summary=summary, ratio=ratio, ratio_of_minima=of_minima)


def part_scaling(base, dataset, args, common) -> dict:
    sizes = args.scaling_batch_sizes
    print(f"\n== part 2: polytrain devices=1 vs devices=2, global batch {', '.join(map(str, sizes))} ==")
    runs = {(b, d): [] for b in sizes for d in (1, 2)}
    for repeat in range(args.repeats):
        for batch_size in sizes:
            for devices in (1, 2):
                result = run_polytrain(
                    copy.deepcopy(base), dataset, devices=devices, batch_size=batch_size, **common
                )
                runs[(batch_size, devices)].append(result)
                print(
                    f"  repeat {repeat + 1}/{args.repeats}  batch {batch_size:<4} devices {devices}  "
                    + "  ".join(f"{seconds:.3f}s" for seconds, _ in result)
                )
    n = len(dataset.train_y)
    summary = {key: summarise(r, args.skip_first) for key, r in runs.items()}
    print(
        f"\n{'batch':>5} {'devices':>7} {'steps':>5} {'median s':>9} {'min s':>8} {'1st epoch':>9} {'samples/s':>10} "
        f"{'ms/step':>8} {'2 vs 1':>7}"
    )
    rows = []
    for batch_size in sizes:
        for devices in (1, 2):
            s = summary[(batch_size, devices)]
            steps = -(-n // batch_size)
            speedup = summary[(batch_size, 1)]["median"] / s["median"]
            print(
                f"{batch_size:5d} {devices:7d} {steps:5d} {s['median']:9.3f} {s['min']:8.3f} {s['first_epoch']:9.3f} "
                f"{n / s['median']:10,.0f} {1e3 * s['median'] / steps:8.2f} {speedup:6.2f}x"
            )
            rows.append(
                dict(
                    batch_size=batch_size,
                    devices=devices,
                    steps=steps,
                    **s,
                    samples_per_second=n / s["median"],
                    speedup_vs_one=speedup,
                )
            )
    return dict(rows=rows)


def step_seconds(model, *, batch_size: int, threads: int, iterations: int = 30) -> float:
    """Median seconds of one training step (forward, backward, SGD) in this process on the CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = copy.deepcopy(model)
        optimizer = torch.optim.SGD(
            model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, foreach=True
        )
        x, y = torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))
        times = []
        for i in range(iterations + 5):
            began = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if i >= 5:
                times.append(time.perf_counter() - began)
        return statistics.median(times)
    finally:
        torch.set_num_threads(before)


def part_communication(base, args) -> dict:
    numel = sum(p.numel() for p in base.parameters())
    print("\n== part 3: communication and compute of one step ==")
    seconds = elastic_launch(launch_config(2, "allreduce"), allreduce_worker)(numel, 200, args.device)[0]
    print(
        f"one all-reduce of the LeNet gradient ({numel:,} float32, {numel * 4 / 2**20:.2f} MiB) between 2 "
        f"processes ({'nccl' if args.device == 'cuda' else 'gloo'}): median {1e3 * seconds:.2f} ms"
    )
    result = dict(numel=numel, allreduce_seconds=seconds, compute=[])
    if args.device != "cpu":
        return result
    cores = os.cpu_count() or 1
    print("compute of one step in one process (median of 30), and what 2 processes would need at best:")
    print(
        f"{'global batch':>12} {f'1 process, {cores} threads':>22} {f'per process: B/2, {cores // 2} thread(s)':>28} "
        f"{'+ all-reduce':>13}"
    )
    for batch_size in args.scaling_batch_sizes:
        whole = step_seconds(base, batch_size=batch_size, threads=cores)
        half = step_seconds(base, batch_size=batch_size // 2, threads=max(1, cores // 2))
        print(
            f"{batch_size:12d} {1e3 * whole:19.2f} ms {1e3 * half:25.2f} ms {1e3 * (half + seconds):10.2f} ms"
        )
        result["compute"].append(dict(batch_size=batch_size, one_process=whole, half_batch_half_threads=half))
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=64, help="global batch of part 1 (default: 64)")
    parser.add_argument(
        "--scaling-batch-sizes",
        type=int,
        nargs="+",
        default=[64, 512],
        help="global batches of part 2 (default: 64 512)",
    )
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run (default: 4)")
    parser.add_argument(
        "--skip-first",
        type=int,
        default=1,
        help="epochs of each run left out of the medians as warm-up (default: 1)",
    )
    parser.add_argument("--repeats", type=int, default=6, help="interleaved runs of each way (default: 6)")
    parser.add_argument("--part", choices=("all", "plain", "scaling", "communication"), default="all")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.epochs <= args.skip_first:
        parser.error(f"--epochs {args.epochs} leaves no epoch after --skip-first {args.skip_first}")
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        parser.error("--device cuda needs at least 2 GPUs")

    import polytrain
    from polytrain.models import build_model

    dataset = polytrain.load_dataset("mnist-sample")
    torch.manual_seed(args.seed)
    base = build_model("lenet", dataset.input_shape, dataset.num_classes)
    common = dict(epochs=args.epochs, seed=args.seed, device_kind=args.device)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, device {args.device}, model lenet, "
        f"{len(dataset.train_y)} training images, {args.epochs} epochs per run (first {args.skip_first} "
        f"left out of medians), {args.repeats} repeats"
    )
    result = dict(
        torch=torch.__version__,
        cores=os.cpu_count(),
        device=args.device,
        epochs=args.epochs,
        skip_first=args.skip_first,
        repeats=args.repeats,
    )
    if args.part in ("all", "plain"):
        result["vs_plain"] = part_vs_plain(base, dataset, args, common)
    if args.part in ("all", "scaling"):
        result["scaling"] = part_scaling(base, dataset, args, common)
    if args.part in ("all", "communication"):
        result["communication"] = part_communication(base, args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
