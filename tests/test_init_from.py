"""--init-from: a Hugging Face checkpoint built and saved by `transformers` (a Llama with grouped-query attention,
sharded with an index; a Qwen2 with q/k/v biases and a tied head, in one file; a GPT-2, whose Conv1D weights
are stored transposed and whose q/k/v are one c_attn layer) loads on one device, on 2 sharded ranks, on tensor 2
and on a 2-stage pipeline, and gives the logits of transformers' own model on the same tokens and, at the first
step, its loss on the same batch; bad folders, flags and GPT-2 configs are one line before any worker. A rank
reads only the pieces it holds, transposed where GPT-2 stores the transpose.

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
from processes import finish_all, start
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

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


def save_moe(folder: Path, family: str) -> Path:
    """A Mixtral (4 experts of width 48, 2 per token, renormalised) or a Qwen2-MoE (q/k/v biases drawn, 4 experts
    of 32 and a shared expert of 64 behind its gate, every other block dense, the kept scores as they are), in
    transformers' files: each expert's weights stored apart."""
    import transformers

    torch.manual_seed(3)
    common = dict(SIZES, vocab_size=VOCAB, num_experts_per_tok=2, rope_theta=10000.0, rms_norm_eps=1e-5)
    if family == "mixtral":
        config = transformers.MixtralConfig(**dict(common, intermediate_size=48), num_local_experts=4)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(
            **common, moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=4,
            decoder_sparse_step=2, norm_topk_prob=False,
        )  # fmt: skip
        model = transformers.Qwen2MoeForCausalLM(config)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def save_qwen3(folder: Path, *, moe: bool) -> Path:
    """A Qwen3 (heads of their own width: 4 of 16 over a hidden size of 32, each query and key head normalised,
    the norms' weights drawn so that they count), or a Qwen3-MoE of the same attention with 4 experts of 32, 2 per
    token, renormalised."""
    import transformers

    torch.manual_seed(4)
    common = dict(SIZES, vocab_size=VOCAB, head_dim=16, rope_theta=1000000.0, rms_norm_eps=1e-6)
    if moe:
        config = transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.normal_(1.0, 0.5)
    model.save_pretrained(folder)
    return folder


def save_gpt2(folder: Path) -> Path:
    """A GPT-2 (tanh GELU, learned positions, the head tied to the token embedding) in one model.safetensors,
    its biases and LayerNorm weights drawn (transformers starts them at zero and one), so that they count; a
    table of 64 positions, read in windows of 16."""
    torch.manual_seed(2)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_layer=2,
        n_head=4,
        n_embd=32,
        n_positions=64,
        layer_norm_epsilon=1e-6,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
            elif ".ln_" in name:
                parameter.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("checkpoints")
    llama, qwen2 = save_llama(folder / "llama"), save_qwen2(folder / "qwen2")
    assert (llama / "model.safetensors.index.json").is_file() and len(list(llama.glob("*.safetensors"))) > 2
    assert (qwen2 / "model.safetensors").is_file()
    moe = {family: save_moe(folder / family, family) for family in ("mixtral", "qwen2-moe")}
    qwen3 = {
        family: save_qwen3(folder / family, moe=family == "qwen3-moe") for family in ("qwen3", "qwen3-moe")
    }
    return {"llama": llama, "qwen2": qwen2, "gpt2": save_gpt2(folder / "gpt2"), **moe, **qwen3}


LAYOUTS = {
    "one device": ["--strategy", "single", "--devices", "1"],
    "sharded 2": ["--strategy", "sharded", "--devices", "2"],
    "tensor 2": ["--strategy", "tensor", "--devices", "2"],
    "pipeline 2": ["--strategy", "pipeline", "--devices", "2", "--pipeline-stages", "2"],
}
# the polytrain model each family loads into
MODELS = {
    **{family: "llama" for family in ("llama", "qwen2", "mixtral", "qwen2-moe", "qwen3", "qwen3-moe")},
    "gpt2": "gpt",
}
# every family on every layout, but Qwen3-MoE, whose attention is Qwen3's and whose mixture Mixtral's: one device
# and its experts sharded
CASES = [
    (family, layout)
    for family in MODELS
    for layout in LAYOUTS
    if family != "qwen3-moe" or layout in ("one device", "sharded 2")
]


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
        {"processes": [0], "runs": [[MODELS[f], *argv(checkpoints[f], layout)] for f, layout in singles]},
        {"processes": [0, 1], "runs": [[MODELS[f], *argv(checkpoints[f], layout)] for f, layout in pairs]},
    ]
    (folder / "plan.json").write_text(json.dumps({"folder": str(folder), "groups": groups}))
    helper = Path(__file__).with_name("matrix_runs.py")
    processes = [start([sys.executable, helper, folder / "plan.json", p]) for p in range(2)]
    finished = finish_all(processes, timeout=400)
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
    assert config.init_from == str(checkpoints[family]) and config.model == (
        "gpt" if family == "gpt2" else "llama"
    )
    assert bool(config.qkv_bias) == family.startswith("qwen2") and config.gelu == (
        "tanh" if family == "gpt2" else None
    )
    assert bool(config.qk_norm) == (config.head_dim == 16) == family.startswith("qwen3")
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


def test_a_run_resumed_before_its_first_checkpoint_starts_from_the_pretrained_weights_again(
    checkpoints, tmp_path
):
    """A run stopped before it wrote a checkpoint (here: its checkpoint and weights removed) and continued with
    --resume trains from the start, from --init-from's weights (it trained from the seed's)."""
    from polytrain.cli import main

    hf = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2"], dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(2))
    run = tmp_path / "run"
    flags = ["--init-from", str(checkpoints["qwen2"]), "--dataset", "shakespeare", "--context", "16"]
    flags += ["--batch-size", "4", "--max-steps", "1", "--lr", "1e-30", "--device", "cpu", "--out", str(run)]
    assert main(["train", *flags]) == 0
    for name in ("checkpoint.pt", "model.pt", "best.pt", "metrics.jsonl"):
        (run / name).unlink(missing_ok=True)
    assert main(["train", "--resume", str(run), "--max-steps", "1"]) == 0
    _, _, model = load_run(run)
    with torch.no_grad():
        assert (model.eval()(ids) - hf(ids).logits).abs().max().item() < 1e-5


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
    values = dict(init_from=str(checkpoints["gpt2"]), context=16)  # windows shorter than the positions
    model, given = apply_checkpoint(values, {"context"})
    expected = dict(
        layers=2, heads=4, width=32, vocab_size=VOCAB, positions=64, norm_eps=1e-6, gelu="tanh", context=16
    )
    assert model == "gpt" and {key: values[key] for key in expected} == expected
    with pytest.raises(ConfigError, match="init_from= loads a checkpoint into polytrain's own model"):
        polytrain.fit(
            torch.nn.Linear(2, 2), "shakespeare", init_from=str(checkpoints["llama"]), verbose=False
        )


def test_loaded_weights_take_a_fine_tuning_rate_and_keep_their_vocabulary(checkpoints):
    from polytrain.cli import parse
    from polytrain.config.flags import config_from_args
    from polytrain.config.model_defaults import FINE_TUNE_LR, defaults_words

    for folder in (checkpoints["llama"], checkpoints["gpt2"]):
        _, args = parse(["train", "--init-from", str(folder), "--dataset", "shakespeare"])
        config = config_from_args(args)
        assert config.lr == FINE_TUNE_LR == 5e-5
        line = defaults_words(config.model, args.model_defaults, pretrained=True)
        assert "--lr 5e-05 because --init-from loads trained weights" in line and "is 0.003" in line
    _, args = parse(["train", "--init-from", str(checkpoints["llama"]), "--lr", "0.01"])
    assert config_from_args(args).lr == 0.01  # a rate given is the rate used
    _, args = parse(["train", "--model", "llama", "--dataset", "shakespeare"])
    assert config_from_args(args).lr == 3e-3  # without weights to keep, the model's recipe
    _, args = parse(["train", "--init-from", str(checkpoints["llama"]), "--vocab-size", str(VOCAB + 10)])
    with pytest.raises(ConfigError, match="does not grow a checkpoint's vocabulary for added tokens"):
        config_from_args(args)


def test_the_comparison_sees_a_wrong_transposition_or_gelu(checkpoints, tmp_path):
    """A GPT-2 loaded on one device gives transformers' logits; with a square Conv1D weight (the attention's
    c_proj, whose shape cannot tell) read untransposed, or with the exact GELU for GPT-2's tanh approximation,
    it does not."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"], dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(2))
    settings = dict(context=16, batch_size=4, max_steps=1, lr=1e-30, verbose=False)
    polytrain.fit(
        None, "shakespeare", init_from=str(checkpoints["gpt2"]), out=str(tmp_path / "a"), **settings
    )
    _, _, loaded = load_run(tmp_path / "a")
    with torch.no_grad():
        expected = hf(ids).logits
        assert (loaded.eval()(ids) - expected).abs().max().item() < 1e-5
        for block in list(loaded)[1:-2]:
            block.mlp[1].approximate = "none"
        assert (loaded(ids) - expected).abs().max().item() > 1e-4  # (8e-4: 80 times the tolerance)
        for block in list(loaded)[1:-2]:
            block.mlp[1].approximate = "tanh"
            block.attention.proj.weight.copy_(block.attention.proj.weight.t().clone())
        assert (loaded(ids) - expected).abs().max().item() > 0.1


def test_a_gpt2_saved_as_the_hub_stores_gpt2_loads(checkpoints, tmp_path):
    """The Hub's gpt2 names its tensors without transformers' "transformer." prefix (saved from the bare
    GPT2Model) and carries each attention's causal mask (attn.bias, attn.masked_bias): it loads as the same
    model."""
    import safetensors.torch

    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "config.json").write_text((checkpoints["gpt2"] / "config.json").read_text())
    tensors = safetensors.torch.load_file(checkpoints["gpt2"] / "model.safetensors")
    tensors = {key.removeprefix("transformer."): value for key, value in tensors.items()}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    safetensors.torch.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"], dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(2))
    settings = dict(context=16, batch_size=4, max_steps=1, lr=1e-30, verbose=False)
    polytrain.fit(None, "shakespeare", init_from=str(folder), out=str(tmp_path / "run"), **settings)
    _, _, loaded = load_run(tmp_path / "run")
    with torch.no_grad():
        assert (loaded.eval()(ids) - hf(ids).logits).abs().max().item() < 1e-5


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
        defaults = ("--model llama defaults:", "--model gpt defaults:")
        assert all(line.startswith(defaults) for line in captured.out.splitlines())
        assert not out.exists()
        for word in words:
            assert word in captured.err, captured.err

    refused(llama, ["--width 64 contradicts", "hidden_size: 32", "drop it"], "--width", "64")
    refused(llama, ["--model gpt", "holds a llama model"], "--model", "gpt")
    refused(llama, ["--size tiny", "drop it"], "--size", "tiny")
    refused(
        llama,
        ["--context 128 is longer than the 64 positions the llama reads", "--context 64 or less"],
        "--context",
        "128",
    )
    refused(llama, ["--tie-embeddings True contradicts", "tie_word_embeddings: False"], "--tie-embeddings")
    foreign = edited(llama, tmp_path / "foreign", architectures=["MistralForCausalLM"])
    refused(
        foreign,
        [
            "MistralForCausalLM",
            "it loads LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel",
        ],
    )
    biased = edited(checkpoints["qwen3"], tmp_path / "qwen3-biased", attention_bias=True)  # o_proj's too
    refused(biased, ["has attention_bias true", "biases only on q/k/v"])
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


def test_added_tokens_of_the_checkpoints_own_tokenizer_are_named_with_fixes_that_work(tmp_path, capsys):
    """The checkpoint's own tokenizer holds 2 added tokens past its model's 300 embedding rows: the line says
    so, naming them, and gives the fixes that work (it told the user to tokenize with the tokenizer they had
    used); a corpus tokenized by it otherwise trains."""
    from polytrain.cli import main
    from polytrain.data.corpus import tokenize_corpus
    from polytrain.data.tokenizer import train_byte_bpe

    folder = save_llama(tmp_path / "own", vocab=300, shard=False)
    text = (Path(polytrain.__file__).with_name("data") / "shakespeare" / "input.txt").read_text()[:20_000]
    tokenizer = train_byte_bpe([text], vocab_size=300)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 300
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text(text)
    tokenize_corpus(
        [str(tmp_path / "corpus.txt")], str(tmp_path / "tokens"), tokenizer=str(folder), show=False
    )
    capsys.readouterr()
    common = [
        "--dataset",
        "tokens",
        "--data-dir",
        str(tmp_path / "tokens"),
        "--context",
        "16",
        "--max-steps",
        "1",
    ]
    code = main(["train", "--init-from", str(folder), *common, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert (
        "own tokenizer has 302 tokens with its added ones ('<|im_start|>' (300), '<|im_end|>' (301))" in err
    )
    assert "resize_token_embeddings(len(tokenizer))" in err and "--tokenizer" not in err


GPT2_REFUSALS = [  # (a change to the GPT-2's config.json, words of the line)
    (dict(scale_attn_by_inverse_layer_idx=True), ["scale_attn_by_inverse_layer_idx true", "false only"]),
    (dict(reorder_and_upcast_attn=True), ["reorder_and_upcast_attn true"]),
    (dict(add_cross_attention=True), ["add_cross_attention true"]),
    (dict(scale_attn_weights=False), ["scale_attn_weights false", "true only"]),
    (dict(tie_word_embeddings=False), ["tie_word_embeddings false"]),
    (dict(n_inner=64), ["n_inner 64", "4 times its width (n_inner 128 or null)"]),
    (dict(activation_function="relu"), ["activation_function 'relu'", "gelu_new"]),
    (dict(n_positions=None), ["has no 'n_positions'"]),
]


@pytest.mark.parametrize("change, words", GPT2_REFUSALS, ids=[next(iter(c)) for c, _ in GPT2_REFUSALS])
def test_gpt2_configs_it_cannot_honour_are_one_line(checkpoints, tmp_path, capsys, change, words):
    """A GPT-2 config.json key whose value polytrain's gpt does not compute is named in one line (exit 2),
    before any worker and before the run folder."""
    from polytrain.cli import main

    folder = edited(checkpoints["gpt2"], tmp_path / "edited", **change)
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(
        [
            "train",
            "--init-from",
            str(folder),
            "--dataset",
            "shakespeare",
            "--context",
            "16",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 2 and captured.err.startswith("polytrain: error:"), captured.out + captured.err
    assert captured.err.count("\n") == 1 and not out.exists(), captured.err
    assert all(word in captured.err for word in words), captured.err


def test_gpt2_flags_that_contradict_it_are_one_line(checkpoints, tmp_path, capsys):
    from polytrain.cli import main

    gpt2 = checkpoints["gpt2"]
    cases = [
        (["--gelu", "exact"], ["--gelu exact contradicts", "(activation_function, as --gelu: tanh)"]),
        (["--positions", "32"], ["--positions 32 contradicts", "n_positions: 64"]),
        (["--context", "128"], ["--context 128 is longer than", "64 positions"]),
        (["--model", "llama"], ["--model llama", "holds a gpt model"]),
    ]
    for extra, words in cases:
        out = tmp_path / "out"
        capsys.readouterr()
        code = main(
            ["train", "--init-from", str(gpt2), "--dataset", "shakespeare", *extra, "--out", str(out)]
        )
        captured = capsys.readouterr()
        assert code == 2 and captured.err.count("\n") == 1 and not out.exists(), captured.out + captured.err
        assert all(word in captured.err for word in words), captured.err


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
    from polytrain.parallel.materialise import materialise
    from polytrain.runtime.pretrained import Pretrained

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


def test_a_rank_reads_only_its_rows_of_each_expert(tmp_path, monkeypatch):
    """Rank 1 of 4 FSDP2 ranks (a fake process group) over a Mixtral of 2 experts: fewer experts than shards are cut
    along their rows, so the rank reads rows 12..23 of each of the 48 rows of every expert's w1 and w3 (and columns
    of none: w2 is cut along its 32 rows of width), from the tensor stored for that expert, into its slice of our
    stacked weight; nothing else of the experts is read."""
    import copy

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import transformers
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from polytrain.models import build_model_on_meta
    from polytrain.parallel.fsdp import shard_model
    from polytrain.parallel.materialise import materialise
    from polytrain.runtime.pretrained import Pretrained

    torch.manual_seed(4)
    config = transformers.MixtralConfig(
        **dict(SIZES, vocab_size=VOCAB, intermediate_size=48), num_local_experts=2
    )
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path)
    values = dict(init_from=str(tmp_path))
    apply_checkpoint(values, set())
    reads = []
    read = dcp.HuggingFaceStorageReader._process_read_request

    def spy(self, handle, request, planner):
        reads.append((request.storage_index.fqn, tuple(request.storage_offsets), tuple(request.lengths)))
        return read(self, handle, request, planner)

    monkeypatch.setattr(dcp.HuggingFaceStorageReader, "_process_read_request", spy)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        model = build_model_on_meta("llama", (16,), VOCAB, values)
        blueprint, weights = copy.deepcopy(model), Pretrained(tmp_path, model)
        shard_model(model, mesh=init_device_mesh("cpu", (4,)))
        materialise(model, blueprint, device="cpu", seed=0, weights=weights)
        stored = load_file(str(tmp_path / "model.safetensors"))
        experts = dict(model.named_parameters())["1.feed_forward.experts.w1"].to_local()
        assert experts.shape == (2, 12, 32)  # both experts, a quarter of their rows
        for e in range(2):
            theirs = stored[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"]
            torch.testing.assert_close(experts[e], theirs[12:24], rtol=0, atol=0)
    finally:
        dist.destroy_process_group()
    expert_reads = sorted(r for r in reads if ".experts." in r[0])
    assert len(expert_reads) == 2 * 2 * 3  # 2 blocks x 2 experts x (w1, w2, w3), one piece each
    assert ("model.layers.0.block_sparse_moe.experts.1.w1.weight", (12, 0), (12, 32)) in expert_reads
    assert ("model.layers.0.block_sparse_moe.experts.1.w2.weight", (8, 0), (8, 48)) in expert_reads


@pytest.mark.parametrize("layout", ["sharded", "tensor", "sharded over tensor"])
def test_a_rank_reads_only_its_pieces_of_gpt2(checkpoints, monkeypatch, layout):
    """The last rank of a fake process group (in this process), its GPT built on the meta device, FSDP2-sharded
    over 2 ranks, split by the tensor plan on 2 (q/k/v fused in c_attn, rows in the ranks' order), or both on
    2 x 2: it holds its part of each one-device value, the Conv1D weights transposed, and DCP's Hugging Face
    reader was asked for exactly as many elements of each stored tensor as the rank holds of it, never the
    whole of a split one."""
    import copy
    from types import SimpleNamespace

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from polytrain.models import build_model_on_meta
    from polytrain.parallel.materialise import materialise
    from polytrain.parallel.tensor import replicate_rest, split_layers
    from polytrain.runtime.pretrained import Pretrained
    from polytrain.strategies.tensor import plan_for

    folder = checkpoints["gpt2"]
    values = dict(init_from=str(folder), context=16)
    apply_checkpoint(values, {"context"})
    reads = {}
    read = dcp.HuggingFaceStorageReader._process_read_request

    def spy(self, handle, request, planner):
        reads.setdefault(request.storage_index.fqn, []).append(math.prod(request.lengths))
        return read(self, handle, request, planner)

    monkeypatch.setattr(dcp.HuggingFaceStorageReader, "_process_read_request", spy)
    world = 4 if layout == "sharded over tensor" else 2
    dist.init_process_group("fake", store=FakeStore(), rank=world - 1, world_size=world)
    try:
        model = build_model_on_meta("gpt", (16,), VOCAB, values)
        blueprint, weights = copy.deepcopy(model), Pretrained(folder, model)
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("data", "tensor"))
        fused = {}
        if layout != "sharded":
            plan = plan_for(SimpleNamespace(tensor_plan=None, context=16), model, devices=2)
            fused = split_layers(model, mesh["tensor"], plan)
            replicate_rest(model, mesh["tensor"])
            assert "1.attention.qkv.weight" in fused
        if layout != "tensor":
            shards = mesh["data"] if layout == "sharded over tensor" else mesh["tensor"]
            for block in list(model)[1:-2]:
                fully_shard(block, mesh=shards)
            fully_shard(model, mesh=shards)
        materialise(model, blueprint, device="cpu", seed=0, reorder=fused, weights=weights)
        stored, held = load_file(folder / "model.safetensors"), {}
        for name, parameter in model.named_parameters():
            full = stored[weights.names[name]]
            full = full.t() if name in weights.transposed else full
            full = full[fused[name]] if name in fused else full
            part = distribute_tensor(
                full, parameter.device_mesh, parameter.placements, src_data_rank=None
            ).to_local()
            torch.testing.assert_close(parameter.to_local(), part, rtol=0, atol=0)
            held[weights.names[name]] = part.numel()
    finally:
        dist.destroy_process_group()
    assert {key: sum(counts) for key, counts in reads.items()} == held and len(held) == len(stored)
    split = [key for key in held if held[key] < stored[key].numel()]
    assert "transformer.h.0.attn.c_attn.weight" in split and "transformer.h.1.mlp.c_proj.weight" in split
