"""Ctrl-C and SIGTERM: every worker stops at the same step, a checkpoint is written there, the run resumes
to the weights of a run that was never stopped; a second signal stops at once."""

import os
import re
import signal
import sys
import time

import pytest
import torch
from conftest import polytrain_here
from distributed import run_on_ranks
from processes import command_line, descendants, finish, start, wait_for

from polytrain.runtime.stopping import MAX_VOTE_INTERVAL, StopSignal

TRAIN = [
    "--dataset",
    "synthetic",
    "--synthetic-size",
    "640",
    "--model",
    "lenet",
    "--batch-size",
    "32",
    "--seed",
    "7",
    "--epochs",
    "2",
    "--checkpoint-every",
    "2",
]
NOISE = ("Traceback", "terminate called", "Fatal Python error", "leaked", "Aborted", "Exception ignored")


def cli(*args):
    return start([sys.executable, "-m", "polytrain", "train", *args])


def progress(out) -> str:
    """Where the checkpoint in `out` stands, as polytrain says it."""
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    epoch, step = state["position"]["epoch"], state["position"]["step"]
    return (
        f"in epoch {epoch + 1} at step {step} of {state['steps_per_epoch']}"
        if step
        else f"after epoch {epoch}"
    )


def assert_all_gone(pids):
    """No process left behind (multiprocessing's resource tracker may take a moment to see its parent go)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.1)
    assert not [command_line(pid) for pid in pids if os.path.exists(f"/proc/{pid}")]


def assert_quiet(text):
    assert not [word for word in NOISE if word in text], text


@pytest.mark.multiprocess
def test_sigint_to_the_launcher_alone_checkpoints_every_worker_and_resumes_exactly(tmp_path, capfd):
    out = tmp_path / "stopped"
    job = cli(*TRAIN, "--devices", 2, "--strategy", "data", "--out", out)
    wait_for(lambda: (out / "checkpoint.pt").exists(), timeout=120, what="first checkpoint", process=job)
    workers = descendants(job.pid)
    started = time.monotonic()
    os.kill(job.pid, signal.SIGINT)  # the parent only: it passes the signal on
    stopped = finish(job, timeout=60)
    assert time.monotonic() - started < 30
    assert stopped.returncode == 128 + signal.SIGINT, stopped.stdout + stopped.stderr
    assert stopped.stderr == (
        f"polytrain: stopped by SIGINT {progress(out)}, checkpoint saved; continue with: "
        f"polytrain train --resume {out}\n"
    )
    assert_quiet(stopped.stdout + stopped.stderr)
    assert_all_gone(workers)
    resumed = polytrain_here(capfd, "train", "--resume", out)  # the stopped run is a command of its own
    assert resumed.returncode == 0, resumed.stderr
    assert "on 2 CPU processes as the run had" in resumed.stdout.splitlines()[0]
    straight = polytrain_here(
        capfd, "train", *TRAIN, "--devices", 2, "--strategy", "data", "--out", tmp_path / "straight"
    )
    assert straight.returncode == 0, straight.stderr
    a = torch.load(out / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    for key in b:
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0)


def test_sigterm_on_one_device_checkpoints_and_exits_with_its_code(tmp_path):
    out = tmp_path / "run"
    job = cli(*TRAIN, "--synthetic-size", "6400", "--out", out)
    wait_for(lambda: (out / "checkpoint.pt").exists(), timeout=120, what="first checkpoint", process=job)
    job.send_signal(signal.SIGTERM)
    stopped = finish(job, timeout=60)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert "stopped by SIGTERM" in stopped.stderr and f"--resume {out}" in stopped.stderr
    assert stopped.stderr.count("\n") == 1
    assert_quiet(stopped.stdout + stopped.stderr)
    position = torch.load(out / "checkpoint.pt", weights_only=True)["position"]
    said = re.search(r"in epoch (\d+) at step (\d+) of 200", stopped.stderr)
    assert said and (int(said[1]), int(said[2])) == (
        position["epoch"] + 1,
        position["step"],
    )  # where it stopped


SLOW_STEP = """
import sys, time, torch, polytrain
class Slow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(784, 10)
    def forward(self, x):
        if self.training and len(x) == 32:  # a step (fit's checks before the run use 2 samples)
            print("step", flush=True)
            time.sleep(30)
        return self.linear(x.flatten(1))
data = polytrain.load_dataset("synthetic", synthetic_size=64)
polytrain.fit(Slow(), data, epochs=1, batch_size=32, out=sys.argv[1], verbose=False)
"""


def test_a_second_signal_stops_at_once(tmp_path):
    job = start([sys.executable, "-c", SLOW_STEP, tmp_path / "run"])
    wait_for(lambda: (tmp_path / "run" / "config.json").exists(), timeout=120, what="run folder", process=job)
    time.sleep(1)
    job.send_signal(signal.SIGINT)  # asks for a stop after this (30 s) step
    time.sleep(3)
    started = time.monotonic()
    job.send_signal(signal.SIGINT)  # a second Ctrl-C: now
    stopped = finish(job, timeout=60)
    assert time.monotonic() - started < 10
    assert stopped.returncode != 0 and "KeyboardInterrupt" in stopped.stderr


def _steps_until_stop(rank, world_size, signal_at):
    stop = StopSignal(exit_on_repeat=False).install()
    stop.connect(world_size)
    try:
        for step in range(1, 2000):
            time.sleep(0.005)  # a 5 ms step
            if rank == 1 and step == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 hears it
            if stop.should_stop():
                return step, stop.interval
        return None, stop.interval
    finally:
        stop.close()


@pytest.mark.multiprocess
def test_ranks_agree_on_the_step_to_stop_at_and_vote_only_every_few_steps():
    from polytrain.runtime.forkserver import start_method

    # forked from the session's forkserver (torch imported already): the vote, not the start, is under test
    (step0, interval0), (step1, interval1) = run_on_ranks(_steps_until_stop, 60, method=start_method())
    assert step0 == step1 and interval0 == interval1  # the same step on every rank
    assert 60 < step0 <= 60 + 2 * MAX_VOTE_INTERVAL
    assert interval0 > 1  # 5 ms steps: a vote every several steps
