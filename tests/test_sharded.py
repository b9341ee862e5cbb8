"""Sharded data parallelism (FSDP2) on 2 CPU processes (gloo) against one device: the same steps, checkpoints of
shards that any strategy resumes (and whole ones it resumes), and what each rank holds."""

import copy

import pytest
import torch
from conftest import (
    RESUME_TRAIN,
    assert_refused_in_one_line,
    assert_same_weights,
    polytrain_here,
    tiny_digits,
)
from conftest import (
    load_weights as load,
)

import polytrain
from polytrain.config.train import TrainConfig
from polytrain.models import build_model
from polytrain.parallel.layout import Layout

pytestmark = pytest.mark.multiprocess

TRAIN = RESUME_TRAIN


def test_replicas_of_shard_groups_are_a_replicate_degree_on_a_two_d_mesh():
    """--replicas R (hybrid sharding): R copies of --devices / R shards; the batch is still cut N ways."""
    hybrid = TrainConfig(strategy="sharded", devices=8, replicas=2).layout
    assert hybrid == Layout(replicate=2, shard=4) and hybrid.mesh_names == ("dp_replicate", "dp_shard")
    assert hybrid.data_degree == 8 and [hybrid.data_rank(r) for r in range(8)] == list(range(8))
    assert hybrid.describe() == "2 replicas x 4 shards"
    assert TrainConfig(strategy="sharded", devices=8, replicas=1).layout == Layout(shard=8)
    assert TrainConfig(strategy="sharded", devices=8).layout == Layout(shard=8)


def test_twenty_sharded_steps_equal_one_device():
    data = tiny_digits(n_train=400, n_val=20)
    torch.manual_seed(0)
    start = build_model("lenet", data.input_shape, 10)
    one, two = copy.deepcopy(start), copy.deepcopy(start)
    settings = dict(epochs=1, batch_size=16, max_steps=20, device="cpu", verbose=False)
    polytrain.fit(one, data, devices=1, **settings)
    polytrain.fit(two, data, devices=2, strategy="sharded", **settings)
    assert (
        max(float((a - b).detach().abs().max()) for a, b in zip(one.parameters(), start.parameters())) > 1e-3
    )
    assert_same_weights(two.state_dict(), one.state_dict())


@pytest.mark.parametrize(
    "first, then",
    [
        (["--strategy", "sharded", "--devices", "2"], ["--devices", "1"]),  # sharded -> single
        (["--devices", "1"], ["--strategy", "sharded", "--devices", "2"]),  # single -> sharded
    ],
)
def test_a_stopped_run_resumes_under_another_strategy_like_one_straight_run(
    straight_resume_run, tmp_path, capfd, first, then
):
    straight = straight_resume_run
    out = tmp_path / "run"
    part = polytrain_here(
        capfd, "train", *TRAIN, *first, "--max-steps", "9", "--out", out
    )  # mid-epoch 2 of 6+6
    assert part.returncode == 0, part.stderr
    if "sharded" in first:
        assert "data parallel would hold" in part.stdout  # each rank's share, next to a replica
        pointer = torch.load(out / "model.pt")  # each rank wrote its own shards: model.pt names their folder
        assert pointer["names"] == list(straight) and "model" not in torch.load(out / "checkpoint.pt")
        assert len(list((out / pointer["shards"]).glob("*.distcp"))) == 2
    rest = polytrain_here(capfd, "train", "--resume", out, *then)
    assert rest.returncode == 0, rest.stderr
    # float32 with Adam: where a gradient is near eps, summation order moves a weight by ~1e-5 (one of 409,600
    # at 1.07e-5 from these initial weights); a wrong resume moves every weight far more
    assert_same_weights(load(out / "model.pt"), straight, atol=2e-5)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--strategy", "data", "--devices", "2", "--cpu-offload"], ["--cpu-offload", "--strategy sharded"]),
        (
            ["--strategy", "sharded", "--devices", "2", "--cpu-offload", "--device", "cpu"],
            ["host memory", "drop"],
        ),
        (
            ["--strategy", "sharded", "--devices", "4", "--replicas", "3"],
            ["--replicas 3", "divide --devices 4"],
        ),
        (
            ["--strategy", "sharded", "--devices", "4", "--replicas", "4"],
            ["fewer than it", "--strategy data"],
        ),
        (["--strategy", "data", "--devices", "4", "--replicas", "2"], ["--replicas", "--strategy sharded"]),
    ],
)
def test_sharded_mistakes_get_one_line_before_any_process_starts(tmp_path, capsys, argv, words):
    assert_refused_in_one_line(capsys, tmp_path / "run", argv, words)


# a small MLP (two epochs of 6 steps) on 2 replicas x 2 shards
HYBRID = [
    *("--dataset", "synthetic", "--synthetic-size", "96", "--synthetic-shape", "1,8,8", "--model", "mlp"),
    *("--batch-size", "16", "--epochs", "2", "--optimizer", "adamw", "--lr", "0.003", "--schedule", "cosine"),
    *("--seed", "5", "--device", "cpu", "--strategy", "sharded", "--devices", "4", "--replicas", "2"),
]


def test_a_stopped_hybrid_sharded_run_resumes_bit_for_bit_like_the_uninterrupted_run(tmp_path, capfd):
    """Stopped in its second epoch and resumed with no flags, on the layout it had (2 replicas of 2 shards, each
    rank writing and reading its own shards): the weights are the uninterrupted run's bit for bit (AdamW's
    moments, the schedule and the sample order were restored, or the 4 steps after the resume would differ)."""
    straight, out = tmp_path / "straight", tmp_path / "run"
    assert polytrain_here(capfd, "train", *HYBRID, "--out", straight).returncode == 0
    part = polytrain_here(capfd, "train", *HYBRID, "--max-steps", 8, "--out", out)
    assert part.returncode == 0, part.stderr
    assert len(list((out / torch.load(out / "checkpoint.pt")["shards"]).glob("*.distcp"))) == 4
    stopped, theirs = load(out / "model.pt"), load(straight / "model.pt")
    assert any(not torch.equal(stopped[k], theirs[k]) for k in theirs)  # 4 steps short of the straight run
    rest = polytrain_here(capfd, "train", "--resume", out)
    assert rest.returncode == 0, rest.stderr
    assert "epoch 2 at step 2 of 6 on 4 CPU processes as the run had" in rest.stdout.splitlines()[0]
    assert "2 replicas" in rest.stdout
    ours = load(out / "model.pt")
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
