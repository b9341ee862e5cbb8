"""Pipeline x tensor parallelism: the 3-D (data, pipeline, tensor) layout worked out by hand, the one-line
refusals, `polytrain verify` of a small GPT in 2 stages of 2 tensor ranks against one device, and a run that
moves one device -> pipeline x tensor -> one device on one straight trajectory."""

import pytest
import torch
import torch.nn as nn
from conftest import (
    assert_refused_in_one_line,
    assert_same_weights,
    polytrain_here,
    tiny_digits,
)
from conftest import (
    load_weights as load,
)

from polytrain.config.train import TrainConfig, replicas
from polytrain.errors import ConfigError
from polytrain.models import build_model
from polytrain.models.gpt import GPT
from polytrain.parallel.presets import layout_of
from polytrain.pipeline.plan import check_tensor_cuts
from polytrain.sources import as_dataset
from polytrain.strategy_registry import make_plan

# ---- the layout and the plan, in this process ----


def test_tensor_ranks_are_innermost_on_the_data_pipeline_tensor_mesh():
    layout = layout_of(
        "pipeline", 8, pipeline_stages=2, tensor_parallel=2
    )  # 2 pipelines x 2 stages x 2 tensor ranks
    assert layout.data_degree == 2 and layout.mesh_shape == (2, 2, 2)
    assert layout.mesh_names == ("dp_replicate", "pp", "tp")

    def coords(r):
        return (layout.data_rank(r), layout.coordinates(r)["pipeline"]), layout.coordinates(r)["tensor"]

    # rank: (replica, pipeline rank), tensor slice
    assert [coords(r) for r in range(8)] == [
        ((0, 0), 0),
        ((0, 0), 1),
        ((0, 1), 0),
        ((0, 1), 1),
        ((1, 0), 0),
        ((1, 0), 1),
        ((1, 1), 0),
        ((1, 1), 1),
    ]
    assert [layout.rank_with(r) for r in range(8)] == list(range(8))
    assert [layout.rank_with(r, pipeline=1 - coords(r)[0][1]) for r in range(8)] == [2, 3, 0, 1, 6, 7, 4, 5]
    assert layout.ranks_where(pipeline=1) == [2, 3, 6, 7]
    plain = layout_of("pipeline", 4, pipeline_stages=2)  # without tensor ranks: as before
    assert plain.mesh_shape == (2, 2) and plain.ranks_where(pipeline=1) == [1, 3]
    assert plain.rank_with(2, pipeline=1) == 3


def test_replicas_count_a_pipeline_of_tensor_groups_once():
    assert replicas(dict(devices=8, strategy="pipeline", pipeline_stages=2, tensor_parallel=2)) == 2
    assert replicas(dict(devices=4, strategy="pipeline", tensor_parallel=2)) == 1
    config = TrainConfig(strategy="pipeline", devices=8, pipeline_stages=2, tensor_parallel=2, batch_size=8)
    assert config.data_parallel_size == 2 and config.pipeline_ranks == 2
    assert TrainConfig(strategy="pipeline", devices=4, tensor_parallel=2).pipeline_ranks == 2


def test_a_stage_may_not_begin_between_a_column_and_its_row_layer():
    styles = (("1", "colwise", 1), ("3", "rowwise", 1))  # the mlp's plan
    names = ("0", "1", "2", "3", "4", "5")
    check_tensor_cuts(styles, names, (1,))
    check_tensor_cuts(styles, names, (4,))
    for points in [(2,), (3,)]:
        with pytest.raises(
            ConfigError, match=r"stage begins at layer \d, between 1 \(colwise\) and 3 \(rowwise\)"
        ):
            check_tensor_cuts(styles, names, points)
    gpt = (("1.attention.qkv", "colwise", 3), ("1.attention.proj", "rowwise", 1))
    check_tensor_cuts(gpt, ("0", "1", "2"), (1, 2))  # whole blocks: any cut between them


def plan(model, devices=4, **settings):
    config = TrainConfig(strategy="pipeline", devices=devices, device="cpu", batch_size=8, **settings)
    data = as_dataset("shakespeare", config) if isinstance(model, GPT) else tiny_digits(64, 8)
    return make_plan("pipeline", config, model, data, device=torch.device("cpu"))


@pytest.mark.parametrize(
    "model, settings, words",
    [
        (
            GPT(65, context=64, layers=1, heads=2, width=32),
            dict(devices=8, tensor_parallel=4),
            ["--tensor-parallel 4", "2 attention heads", "a --tensor-parallel that divides 2"],
        ),
        (
            build_model("mlp", (1, 28, 28), 10),
            dict(tensor_parallel=2, split="2"),
            ["between 1 (colwise) and 3 (rowwise)"],
        ),
        (
            nn.Sequential(nn.Flatten(), nn.Linear(784, 10)),
            dict(tensor_parallel=2, split="1"),
            ["--model mlp, gpt, llama", "not your Sequential", "--strategy tensor"],
        ),
    ],
)
def test_a_pipeline_of_tensor_groups_that_cannot_work_is_one_line_before_any_worker(model, settings, words):
    with pytest.raises(ConfigError) as caught:
        plan(model, **settings)
    assert "\n" not in str(caught.value) and all(word in str(caught.value) for word in words), str(
        caught.value
    )


@pytest.mark.parametrize(
    "settings, words",
    [
        (
            dict(devices=6, pipeline_stages=2, tensor_parallel=2),
            ["2 x --tensor-parallel 2 = 4", "--devices 6"],
        ),
        (dict(devices=2, tensor_parallel=2), ["at least 2 pipeline stages", "--devices 4"]),
        (dict(devices=4, tensor_parallel=2, split_at="2"), ["--split-at", "--tensor-parallel"]),
        (
            dict(strategy="parameter-server", devices=4, tensor_parallel=2),
            ["--strategy tensor or pipeline only"],
        ),
    ],
)
def test_a_mesh_that_does_not_multiply_out_is_one_line(settings, words):
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**{"strategy": "pipeline", **settings})
    assert "\n" not in str(caught.value) and all(word in str(caught.value) for word in words), str(
        caught.value
    )


@pytest.mark.parametrize("strategy", ["tensor", "pipeline"])
@pytest.mark.parametrize("size", [1, 3])
def test_a_tensor_degree_that_does_not_divide_the_devices_is_one_message_from_the_layout(strategy, size):
    """The tensor degree is checked in one place (parallel/layout.py `layout_of`), whatever preset names it: the
    same line from the layout and from the settings (config/train.py wrote it a second time)."""
    words = f"--tensor-parallel {size} must be 2 or more and divide --devices 4"
    with pytest.raises(ConfigError, match=words):
        layout_of(strategy, 4, tensor_parallel=size)
    with pytest.raises(ConfigError, match=words):
        TrainConfig(strategy=strategy, devices=4, tensor_parallel=size)


def test_the_cli_refuses_a_split_at_with_tensor_ranks_in_one_line(tmp_path, capsys):
    assert_refused_in_one_line(
        capsys,
        tmp_path / "run",
        [
            "--model",
            "gpt",
            "--dataset",
            "shakespeare",
            "--strategy",
            "pipeline",
            "--devices",
            "4",
            "--tensor-parallel",
            "2",
            "--split-at",
            "2",
        ],
        ["--split-at", "--tensor-parallel"],
    )


# ---- on 4 processes: 2 stages, each split over 2 tensor ranks ----

# --eps 1e-5 for runs compared in float32 (not verify, which trains in float64): see test_tensor.py
GPT_TINY = ["--model", "gpt", "--layers", "2", "--width", "32", "--heads", "2", "--eps", "1e-5"]
MESH = ["--strategy", "pipeline", "--devices", "4", "--tensor-parallel", "2", "--split", "2"]


@pytest.mark.multiprocess
def test_verify_a_tiny_gpt_in_two_stages_of_two_tensor_ranks(capfd):
    """The tied embedding and head on the first and last stage, each a replicated DTensor; accumulation and the
    global-norm clip over the stages' DTensor norms."""
    result = polytrain_here(
        capfd,
        "verify",
        *GPT_TINY[:-2],
        *MESH,
        "--dataset",
        "shakespeare",
        "--context",
        "16",
        "--batch-size",
        "8",
        "--steps",
        "2",
        "--accumulate",
        "2",
        "--clip-grad-norm",
        "0.5",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 and all(float(diff) <= 1e-5 for *_, diff in rows) and "PASS" in result.stdout
    assert "each stage split over 2 tensor ranks" in result.stdout


@pytest.mark.multiprocess
def test_a_run_moves_one_device_to_pipeline_x_tensor_and_back_on_one_straight_trajectory(tmp_path, capfd):
    """The pipeline x tensor part loads whole-model state into its slices, trains across an epoch's end (its
    evaluation too) and saves the whole model by its original names, fused rows in order."""
    path = tmp_path / "text.txt"
    path.write_text(
        "".join("ROMEO: but soft, what light through yonder window breaks?\n"[i % 58] for i in range(480))
    )
    train = [
        *GPT_TINY,
        "--context",
        "8",
        "--dataset",
        "text",
        "--data-dir",
        path,
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--optimizer",
        "adamw",
        "--lr",
        "0.003",
        "--schedule",
        "constant",
        "--seed",
        "3",
        "--device",
        "cpu",
    ]
    assert (
        polytrain_here(None, "train", *train, "--devices", "1", "--out", tmp_path / "straight").returncode
        == 0
    )
    straight = load(tmp_path / "straight" / "model.pt")
    out = tmp_path / "run"
    assert (
        polytrain_here(None, "train", *train, "--devices", "1", "--max-steps", "3", "--out", out).returncode
        == 0
    )
    mesh = polytrain_here(capfd, "train", "--resume", out, *MESH, "--max-steps", "9")
    assert mesh.returncode == 0, mesh.stdout + mesh.stderr
    assert "rank 3: replica 1/1, stage 1, tensor slice 2/2" in mesh.stdout
    assert list(load(out / "model.pt")) == list(straight)
    rest = polytrain_here(
        capfd, "train", "--resume", out, "--strategy", "single", "--devices", "1", "--max-steps", 0
    )
    assert rest.returncode == 0, rest.stderr
    assert_same_weights(load(out / "model.pt"), straight)
