"""Checkpoints of shards (torch.distributed.checkpoint): every sharded rank writes its own part, a resume on any
number of ranks or on one device continues exactly, `polytrain export` streams one file tensor by tensor, and a
damaged shard set is one line naming the file."""

import weakref

import pytest
import torch
from conftest import RESUME_TRAIN, assert_same_weights, polytrain_here
from conftest import load_weights as load

from polytrain.cli import main
from polytrain.runtime import export, shards
from polytrain.runtime.checkpoint import Checkpointer, atomic_torch_save, pointer

# float32 AdamW over a resume: 1 of 409,600 weights of the straight run's trajectory lands 1.1e-5 away (its
# update is lr x a sign where the gradient is near eps); the Adam moments below catch a real mapping error
ADAM_ROUNDING = 2e-5


@pytest.mark.multiprocess
def test_four_sharded_ranks_write_shards_that_two_resume_and_export_like_a_straight_run(
    straight_resume_run, tmp_path, capfd
):
    out = tmp_path / "run"
    part = polytrain_here(
        capfd, "train", *RESUME_TRAIN, "--strategy", "sharded", "--devices", 4, "--max-steps", 9, "--out", out
    )
    assert part.returncode == 0, part.stderr
    progress = torch.load(out / "checkpoint.pt", weights_only=True)
    assert "model" not in progress and "optimizer" not in progress  # nothing was gathered to rank 0
    folder = out / progress["shards"]
    assert sorted(p.name for p in folder.iterdir()) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    assert not list(out.glob("*.tmp"))
    rest = polytrain_here(capfd, "train", "--resume", out, "--strategy", "sharded", "--devices", 2)
    assert rest.returncode == 0, rest.stderr
    assert not folder.exists()  # replaced by the resumed run's last checkpoint
    assert_same_weights(load(out / "model.pt"), straight_resume_run, atol=ADAM_ROUNDING)
    safetensors = pytest.importorskip("safetensors.torch")
    assert main(["export", str(out), "--out", str(tmp_path / "model.safetensors")]) == 0
    exported = safetensors.load_file(tmp_path / "model.safetensors")
    assert_same_weights(
        {k: exported[k] for k in straight_resume_run}, straight_resume_run, atol=ADAM_ROUNDING
    )
    assert main(["export", str(out), "--format", "pt", "--out", str(tmp_path / "model.pt")]) == 0
    assert_same_weights(load(tmp_path / "model.pt"), straight_resume_run, atol=ADAM_ROUNDING)


# a tiny GPT on Shakespeare: its 65-token vocabulary splits unevenly over 2 tensor ranks (33 + 32 rows), and its
# fused q/k/v rows are reordered on the tensor ranks
GPT_RUN = [
    *("--model", "gpt", "--layers", "2", "--width", "32", "--heads", "2", "--context", "8", "--eps", "1e-5"),
    *("--dataset", "shakespeare", "--batch-size", "8", "--epochs", "1", "--optimizer", "adamw"),
    *("--lr", "0.003", "--schedule", "constant", "--seed", "3", "--device", "cpu"),
]


@pytest.mark.multiprocess
def test_sharded_4_then_sharded_2_then_tensor_2_then_one_device_is_the_straight_run(tmp_path, capfd):
    """Each leg resumes the shards the previous one wrote (DCP re-shards them); the tensor leg writes its slices,
    fused rows at their one-device places, and the one-device leg reads them whole."""
    straight = tmp_path / "straight"
    assert polytrain_here(None, "train", *GPT_RUN, "--max-steps", 8, "--out", straight).returncode == 0
    out = tmp_path / "run"
    for leg, (strategy, devices, steps) in enumerate(
        [("sharded", 4, 2), ("sharded", 2, 4), ("tensor", 2, 6), ("single", 1, 8)]
    ):
        start = [*GPT_RUN, "--out", out] if leg == 0 else ["--resume", out]
        run = polytrain_here(
            capfd, "train", *start, "--strategy", strategy, "--devices", devices, "--max-steps", steps
        )
        assert run.returncode == 0, run.stdout + run.stderr
        progress = torch.load(out / "checkpoint.pt", weights_only=True)
        assert ("shards" in progress) == (strategy != "single") and "model" not in progress or leg == 3
    assert_same_weights(load(out / "model.pt"), load(straight / "model.pt"))
    # Adam's moments keep each leg's gradients (its weights' steps are near lr x a sign whatever the gradient)
    ours, theirs = (
        torch.load(run / "checkpoint.pt", weights_only=True)["optimizer"] for run in (out, straight)
    )
    for number, slots in theirs["state"].items():
        torch.testing.assert_close(ours["state"][number]["exp_avg"], slots["exp_avg"], atol=1e-6, rtol=1e-4)


@pytest.fixture
def shard_run(tmp_path, capsys):
    """A one-device run whose model.pt is replaced by a pointer to the same weights saved as shards."""
    run = tmp_path / "run"
    argv = ["--dataset", "synthetic", "--synthetic-size", "96", "--model", "mlp", "--batch-size", "32"]
    assert main(["train", *argv, "--epochs", "1", "--device", "cpu", "--out", str(run)]) == 0
    weights = torch.load(run / "model.pt", weights_only=True)
    shards.save({"model": weights}, run, "checkpoint-1", is_main=True)
    atomic_torch_save(pointer("checkpoint-1", weights), run / "model.pt")
    capsys.readouterr()
    return run, weights


def test_evaluate_reads_shards_as_it_reads_one_file(shard_run, capsys):
    run, _ = shard_run
    assert main(["evaluate", str(run)]) == 0
    assert "(19 samples)" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["missing shard", "truncated shard", "missing index"])
def test_a_damaged_shard_set_is_one_line_naming_the_file(shard_run, capsys, damage):
    run, _ = shard_run
    folder = run / "checkpoint-1"
    broken = folder / (".metadata" if damage == "missing index" else "__0_0.distcp")
    if damage == "truncated shard":
        broken.write_bytes(broken.read_bytes()[:100])
    else:
        broken.unlink()
    for command in (["evaluate", str(run)], ["export", str(run)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"{broken} is {damage.split()[0]}" in err and "start the run again" in err


def test_export_holds_one_tensor_at_a_time(shard_run, monkeypatch, tmp_path):
    run, weights = shard_run
    read, alive, peak = shards.read_tensor, [], [0]

    def counted(*args):
        tensor = read(*args)
        alive.append(weakref.ref(tensor))
        held = sum(r().numel() * r().element_size() for r in alive if r() is not None)
        peak[0] = max(peak[0], held)
        return tensor

    monkeypatch.setattr(shards, "read_tensor", counted)
    export.export_weights(run / "model.pt", tmp_path / "model.safetensors")
    largest = max(t.numel() * t.element_size() for t in weights.values())
    assert len(alive) == len(weights) and peak[0] == largest
    kept = []  # a writer that kept what it read would hold the whole model: the count sees it
    monkeypatch.setattr(export, "_raw", lambda tensor: kept.append(tensor) or tensor.numpy().view("uint8"))
    alive.clear()
    export.export_weights(run / "model.pt", tmp_path / "again.safetensors")
    assert peak[0] == sum(t.numel() * t.element_size() for t in weights.values())


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_partial_folder(shard_run, monkeypatch):
    run, weights = shard_run
    from torch.distributed.checkpoint import FileSystemWriter

    def full_disk(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    with pytest.raises(BaseException, match="No space left"):
        shards.save({"model": {k: v + 1 for k, v in weights.items()}}, run, "checkpoint-2", is_main=True)
    assert not (run / "checkpoint-2.tmp").exists() and not (run / "checkpoint-2").exists()
    assert_same_weights(load(run / "model.pt"), weights)


@pytest.mark.multiprocess
def test_checkpoints_written_in_the_background_resume_like_a_straight_run(
    straight_resume_run, tmp_path, capfd
):
    out = tmp_path / "run"
    argv = [*RESUME_TRAIN, "--strategy", "sharded", "--devices", 2, "--async-checkpoint"]
    part = polytrain_here(capfd, "train", *argv, "--checkpoint-every", 2, "--max-steps", 9, "--out", out)
    assert part.returncode == 0, part.stderr
    progress = torch.load(out / "checkpoint.pt", weights_only=True)
    assert progress["position"]["step"] == 3 and not list(out.glob("*.tmp"))  # the last one, switched in
    rest = polytrain_here(capfd, "train", "--resume", out, "--strategy", "sharded", "--devices", 2)
    assert rest.returncode == 0, rest.stderr
    assert_same_weights(load(out / "model.pt"), straight_resume_run, atol=ADAM_ROUNDING)


def test_a_failed_background_write_leaves_the_previous_checkpoint(shard_run, monkeypatch, tmp_path):
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    run, weights = shard_run

    def full_disk(*args, **kwargs):
        raise OSError("No space left on device")

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
        checkpointer = Checkpointer(run, is_main=True, asynchronous=True)
        changed = {"model": {k: v + 1 for k, v in weights.items()}}
        future = shards.save_async(changed, run, "checkpoint-2", group=None)
        checkpointer.pending = (
            future,
            "checkpoint-2",
            ({"shards": "checkpoint-2"}, pointer("checkpoint-2", [])),
        )
        with pytest.raises(BaseException, match="No space"):
            checkpointer.finish()
    finally:
        dist.destroy_process_group()
    assert not (run / "checkpoint-2.tmp").exists() and not (run / "checkpoint-2").exists()
    assert_same_weights(load(run / "model.pt"), weights)
