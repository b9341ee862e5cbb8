"""Checkpoints of shards (torch.distributed.checkpoint): every sharded rank writes its own part, a resume on any
number of ranks or on one device continues exactly, `polytrain export` streams one file tensor by tensor, and a
damaged shard set is one line naming the file."""

import weakref

import pytest
import torch
from conftest import RESUME_TRAIN, assert_same_weights, polytrain_here
from conftest import load_weights as load

from polytrain.checkpoint import atomic_torch_save, pointer
from polytrain.cli import main
from polytrain.runtime import export, shards


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
    assert_same_weights(load(out / "model.pt"), straight_resume_run)
    safetensors = pytest.importorskip("safetensors.torch")
    assert main(["export", str(out), "--out", str(tmp_path / "model.safetensors")]) == 0
    exported = safetensors.load_file(tmp_path / "model.safetensors")
    assert_same_weights({k: exported[k] for k in straight_resume_run}, straight_resume_run)
    assert main(["export", str(out), "--format", "pt", "--out", str(tmp_path / "model.pt")]) == 0
    assert_same_weights(load(tmp_path / "model.pt"), straight_resume_run)


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
