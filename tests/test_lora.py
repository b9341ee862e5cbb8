"""LoRA adapters (`--lora R`, models/lora.py): peft's layers on the attention and feed-forward projections, the
rest frozen. A fine-tune of a Hugging Face Llama and GPT-2 (--init-from) exports adapters that peft's
`PeftModel.from_pretrained` loads onto the same checkpoint with the run's logits, and a merged checkpoint that
transformers loads alone; the adapters start as peft starts them (the model is the base model at step 0, also
when built on the meta device); verify proves 1 device = 2 devices in float64 on every layout --lora takes; a
resumed run is the run; bad input is one line.
"""

import json
import math
import shutil

import pytest
import safetensors.torch
import torch
from conftest import assert_refused_in_one_line, polytrain_here
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import polytrain
from polytrain.cli import main
from polytrain.errors import UserError
from polytrain.models import build_model, build_model_on_meta
from polytrain.models.lora import add_adapters
from polytrain.parallel.meta import materialised_copy
from polytrain.runtime.inference import load_run

peft = pytest.importorskip("peft")

TRAIN = dict(data="shakespeare", context=16, batch_size=4, device="cpu", verbose=False, lr=0.01)
SIZES = dict(layers=2, heads=4, kv_heads=2, width=32, context=16)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict:
    """Hugging Face checkpoints of a small Llama and GPT-2 (random weights), as save_pretrained writes them."""
    folder = tmp_path_factory.mktemp("bases")
    torch.manual_seed(0)
    llama = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(llama).save_pretrained(folder / "llama")
    GPT2LMHeadModel(
        GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    ).save_pretrained(folder / "gpt")
    return {name: folder / name for name in ("llama", "gpt")}


@pytest.fixture(scope="module")
def runs(bases, tmp_path_factory) -> dict:
    """LoRA fine-tunes of 4 steps from each base on one device, and of the Llama on 2 sharded ranks (whose
    weights are shards)."""
    folder = tmp_path_factory.mktemp("runs")
    polytrain.fit(
        "llama", init_from=str(bases["llama"]), lora=4, out=str(folder / "llama"), max_steps=4, **TRAIN
    )
    polytrain.fit("gpt", init_from=str(bases["gpt"]), lora=4, out=str(folder / "gpt"), max_steps=4, **TRAIN)
    polytrain.fit(
        "llama",
        init_from=str(bases["llama"]),
        lora=4,
        lora_alpha=16,
        out=str(folder / "sharded"),
        strategy="sharded",
        devices=2,
        max_steps=4,
        **TRAIN,
    )
    return {name: folder / name for name in ("llama", "gpt", "sharded")}


def _logits(model, ids):
    with torch.no_grad():
        output = model.eval()(ids)
    return getattr(output, "logits", output)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama", "gpt", "sharded"])
def test_peft_loads_the_adapters_onto_the_base_and_the_merged_checkpoint_alone(runs, bases, tmp_path, name):
    base = bases["gpt" if name == "gpt" else "llama"]
    assert main(["export", str(runs[name]), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    assert (
        main(["export", str(runs[name]), "--format", "hf", "--merge", "--out", str(tmp_path / "merged")]) == 0
    )
    saved = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["r"] == 4 and saved["base_model_name_or_path"] == str(base)
    stored = safetensors.torch.load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert len(stored) == 2 * 4 * 2 if name == "gpt" else 2 * 7 * 2  # A and B of each adapted layer
    ids = torch.randint(0, 65, (3, 16), generator=torch.Generator().manual_seed(2))
    ours = _logits(load_run(runs[name])[2], ids)
    plain = _logits(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), ids)
    adapted = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / "peft"
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert (ours - plain).abs().max() > 1e-4  # the adapters trained (10x the tolerance below): it can fail
    assert (ours - _logits(adapted, ids)).abs().max() < 1e-5
    assert (ours - _logits(merged, ids)).abs().max() < 1e-5


def test_the_adapters_start_as_peft_starts_them_and_only_they_train():
    """Built on the meta device and given values (as every rank does), a LoRA model is its base model at step 0:
    each B is zero, each A drawn from peft's kaiming-uniform bound; only the adapters train."""
    options = dict(model="llama", **SIZES, lora=4)
    torch.manual_seed(0)
    adapted = materialised_copy(build_model_on_meta("llama", (16,), 65, options), device="cpu", seed=3)
    plain = materialised_copy(
        build_model_on_meta("llama", (16,), 65, dict(options, lora=None)), device="cpu", seed=3
    )
    ids = torch.randint(0, 65, (2, 16))
    assert torch.equal(_logits(adapted, ids), _logits(plain, ids))
    trained = {name for name, p in adapted.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    assert len(trained) == 2 * 7 * 2  # wq wk wv wo w1 w2 w3 of 2 blocks, A and B
    for name, p in adapted.named_parameters():
        if ".lora_B." in name:
            assert not p.any(), name
        if ".lora_A." in name:
            bound = 1 / math.sqrt(p.shape[1])  # kaiming_uniform_(a=sqrt(5)) of an nn.Linear
            assert p.abs().max() <= bound and p.std() > bound / 4, name


def test_a_glob_chooses_the_layers_and_a_model_of_ones_own_needs_them():
    model = build_model(
        "llama", (16,), 65, dict(model="llama", **SIZES, lora=2, lora_targets="1.attention.wq,*.wv")
    )
    adapted = sorted({n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad})
    assert adapted == ["1.attention.wq", "1.attention.wv", "2.attention.wv"]
    own = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    pairs = torch.utils.data.TensorDataset(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))
    with pytest.raises(UserError, match=r"declares no layers to adapt; give lora_targets= .*\(0, 2\)"):
        polytrain.fit(own, train=pairs, val=pairs, lora=2, verbose=False, max_steps=1)
    polytrain.fit(own, train=pairs, val=pairs, lora=2, lora_targets="2", verbose=False, max_steps=1)
    assert [n for n, p in own.named_parameters() if p.requires_grad] == [
        "2.lora_A.default.weight",
        "2.lora_B.default.weight",
    ]  # the module itself, adapted and trained
    # a name is the whole name: `0` is not `1.0`, though peft's list of names would match that too
    nested = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)))
    add_adapters(nested, 2, targets="0")
    assert {n.split(".lora_")[0] for n, p in nested.named_parameters() if p.requires_grad} == {"0"}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--lora-alpha", "4"], ["--lora-alpha describes LoRA adapters; add --lora R"]),
        (["--lora-targets", "*.wq"], ["--lora-targets describes LoRA adapters"]),
        (["--lora", "0"], ["--lora must be a positive whole number"]),
        (["--lora", "4", "--lora-dropout", "1"], ["--lora-dropout"]),
    ],
    ids=["alpha-without-lora", "targets-without-lora", "rank-zero", "dropout-one"],
)
def test_settings_that_make_no_adapters_are_refused_in_one_line(capsys, tmp_path, argv, words):
    base = ["--model", "llama", "--dataset", "shakespeare", "--max-steps", "1"]
    assert_refused_in_one_line(capsys, tmp_path / "out", base + argv, words)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--lora", "64"], ["--lora 64 is above the width of 1.attention.wq (32 in, 32 out)", "at most 32"]),
        (
            ["--lora", "4", "--lora-targets", "*.nothing"],
            ["'*.nothing' matches no linear layer", "1.attention.wq"],
        ),
        (
            ["--lora", "4", "--lora-dropout", "0.1", "--strategy", "sharded", "--devices", "2"]
            + ["--context-parallel", "2"],
            ["does not split dropout masks yet", "lora_dropout", "give --lora-dropout 0"],
        ),
    ],
    ids=["rank-above-width", "glob-matches-nothing", "dropout-with-split-sequences"],
)
def test_adapters_the_model_cannot_take_are_one_line_before_any_run_folder(capsys, tmp_path, argv, words):
    sizes = ["--layers", "2", "--width", "32", "--heads", "4", "--context", "16"]
    out = tmp_path / "out"
    code = main(["train", "--model", "llama", "--dataset", "shakespeare", *sizes, *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("polytrain: error:") and err.count("\n") == 1, err
    assert all(word in err for word in words), err
    assert not out.exists()


@pytest.mark.multiprocess
def test_generate_samples_from_a_lora_run(runs, capsys):
    assert main(["generate", str(runs["llama"]), "--prompt", "To be", "--tokens", "12", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("To be") and len(text.rstrip("\n")) >= len("To be") + 12, text


def test_exports_that_do_not_fit_the_run_are_one_line(runs, tmp_path, capsys):
    plain = tmp_path / "plain"
    polytrain.fit("llama", out=str(plain), max_steps=1, **{**TRAIN, **SIZES})
    for argv, words in [
        ([str(plain), "--format", "peft"], "trained every parameter; export it with --format hf"),
        ([str(plain), "--format", "hf", "--merge"], "has none; drop --merge"),
        ([str(runs["llama"]), "--format", "hf"], "give --merge"),
        ([str(runs["llama"]), "--merge"], "add --format hf"),
    ]:
        assert main(["export", *argv, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "x").exists()


@pytest.mark.multiprocess
def test_a_fine_tune_s_files_hold_its_adapters_and_it_resumes_across_layouts(bases, tmp_path):
    """From a Hugging Face checkpoint, the run's files hold the adapters and their optimizer state only (the base
    stays in --init-from, recorded by its sha256 in base.json); read back, the weights are the base's and the
    adapters'. Stopped after 2 steps and resumed, on one device it is the straight run bit for bit; moved from one
    device to 2 sharded ranks, or back, it ends where the straight run does."""
    start = dict(init_from=str(bases["llama"]), lora=4, **TRAIN)
    sharded = dict(strategy="sharded", devices=2)
    polytrain.fit("llama", out=str(tmp_path / "straight"), max_steps=4, **start)
    for run, first, then in [("stopped", {}, {}), ("grown", {}, sharded), ("shrunk", sharded, {})]:
        polytrain.fit("llama", out=str(tmp_path / run), max_steps=2, **start, **first)
        polytrain.fit("llama", resume=str(tmp_path / run), max_steps=4, **start, **then)
    straight = load_run(tmp_path / "straight")[2].state_dict()
    stopped = load_run(tmp_path / "stopped")[2].state_dict()
    assert straight.keys() == stopped.keys() and all(torch.equal(straight[k], stopped[k]) for k in straight)
    for run in ("grown", "shrunk"):
        moved = load_run(tmp_path / run)[2].state_dict()
        for key in straight:
            torch.testing.assert_close(moved[key], straight[key], rtol=1e-4, atol=1e-6, msg=f"{run}: {key}")
    base = safetensors.torch.load_file(bases["llama"] / "model.safetensors")
    assert torch.equal(
        straight["1.attention.wq.base_layer.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )
    assert (straight["1.attention.wq.lora_B.default.weight"] != 0).any()
    # the files: adapters only (a sharded run's pointer names its shards' tensors)
    whole = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    names = torch.load(tmp_path / "grown" / "model.pt", weights_only=True)["names"]
    checkpoint = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)
    for stored in (list(whole), names, list(checkpoint["model"])):
        assert stored and all(".lora_" in name for name in stored), stored
    record = json.loads((tmp_path / "straight" / "base.json").read_text())
    assert record["init_from"] == str(bases["llama"].resolve()) and len(record["sha256"]) == 64
    held = sum(t.numel() for t in checkpoint["model"].values())
    assert held < sum(t.numel() for t in straight.values()) / 4


def test_a_fine_tune_needs_the_base_it_started_from(bases, tmp_path, capsys):
    """Resuming, sampling, evaluating or exporting a fine-tune whose base folder now holds other weights (or none)
    is one line each."""
    folder = tmp_path / "base"
    shutil.copytree(bases["llama"], folder)
    run = tmp_path / "run"
    polytrain.fit("llama", init_from=str(folder), lora=4, out=str(run), max_steps=1, **TRAIN)
    torch.manual_seed(5)
    other = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))  # other weights, same shapes
    other.save_pretrained(folder)
    capsys.readouterr()
    for argv in (
        ["train", "--resume", str(run), "--max-steps", "2"],
        ["generate", str(run), "--prompt", "To be", "--tokens", "4"],
        ["evaluate", str(run)],
        ["export", str(run), "--format", "peft", "--out", str(tmp_path / "peft")],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "holds other weights (sha256" in err, err
    shutil.rmtree(folder)
    assert main(["evaluate", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no weights now; put the base back there" in err, err


def test_a_fine_tune_reads_its_recorded_base_from_anywhere_and_a_failed_start_leaves_no_record(
    bases, tmp_path, monkeypatch
):
    """The base is the folder recorded as the run started (resolved): a run started with a relative --init-from
    resumes from another working folder; a start that fails before its first checkpoint takes its base.json with
    it, so that the folder can hold another run."""
    shutil.copytree(bases["llama"], tmp_path / "b1")
    monkeypatch.chdir(tmp_path)
    start = dict(init_from="b1", lora=4, **TRAIN)
    polytrain.fit("llama", out=str(tmp_path / "run"), max_steps=1, **start)
    monkeypatch.chdir(tmp_path / "run")  # where no b1 is
    assert main(["train", "--resume", str(tmp_path / "run"), "--max-steps", "2"]) == 0
    assert json.loads((tmp_path / "run" / "base.json").read_text())["init_from"] == str(tmp_path / "b1")

    class Stop:
        def on_fit_start(self, trainer):
            raise RuntimeError("stopped on purpose")

    monkeypatch.chdir(tmp_path)
    (tmp_path / "again").mkdir()
    with pytest.raises(RuntimeError, match="on purpose"):
        polytrain.fit("llama", out=str(tmp_path / "again"), max_steps=1, callbacks=[Stop()], **start)
    assert not any((tmp_path / "again").iterdir())


@pytest.mark.multiprocess
def test_a_fine_tune_on_tensor_ranks_resumes_on_one_device(tmp_path):
    """Two steps of the GPT on 2 tensor ranks (its fused q/k/v split by interleaved rows, the adapters' B with
    them) and two more on one device are four steps on one device: the checkpoint holds every tensor in its
    one-device order."""
    start = dict(TRAIN, lora=4, layers=2, heads=4, width=32)
    polytrain.fit("gpt", out=str(tmp_path / "straight"), max_steps=4, **start)
    polytrain.fit("gpt", out=str(tmp_path / "moved"), max_steps=2, strategy="tensor", devices=2, **start)
    polytrain.fit("gpt", resume=str(tmp_path / "moved"), max_steps=4, **start)
    straight = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    moved = torch.load(tmp_path / "moved" / "model.pt", weights_only=True)
    assert straight.keys() == moved.keys()
    trained = [key for key in straight if ".lora_B." in key]
    assert trained and all(straight[key].abs().max() > 0 for key in trained)  # (B starts at zero)
    for key in straight:
        torch.testing.assert_close(moved[key], straight[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "model, layout",
    [
        ("llama", ["--strategy", "data"]),
        ("llama", ["--strategy", "sharded", "--activation-checkpointing", "full"]),
        ("llama", ["--strategy", "pipeline"]),
        ("llama", ["--strategy", "parameter-server"]),
        ("gpt", ["--strategy", "sharded"]),
        ("llama", ["--strategy", "sharded", "--context-parallel", "2"]),
        (
            "llama",
            ["--strategy", "sharded", "--experts", "4", "--experts-per-token", "2", "--expert-parallel", "2"],
        ),
        ("llama", ["--strategy", "tensor", "--devices", "4", "--tensor-parallel", "2"]),
        ("gpt", ["--strategy", "tensor"]),
        ("llama", ["--strategy", "pipeline", "--devices", "4", "--tensor-parallel", "2"]),
    ],
    ids=[
        "llama-data",
        "llama-sharded-checkpointed",
        "llama-pipeline",
        "llama-parameter-server",
        "gpt-sharded",
        "llama-cp2",
        "llama-ep2",
        "llama-sharded2-x-tensor2",
        "gpt-tensor2-sequence-parallel",
        "llama-pipeline2-x-tensor2",
    ],
)
def test_verify_passes_in_float64_with_adapters(capfd, model, layout):
    """The tensor layouts split each adapter with its layer (B by outputs under a column split, A by inputs
    under a row split; the GPT's fused q/k/v interleaves B's rows as its own, and its norms, frozen, stay frozen
    under sequence parallelism). verify refuses dropout on the layouts that cut a sequence or a layer (its masks
    are not one device's there: the tests below and in test_context_parallel.py), so those run without."""
    sizes = ["--layers", "2", "--width", "32", "--heads", "4", "--context", "16"]
    sizes += ["--kv-heads", "2"] if model == "llama" else []
    cut = "--context-parallel" in layout or "tensor" in layout or "--tensor-parallel" in layout
    dropout = [] if cut else ["--lora-dropout", "0.1"]
    devices = [] if "--devices" in layout else ["--devices", "2"]
    done = polytrain_here(
        capfd, "verify", "--model", model, "--dataset", "shakespeare", *sizes, *layout, *devices,
        "--steps", "3", "--lora", "4", *dropout,
    )  # fmt: skip
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 3 and all(float(row[3]) < 1e-12 for row in rows), done.stdout
    assert float(rows[0][1]) != float(rows[-1][1])  # the adapters trained


@pytest.mark.multiprocess
def test_the_start_up_lines_count_gradients_and_optimizer_state_of_the_adapters_only(capfd, tmp_path):
    sizes = ["--layers", "2", "--width", "32", "--heads", "4", "--kv-heads", "2", "--context", "16"]
    done = polytrain_here(
        capfd, "train", "--model", "llama", "--dataset", "shakespeare", *sizes, "--strategy", "sharded",
        "--devices", "2", "--lora", "4", "--max-steps", "1", "--out", tmp_path / "run",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trainable 5,632 of 40,672 parameters (13.85%)" in done.stdout, done.stdout
    line = next(line for line in done.stdout.splitlines() if line.startswith("  rank 0 (cpu): "))
    held, gradients, state = (
        float(part.split()[0]) for part in line.split(": ")[1].split(";")[0].split(" + ")
    )
    # 40,672 float32 parameters over 2 ranks; 5,632 of them trained, with Adam's 2 slots
    assert (held, gradients, state) == (0.08, 0.01, 0.02), line


def test_the_planner_counts_gradients_and_optimizer_state_of_the_adapters_only():
    """`polytrain plan --lora R` builds the adapted model at full size: its gradients and optimizer state are the
    adapters' (their bytes: the trainable parameters times 4, and twice that for AdamW's two slots), its
    parameters the base's and theirs; on a tensor layout too, where the adapters split with their layers."""
    common = dict(model="llama", size="tiny", devices=2, batch_size=4, context=64, precision="fp32")
    full = polytrain.plan(layout="dp_shard=2", **common)[0]["memory_split_gib"]
    lora = polytrain.plan(layout="dp_shard=2", lora=8, **common)[0]["memory_split_gib"]
    model = build_model_on_meta("llama", (64,), 65, dict(model="llama", size="tiny", context=64, lora=8))
    trained = (
        sum(p.numel() for p in model.parameters() if p.requires_grad) * 4 / 2 / 2**30
    )  # fp32, over 2 shards
    assert lora["gradients"] == pytest.approx(trained, rel=0.05) and lora["optimizer"] == pytest.approx(
        2 * trained, rel=0.05
    )
    assert lora["gradients"] < full["gradients"] / 5 and lora["parameters"] > full["parameters"]
    # FSDP2 reduce-scatters the adapters' gradients only: where communication is exposed (an 8B llama over 64
    # ranks on a small batch), its two all-gathers of bf16 weights (2 x 2 bytes an element) are about half of
    # theirs and a full fine-tune's reduce-scatter of fp32 gradients (4 more)
    big = dict(model="llama", size="8b", devices=64, batch_size=64, context=256, gpu="h100")
    exposed = [
        polytrain.plan(layout="dp_shard=64", lora=rank, **big)[0]["exposed_communication_seconds"]["fsdp"]
        for rank in (None, 16)
    ]
    assert 0.45 < exposed[1] / exposed[0] < 0.55, exposed
    tensor = polytrain.plan(layout="tp=2", **common)[0]["memory_split_gib"]
    split = polytrain.plan(layout="tp=2", lora=8, **common)[0]["memory_split_gib"]
    assert split["gradients"] < tensor["gradients"] / 5 and split["parameters"] > tensor["parameters"]
