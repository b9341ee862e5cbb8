"""Data parallelism on 2 CPU processes (gloo) against one device: same samples, same steps, same weights."""

import copy
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import polytrain_here, tiny_digits
from distributed import MisbehavingModel, run_on_ranks
from processes import finish, start

import polytrain
from polytrain.data import load_dataset
from polytrain.data.arrays import ArrayDataset
from polytrain.data.loader import make_loaders
from polytrain.models import build_model
from polytrain.runtime.launch import WorkerFailed
from polytrain.runtime.verify import in_float64
from polytrain.strategies import Strategy
from polytrain.trainer import Trainer

pytestmark = pytest.mark.multiprocess


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_steps_stopped_mid_epoch_on_two_processes_equal_one_device():
    data = tiny_digits(n_train=640)
    torch.manual_seed(0)
    model = build_model("lenet", data.input_shape, 10)
    one, two = copy.deepcopy(model), copy.deepcopy(model)
    settings = dict(epochs=1, batch_size=32, max_steps=15, verbose=False)  # stops mid-epoch (20 steps)
    polytrain.fit(one, data, devices=1, **settings)
    polytrain.fit(two, data, devices=2, strategy="data", **settings)
    assert (flat(one) - flat(model)).abs().max() > 1e-3  # it did train
    torch.testing.assert_close(flat(two), flat(one), atol=1e-5, rtol=0)


def test_whole_epochs_on_real_digits_equal_one_device_in_float64():
    # In float32, one device and two processes round differently (a batch's gradient summed whole or as two
    # halves, kernels chosen by thread count), and 250 steps of SGD with momentum grow that to 0.0064 in the
    # epoch-1 loss. In float64 the same runs agree to 4e-16: the float32 gap is rounding, not a difference in
    # what is trained, and whole epochs (order, reshuffle, validation) of real digits are held to 1e-9 here
    # (on a quarter of them: float64 convolutions run without oneDNN, 10x slower).
    digits = load_dataset("mnist-sample")
    data = ArrayDataset(
        "digits", digits.train_x[:2048], digits.train_y[:2048], digits.val_x[:512], digits.val_y[:512]
    )
    torch.manual_seed(0)
    model, data = in_float64(build_model("lenet", data.input_shape, 10), data)
    settings = dict(epochs=2, batch_size=64, verbose=False, channels_last=False)
    one = polytrain.fit(copy.deepcopy(model), data, devices=1, **settings)
    two = polytrain.fit(copy.deepcopy(model), data, devices=2, strategy="data", **settings)
    for key in ("train_loss", "val_loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-9, abs=0)
    assert two["train_acc"] == one["train_acc"] and two["val_acc"] == one["val_acc"]
    assert one.last["val_acc"] > 0.8


def _evaluate_on_rank(rank, world_size, model, data):
    strategy = Strategy(device=torch.device("cpu"), rank=rank, world_size=world_size)
    strategy.model = model
    _, val = make_loaders(
        data, batch_size=64, device="cpu", rank=rank, world_size=world_size, eval_batch_size=7
    )
    return Trainer(strategy, val, val, epochs=0).evaluate()


def test_sharded_evaluation_equals_one_device_exactly():
    data = tiny_digits(n_train=64, n_val=101)  # odd size: no rank may pad or drop a sample
    model = build_model("mlp", data.input_shape, 10)
    strategy = Strategy(device=torch.device("cpu"))
    strategy.model = model
    _, val = make_loaders(data, batch_size=64, device="cpu", eval_batch_size=7)
    expected = Trainer(strategy, val, val, epochs=0).evaluate()
    results = run_on_ranks(_evaluate_on_rank, model, data)
    for result in results:
        assert result["count"] == 101
        assert result["acc"] == expected["acc"]
        assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6)  # float32 batch sums


FORKED_OR_SPAWNED = """
import os, sys
import polytrain
from polytrain.runtime import launch
from conftest import tiny_digits
from distributed import SeesTheEnvironment

def seen_by_workers(verbose=False):
    model = SeesTheEnvironment()
    polytrain.fit(model, tiny_digits(n_train=64), devices=2, strategy="data", epochs=1, batch_size=32, verbose=verbose)
    return float(model.seen), float(model.preloaded), float(model.frozen)

if __name__ == "__main__":
    import datasets  # (imported before the forkserver starts: it preloads it, forkserver.py IF_IMPORTED)
    os.environ.pop("POLYTRAIN_SEEN", None)
    found = [(launch.start_method(), seen_by_workers())]  # starts the forkserver, and forks from it
    for value in ("1", "2"):
        os.environ["POLYTRAIN_SEEN"] = value
        found.append((launch.start_method(), seen_by_workers()))
    del os.environ["POLYTRAIN_SEEN"]
    os.environ["PYTEST_CURRENT_TEST"] = "another test (call)"  # pytest's, set at each test: not compared
    # this process's output now goes to a file: so does the forked workers' (rank 0 prints the epoch)
    sys.stdout.flush()
    kept = os.dup(1)
    with open(sys.argv[1], "w") as redirected:
        os.dup2(redirected.fileno(), 1)
    found.append((launch.start_method(), seen_by_workers(verbose=True)))
    sys.stdout.flush()
    os.dup2(kept, 1)
    print("FOUND", found)
"""


def test_workers_see_the_environment_as_it_is_at_each_launch(tmp_path):
    """In a fresh process: workers fork from the forkserver while the environment is the one it started with;
    a launch after a variable was set spawns its workers afresh, so that they see it (launch.py `start_method`),
    except where the variable is one that changes without mattering to a worker (pytest's name of the test).
    Forked workers print where the launching process prints at each launch, and hold a library this process
    imported before the forkserver started (`datasets`) without importing it, with what the forkserver imported
    out of the collector's scans (runtime/fork_ready.py); spawned ones do neither."""
    script = tmp_path / "forked_or_spawned.py"
    script.write_text(FORKED_OR_SPAWNED)
    tests = str(Path(__file__).parent)
    path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    printed = tmp_path / "printed.txt"
    result = finish(start([sys.executable, script, printed], env={"PYTHONPATH": path}), timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    found = next(line for line in result.stdout.splitlines() if line.startswith("FOUND"))
    forked = ("forkserver", (0.0, 1.0, 1.0))  # (the variable unset; datasets held; objects frozen)
    expected = [forked, ("spawn", (1.0, 0.0, 0.0)), ("spawn", (2.0, 0.0, 0.0)), forked]
    assert found == f"FOUND {expected}", result.stdout
    # where the launching process's output went at the last launch, not where it went as the forkserver started
    assert "epoch 1/1" in printed.read_text() and "epoch 1/1" not in result.stdout, result.stdout


def test_a_failing_worker_stops_every_worker_and_names_its_rank():
    started = time.monotonic()
    with pytest.raises(WorkerFailed) as failure:
        polytrain.fit(
            MisbehavingModel("raise"),
            tiny_digits(n_train=320),
            devices=2,
            strategy="data",
            epochs=3,
            batch_size=32,
            verbose=False,
        )
    assert time.monotonic() - started < 90
    message = str(failure.value)
    assert "worker rank 1" in message and "boom on purpose" in message


def test_verify_command_passes_with_its_defaults(capfd):
    # (every strategy verifies in test_knobs_strategies.py, with accumulation and clipping, and test_gpt.py)
    result = polytrain_here(
        capfd,
        "verify",
        "--devices",
        "2",
        "--steps",
        "8",
        "--model",
        "lenet",
        "--dataset",
        "mnist-sample",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 8
    for _step, loss_one, loss_two, diff in rows:
        assert abs(float(loss_one) - float(loss_two)) < 1e-4 and float(diff) <= 1e-5


def test_channels_last_weights_over_one_channel_get_the_default_strides_for_ddp_and_nothing_else():
    import torch

    from polytrain.models import build_model
    from polytrain.parallel.ddp import default_strides_where_alike

    model = build_model("lenet", (1, 28, 28), 10).to(memory_format=torch.channels_last)
    before = {name: (p.detach().clone(), p.stride()) for name, p in model.named_parameters()}
    default_strides_where_alike(model)
    first, second = model[0].weight, model[3].weight  # over 1 input channel, over 20
    assert first.stride() == (25, 25, 5, 1) and before["0.weight"][1] == (25, 1, 5, 1)
    assert second.stride() == before["3.weight"][1]  # genuinely channels-last: left so
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name][0]), name
