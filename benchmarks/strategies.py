"""Data parallelism, parameter servers (K = 1 and K = 2; K = 1 asynchronous with staleness 2) and sharded
training at the same device count:
throughput, bytes sent per step per rank, and memory per rank, beside what the alpha-beta model predicts.

Run (about 3 minutes on a 2-core CPU; Linux, for /proc/net/dev):

    python benchmarks/strategies.py --devices 3 --device cpu

Throughput and accuracy: samples per second of the last of `--epochs` epochs, and the final validation accuracy, of `polytrain train --devices N`, LeNet on
mnist-sample, global batch `--batch-size`, median of `--repeats` interleaved rounds.

Bytes: every process of a run talks over the loopback interface, so the growth of its transmit counter
(`lo` in /proc/net/dev) over a run, divided by the steps and the ranks, is what each rank sent per step,
measured, including the small extras of a run (evaluation sums, the stop vote, checkpoint gathering). The
alpha-beta model's bandwidth term predicts, for S bytes of gradients and n ranks: ring all-reduce sends
2(n-1)/n S per rank; a server receives n S and sends n S per step (here a tree reduce and broadcast, so the
load is spread, but the server's own link still carries S in and S out per worker); FSDP2 all-gathers the
weights in the forward pass and again in the backward pass and reduce-scatters the gradients: 3(n-1)/n S.

Memory per rank: computed from the model's sizes and the partition each strategy uses (weights, gradients,
optimizer slots: SGD with momentum keeps 1 per parameter), not measured.

On one CPU, N processes share the cores, so these throughputs show each strategy's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile

from polytrain.data import load_dataset
from polytrain.models import build_model
from polytrain.planning.servers import partition_by_size

SPEED = re.compile(r"([0-9,]+) samples/s")
ACCURACY = re.compile(r"done: validation accuracy ([0-9.]+)")


def loopback_sent() -> int:
    for line in open("/proc/net/dev"):
        name, _, values = line.partition(":")
        if name.strip() == "lo":
            return int(values.split()[8])
    raise SystemExit("no loopback interface in /proc/net/dev")


def run(flags, args):
    with tempfile.TemporaryDirectory() as folder:
        before = loopback_sent()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "polytrain",
                "train",
                "--out",
                f"{folder}/run",
                "--devices",
                str(args.devices),
                "--epochs",
                str(args.epochs),
                "--batch-size",
                str(args.batch_size),
                "--device",
                args.device,
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
        sent = loopback_sent() - before
    if done.returncode:
        raise SystemExit(f"{flags} failed:\n{done.stderr[-2000:]}")
    return (
        float(SPEED.findall(done.stdout)[-1].replace(",", "")),
        sent,
        float(ACCURACY.search(done.stdout).group(1)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=60)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.devices
    data = load_dataset("mnist-sample")
    model = build_model("lenet", data.input_shape, data.num_classes)
    sizes = [p.numel() * 4 for p in model.parameters()]
    total = sum(sizes)
    steps = args.epochs * -(-len(data.train_y) // args.batch_size)
    ways = {
        "data": ["--strategy", "data"],
        "parameter server, K=1": ["--strategy", "parameter-server", "--servers", "1"],
        "parameter server, K=2": ["--strategy", "parameter-server", "--servers", "2"],
        "parameter server, K=1, S=2": [
            "--strategy",
            "parameter-server",
            "--servers",
            "1",
            "--staleness",
            "2",
        ],
        "sharded": ["--strategy", "sharded"],
    }
    # average bytes each rank sends per step (bandwidth term); a server's own link also carries (n-1) S_k out
    predicted = {
        "data": 2 * (n - 1) / n * total,
        "parameter server, K=1": 2 * (n - 1) / n * total,
        "parameter server, K=2": 2 * (n - 1) / n * total,
        "parameter server, K=1, S=2": 2 * (n - 1) / n * total,
        "sharded": 3 * (n - 1) / n * total,
    }
    speeds, sent, accuracy = {w: [] for w in ways}, {w: [] for w in ways}, {w: [] for w in ways}
    for _ in range(args.repeats):
        for way, flags in ways.items():
            speed, nbytes, acc = run(flags, args)
            speeds[way].append(speed)
            accuracy[way].append(acc)
            sent[way].append(nbytes / steps / n)
    print(
        f"lenet, {n} processes, batch {args.batch_size}, {steps} steps; gradients S = {total / 2**20:.2f} MiB"
    )
    print(
        f"{'strategy':<27} {'samples/s':>10} {'val acc':>8} {'sent/step/rank':>15} {'alpha-beta':>11} "
        f"{'busiest server sends':>21}"
    )
    for way in ways:
        link = ""
        if way.startswith("parameter server"):
            servers = int(way.split("K=")[1][0])
            owner = partition_by_size(sizes, servers=servers)
            busiest = max(sum(s for s, k in zip(sizes, owner) if k == server) for server in range(servers))
            link = f"{(n - 1) * busiest / 2**20:.2f} MiB"
        print(
            f"{way:<27} {statistics.median(speeds[way]):>10,.0f} {statistics.median(accuracy[way]):>8.4f} "
            f"{statistics.median(sent[way]) / 2**20:>11.2f} MiB "
            f"{predicted[way] / 2**20:>7.2f} MiB {link:>21}"
        )
    print("\nmemory per rank (MiB): weights + gradients + momentum")
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    print(f"  data                   every rank {mib(total)} + {mib(total)} + {mib(total)}")
    for servers in (1, 2):
        owner = partition_by_size(sizes, servers=servers)
        shares = [sum(s for s, k in zip(sizes, owner) if k == server) for server in range(servers)]
        held = ", ".join(
            f"rank {k}: + {mib(share)} master + {mib(share)} momentum in host memory"
            for k, share in enumerate(shares)
        )
        print(f"  parameter server K={servers} every rank {mib(total)} + {mib(total)} (replica); {held}")
    print(f"  sharded                every rank {mib(total / n)} + {mib(total / n)} + {mib(total / n)}")


if __name__ == "__main__":
    main()
