"""Faults of multi-process training: a stalled rank, a killed worker, resuming on another device count."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import polytrain
from polytrain.launch import WorkerFailed
from conftest import tiny_digits
from distributed import MisbehavingModel

pytestmark = pytest.mark.multiprocess

TRAIN = ["--dataset", "synthetic", "--synthetic-size", "320", "--model", "lenet", "--batch-size", "32",
         "--seed", "5"]


def polytrain_cli(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "polytrain", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def load(path):
    return torch.load(path, weights_only=True)


def assert_same_weights(a, b, atol):
    for key in b:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0)


def test_a_stalled_rank_is_named_with_its_step_and_stack():
    started = time.monotonic()
    with pytest.raises(WorkerFailed) as failure:
        polytrain.fit(MisbehavingModel("stall"), tiny_digits(n_train=320), devices=2, epochs=2, batch_size=32,
                      hang_timeout=4, verbose=False)
    assert time.monotonic() - started < 60
    message = str(failure.value)
    assert "rank 1 made no progress" in message and "epoch 1, step 3" in message
    assert "time.sleep(600)" in message                     # where: the stalled line of code


@pytest.mark.parametrize("first, second", [(2, 1), (1, 2)])
def test_resume_on_another_device_count_continues_the_same_trajectory(tmp_path, first, second):
    straight = polytrain_cli("train", *TRAIN, "--epochs", 2, "--devices", 1, "--out", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr
    part = polytrain_cli("train", *TRAIN, "--epochs", 2, "--devices", first, "--max-steps", 13,
                         "--out", tmp_path / "run")
    assert part.returncode == 0, part.stderr
    rest = polytrain_cli("train", "--resume", tmp_path / "run", "--devices", second)
    assert rest.returncode == 0, rest.stderr
    assert_same_weights(load(tmp_path / "run" / "model.pt"), load(tmp_path / "straight" / "model.pt"), 1e-5)


def worker_pids(parent: int) -> list:
    """The spawned training processes below `parent` (not multiprocessing's resource tracker)."""
    return children(parent, b"spawn_main")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds worker processes through /proc")
def test_a_killed_worker_is_restarted_from_the_checkpoint_and_finishes_identically(tmp_path):
    settings = [*TRAIN, "--epochs", 3, "--devices", 2, "--checkpoint-every", 3]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    job = subprocess.Popen([sys.executable, "-m", "polytrain", "train", *map(str, settings),
                            "--max-restarts", "1", "--out", str(tmp_path / "killed")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "killed" / "checkpoint.pt").exists():
            assert time.monotonic() < deadline and job.poll() is None, "no checkpoint appeared"
            time.sleep(0.05)
        victims = worker_pids(job.pid)
        assert len(victims) == 2
        os.kill(victims[1], signal.SIGKILL)
        output = job.communicate(timeout=240)[0]
    finally:
        job.kill()
    assert job.returncode == 0, output
    assert len(load(tmp_path / "killed" / "checkpoint.pt")["history"]) == 3
    straight = polytrain_cli("train", *map(str, settings), "--out", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr
    assert_same_weights(load(tmp_path / "killed" / "model.pt"), load(tmp_path / "straight" / "model.pt"), 1e-5)


def children(parent: int, marker: bytes) -> list:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmd:
                cmdline = cmd.read()
        except OSError:
            continue
        if ppid == parent and marker in cmdline:
            found.append(int(entry))
    return found
