import os
import random
import subprocess
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
from processes import ENV, abort_tree

from polytrain.data import ArrayDataset


def pytest_configure(config):
    """The environment of the processes tests start (`processes.ENV`: one intra-op thread, output unbuffered,
    stacks on SIGABRT), set for the whole session, so that it is the same in every test, in `polytrain_here`
    and at the session's start, where the forkserver starts: a launch forks from it only while the environment
    is the one it started with (this process's own threads are set already, with torch imported above)."""
    os.environ.update(ENV)


@pytest.fixture(scope="session", autouse=True)
def forkserver_at_start(request):
    """Where the session launches workers, polytrain's forkserver starts first, with the session's own
    environment (runtime/launch.py `start_method`): later launches fork from it, where a test or a session
    fixture (which runs before every test's `clean_state`) would otherwise start it with a temporary variable
    set, and every launch after it would spawn."""
    if any(item.get_closest_marker("multiprocess") for item in request.session.items):
        from polytrain.runtime.launch import start_method

        try:  # the session's LoRA runs: their workers fork with peft imported, as a notebook's that imported it
            import peft  # noqa: F401  (runtime/forkserver.py IF_IMPORTED)
        except ImportError:
            pass
        start_method()
    yield


@pytest.fixture(autouse=True)
def clean_state():
    """Reset seeds, restore environment variables, and leave no process group behind."""
    saved_env = dict(os.environ)
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved_env)
    torch.set_num_threads(threads)


def tiny_digits(n_train: int = 256, n_val: int = 100, seed: int = 0, shape=(1, 28, 28)) -> ArrayDataset:
    """Learnable synthetic digits: each class is a bright square in its own place, plus noise."""
    generator = torch.Generator().manual_seed(seed)
    n = n_train + n_val
    labels = torch.randint(0, 10, (n,), generator=generator)
    images = torch.randint(0, 60, (n, *shape), generator=generator, dtype=torch.uint8)
    for digit in range(10):
        row, col = 2 + (digit // 5) * 12, 2 + (digit % 5) * 5
        images[labels == digit, :, row : row + 8, col : col + 4] = 250
    return ArrayDataset("tiny", images[:n_train], labels[:n_train], images[n_train:], labels[n_train:])


@pytest.fixture
def digits() -> ArrayDataset:
    return tiny_digits()


@pytest.fixture(autouse=True)
def stacks_before_timeout(request):
    """Shortly before pytest-timeout fails a test, every process the test started prints its stacks
    (SIGABRT with PYTHONFAULTHANDLER), so a hang shows what each process was doing, not only pytest's."""
    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 0)
    if limit <= 0 or not os.path.isdir("/proc"):
        yield
        return
    timer = threading.Timer(
        max(1.0, limit - 20), abort_tree, args=(os.getpid(),), kwargs={"include_root": False}
    )
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


def load_weights(path) -> dict:
    """A weights file's state dict (read from the shards it names, where a sharded run wrote it)."""
    from polytrain.runtime.checkpoint import read_weights

    return read_weights(path)


def assert_same_weights(got: dict, expected: dict, atol: float = 1e-5) -> None:
    """Same names in the same order, and every tensor within `atol`."""
    assert list(got) == list(expected)
    for key in expected:
        torch.testing.assert_close(
            got[key], expected[key], atol=atol, rtol=0, msg=lambda m, key=key: f"{key}: {m}"
        )


# A short run that every strategy can stop and resume: 6 steps per epoch, the one-device run is the reference.
# --weight-decay 5e-4: without it (Adam's default 0) weights whose gradient is near zero move by lr x the sign of
# their rounding noise, 6e-5 apart between layouts in float32
RESUME_TRAIN = [
    "--dataset",
    "synthetic",
    "--synthetic-size",
    "192",
    "--model",
    "lenet",
    "--batch-size",
    "32",
    "--epochs",
    "2",
    "--schedule",
    "constant",
    "--optimizer",
    "adam",
    "--lr",
    "0.001",
    "--weight-decay",
    "5e-4",
    "--seed",
    "4",
    "--device",
    "cpu",
]


@pytest.fixture(scope="session")
def straight_resume_run(tmp_path_factory):
    """model.pt of RESUME_TRAIN on one device, uninterrupted."""
    out = tmp_path_factory.mktemp("straight") / "run"
    assert polytrain_here(None, "train", *RESUME_TRAIN, "--devices", "1", "--out", out).returncode == 0
    return load_weights(out / "model.pt")


def polytrain_here(capfd, *args, env=None) -> subprocess.CompletedProcess:
    """`polytrain ARGS` run by `polytrain.cli.main` in this process, as the command line runs it (one intra-op
    thread; the environment of processes.ENV and `env`, which its workers inherit), without starting Python and
    importing torch again: its exit code and what it and its workers printed, as `processes.polytrain` returns
    them (`capfd` None: the output is left to pytest, and comes back empty)."""
    from polytrain.cli import main

    argv = [str(a) for a in args]
    saved_env, threads = dict(os.environ), torch.get_num_threads()
    os.environ.update(ENV, **(env or {}))
    torch.set_num_threads(1)
    if capfd is not None:
        capfd.readouterr()
    try:
        code = main(argv)
    except SystemExit as error:  # argparse's exit, as `python -m polytrain` would end
        code = error.code if isinstance(error.code, int) else int(error.code is not None)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
    out, err = capfd.readouterr() if capfd is not None else ("", "")
    return subprocess.CompletedProcess(["polytrain", *argv], code, out, err)


def assert_refused_in_one_line(capsys, out, argv, words) -> None:
    """`polytrain train ARGV` exits 2 with one `polytrain: error:` line naming `words`, before any run folder
    (so before any worker) exists."""
    from polytrain.cli import main

    code = main(["train", *argv, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2, captured.out + captured.err
    assert captured.err.startswith("polytrain: error:") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    for word in words:
        assert word in captured.err, captured.err
    assert not out.exists()
