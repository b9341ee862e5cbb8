"""The Llama against an independent reference (Hugging Face transformers' LlamaForCausalLM with the same
weights), its settings and named shapes, training from the registry, and `polytrain verify` on 2 processes."""

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import polytrain_here
from transformers import LlamaConfig, LlamaForCausalLM

import polytrain
from polytrain.cli import parse
from polytrain.config.flags import config_from_args
from polytrain.errors import ConfigError
from polytrain.models import build_model
from polytrain.models.llama import Llama
from polytrain.models.llama_hf import HF_NAMES
from polytrain.parallel.layout import Layout
from polytrain.strategies.tensor import plan_for, run_plan

VOCAB = 65


def reference(*, layers=2, heads=4, kv_heads=2, width=32, ffn_width=64, tie=False, theta=500000.0):
    """A transformers Llama of that shape (random weights, no download): weights of std 0.2 make the attention
    sharp, so that the positions matter (at 0.02 it is nearly uniform, and a wrong rope shows only 3e-4)."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=ffn_width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=16,
        rms_norm_eps=1e-5,
        rope_theta=theta,
        tie_word_embeddings=tie,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def ours_from(hf, *, layers, mapping=HF_NAMES, **sizes) -> Llama:
    """Our model of the same shape with the reference's weights, copied by `mapping`'s names."""
    model = Llama(VOCAB, context=16, layers=layers, **sizes).eval()
    names = {}
    for theirs, mine in mapping.items():
        for i in range(layers) if "{i}" in theirs else [0]:
            names[theirs.format(i=i)] = mine.format(i=i + 1, last=layers + 1, head=layers + 2)
    state = {names[key]: value for key, value in hf.state_dict().items() if key in names}
    model.load_state_dict(state)
    return model


def largest_difference(model, hf) -> float:
    ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (model(ids) - hf(ids).logits).abs().max().item()


@pytest.mark.parametrize(
    "shape",
    [
        dict(heads=4, kv_heads=4),  # multi-head attention
        dict(heads=4, kv_heads=2),  # grouped-query attention
        dict(heads=4, kv_heads=1, tie=True),  # multi-query, the head tied to the token embedding
    ],
)
def test_logits_equal_transformers_llama(shape):
    tie = shape.pop("tie", False)
    hf = reference(tie=tie, **shape)
    model = ours_from(hf, layers=2, width=32, ffn_width=64, tie_embeddings=tie, **shape)
    if tie:
        assert model[-1].weight is model[0].weight
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    assert largest_difference(model, hf) < 1e-5


def test_the_comparison_sees_a_wrong_rope_or_a_wrong_weight():
    hf = reference()
    sizes = dict(layers=2, heads=4, kv_heads=2, width=32, ffn_width=64)
    assert largest_difference(ours_from(hf, **sizes), hf) < 1e-5
    assert largest_difference(ours_from(hf, **sizes, rope_theta=10000.0), hf) > 0.5  # Llama 2's theta
    swapped = dict(HF_NAMES)  # gate and up projections exchanged
    swapped["model.layers.{i}.mlp.gate_proj.weight"] = "{i}.feed_forward.w3.weight"
    swapped["model.layers.{i}.mlp.up_proj.weight"] = "{i}.feed_forward.w1.weight"
    assert largest_difference(ours_from(hf, **sizes, mapping=swapped), hf) > 0.1


def test_the_8b_shape_on_the_meta_device():
    with torch.device("meta"):
        model = build_model("llama", (64,), VOCAB, dict(size="8b"))
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert (model.vocab, model.context, len(model)) == (128256, 8192, 32 + 3)
    attention = model[1].attention
    assert (attention.heads, attention.kv_heads, attention.head_dim) == (32, 8, 128)
    assert model[1].feed_forward.w1.out_features == 14336 and model[1].attention.rope_theta == 500000.0


def test_settings_presets_and_refusals():
    config = config_from_args(parse(["train", "--model", "llama", "--heads", "8", "--width", "64"])[1])
    assert (config.layers, config.heads, config.kv_heads, config.width, config.ffn_width) == (
        4,
        8,
        4,
        64,
        192,
    )
    assert (config.optimizer, config.rope_theta, config.context) == ("adamw", 500000.0, 64)
    config = config_from_args(parse(["train", "--model", "llama", "--size", "70b", "--layers", "2"])[1])
    assert (config.layers, config.width, config.heads, config.kv_heads, config.ffn_width) == (
        2,
        8192,
        64,
        8,
        28672,
    )
    assert (config.vocab_size, config.context) == (128256, 8192)
    with pytest.raises(ConfigError, match="--kv-heads applies to the llama model only, not gpt; drop it"):
        config_from_args(parse(["train", "--model", "gpt", "--kv-heads", "2"])[1])
    with pytest.raises(
        ConfigError, match="unknown --size '7b' for --model llama; choose one of tiny, 8b, 70b"
    ):
        config_from_args(parse(["train", "--model", "llama", "--size", "7b"])[1])
    with pytest.raises(ConfigError, match="--vocab-size 50 is smaller than the dataset's 65 tokens"):
        build_model("llama", (16,), VOCAB, dict(vocab_size=50))
    larger = build_model("llama", (16,), VOCAB, dict(vocab_size=128))  # rows for planning, never a target
    assert larger(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 128)
    with pytest.raises(
        ConfigError, match=r"--kv-heads 3 does not divide --heads 4 \(.*\); give a divisor of 4 such as 2"
    ):
        build_model("llama", (16,), VOCAB, dict(kv_heads=3))
    model = build_model("llama", (16,), VOCAB, dict(heads=8, kv_heads=2, width=64))
    assert len(plan_for(SimpleNamespace(tensor_plan=None), model, devices=2).styles) == 4 * 7
    with pytest.raises(ConfigError, match="the model's 2 key/value heads do not split evenly; use --devices"):
        plan_for(SimpleNamespace(tensor_plan=None), model, devices=4)
    # with --tensor-parallel the groups are what does not divide, not --devices
    config = SimpleNamespace(
        tensor_plan=None,
        devices=8,
        tensor_parallel=4,
        context_parallel=None,
        layout=Layout(shard=2, tensor=4),
    )
    with pytest.raises(
        ConfigError, match="tensor-parallel 4: .* 2 key/value heads .* use a --tensor-parallel that"
    ):
        run_plan(config, model, None)


def test_llama_trains_on_shakespeare(tmp_path):
    settings = dict(batch_size=16, layers=2, width=64, context=32, schedule="constant", warmup_epochs=0)
    history = polytrain.fit(
        "llama", "shakespeare", max_steps=30, out=str(tmp_path / "run"), verbose=False, **settings
    )
    # the mean loss of the 30 steps, from uniform guessing (4.17) to below 3.6 (measured: 3.12)
    assert history.validations[-1]["train_loss"] < math.log(VOCAB) - 0.6


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "strategy, attention", [("data", ()), ("tensor", ("--head-dim", "16", "--qk-norm")), ("pipeline", ())]
)
def test_verify_llama(strategy, attention, capfd):
    """Grouped-query attention (4 query heads, 2 key/value heads) on 2 processes: the tensor plan gives each
    rank 2 query heads and their 1 key/value head; there with Qwen3's attention (heads of their own width, each
    query and key head normalised: a rank's norms see its heads only, and their weights' gradients sum both
    ranks')."""
    result = polytrain_here(
        capfd,
        *("verify", "--model", "llama", "--dataset", "shakespeare", "--devices", "2", "--strategy", strategy),
        *attention,
        *("--layers", "2", "--width", "32", "--heads", "4", "--kv-heads", "2", "--ffn-width", "64"),
        *("--context", "16", "--batch-size", "8", "--steps", "2"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 and all(float(diff) <= 1e-5 for *_, diff in rows) and "PASS" in result.stdout
    if strategy == "tensor":  # its norms on parts of the sequence, their weights' gradients summed over them
        assert "norms sequence-parallel" in result.stdout
