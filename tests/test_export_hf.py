"""`polytrain export RUN --format hf`: a folder that transformers' AutoModelForCausalLM.from_pretrained loads and
that gives the logits of polytrain's model, for a Llama trained a few steps on one device (one
model.safetensors) and on 2 sharded ranks (whose checkpoint is shards; exported in files of at most 20 kB with
an index), for a Qwen2-shaped run (q/k/v biases, tied head), and for a GPT (a GPT2LMHeadModel: Conv1D weights
transposed, q/k/v fused in c_attn), and for mixtures of experts in Mixtral's shape (2 sharded ranks) and
Qwen2-MoE's (each expert's weights a tensor of their own); written one tensor at a time by the safetensors
library. A GPT-2 loaded
with --init-from comes back out as the same tensors. The one-file safetensors and pt exports stay readable as
before. Models it cannot write are refused in one line.
"""

import json
import weakref
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import polytrain
from polytrain.cli import main
from polytrain.runtime import export, shards
from polytrain.runtime.inference import load_run

SIZES = dict(layers=2, heads=4, kv_heads=2, width=32, context=16)
TRAIN = dict(data="shakespeare", batch_size=4, max_steps=3, device="cpu", verbose=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Llama runs of 3 steps: on one device, on 2 sharded ranks (shards), and Qwen2's shape on one device; a GPT
    on one device with GPT-2's GELU, a vocabulary larger than the data's, more positions than its context, and
    dropout."""
    folder = tmp_path_factory.mktemp("runs")
    polytrain.fit("llama", out=str(folder / "one"), **SIZES, **TRAIN)
    polytrain.fit("llama", out=str(folder / "sharded"), strategy="sharded", devices=2, **SIZES, **TRAIN)
    qwen2 = dict(qkv_bias=True, tie_embeddings=True, norm_eps=1e-6, rope_theta=1e6)
    polytrain.fit("llama", out=str(folder / "qwen2"), **SIZES, **TRAIN, **qwen2)
    gpt = dict(layers=2, heads=4, width=32, context=16, positions=32, vocab_size=70, gelu="tanh", dropout=0.1)
    polytrain.fit("gpt", out=str(folder / "gpt"), **gpt, **TRAIN)
    # mixtures of experts: Mixtral's shape on 2 sharded ranks; Qwen2-MoE's (a shared expert, every other block
    # dense, the kept scores as they are, the load-balancing loss) on one device
    mixtral = dict(experts=4, experts_per_token=2)
    polytrain.fit(
        "llama", out=str(folder / "mixtral"), strategy="sharded", devices=2, **SIZES, **TRAIN, **mixtral
    )
    qwen2_moe = dict(
        qwen2, experts=4, shared_experts=2, moe_every=2, experts_renormalise=False, router_aux_loss=0.01
    )
    polytrain.fit("llama", out=str(folder / "qwen2-moe"), **SIZES, **TRAIN, **qwen2_moe)
    # Qwen3's attention (heads of their own width, q/k norms) on 2 tensor ranks; with Qwen3-MoE's mixtures on one
    qwen3 = dict(head_dim=16, qk_norm=True, norm_eps=1e-6)
    polytrain.fit("llama", out=str(folder / "qwen3"), strategy="tensor", devices=2, **SIZES, **TRAIN, **qwen3)
    qwen3_moe = dict(qwen3, experts=4, experts_per_token=2)
    polytrain.fit("llama", out=str(folder / "qwen3-moe"), **SIZES, **TRAIN, **qwen3_moe)
    assert (folder / "sharded" / "checkpoint-1").is_dir()  # the sharded run's weights are shards
    return {name: folder / name for name in NAMES}


NAMES = ("one", "sharded", "qwen2", "gpt", "mixtral", "qwen2-moe", "qwen3", "qwen3-moe")


def logits_apart(folder: Path, run: Path) -> float:
    """The largest difference between the logits of transformers' model loaded from `folder` and of the run's
    model, on the same tokens."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _, _, model = load_run(run)
    ids = torch.randint(0, 65, (3, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return (hf(ids).logits - model.eval()(ids)).abs().max().item()


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_transformers_loads_the_export_and_gives_the_same_logits(runs, tmp_path, name, capsys):
    out = tmp_path / "hf"
    size = ["--max-shard-size", "20KB"] if name == "sharded" else []
    assert main(["export", str(runs[name]), "--format", "hf", "--out", str(out), *size]) == 0
    assert "no tokenizer" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    architecture = {
        "qwen2": "Qwen2ForCausalLM",
        "gpt": "GPT2LMHeadModel",
        "mixtral": "MixtralForCausalLM",
        "qwen2-moe": "Qwen2MoeForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3-moe": "Qwen3MoeForCausalLM",
    }.get(name, "LlamaForCausalLM")
    assert config["architectures"] == [architecture] and config["tie_word_embeddings"] == (
        name in ("qwen2", "gpt", "qwen2-moe")
    )
    if name == "qwen2-moe":
        expected = dict(
            num_experts=4, decoder_sparse_step=2, norm_topk_prob=False, moe_intermediate_size=128,
            shared_expert_intermediate_size=256, router_aux_loss_coef=0.01, output_router_logits=True,
        )  # fmt: skip
        assert {key: config[key] for key in expected} == expected
    if name.startswith("qwen3"):
        assert (config["head_dim"], config["hidden_size"], config["num_attention_heads"]) == (16, 32, 4)
    if name == "qwen3-moe":
        expected = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=128)
        assert {key: config[key] for key in expected} == expected
    if name == "gpt":
        expected = dict(n_positions=32, vocab_size=70, activation_function="gelu_new", resid_pdrop=0.1)
        assert {key: config[key] for key in expected} == expected
    files = sorted(path.name for path in out.glob("*.safetensors"))
    if name == "sharded":  # 20 kB files: the embedding and head (8 kB each) and the blocks' tensors share few
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    else:
        assert files == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
    if name in (
        "qwen2",
        "gpt",
        "qwen2-moe",
    ):  # a tied head is stored once, as the embedding (as save_pretrained)
        assert "lm_head.weight" not in safetensors.torch.load_file(out / "model.safetensors")
    assert logits_apart(out, runs[name]) < 1e-5


def test_the_comparison_sees_a_wrong_name(runs, tmp_path):
    """An export that swapped the MLP's gate and up projections of one block (a mapping mistake) loads, and
    gives other logits."""
    out = tmp_path / "hf"
    export.export_hf(runs["one"], out)
    tensors = safetensors.torch.load_file(out / "model.safetensors")
    gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    tensors[gate], tensors[up] = tensors[up], tensors[gate]
    safetensors.torch.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert logits_apart(out, runs["one"]) > 1e-3


@pytest.mark.multiprocess
def test_the_export_holds_one_tensor_at_a_time_and_writes_with_the_library(runs, tmp_path, monkeypatch):
    """A sharded run's tensors are read one at a time (the most held at once is the largest), and every file is
    written by safetensors' save_file."""
    read, alive, peak, written = shards.read_tensor, [], [0], []

    def counted(*args):
        tensor = read(*args)
        alive.append(weakref.ref(tensor))
        held = sum(r().numel() * r().element_size() for r in alive if r() is not None)
        peak[0] = max(peak[0], held)
        return tensor

    save_file = safetensors.torch.save_file
    monkeypatch.setattr(shards, "read_tensor", counted)
    monkeypatch.setattr(
        safetensors.torch, "save_file", lambda *a, **k: written.append(a[1]) or save_file(*a, **k)
    )
    _, count, _ = export.export_hf(runs["sharded"], tmp_path / "hf", max_shard_size="20KB")
    _, _, model = load_run(runs["sharded"])
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    assert len(alive) == count == len(model.state_dict()) and peak[0] == largest
    assert sorted(Path(path).name for path in written) == sorted(
        p.name for p in (tmp_path / "hf").glob("*.safetensors")
    )


@pytest.mark.multiprocess
def test_the_one_file_exports_read_as_before(runs, tmp_path):
    """--format safetensors (safetensors' own reader) and pt (torch.load) give the run's weights by its names."""
    _, _, model = load_run(runs["sharded"])
    expected = model.state_dict()
    assert main(["export", str(runs["sharded"]), "--out", str(tmp_path / "model.safetensors")]) == 0
    assert main(["export", str(runs["sharded"]), "--format", "pt", "--out", str(tmp_path / "model.pt")]) == 0
    for got in (
        safetensors.torch.load_file(tmp_path / "model.safetensors"),
        torch.load(tmp_path / "model.pt", weights_only=True),
    ):
        assert sorted(got) == sorted(expected)  # (safetensors keeps its own order)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)
    assert not list(tmp_path.glob(".*"))  # no scratch file left behind


def test_a_gpt2_comes_back_out_as_it_went_in(tmp_path):
    """A GPT-2 saved by transformers, loaded with --init-from (one step at a learning rate too small to move a
    float32 weight) and exported: the same tensors by the same names, bit for bit, the same logits in
    transformers, and the source config's other keys kept: its token ids, and its dropouts (GPT-2's 0.1, which
    a later fine-tune in transformers inherits; the run's 0.0 was written over them)."""
    torch.manual_seed(3)
    source = GPT2Config(
        vocab_size=65, n_layer=2, n_head=4, n_embd=32, n_positions=64, bos_token_id=7, eos_token_id=7
    )
    model = GPT2LMHeadModel(source)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path / "gpt2")
    settings = dict(TRAIN, max_steps=1, lr=1e-30, context=16)
    polytrain.fit(None, init_from=str(tmp_path / "gpt2"), out=str(tmp_path / "run"), **settings)
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    before = safetensors.torch.load_file(tmp_path / "gpt2" / "model.safetensors")
    after = safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(after) == sorted(before)
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["bos_token_id"] == 7 and config["n_positions"] == 64 and config["model_type"] == "gpt2"
    assert config["embd_pdrop"] == config["resid_pdrop"] == config["attn_pdrop"] == 0.1
    ids = torch.randint(0, 65, (3, 16), generator=torch.Generator().manual_seed(2))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, model.eval()(ids).logits, rtol=0, atol=0)


def test_models_it_cannot_write_and_bad_sizes_are_one_line(runs, tmp_path, capsys):
    polytrain.fit("mlp", "synthetic", out=str(tmp_path / "mlp"), max_steps=1, device="cpu", verbose=False)
    capsys.readouterr()
    cases = [
        (
            tmp_path / "mlp",
            [],
            ["--model mlp run", "--model llama runs", "--model gpt", "--format safetensors or pt"],
        ),
        (runs["one"], ["--max-shard-size", "lots"], ["--max-shard-size lots", "5GB"]),
    ]
    for run, extra, words in cases:
        assert main(["export", str(run), "--format", "hf", *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("polytrain: error:") and "Traceback" not in err, err
        assert all(word in err for word in words), err
        assert not (run / "hf").exists()


def test_sizes_as_hugging_face_writes_them():
    assert [export.parse_size(s) for s in ("5GB", "20KB", "2GiB", "1.5MB", "1000")] == [
        5 * 10**9,
        20 * 10**3,
        2 * 2**30,
        1_500_000,
        1000,
    ]
    entries = [("a", (10,), torch.float32), ("b", (10,), torch.float32), ("c", (30,), torch.float32)]
    assert [[e[0] for e in part] for part in export._shards(entries, 80)] == [["a", "b"], ["c"]]


def test_the_export_holds_the_runs_tokenizer_as_autotokenizer_loads_it(tmp_path):
    """A run on token shards that a checkpoint's tokenizer wrote exports that tokenizer with its special tokens
    and chat template: AutoTokenizer loads the export and encodes, names its end token and formats a chat as
    the checkpoint's does (AutoTokenizer.from_pretrained(export) failed: no tokenizer was written). A tokenizer
    trained by polytrain tokenize exports with a config of its own, its end-of-text token as bos and eos."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from polytrain.data.corpus import tokenize_corpus
    from polytrain.data.tokenizer import train_byte_bpe

    text = (Path(polytrain.__file__).with_name("data") / "shakespeare" / "input.txt").read_text()[:30_000]
    (tmp_path / "corpus.txt").write_text(text)
    checkpoint = tmp_path / "checkpoint"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(checkpoint)
    PreTrainedTokenizerFast(
        tokenizer_object=train_byte_bpe([text], vocab_size=300),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}",
    ).save_pretrained(checkpoint)
    tokenize_corpus(
        [str(tmp_path / "corpus.txt")], str(tmp_path / "tokens"), tokenizer=str(checkpoint), show=False
    )
    quick = dict(batch_size=4, max_steps=3, device="cpu", verbose=False, context=16)
    trained = dict(data_dir=str(tmp_path / "tokens"), **quick)
    polytrain.fit(None, "tokens", init_from=str(checkpoint), out=str(tmp_path / "run"), **trained)
    out, _, _ = export.export_run(tmp_path / "run", format="hf")
    theirs, ours = AutoTokenizer.from_pretrained(checkpoint), AutoTokenizer.from_pretrained(out)
    sample = "ROMEO: What light through yonder window breaks?"
    assert ours(sample)["input_ids"] == theirs(sample)["input_ids"]
    assert (ours.eos_token, ours.bos_token) == (theirs.eos_token, theirs.bos_token) == ("<|endoftext|>",) * 2
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)

    tokenize_corpus([str(tmp_path / "corpus.txt")], str(tmp_path / "own"), vocab_size=300, show=False)
    own = dict(trained, data_dir=str(tmp_path / "own"))
    polytrain.fit("gpt", "tokens", out=str(tmp_path / "gpt"), layers=1, heads=2, width=16, **own)
    out, _, _ = export.export_run(tmp_path / "gpt", format="hf")
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded.eos_token == loaded.bos_token == "<|endoftext|>"
    assert loaded(sample)["input_ids"] == loaded.backend_tokenizer.encode(sample).ids
