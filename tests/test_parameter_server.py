"""The parameter server on 2-3 CPU processes (gloo) against one device: the synchronous step equals the
one-device step for one server and for parameters split over two; checkpoints resume under any strategy; a
failing server ends the job with its rank named; mistakes get one line."""

import copy
import time

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
from distributed import MisbehavingModel, SlowOnRank

import polytrain
from polytrain.models import build_model
from polytrain.runtime.launch import WorkerFailed

pytestmark = pytest.mark.multiprocess

TRAIN = RESUME_TRAIN


@pytest.mark.parametrize("devices, servers, server_device", [(2, 1, "cpu"), (3, 2, "same")])
def test_twenty_synchronous_steps_equal_one_device(devices, servers, server_device):
    data = tiny_digits(n_train=600, n_val=20)
    torch.manual_seed(0)
    start = build_model("lenet", data.input_shape, 10)
    one, many = copy.deepcopy(start), copy.deepcopy(start)
    # the default memory format: channels-last kernels round batches of 8 and 24 apart, and 20 float32 steps
    # grow that to 2e-3 (float64, as verify trains, agrees to 1e-16 either way)
    settings = dict(epochs=1, batch_size=24, max_steps=20, device="cpu", verbose=False, channels_last=False)
    polytrain.fit(one, data, devices=1, **settings)
    history = polytrain.fit(
        many,
        data,
        devices=devices,
        strategy="parameter-server",
        servers=servers,
        server_device=server_device,
        **settings,
    )
    assert (
        max(float((a - b).detach().abs().max()) for a, b in zip(one.parameters(), start.parameters())) > 1e-3
    )
    assert_same_weights(many.state_dict(), one.state_dict())
    assert history is None or all(record["server_wait_seconds"] > 0 for record in history.epochs)


@pytest.mark.parametrize(
    "first, then",
    [
        (
            ["--strategy", "parameter-server", "--devices", "2"],
            ["--strategy", "sharded"],
        ),  # server -> sharded
        (["--strategy", "data", "--devices", "2"], ["--strategy", "parameter-server"]),  # data -> server
    ],
)
def test_a_stopped_run_resumes_under_another_strategy_like_one_straight_run(
    straight_resume_run, tmp_path, capfd, first, then
):
    straight = straight_resume_run
    out = tmp_path / "run"
    part = polytrain_here(capfd, "train", *TRAIN, *first, "--max-steps", "9", "--out", out)
    assert part.returncode == 0, part.stderr
    if "parameter-server" in first:  # each epoch says how long the workers waited on the servers
        assert "server 0 (rank 0): 8 tensors" in part.stdout
        assert "waited" in part.stdout and "on the servers" in part.stdout
        assert '"server_wait_seconds"' in (out / "metrics.jsonl").read_text()
    rest = polytrain_here(capfd, "train", "--resume", out, *then)
    assert rest.returncode == 0, rest.stderr
    assert_same_weights(load(out / "model.pt"), straight)


@pytest.mark.parametrize("staleness", [1, 3])
def test_asynchronous_updates_keep_every_worker_within_the_staleness_bound(tmp_path, staleness):
    """Rank 1 is slow: rank 0 runs ahead until the bound holds it back, and never further."""
    import json

    data = tiny_digits(n_train=480, n_val=40)
    torch.manual_seed(0)
    model = SlowOnRank(rank=1, seconds=0.03)
    polytrain.fit(
        model,
        data,
        devices=2,
        strategy="parameter-server",
        staleness=staleness,
        epochs=2,
        batch_size=24,
        lr=0.01,
        out=str(tmp_path / "run"),
        verbose=False,
    )
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line
    ]
    assert [r["updates"] for r in records] == [40, 40]  # 20 steps x 2 workers, every one applied
    assert max(r["lead_max"] for r in records) == staleness  # the fast worker reached the bound ...
    assert all(r["lead_max"] <= staleness for r in records)  # ... and never passed it
    assert max(r["version_lag_max"] for r in records) >= 1  # updates really were applied out of step
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert set(saved) == set(model.state_dict()) and records[-1]["val_acc"] > 0.5


def test_a_failing_server_rank_ends_the_job_and_is_named():
    started = time.monotonic()
    with pytest.raises(WorkerFailed) as failure:
        polytrain.fit(
            MisbehavingModel("raise", rank=0),
            tiny_digits(n_train=320),
            devices=2,
            epochs=2,
            batch_size=32,
            strategy="parameter-server",
            verbose=False,
        )
    assert time.monotonic() - started < 90
    assert "worker rank 0" in str(failure.value) and "boom on purpose" in str(failure.value)


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--strategy", "parameter-server", "--devices", "2", "--servers", "2"],
            ["--servers 2", "between 1 and 1"],
        ),
        (
            ["--strategy", "sharded", "--devices", "2", "--servers", "1"],
            ["--servers", "--strategy parameter-server"],
        ),
        (
            ["--strategy", "data", "--devices", "2", "--server-device", "cpu"],
            ["--server-device", "parameter-server"],
        ),
        (
            ["--strategy", "parameter-server", "--devices", "2", "--server-device", "gpu"],
            ["--server-device 'gpu'"],
        ),
        (
            ["--strategy", "data", "--devices", "2", "--staleness", "2"],
            ["--staleness", "--strategy parameter-server"],
        ),
        (["--strategy", "parameter-server", "--devices", "2", "--staleness", "-1"], ["--staleness", ">= 0"]),
    ],
)
def test_parameter_server_mistakes_get_one_line_before_any_process_starts(tmp_path, capsys, argv, words):
    assert_refused_in_one_line(capsys, tmp_path / "run", argv, words)
