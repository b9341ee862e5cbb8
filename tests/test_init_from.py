"""--init-from: a Hugging Face checkpoint built and saved by `transformers` (a Llama with grouped-query attention,
sharded with an index; a Qwen2 with q/k/v biases and a tied head, in one file) loads on one device, on 2 sharded
ranks, on tensor 2 and on a 2-stage pipeline, and gives the logits of transformers' own model on the same tokens
and, at the first step, its loss on the same batch; bad folders and flags are one line before any worker.

The two-process runs share one launch of two processes (tests/matrix_runs.py). Each trains one step at a
learning rate too small to move a float32 weight (1e-30), so that the run's final weights are the loaded ones.
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from processes import finish, start
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import polytrain
from polytrain.config.pretrained import apply_checkpoint
from polytrain.data.loader import make_loaders
from polytrain.errors import ConfigError
from polytrain.runtime.inference import load_run

VOCAB = 65  # shakespeare's characters
SIZES = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,  # sharp attention: a wrong position or head shows in the logits
)


def save_llama(folder: Path, *, vocab=VOCAB, shard=True) -> Path:
    """A Llama (grouped-query attention, untied head, Llama 2's rope_theta and rms_norm_eps) saved in shards of
    at most 20 kB with model.safetensors.index.json."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, **SIZES
    )
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="20KB" if shard else "1GB")
    return folder


def save_qwen2(folder: Path) -> Path:
    """A Qwen2 (q/k/v biases, the head tied to the embedding, rms_norm_eps 1e-6) in one model.safetensors;
    its biases are drawn (transformers starts them at zero), so that they count."""
    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=VOCAB, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, **SIZES
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("checkpoints")
    llama, qwen2 = save_llama(folder / "llama"), save_qwen2(folder / "qwen2")
    assert (llama / "model.safetensors.index.json").is_file() and len(list(llama.glob("*.safetensors"))) > 2
    assert (qwen2 / "model.safetensors").is_file()
    return {"llama": llama, "qwen2": qwen2}


LAYOUTS = {
    "one device": ["--strategy", "single", "--devices", "1"],
    "sharded 2": ["--strategy", "sharded", "--devices", "2"],
    "tensor 2": ["--strategy", "tensor", "--devices", "2"],
    "pipeline 2": ["--strategy", "pipeline", "--devices", "2", "--pipeline-stages", "2"],
}
CASES = [(family, layout) for family in ("llama", "qwen2") for layout in LAYOUTS]


def argv(folder: Path, layout: str) -> list:
    return [
        *("--init-from", str(folder), "--dataset", "shakespeare", "--context", "16", "--batch-size", "4"),
        *("--max-steps", "1", "--lr", "1e-30", "--device", "cpu", *LAYOUTS[layout]),
    ]


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory) -> dict:
    """(family, layout) -> its run folder: the one-device runs in one process, the others on two processes
    that stand in for torchrun's workers, all in one launch."""
    folder = tmp_path_factory.mktemp("runs")
    singles = [case for case in CASES if LAYOUTS[case[1]][-1] == "1"]
    pairs = [case for case in CASES if case not in singles]
    groups = [
        {"processes": [0], "runs": [["llama", *argv(checkpoints[f], layout)] for f, layout in singles]},
        {"processes": [0, 1], "runs": [["llama", *argv(checkpoints[f], layout)] for f, layout in pairs]},
    ]
    (folder / "plan.json").write_text(json.dumps({"folder": str(folder), "groups": groups}))
    helper = Path(__file__).with_name("matrix_runs.py")
    processes = [start([sys.executable, helper, folder / "plan.json", p]) for p in range(2)]
    finished = [finish(process, timeout=400) for process in processes]
    assert all(done.returncode == 0 for done in finished), "\n".join(done.stderr[-3000:] for done in finished)
    return {case: folder / f"run-{number}" for number, case in enumerate(singles + pairs, start=1)}


def first_batch(config, dataset) -> tuple:
    """The first step's global batch (inputs, targets), as the run's loader draws it."""
    train, _ = make_loaders(dataset, batch_size=config.batch_size, device="cpu", seed=config.seed)
    batch = next(train.train_batches(0))
    return batch.x, batch.y


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]}-{case[1].replace(' ', '')}")
def test_logits_and_first_loss_equal_transformers(runs, checkpoints, case):
    family, _ = case
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32).eval()
    config, dataset, model = load_run(runs[case])
    assert config.init_from == str(checkpoints[family]) and config.qkv_bias == (family == "qwen2")
    ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(ids).logits
        assert (model.eval()(ids) - expected).abs().max().item() < 1e-5
        x, y = first_batch(config, dataset)
        loss = F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    first = json.loads((runs[case] / "metrics.jsonl").read_text().splitlines()[0])
    assert first["global_step"] == 1 and first["train_loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert abs(loss - math.log(VOCAB)) > 0.05  # the loaded weights predict, unlike uniform guessing


def test_the_comparison_sees_wrong_weights(checkpoints, tmp_path):
    """The seeded initial weights (no --init-from) are far from the checkpoint's logits, and a Qwen2 read
    without its biases is too."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2"], dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(2))
    settings = dict(context=16, batch_size=4, max_steps=1, lr=1e-30, verbose=False)
    polytrain.fit(
        None, "shakespeare", init_from=str(checkpoints["qwen2"]), out=str(tmp_path / "a"), **settings
    )
    _, _, loaded = load_run(tmp_path / "a")
    with torch.no_grad():
        assert (loaded.eval()(ids) - hf(ids).logits).abs().max().item() < 1e-5
        for name, parameter in loaded.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
        assert (loaded(ids) - hf(ids).logits).abs().max().item() > 0.1
    sizes = dict(init_from=str(checkpoints["qwen2"]))
    apply_checkpoint(sizes, set())  # the same shape, from the seed
    sizes = {key: value for key, value in sizes.items() if key not in ("init_from", "model")}
    polytrain.fit("llama", "shakespeare", out=str(tmp_path / "b"), **settings, **sizes)
    _, _, seeded = load_run(tmp_path / "b")
    with torch.no_grad():
        assert (seeded.eval()(ids) - hf(ids).logits).abs().max().item() > 0.1


def test_settings_come_from_the_config(checkpoints):
    values = dict(init_from=str(checkpoints["llama"]))
    model, given = apply_checkpoint(values, set())
    assert model == "llama" and {"layers", "heads", "kv_heads", "width", "ffn_width"} <= given
    expected = dict(
        layers=2, heads=4, kv_heads=2, width=32, ffn_width=64, vocab_size=VOCAB, rope_theta=10000.0
    )
    assert {key: values[key] for key in expected} == expected
    assert (values["norm_eps"], values["tie_embeddings"], values["qkv_bias"]) == (1e-5, False, False)
    values = dict(init_from=str(checkpoints["qwen2"]), width=32)  # a flag that agrees is accepted
    apply_checkpoint(values, {"width"})
    assert (values["rope_theta"], values["norm_eps"], values["tie_embeddings"], values["qkv_bias"]) == (
        1e6,
        1e-6,
        True,
        True,
    )
    with pytest.raises(ConfigError, match="init_from= loads a checkpoint into polytrain's own model"):
        polytrain.fit(
            torch.nn.Linear(2, 2), "shakespeare", init_from=str(checkpoints["llama"]), verbose=False
        )


def edited(folder: Path, target: Path, **changes) -> Path:
    """A copy of the checkpoint folder with its config.json changed (None removes a key)."""
    target.mkdir()
    for path in folder.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    config = {key: value for key, value in config.items() if value is not None}
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_mistakes_are_one_line_before_any_worker(checkpoints, tmp_path, capsys):
    """Each exits 2 with one `polytrain: error:` line and no run folder (the line of the llama's defaults may
    come first, where the checkpoint is read after the settings)."""
    from polytrain.cli import main

    llama = checkpoints["llama"]
    common = ["--dataset", "shakespeare", "--context", "16", "--batch-size", "4", "--max-steps", "1"]

    def refused(folder, words, *extra):
        out = tmp_path / "out"
        capsys.readouterr()  # (what saving the checkpoints printed)
        code = main(["train", "--init-from", str(folder), *common, *extra, "--out", str(out)])
        captured = capsys.readouterr()
        assert code == 2 and captured.err.startswith("polytrain: error:"), captured.out + captured.err
        assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
        assert all(line.startswith("--model llama defaults:") for line in captured.out.splitlines())
        assert not out.exists()
        for word in words:
            assert word in captured.err, captured.err

    refused(llama, ["--width 64 contradicts", "hidden_size: 32", "drop it"], "--width", "64")
    refused(llama, ["--model gpt", "holds a llama model"], "--model", "gpt")
    refused(llama, ["--size tiny", "drop it"], "--size", "tiny")
    refused(llama, ["--tie-embeddings True contradicts", "tie_word_embeddings: False"], "--tie-embeddings")
    foreign = edited(llama, tmp_path / "foreign", architectures=["MistralForCausalLM"])
    refused(foreign, ["MistralForCausalLM", "it loads LlamaForCausalLM, Qwen2ForCausalLM"])
    scaled = edited(llama, tmp_path / "scaled", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5})
    refused(scaled, ["scales its rotary embedding ('llama3')"])
    wider = edited(llama, tmp_path / "wider", intermediate_size=96)
    refused(wider, ["has shape [64, 32]", "implies [96, 32]"])
    missing = edited(llama, tmp_path / "missing")
    shard = sorted(missing.glob("model-*.safetensors"))[-1]
    shard.unlink()
    refused(missing, [shard.name, "model.safetensors.index.json", "is missing"])
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", ["has no config.json"])
    small = save_llama(tmp_path / "small", vocab=40, shard=False)
    refused(small, ["vocabulary of 40 tokens", "has 65"])


def test_a_sharded_rank_reads_only_its_rows(checkpoints, monkeypatch):
    """Rank 1 of 2 FSDP2 ranks (a fake process group, in this process): DCP's Hugging Face reader is asked, for
    every tensor, for the rows rank 1 holds (33 of the head's 65 rows go to rank 0), and they arrive in its
    shards; nothing else is read."""
    import copy

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from polytrain.config.pretrained import weight_files
    from polytrain.models import build_model_on_meta
    from polytrain.models.pretrained import Pretrained
    from polytrain.strategies.materialise import materialise

    folder = checkpoints["llama"]
    values = dict(init_from=str(folder))
    apply_checkpoint(values, set())
    reads = []
    read = dcp.HuggingFaceStorageReader._process_read_request

    def spy(self, handle, request, planner):
        reads.append((request.storage_index.fqn, tuple(request.storage_offsets), tuple(request.lengths)))
        return read(self, handle, request, planner)

    monkeypatch.setattr(dcp.HuggingFaceStorageReader, "_process_read_request", spy)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        model = build_model_on_meta("llama", (16,), VOCAB, values)
        blueprint, weights = copy.deepcopy(model), Pretrained(folder, model)
        mesh = init_device_mesh("cpu", (2,))
        for block in list(model)[1:-2]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        materialise(model, blueprint, device="cpu", seed=0, weights=weights)
        stored = {}
        for path in weight_files(folder):
            with safe_open(str(path), framework="pt") as handle:
                stored.update({key: handle.get_tensor(key) for key in handle.keys()})
        held = {}
        for name, parameter in model.named_parameters():
            full = stored[weights.names[name]]
            first = -(-len(full) // 2)  # torch.chunk's: rank 0 holds the first ceil(n / 2) rows
            torch.testing.assert_close(parameter.to_local(), full[first:], rtol=0, atol=0)
            held[weights.names[name]] = ((first,) + (0,) * (full.dim() - 1), tuple(full[first:].shape))
    finally:
        dist.destroy_process_group()
    assert sorted(reads) == sorted((key, *where) for key, where in held.items())
    assert ("lm_head.weight", (33, 0), (32, 32)) in reads and len(reads) == len(stored) == 21
