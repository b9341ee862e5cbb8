"""`polytrain train --dry-run [GPU]` (runtime/dry_run.py): the run's own layout, from the flags a user
gives `train`, built at full size at its --devices on torch's fake process group as `polytrain plan` builds each
layout (whose figures tests/test_cluster_plan.py checks against real runs), on a machine with fewer devices than
the run; nothing trained, no run folder, no worker."""

import math

import pytest
from conftest import assert_refused_in_one_line, polytrain_here

from polytrain.cli import parse
from polytrain.config.flags import config_from_args
from polytrain.parallel.layout import Layout
from polytrain.runtime.dry_run import dry_run_plan
from polytrain.scaling.cluster_plan import PlanRequest, model_work, plan_layout

LLAMA = [
    "--model",
    "llama",
    "--layers",
    "2",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--width",
    "64",
    "--ffn-width",
    "128",
]
GPT = ["--model", "gpt", "--layers", "2", "--heads", "4", "--width", "64"]
DATA = ["--dataset", "shakespeare", "--context", "16"]

# each built-in language model on each kind of layout `train` names, at more devices than this machine has
CASES = {
    "gpt-data": (GPT + ["--strategy", "data", "--devices", "4"], Layout(replicate=4, context_in="replicate")),
    "gpt-pipeline-tensor": (
        GPT
        + ["--strategy", "pipeline", "--pipeline-stages", "2", "--tensor-parallel", "2", "--devices", "8"],
        Layout(replicate=2, pipeline=2, tensor=2, context_in="replicate"),
    ),
    "llama-sharded": (LLAMA + ["--strategy", "sharded", "--devices", "16"], Layout(shard=16)),
    "llama-hsdp-context": (
        LLAMA + ["--strategy", "sharded", "--replicas", "2", "--context-parallel", "2", "--devices", "16"],
        Layout(replicate=2, shard=4, context=2),
    ),
    "llama-tensor": (
        LLAMA + ["--strategy", "tensor", "--tensor-parallel", "2", "--devices", "16"],
        Layout(shard=8, tensor=2),
    ),
    "llama-pipeline-shards": (
        LLAMA
        + ["--strategy", "pipeline", "--pipeline-stages", "2", "--data-parallel", "shard", "--devices", "8"],
        Layout(shard=4, pipeline=2),
    ),
}


def _config(argv, batch: int = 32):
    _, args = parse(["train", *argv, *DATA, "--batch-size", str(batch), "--precision", "bf16"])
    return config_from_args(args)


@pytest.mark.parametrize("case", CASES)
def test_the_dry_run_builds_the_layout_the_flags_name_as_the_plan_builds_it(case):
    argv, layout = CASES[case]
    config = _config(argv)
    request, rows, _ = dry_run_plan(config, "h100")
    (row,) = rows
    assert row.layout == layout == config.layout and not row.refused
    # the same layout planned from its degrees alone (`polytrain plan --layout`), whose figures are checked
    # against real runs: the run's flags reach the same code
    alone = PlanRequest(request.build, "x", layout.world_size, request.gpu, 32, 16, precision="bf16")
    alone.layers = request.layers
    planned = plan_layout(alone, layout, model_work(alone))
    for part in ("parameters", "gradients", "optimizer", "activations", "buffers", "step_seconds"):
        assert getattr(row, part) == pytest.approx(getattr(planned, part), rel=1e-12), part
    assert row.parameters > 0 and row.activations > 0 and row.fits


def test_what_a_shard_holds_is_torchs_chunk_of_each_parameter():
    config = _config(LLAMA + ["--strategy", "sharded", "--devices", "16"])
    request, (row,), _ = dry_run_plan(config, "h100")
    # FSDP2 keeps rank 0's torch.chunk of dim 0 (ceil(rows / 16) rows), float32 under bf16's autocast
    expected = sum(4 * math.ceil(p.shape[0] / 16) * p[0].numel() for p in request.build().parameters())
    assert row.parameters == expected and row.gradients == expected
    assert row.optimizer == 2 * expected  # adamw: two state tensors per trained parameter
    sgd = _config(
        LLAMA + ["--strategy", "sharded", "--devices", "16", "--optimizer", "sgd", "--momentum", "0"]
    )
    assert dry_run_plan(sgd, "h100")[1][0].optimizer == 0  # plain SGD keeps no state


def test_the_command_says_whether_it_fits_and_writes_nothing(capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["train", *LLAMA, *DATA, "--strategy", "tensor", "--tensor-parallel", "2", "--devices", "16"]
    done = polytrain_here(capfd, *argv, "--batch-size", "32", "--dry-run", "a100-80gb")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nothing is trained" in done.stdout and "dp_shard=8,tp=2" in done.stdout
    assert "fits:" in done.stdout and "per GPU (8 shards x 2 tensor ranks)" in done.stdout
    assert list(tmp_path.iterdir()) == []  # no run folder
    # a batch whose activations no GPU holds: exit 1, with how much it needs
    big = [*argv[:-2], "--devices", "2", "--context", "4096", "--batch-size", "4096", "--dry-run", "l40s"]
    done = polytrain_here(capfd, *big)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "does not fit:" in done.stdout and "45 GiB per l40s" in done.stdout
    # --strategy auto: every layout ranked, and the flags of the first
    done = polytrain_here(capfd, "train", *GPT, *DATA, "--devices", "4", "--batch-size", "8", "--dry-run")
    assert done.returncode == 0 and "train the first with: --strategy" in done.stdout, (
        done.stdout + done.stderr
    )
    assert "no GPU here: as on an H100" in done.stdout


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "lenet", "--dataset", "mnist-sample", "--dry-run"], ["--dry-run plans language models"]),
        (
            ["--model", "gpt", "--dataset", "shakespeare", "--dry-run", "--resume", "runs/x"],
            ["drop --resume"],
        ),
        (
            GPT + DATA + ["--strategy", "parameter-server", "--devices", "2", "--dry-run"],
            ["parameter server"],
        ),
        (GPT + DATA + ["--dry-run", "h900"], ["--dry-run: unknown GPU 'h900'", "h100"]),
        (
            LLAMA + DATA + ["--strategy", "tensor", "--tensor-parallel", "4", "--devices", "4", "--dry-run"],
            ["--dry-run at --devices 4", "key/value heads"],
        ),
    ],
    ids=["not-a-language-model", "resume", "parameter-server", "unknown-gpu", "refused-layout"],
)
def test_what_a_dry_run_cannot_plan_is_refused_in_one_line(capsys, tmp_path, argv, words):
    assert_refused_in_one_line(capsys, tmp_path / "out", argv, words)
