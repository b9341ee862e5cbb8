"""Sharded data parallelism (FSDP2) on 2 CPU processes (gloo) against one device: the same steps, whole-model
checkpoints that any strategy resumes, and what each rank holds."""
import copy

import pytest
import torch

import polytrain
from polytrain.cli import main
from polytrain.models import build_model
from conftest import assert_same_weights, load_weights as load, tiny_digits
from processes import polytrain as run_polytrain

pytestmark = pytest.mark.multiprocess

TRAIN = ["--dataset", "synthetic", "--synthetic-size", "192", "--model", "lenet", "--batch-size", "32",
         "--epochs", "2", "--schedule", "constant", "--optimizer", "adam", "--lr", "0.001", "--seed", "4",
         "--device", "cpu"]


def test_twenty_sharded_steps_equal_one_device():
    data = tiny_digits(n_train=400, n_val=20)
    torch.manual_seed(0)
    start = build_model("lenet", data.input_shape, 10)
    one, two = copy.deepcopy(start), copy.deepcopy(start)
    settings = dict(epochs=1, batch_size=16, max_steps=20, device="cpu", verbose=False)
    polytrain.fit(one, data, devices=1, **settings)
    polytrain.fit(two, data, devices=2, strategy="sharded", **settings)
    assert max(float((a - b).detach().abs().max()) for a, b in zip(one.parameters(), start.parameters())) > 1e-3
    assert_same_weights(two.state_dict(), one.state_dict())


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    result = run_polytrain("train", *TRAIN, "--devices", "1", "--out", out)
    assert result.returncode == 0, result.stderr
    return load(out / "model.pt")


@pytest.mark.parametrize("first, then", [
    (["--strategy", "sharded", "--devices", "2"], ["--devices", "1"]),                      # sharded -> single
    (["--devices", "1"], ["--strategy", "sharded", "--devices", "2"]),                      # single -> sharded
])
def test_a_stopped_run_resumes_under_another_strategy_like_one_straight_run(straight, tmp_path, first, then):
    out = tmp_path / "run"
    part = run_polytrain("train", *TRAIN, *first, "--max-steps", "9", "--out", out)      # mid-epoch 2 of 6+6
    assert part.returncode == 0, part.stderr
    if "sharded" in first:
        assert "data parallel would hold" in part.stdout                 # each rank's share, next to a replica
        assert set(load(out / "model.pt")) == set(straight)              # whole model, original names
    rest = run_polytrain("train", "--resume", out, *then)
    assert rest.returncode == 0, rest.stderr
    assert_same_weights(load(out / "model.pt"), straight)


@pytest.mark.parametrize("argv, words", [
    (["--strategy", "data", "--devices", "2", "--cpu-offload"], ["--cpu-offload", "--strategy sharded"]),
    (["--strategy", "sharded", "--devices", "2", "--cpu-offload", "--device", "cpu"], ["host memory", "drop"]),
])
def test_sharded_mistakes_get_one_line_before_any_process_starts(tmp_path, capsys, argv, words):
    code = main(["train", *argv, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("polytrain: error:") and "\n" not in err
    assert all(word in err for word in words), err
    assert not (tmp_path / "run").exists()
