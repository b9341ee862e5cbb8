"""How long a launch of worker processes takes when one process launches several times: workers forked from the
forkserver (polytrain's default, `runtime/launch.py` `start_method`) against workers spawned afresh (each importing
torch), interleaved in one process.

Run (about 2 minutes on an idle 2-core CPU):

    python benchmarks/launches.py --devices 2,4 --rounds 3

Each launch is `polytrain train --strategy data --max-steps 2` (LeNet on the MNIST sample, CPU processes) into a
fresh run folder, timed whole (start-up, 2 steps, the final evaluation and model.pt). The first launch of the
process starts the forkserver and is reported apart; then, for each device count, `--rounds` rounds of one
forked and one spawned launch. The table gives each start method's min / median / max seconds and the ratio of
the medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from polytrain.cli import main
from polytrain.runtime import launch

FORKED = launch.start_method


def timed_launch(devices: int, folder: Path, method: str) -> float:
    launch.start_method = FORKED if method == "forkserver" else (lambda: "spawn")
    began = time.perf_counter()
    code = main(
        ["train", "--devices", str(devices), "--strategy", "data", "--max-steps", "2", "--out", str(folder)]
    )
    if code not in (0, None):
        raise SystemExit(f"polytrain train exited with {code}")
    return time.perf_counter() - began


def run(counts, rounds: int) -> None:
    lines = []  # printed at the end, after the runs' own output
    with tempfile.TemporaryDirectory(prefix="polytrain-launches-") as scratch:
        folders = (Path(scratch) / f"run{i}" for i in range(10_000))
        first = timed_launch(counts[0], next(folders), "forkserver")
        lines.append(f"first launch ({counts[0]} workers, starts the forkserver): {first:.2f} s")
        lines.append(f"{'workers':>7} {'start method':<12} {'min s':>6} {'median s':>8} {'max s':>6}")
        for devices in counts:
            seconds = {"forkserver": [], "spawn": []}
            for _ in range(rounds):
                for method in seconds:
                    seconds[method].append(timed_launch(devices, next(folders), method))
            for method, values in seconds.items():
                lines.append(
                    f"{devices:>7} {method:<12} {min(values):>6.2f} {statistics.median(values):>8.2f} "
                    f"{max(values):>6.2f}"
                )
            ratio = statistics.median(seconds["spawn"]) / statistics.median(seconds["forkserver"])
            lines.append(f"{devices:>7} spawned / forked: {ratio:.2f}x")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="2,4", help="worker counts, comma-separated (default 2,4)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="forked and spawned launches per count (default 3)"
    )
    options = parser.parse_args()
    run([int(n) for n in options.devices.split(",")], options.rounds)
