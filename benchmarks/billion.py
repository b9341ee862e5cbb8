"""A Llama-style model of about a billion parameters trained on 8 CPU processes of one machine.

    python benchmarks/billion.py                    # 1.01e9 parameters, 8 processes, sharded (FSDP2)
    python benchmarks/billion.py --shape tiny --devices 2 --steps 2    # the same path in seconds

Training state of 1.01e9 parameters in float32 with AdamW is 17 GB (parameters, gradients and two optimizer
tensors, 16 bytes each): on a 24 GiB machine with 8 processes it fits only if each process holds its eighth.
The run uses sharded data parallelism (FSDP2), the model built on the meta device, full activation
checkpointing, a sharded checkpoint after `--steps` steps, then a resume for `--resume-steps` more. AdamW runs
per parameter (`foreach=False`): its default multi-tensor step makes temporaries the size of a rank's whole
shard, which 8 processes on 24 GiB cannot spare.

What it records, measured from outside the training processes (every 0.2 s, /proc/PID/status of each worker
process): each rank's peak resident memory (VmHWM) against the theoretical shard of the training state, the
checkpoint's size on disk and how long its folder was being written, and the resume's time and memory.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHAPES = {
    # 20 blocks of width 2048 (16 heads, 8 key/value heads), SwiGLU 5632, vocabulary 16000, untied head
    "1b": dict(layers=20, width=2048, heads=16, kv_heads=8, ffn_width=5632, vocab_size=16000, context=64),
    "tiny": dict(layers=2, width=64, heads=4, kv_heads=2, ffn_width=128, vocab_size=128, context=16),
}


def parameters(shape: dict) -> int:
    """The Llama shape's parameter count by the formula (embedding, blocks, final norm, untied head)."""
    width, head_dim = shape["width"], shape["width"] // shape["heads"]
    attention = 2 * width * width + 2 * width * shape["kv_heads"] * head_dim
    block = attention + 3 * width * shape["ffn_width"] + 2 * width
    return 2 * shape["vocab_size"] * width + shape["layers"] * block + width


def kib(line: str) -> int:
    return int(line.split()[1]) * 1024


def workers(root: int) -> list:
    """PIDs of every process below `root` (the launcher's workers)."""
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        found += [int(c) for c in children]
        frontier += [int(c) for c in children]
    return found


class PeakWatch(threading.Thread):
    """Polls the peak resident memory (VmHWM) of every process under `root` until stopped."""

    def __init__(self, root: int, run_dir: Path):
        super().__init__(daemon=True)
        self.root, self.peaks, self.done = root, {}, threading.Event()
        self.run_dir, self.writing = run_dir, {}  # shard folder being written -> [first seen, last seen]

    def run(self) -> None:
        while not self.done.is_set():
            now = time.perf_counter()
            for folder in self.run_dir.glob("checkpoint-*.tmp"):
                self.writing.setdefault(folder.name, [now, now])[1] = now
            for pid in workers(self.root):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                hwm = next((kib(line) for line in status.splitlines() if line.startswith("VmHWM")), 0)
                self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)
            time.sleep(0.2)


def run(command: list, log: Path, run_dir: Path) -> tuple:
    """Run `command`, watching its workers' memory and the shard folders being written; (seconds, return code,
    peaks by pid, seconds each shard folder was seen being written)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        watch = PeakWatch(process.pid, run_dir)
        watch.start()
        code = process.wait()
        watch.done.set()
        watch.join()
    writes = {name: last - first for name, (first, last) in watch.writing.items()}
    return time.perf_counter() - start, code, watch.peaks, writes


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="1b")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="steps before the checkpoint")
    parser.add_argument("--resume-steps", type=int, default=1, help="steps after resuming")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--checkpointing", default="full", help="--activation-checkpointing")
    parser.add_argument("--out", type=Path, default=None, help="run folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    count = parameters(shape)
    work = args.out or Path(tempfile.mkdtemp(prefix="billion-"))
    run_dir = work / "run"
    flags = [
        "--model", "llama", "--dataset", "shakespeare",
        *[x for key, value in shape.items() for x in (f"--{key.replace('_', '-')}", str(value))],
        "--devices", str(args.devices), "--strategy", "sharded", "--device", "cpu",
        "--optimizer", "adamw", "--optimizer-args", "foreach=False", "--batch-size", str(args.batch_size),
        "--activation-checkpointing", args.checkpointing, "--val-every", "0",
    ]  # fmt: skip
    polytrain = [sys.executable, "-m", "polytrain"]
    first = [*polytrain, "train", *flags, "--max-steps", str(args.steps), "--out", str(run_dir)]
    seconds, code, peaks, writes = run(first, work / "train.log", run_dir)
    if code:
        sys.exit(f"training failed ({code}); see {work / 'train.log'}")
    shards = sorted(run_dir.glob("checkpoint-*"))
    size = folder_bytes(shards[-1]) if shards else 0
    files = len(list(shards[-1].glob("*.distcp"))) if shards else 0
    total = args.steps + args.resume_steps
    again = [*polytrain, "train", "--resume", str(run_dir), "--max-steps", str(total)]
    resume_seconds, resume_code, resume_peaks, _ = run(again, work / "resume.log", run_dir)
    state = 16 * count  # float32 parameters, gradients, AdamW's two moments
    report = {
        "shape": args.shape,
        "parameters": count,
        "devices": args.devices,
        "training_state_bytes": state,
        "shard_bytes": state / args.devices,
        "peak_rss_bytes": sorted(peaks.values(), reverse=True)[: args.devices],
        "resume_peak_rss_bytes": sorted(resume_peaks.values(), reverse=True)[: args.devices],
        "train_seconds": seconds,
        "checkpoint_bytes": size,
        "checkpoint_write_seconds": writes,  # from its .tmp folder's first to last sight (0.2 s polls)
        "checkpoint_files": files,
        "resume_seconds": resume_seconds,
        "resumed": resume_code == 0,
        "log_lines": [
            line
            for line in (work / "train.log").read_text().splitlines()
            if re.search(r"rank \d|checkpoint|stopped|loss", line)
        ][-12:],
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
