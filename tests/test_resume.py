"""`--resume` continues what the run had: its devices, its length; it says what it keeps and what it refuses."""

import json
import os
import subprocess
import sys

import pytest
import torch

import polytrain
from polytrain.cli import main
from polytrain.errors import UserError
from polytrain.run_dir import in_training, training

COMMON = [
    "--dataset",
    "synthetic",
    "--synthetic-size",
    "96",
    "--model",
    "mlp",
    "--batch-size",
    "32",
    "--device",
    "cpu",
]


def train(capsys, *args):
    code = main(["train", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(capsys, *COMMON, "--epochs", 1, "--out", out)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, stdout, err = train(capsys, "--resume", out)
    assert code == 0 and err == ""
    assert f"{out} already finished its 1 epochs" in stdout and "nothing to resume" in stdout
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_max_steps_below_the_steps_done_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(capsys, *COMMON, "--epochs", 2, "--max-steps", 5, "--out", out)[0] == 0
    code, _, err = train(capsys, "--resume", out, "--max-steps", 4)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "--max-steps 4: this run has already done 5 steps; give more than 5" in err


def test_the_runs_own_command_given_again_resumes_and_only_a_changed_value_is_refused(tmp_path, capsys):
    """A user adds --resume to the command that started the run: the flags that equal the run's values (a path
    given another way too) resume; a changed one is refused naming the run's value, and the flags it says may
    change are the command line's (no --tensor-plan, a setting of fit() only)."""
    out = tmp_path / "run"
    first = [*COMMON, "--epochs", 2, "--lr", 0.05, "--max-steps", 2, "--out", out]
    assert train(capsys, *first)[0] == 0
    again = [*COMMON, "--epochs", 2, "--lr", "5e-2", "--max-steps", 3, "--out", tmp_path / "." / "run"]
    code, stdout, err = train(capsys, *again, "--resume", out)
    assert code == 0 and err == "", err
    assert "stopped after 3 steps" in stdout
    code, _, err = train(capsys, *COMMON, "--lr", 0.1, "--batch-size", 16, "--resume", out)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert (
        "it was trained with --batch-size 32, --lr 0.05, and this command gives --batch-size 16, --lr 0.1"
        in err
    )
    assert "--tensor-parallel" in err and "--tensor-plan" not in err


def test_a_constant_schedule_is_extended_to_more_epochs_like_a_longer_run(tmp_path, capsys):
    constant = [*COMMON, "--schedule", "constant", "--warmup-epochs", "0.5"]
    assert train(capsys, *constant, "--epochs", 2, "--out", tmp_path / "short")[0] == 0
    code, stdout, _ = train(capsys, "--resume", tmp_path / "short", "--epochs", 3)
    assert code == 0, stdout
    assert (
        "after epoch 2" in stdout.splitlines()[0] and "changed: --epochs 3 (was 2)" in stdout.splitlines()[0]
    )
    assert train(capsys, *constant, "--epochs", 3, "--out", tmp_path / "long")[0] == 0
    extended = torch.load(tmp_path / "short" / "model.pt", weights_only=True)
    longer = torch.load(tmp_path / "long" / "model.pt", weights_only=True)
    for key in longer:
        torch.testing.assert_close(extended[key], longer[key], atol=1e-6, rtol=0)
    assert json.loads((tmp_path / "short" / "config.json").read_text())["epochs"] == 3
    assert len((tmp_path / "short" / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_schedule_that_depends_on_the_length_is_not_extended(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(capsys, *COMMON, "--epochs", 1, "--out", out)[0] == 0
    code, _, err = train(capsys, "--resume", out, "--epochs", 3)
    assert code == 2 and err.count("\n") == 1
    assert "onecycle learning-rate schedule is laid out over its 1 epochs" in err
    assert "start a new run with --epochs 3" in err


def test_the_first_line_says_where_the_run_continues(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(capsys, *COMMON, "--epochs", 2, "--max-steps", 4, "--out", out)[0] == 0
    code, stdout, _ = train(capsys, "--resume", out, "--max-steps", 5)
    assert code == 0
    assert (
        stdout.splitlines()[0] == f"resuming {out} in epoch 2 at step 1 of 3 on 1 CPU process as the run had"
    )
    record = json.loads((out / "config.json").read_text())
    assert record["device_type"] == "cpu" and record["devices"] == 1


def test_latest_names_the_newest_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train(capsys, *COMMON, "--epochs", 1, "--out", "runs/older")[0] == 0
    assert train(capsys, *COMMON, "--epochs", 1, "--out", "runs/newer")[0] == 0
    assert main(["evaluate", "runs/LATEST"]) == 0
    assert "(19 samples)" in capsys.readouterr().out
    code, stdout, _ = train(capsys, "--resume", "runs/LATEST")
    assert code == 0 and "runs/newer already finished" in stdout
    assert main(["evaluate", str(tmp_path / "empty" / "LATEST")]) == 2
    assert "there is no run folder" in capsys.readouterr().err


def test_a_torch_schedule_by_epoch_is_extended_like_a_longer_run(tmp_path, capsys):
    steplr = [*COMMON, "--schedule", "steplr", "--schedule-args", "step_size=1,gamma=0.5"]
    assert train(capsys, *steplr, "--epochs", 1, "--out", tmp_path / "short")[0] == 0
    code, stdout, _ = train(capsys, "--resume", tmp_path / "short", "--epochs", 2)
    assert code == 0 and "changed: --epochs 2 (was 1)" in stdout.splitlines()[0], stdout
    assert train(capsys, *steplr, "--epochs", 2, "--out", tmp_path / "long")[0] == 0
    extended = torch.load(tmp_path / "short" / "model.pt", weights_only=True)
    longer = torch.load(tmp_path / "long" / "model.pt", weights_only=True)
    for key in longer:
        torch.testing.assert_close(extended[key], longer[key], atol=1e-6, rtol=0)


HOLD_LOCK = (
    "import sys\nfrom polytrain.run_dir import training\nwith training(sys.argv[1]):\n"
    "    print('held', flush=True)\n    sys.stdin.read()\n"
)


def test_a_run_that_another_process_trains_is_refused_and_a_dead_holder_blocks_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(capsys, *COMMON, "--epochs", 2, "--max-steps", 2, "--out", out)[0] == 0
    recorded = (out / "config.json").read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        busy = f"{out} is being trained by another process (pid {holder.pid}); "
        code, stdout, err = train(capsys, "--resume", out)
        assert (
            code == 2
            and stdout == ""
            and err.startswith(f"polytrain: error: {busy}wait for it")
            and err.count("\n") == 1
        ), err
        code, stdout, err = train(capsys, *COMMON, "--out", out)  # a new run into the same folder
        assert code == 2 and err.startswith(f"polytrain: error: {busy}choose another folder"), err
        with pytest.raises(UserError, match=f"pid {holder.pid}"):
            polytrain.fit(
                "mlp",
                "synthetic",
                synthetic_size=96,
                batch_size=32,
                device="cpu",
                epochs=2,
                resume=str(out),
                verbose=False,
            )
        assert (out / "config.json").read_bytes() == recorded
    finally:
        holder.kill()  # as a crash would end it: the lock file stays, its lock does not
        holder.wait(timeout=60)
    assert (out / ".training.lock").is_file()
    code, stdout, err = train(capsys, "--resume", out)
    assert code == 0 and err == "" and "resuming" in stdout, err


def test_the_run_folder_is_locked_while_it_trains(tmp_path):
    seen = []

    class Look:
        def on_epoch_end(self, trainer):
            seen.append(in_training(tmp_path / "run"))

    polytrain.fit(
        "mlp",
        "synthetic",
        synthetic_size=96,
        batch_size=32,
        device="cpu",
        epochs=1,
        verbose=False,
        out=str(tmp_path / "run"),
        callbacks=[Look()],
    )
    assert seen == [True] and not in_training(tmp_path / "run")


def test_a_resumed_folder_records_the_layout_it_now_trains_on(tmp_path):
    """config.json after a resume names the strategy and every setting of its layout as it now trains (those
    `--strategy auto` chose too), with the versions it now trains on."""
    from polytrain.config import TrainConfig
    from polytrain.planning.sharded import ShardedPlan
    from polytrain.runtime.phases import record_new_layout

    before = dict(
        strategy="data", devices=2, replicas=None, tensor_parallel=None, epochs=3, versions={"x": 1}
    )
    (tmp_path / "config.json").write_text(json.dumps(before))
    now = TrainConfig(strategy="sharded", devices=4, replicas=2, epochs=3)
    record_new_layout(tmp_path, now, "sharded", ShardedPlan(), launched=False)
    recorded = json.loads((tmp_path / "config.json").read_text())
    assert (recorded["strategy"], recorded["devices"], recorded["replicas"]) == ("sharded", 4, 2)
    assert recorded["strategy_plan"] == {"summary": "shards on each device"}
    assert recorded["epochs"] == 3 and recorded["versions"]["torch"] == torch.__version__


def test_a_child_forked_while_a_run_trains_does_not_keep_its_folder_locked(tmp_path):
    # persistent DataLoader workers are forked while the folder is locked and may outlive the run until the
    # garbage collector takes their loader: the folder must be free when the run ends all the same
    (tmp_path / "run").mkdir()
    started, hold = os.pipe(), os.pipe()
    with training(tmp_path / "run"):
        child = os.fork()
        if child == 0:  # lives on until the parent has asked whether the folder is locked
            os.write(started[1], b"s")
            os.read(hold[0], 1)
            os._exit(0)
        assert os.read(started[0], 1) == b"s"
    try:
        assert not in_training(tmp_path / "run")
    finally:
        os.write(hold[1], b"x")
        os.waitpid(child, 0)
        for end in started + hold:
            os.close(end)


def test_a_resume_from_python_refuses_a_setting_of_the_trajectory_given_otherwise_than_the_run_had_it(
    tmp_path,
):
    """fit(resume=) with lr= other than the run's trained on with the checkpoint's rate, and without epochs=
    laid the run's onecycle schedule out over the default 5 epochs, both silently; each is one line naming the
    run's value. The run's own settings resume; a schedule that does not depend on the length may extend it."""
    run = str(tmp_path / "run")
    common = dict(device="cpu", verbose=False, batch_size=64)
    polytrain.fit("lenet", "mnist-sample", epochs=2, out=run, max_steps=3, **common)
    with pytest.raises(UserError, match=r"trained with lr=0\.05, this call gives lr=0\.5; .* pass the run's"):
        polytrain.fit("lenet", "mnist-sample", resume=run, epochs=2, lr=0.5, max_steps=4, **common)
    with pytest.raises(UserError, match=r"trained with epochs=2, this call gives epochs=5"):
        polytrain.fit("lenet", "mnist-sample", resume=run, max_steps=4, **common)
    history = polytrain.fit("lenet", "mnist-sample", resume=run, epochs=2, max_steps=4, **common)
    assert history.validations[-1]["global_step"] == 4
    constant = str(tmp_path / "constant")
    polytrain.fit("lenet", "mnist-sample", epochs=1, schedule="constant", out=constant, max_steps=2, **common)
    longer = polytrain.fit("lenet", "mnist-sample", resume=constant, epochs=2, schedule="constant", **common)
    assert len(longer.epochs) == 2
