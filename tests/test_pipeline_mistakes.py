"""Mistakes with --strategy pipeline get one line, exit code 2, before any process starts (no spawn here)."""

import pytest
import torch
from conftest import assert_refused_in_one_line, tiny_digits

import polytrain
from polytrain.errors import UserError

DATA = ["--dataset", "synthetic", "--synthetic-size", "64", "--device", "cpu", "--epochs", "1"]
PIPE = ["--strategy", "pipeline"]


@pytest.mark.parametrize(
    "argv, words",
    [
        # --model mlp has 6 layers; interleaved 1F1B puts 2 stages on each of 4 ranks
        (
            [*PIPE, "--model", "mlp", "--devices", "4", "--pipeline-schedule", "interleaved-1f1b"],
            ["cannot split 6 layers into 8 stages", "at most 3 pipeline stages"],
        ),
        (
            [*PIPE, "--model", "mlp", "--devices", "2", "--split", "0"],
            ["--split point 0 is outside 1..5", "6 layers"],
        ),
        ([*PIPE, "--model", "mlp", "--devices", "2", "--split", "6"], ["--split point 6 is outside 1..5"]),
        ([*PIPE, "--model", "mlp", "--devices", "3", "--split", "2,2"], ["--split repeats layer 2"]),
        (
            [*PIPE, "--model", "mlp", "--devices", "3", "--split", "4,2"],
            ["--split points must increase", "2,4"],
        ),
        (
            [*PIPE, "--model", "mlp", "--devices", "2", "--split", "2,4"],
            ["gives 2 points", "2 stages needs 1"],
        ),
        (
            [*PIPE, "--model", "mlp", "--devices", "2", "--split", "two"],
            ["--split must be 'auto' or increasing"],
        ),
        (
            [*PIPE, "--model", "mlp", "--devices", "2", "--batch-size", "8", "--microbatches", "16"],
            ["--microbatches 16 is larger than the batch of 8", "use one of 1, 2, 4, 8"],
        ),
        (
            [*PIPE, "--model", "mlp", "--devices", "2", "--batch-size", "12", "--microbatches", "5"],
            ["--microbatches 5 does not divide the batch of 12", "use one of 1, 2, 3, 4, 6, 12"],
        ),
        (
            [
                *PIPE,
                "--model",
                "mlp",
                "--devices",
                "4",
                "--pipeline-stages",
                "2",
                "--batch-size",
                "16",
                "--microbatches",
                "16",
            ],
            ["is larger than the batch of 8", "2 pipeline replicas", "use one of 1, 2, 4, 8"],
        ),
        (
            [*PIPE, "--model", "mlp", "--devices", "4", "--pipeline-stages", "3"],
            ["--pipeline-stages 3 does not divide --devices 4", "2, 4"],
        ),
        (
            ["--strategy", "data", "--model", "mlp", "--devices", "2", "--microbatches", "2"],
            ["--microbatches applies to --strategy pipeline only"],
        ),
        (
            ["--model", "mlp", "--devices", "2", "--split", "3"],
            ["--split applies to --strategy pipeline only"],
        ),
        ([*PIPE, "--model", "mlp", "--devices", "1"], ["pipeline", "--devices 2"]),
    ],
)
def test_pipeline_mistakes_get_one_line_before_any_process_starts(tmp_path, capsys, argv, words):
    assert_refused_in_one_line(capsys, tmp_path / "run", [*DATA, *argv], words)


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten, self.linear = torch.nn.Flatten(), torch.nn.Linear(784, 10)

    def forward(self, x):
        return self.linear(self.flatten(x))


class SequentialWithItsOwnForward(torch.nn.Sequential):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize(
    "model", [TwoLayers(), SequentialWithItsOwnForward(torch.nn.Flatten(), torch.nn.Linear(784, 10))]
)
def test_a_model_that_is_not_a_plain_sequential_is_refused_from_python(tmp_path, model):
    with pytest.raises(UserError) as refused:  # a UserError from this process, not a WorkerFailed
        polytrain.fit(
            model,
            tiny_digits(n_train=64, n_val=10),
            devices=2,
            strategy="pipeline",
            batch_size=16,
            device="cpu",
            verbose=False,
            out=str(tmp_path / "run"),
        )
    message = str(refused.value)
    assert "nn.Sequential" in message and type(model).__name__ in message and "\n" not in message
    assert not (tmp_path / "run").exists()


def test_a_last_batch_too_small_for_the_copies_is_refused_unless_the_run_stops_before_it(tmp_path, capsys):
    """65 samples in batches of 8 leave a last batch of 1, which 2 pipeline copies cannot share: refused in one
    line; with --max-steps 8 the run never reaches it, and it is planned."""
    from polytrain.config.train import TrainConfig
    from polytrain.models import build_model
    from polytrain.strategy_registry import make_plan

    data = tiny_digits(n_train=65)
    settings = dict(strategy="pipeline", model="mlp", devices=4, pipeline_stages=2, batch_size=8)
    model = build_model("mlp", (1, 28, 28), 10, {})
    with pytest.raises(UserError, match="the last batch of an epoch has 1 samples, too few for 2 pipeline"):
        make_plan("pipeline", TrainConfig(**settings), model, data, device=torch.device("cpu"))
    plan = make_plan(
        "pipeline", TrainConfig(**settings, max_steps=8), model, data, device=torch.device("cpu")
    )
    assert plan.ranks == 2 and plan.model_stages == 2
    with pytest.raises(UserError, match="too few for 2 pipeline"):  # the 9th step would reach it
        make_plan("pipeline", TrainConfig(**settings, max_steps=9), model, data, device=torch.device("cpu"))
