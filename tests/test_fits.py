"""A layout whose ranks cannot hold the model is refused in one line before any worker starts (scaling/fits.py),
judged from the model's shapes on the meta device: Llama 3 8B and 70B are never allocated."""

import pytest
import torch
from processes import polytrain

import polytrain as polytrain_api
from polytrain.config import TrainConfig
from polytrain.errors import UserError
from polytrain.models import build_model_on_meta
from polytrain.scaling import fits

GIB = 2**30
# Llama 3 8B's shape, counted by hand: 32 blocks of wq, wo (4096^2), wk, wv (4096 x 1024), three SwiGLU
# matrices (4096 x 14336) and two norms, an embedding and a head of 128256 x 4096, and the final norm
BLOCK = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
PARAMETERS_8B = 32 * BLOCK + 2 * 128256 * 4096 + 4096
EMBEDDING_BYTES = 128256 * 4096 * 4


@pytest.fixture
def llama_8b():
    model = build_model_on_meta("llama", (64,), 65, dict(size="8b"))
    assert all(p.is_meta for p in model.parameters())  # built without storage
    return model


def refusal(model, monkeypatch, *, available_gib: float, **settings) -> str:
    monkeypatch.setattr(fits, "available_per_rank", lambda device, devices: available_gib * GIB)
    config = TrainConfig(model="llama", **settings)
    with pytest.raises(UserError) as caught:
        fits.check_fits(config, model, config.strategy, name="llama", device=torch.device("cpu"), slots=2)
    return str(caught.value)


def test_the_8b_preset_is_refused_with_the_figures_and_the_settings_that_fit(llama_8b, monkeypatch):
    assert sum(p.numel() for p in llama_8b.parameters()) == PARAMETERS_8B
    line = refusal(llama_8b, monkeypatch, available_gib=64, strategy="data", devices=2)
    assert "\n" not in line
    # AdamW: parameters, gradients and two moments in float32, on every replica
    assert f"needs at least {PARAMETERS_8B * 16 / GIB:,.1f} GiB" in line and "has 64.0 GiB" in line
    assert "8.03B parameters" in line
    # sharded over the same 2 devices: half of it, plus FSDP2's two largest units gathered whole (the embedding
    # and the head, each larger than a block; the root holds no parameters of its own)
    sharded = PARAMETERS_8B * 16 / 2 + 2 * EMBEDDING_BYTES
    assert f"--strategy sharded ({sharded / GIB:,.1f} GiB per rank)" in line
    assert "--activation-checkpointing full and --precision bf16" in line


def test_more_devices_are_named_where_sharding_over_these_is_not_enough(llama_8b, monkeypatch):
    line = refusal(llama_8b, monkeypatch, available_gib=20, strategy="sharded", devices=2)
    # 8 x 20 GiB: each holds 1/8 of 119.7 GiB, the 1.96 GiB embedding and head, 18.9 GiB
    assert "--strategy sharded --devices 8 (18.9 GiB per rank" in line and "--strategy sharded (" not in line


def test_a_layout_that_fits_passes(llama_8b, monkeypatch):
    monkeypatch.setattr(fits, "available_per_rank", lambda device, devices: 64 * GIB)
    config = TrainConfig(model="llama", strategy="sharded", devices=4)
    fits.check_fits(config, llama_8b, "sharded", name="llama", device=torch.device("cpu"), slots=2)


def test_the_70b_preset_is_refused_in_one_line_before_any_worker_starts():
    result = polytrain(
        *("train", "--model", "llama", "--size", "70b", "--dataset", "shakespeare"),
        *("--devices", "2", "--strategy", "sharded"),
        timeout=240,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "does not fit --strategy sharded on 2 device(s)" in errors[0], result.stderr
    assert "70.55B parameters" in errors[0] and "worker" not in result.stderr


@pytest.mark.parametrize(
    "stages, data_parallel, replicas, bytes_per_parameter",
    [
        (
            8,
            "replicate",
            None,
            16 / 8,
        ),  # one pipeline of 8 stages: an eighth of weights, gradients and moments
        (2, "replicate", None, 16 / 2),  # 4 replicas of 2 stages: each rank holds half the model's state
        (
            2,
            "shard",
            None,
            16 / 8 + 2 * 4 / 2,
        ),  # 4 shards of 2 stages: an eighth at rest, its stage whole in a step
        (2, "shard", 2, 16 / 4 + 2 * 4 / 2),  # 2 replicas of 2 shards of 2 stages: a quarter at rest
    ],
)
def test_a_pipeline_is_counted_by_its_stages_and_whether_its_replicas_shard(
    llama_8b, monkeypatch, stages, data_parallel, replicas, bytes_per_parameter
):
    line = refusal(
        llama_8b,
        monkeypatch,
        available_gib=1,
        strategy="pipeline",
        devices=8,
        pipeline_stages=stages,
        data_parallel=data_parallel,
        replicas=replicas,
    )
    assert f"needs at least {PARAMETERS_8B * bytes_per_parameter / GIB:,.1f} GiB" in line, line
    # sharding over all 8 ranks would not fit in 1 GiB either: named as the closest, not proposed
    assert "nothing fits: even --strategy sharded" in line and "; use --strategy" not in line


def test_hybrid_sharding_is_counted_by_its_shard_groups_and_names_sharding_over_every_rank(
    llama_8b, monkeypatch
):
    line = refusal(llama_8b, monkeypatch, available_gib=20, strategy="sharded", devices=8, replicas=2)
    # 2 replicas of 4 shards: a quarter of 119.7 GiB, the embedding and the head gathered whole
    assert f"needs at least {(PARAMETERS_8B * 16 / 4 + 2 * EMBEDDING_BYTES) / GIB:,.1f} GiB" in line, line
    assert (
        f"--strategy sharded ({(PARAMETERS_8B * 16 / 8 + 2 * EMBEDDING_BYTES) / GIB:,.1f} GiB per rank)"
        in line
    )


def test_a_pipeline_of_tensor_ranks_holds_its_slices_of_the_split_layers(llama_8b, monkeypatch):
    whole = refusal(llama_8b, monkeypatch, available_gib=1, strategy="pipeline", devices=2)
    split = refusal(llama_8b, monkeypatch, available_gib=1, strategy="pipeline", devices=4, tensor_parallel=2)

    def needed(line):
        return float(line.split("needs at least ")[1].split(" GiB")[0].replace(",", ""))

    # the same 2 stages, each rank with half of the split layers (all but the embeddings and norms)
    assert needed(whole) / 2 < needed(split) < needed(whole) * 0.6, (whole, split)


def proposals(line: str) -> list:
    """(settings, GiB per rank) of each setting the refusal proposes."""
    found = []
    for part in line.split("; use ", 1)[1].split("; or "):
        flags, figure = part.split(" (", 1)
        words = flags.replace("--", "").split()
        settings = {
            key.replace("-", "_"): int(value) if value.isdigit() else value
            for key, value in zip(words[::2], words[1::2])
        }
        found.append((settings, float(figure.split(" GiB")[0].replace(",", ""))))
    return found


@pytest.mark.parametrize("available_gib", [2.8, 40, 100])
def test_only_what_the_check_itself_finds_would_fit_is_proposed(llama_8b, monkeypatch, available_gib):
    """Llama 3 8B at its context of 8192 on 8 sharded ranks with the activations counted: more shards do not shrink
    a rank's activations, and a global batch of 8 cannot be split over more than 8 ranks; every setting proposed
    passes the same check, with the figure it gives."""
    from polytrain.data import load_dataset

    dataset = load_dataset("shakespeare", context=8192)
    monkeypatch.setattr(fits, "available_per_rank", lambda device, devices: available_gib * GIB)
    settings = dict(model="llama", strategy="sharded", devices=8, batch_size=8)
    with pytest.raises(UserError) as caught:
        fits.check_fits(
            TrainConfig(**settings),
            llama_8b,
            "sharded",
            name="llama",
            device=torch.device("cpu"),
            slots=2,
            dataset=dataset,
        )
    line = str(caught.value)
    assert "of activations with --activation-checkpointing none" in line
    # more ranks than samples only where they split the sequences (context parallelism)
    assert "--devices 16" not in line.replace("--devices 16 --context-parallel", ""), line
    if available_gib == 2.8:
        assert "nothing fits: even " in line and "--activation-checkpointing full needs" in line, line
        assert "; use --" not in line
        return
    found = proposals(line)
    assert found and all(gib <= available_gib for _, gib in found), line
    # splitting the sequences over more ranks than samples shrinks a rank's activations: proposed, and checked
    assert any(proposed.get("context_parallel", 1) > 1 for proposed, _ in found), line
    for proposed, _ in found:
        config = TrainConfig(**dict(settings, **proposed))
        fits.check_fits(
            config,
            llama_8b,
            config.strategy,
            name="llama",
            device=torch.device("cpu"),
            slots=2,
            dataset=dataset,
        )


def test_a_process_gives_freed_memory_back_where_a_heap_keeping_it_would_not_fit(
    monkeypatch, tmp_path, capsys
):
    """The check's figures are the count (memory_per_rank with and without activations); where the tensors fit
    but a heap keeping freed blocks (heap_keeps x the activations more) would not, the command line says so in
    one line and its process trains with freed blocks given back (runtime/hostenv.py keep_freed_memory)."""
    from polytrain.cli import main
    from polytrain.data import load_dataset
    from polytrain.parallel.presets import plain_layout
    from polytrain.planning.memory import memory_per_rank
    from polytrain.runtime import worker

    shape = dict(layers=2, width=64, heads=4, kv_heads=2, context=128)
    settings = dict(model="llama", dataset="shakespeare", batch_size=8, max_steps=1, **shape)
    data = load_dataset("shakespeare", context=128)
    model = build_model_on_meta("llama", data.input_shape, data.num_classes, shape)
    config = TrainConfig(**settings)
    monkeypatch.setattr(fits, "available_per_rank", lambda device, devices: 64 * GIB)
    found = fits.check_fits(
        config, model, "single", name="llama", device=torch.device("cpu"), slots=2, dataset=data
    )
    work = fits.model_workload(
        model, batch_size=8, **fits.measured_activations(model, data, torch.device("cpu"))
    )
    assert found.needed == memory_per_rank(work, plain_layout("single", 1), optimizer_slots=2)
    assert 1e6 < found.activations < found.needed and not found.gives_back_memory()
    assert found.kept_heap == found.needed + 0.8 * found.activations  # (without activation checkpointing)
    between = (found.needed + found.kept_heap) / 2
    assert fits.Fit(found.needed, found.activations, between).gives_back_memory()
    assert not fits.Fit(found.needed, found.activations, between + found.activations).gives_back_memory()
    # full checkpointing recomputes each block's activations while the gradients live: its heap keeps more
    room = found.needed + found.activations
    assert not fits.Fit(found.needed, found.activations, room).gives_back_memory()
    assert fits.Fit(found.needed, found.activations, room, "full").gives_back_memory()
    assert fits.heap_keeps("selective:2") == fits.heap_keeps("selective")

    calls = []
    monkeypatch.setattr(worker, "keep_freed_memory", lambda **kwargs: calls.append(kwargs))
    flags = [
        "--model",
        "llama",
        "--dataset",
        "shakespeare",
        "--batch-size",
        "8",
        "--max-steps",
        "1",
        "--layers",
        "2",
    ]
    flags += ["--width", "64", "--heads", "4", "--kv-heads", "2", "--context", "128", "--out"]
    lines = {}
    for available, gives_back in ((between, True), (64 * GIB, False)):
        monkeypatch.setattr(fits, "available_per_rank", lambda device, devices, limit=available: limit)
        assert main(["train", *flags, str(tmp_path / str(gives_back))]) == 0
        lines[gives_back] = [
            line for line in capsys.readouterr().out.splitlines() if line.startswith("memory: ")
        ]
        assert calls.pop()["give_back"] is gives_back
    assert lines[False] == [] and len(lines[True]) == 1
    assert "freed blocks are given back to the system at once" in lines[True][0], lines[True]
    # fit() on one device trains in the caller's own process: its allocator is never set, whatever the check found
    monkeypatch.setattr(fits.Fit, "gives_back_memory", lambda self: True)
    polytrain_api.fit("llama", "shakespeare", batch_size=8, max_steps=1, out=str(tmp_path / "fit"), **shape)
    assert calls == [] and "memory: " not in capsys.readouterr().out


def test_under_a_launcher_the_host_is_shared_by_its_own_ranks_only(llama_8b, monkeypatch):
    """16 ranks on 2 hosts (torchrun's local world of 8): each rank has 1/8 of its host's memory, not 1/16."""
    shares = []
    monkeypatch.setattr(fits, "available_per_rank", lambda device, devices: shares.append(devices) or 8 * GIB)
    config = TrainConfig(model="llama", strategy="sharded", devices=16)
    with pytest.raises(UserError, match=r"the host's available memory / 8 processes"):
        fits.check_fits(
            config, llama_8b, "sharded", name="llama", device=torch.device("cpu"), slots=2, on_this_host=8
        )
    assert shares == [8]
