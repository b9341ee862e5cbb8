"""A mixture of experts in the llama's blocks (models/moe.py, `--experts E --experts-per-token K`): its logits
against Hugging Face's Mixtral and Qwen2-MoE with the same weights, its grouped computation against the
per-token sum written out, training proven equal to one device on the layouts it takes, and what does not make
a mixture refused in one line. The model-by-layout matrix (test_matrix.py, llama-moe) trains it on every layout."""

import pytest
import torch
from conftest import assert_refused_in_one_line, polytrain_here

from polytrain.models.llama import Llama
from polytrain.models.moe import MixtureOfExperts

SHAPE = dict(layers=2, heads=4, kv_heads=2, width=64, ffn_width=32, rope_theta=10000.0)
VOCAB = 96


def _ours_from_hf(hf_state: dict, ours: Llama, experts_key: str) -> None:
    """Load Hugging Face's tensors (transformers 5's names: fused 3-D experts) into the llama by hand."""
    width, new = SHAPE["ffn_width"], {}
    new["0.weight"] = hf_state["model.embed_tokens.weight"]
    for i in range(SHAPE["layers"]):
        at, theirs = i + 1, f"model.layers.{i}."
        new[f"{at}.attention_norm.weight"] = hf_state[theirs + "input_layernorm.weight"]
        new[f"{at}.ffn_norm.weight"] = hf_state[theirs + "post_attention_layernorm.weight"]
        for a, o in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo")):
            new[f"{at}.attention.{o}.weight"] = hf_state[theirs + f"self_attn.{a}_proj.weight"]
            if a != "o" and theirs + f"self_attn.{a}_proj.bias" in hf_state:
                new[f"{at}.attention.{o}.bias"] = hf_state[theirs + f"self_attn.{a}_proj.bias"]
        mlp = theirs + f"{experts_key}."
        new[f"{at}.feed_forward.router.weight"] = hf_state[mlp + "gate.weight"]
        fused = hf_state[mlp + "experts.gate_up_proj"]  # [E, 2F, D]: the gate's rows, then the up's
        new[f"{at}.feed_forward.experts.w1"] = fused[:, :width]
        new[f"{at}.feed_forward.experts.w3"] = fused[:, width:]
        new[f"{at}.feed_forward.experts.w2"] = hf_state[mlp + "experts.down_proj"]
        if mlp + "shared_expert_gate.weight" in hf_state:
            for ours_name, hf_name in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
                new[f"{at}.feed_forward.shared.{ours_name}.weight"] = hf_state[
                    mlp + f"shared_expert.{hf_name}.weight"
                ]
            new[f"{at}.feed_forward.shared.gate.weight"] = hf_state[mlp + "shared_expert_gate.weight"]
    new[f"{SHAPE['layers'] + 1}.weight"] = hf_state["model.norm.weight"]
    new[f"{SHAPE['layers'] + 2}.weight"] = hf_state["lm_head.weight"]
    ours.load_state_dict(new)  # strict: every tensor of ours given, none left over


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_logits_equal_hugging_faces_moe_models_with_the_same_weights(family):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64, num_experts_per_tok=2,
    )  # fmt: skip
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=32, num_local_experts=4, **common)
        hf, key, options = transformers.MixtralForCausalLM(config), "mlp", {}
    else:  # a shared expert of 2 x 32 behind its gate, q/k/v biases, the kept probabilities not renormalised
        config = transformers.Qwen2MoeConfig(
            intermediate_size=32, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
            decoder_sparse_step=1, norm_topk_prob=False, **common,
        )  # fmt: skip
        hf, key = transformers.Qwen2MoeForCausalLM(config), "mlp"
        options = dict(shared_experts=2, qkv_bias=True, experts_renormalise=False)
    hf.eval()
    for p in hf.parameters():  # Qwen2-MoE's router starts at zero: give every tensor values
        torch.nn.init.normal_(p, std=0.1) if p.dim() > 1 else torch.nn.init.normal_(p, mean=1.0, std=0.1)
    ours = Llama(VOCAB, context=16, **SHAPE, experts=4, experts_per_token=2, **options).eval()
    _ours_from_hf(hf.state_dict(), ours, key)
    ids = torch.randint(0, VOCAB, (3, 16))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    assert (expected - got).abs().max() < 1e-5
    assert expected.std() > 0.1  # (the comparison is not of zeros)


def test_the_grouped_experts_compute_the_weighted_sum_over_each_tokens_experts():
    """Each token's output is sum_k w_k expert_{c_k}(x), its gradients those of that sum, written token by token;
    an expert that gets no token changes nothing."""
    torch.manual_seed(1)
    mixture = MixtureOfExperts(8, 12, 6, 3, shared=1, renormalise=False).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    out = mixture(x)
    chosen, weights, probabilities = mixture.route(x.reshape(-1, 8))
    assert torch.allclose(weights, probabilities.gather(1, chosen))  # not renormalised
    experts = mixture.experts
    expected = []
    for token, row in enumerate(x.reshape(-1, 8)):
        total = mixture.shared(row)
        for k in range(3):
            e = int(chosen[token, k])
            hidden = torch.nn.functional.silu(experts.w1[e] @ row) * (experts.w3[e] @ row)
            total = total + weights[token, k] * (experts.w2[e] @ hidden)
        expected.append(total)
    expected = torch.stack(expected).reshape(2, 5, 8)
    assert torch.allclose(out, expected, atol=1e-14)
    grads = torch.autograd.grad(out.square().sum(), [x, experts.w1, mixture.router.weight])
    references = torch.autograd.grad(expected.square().sum(), [x, experts.w1, mixture.router.weight])
    for grad, reference in zip(grads, references):
        assert torch.allclose(grad, reference, atol=1e-13)
    # renormalised (the default): the kept weights sum to one
    mixture.renormalise = True
    assert torch.allclose(mixture.route(x.reshape(-1, 8))[1].sum(-1), torch.ones(10, dtype=torch.float64))


SMALL = ["--model", "llama", "--dataset", "shakespeare", "--layers", "2", "--width", "32", "--heads", "2", "--kv-heads", "2",
         "--context", "16", "--experts", "4", "--experts-per-token", "2"]  # fmt: skip
VERIFIES = {
    "4 FSDP2 shards of 2 experts (cut along their width)": [
        "--strategy", "sharded", "--devices", "4", "--experts", "2", "--experts-per-token", "1",
    ],
    "2 FSDP2 shards x 2 tensor ranks, a shared expert": [
        "--strategy", "tensor", "--tensor-parallel", "2", "--devices", "4", "--shared-experts", "1",
    ],
    "2 pipeline stages x 2 context ranks, every other block dense, full checkpointing": [
        "--strategy", "pipeline", "--context-parallel", "2", "--devices", "4", "--moe-every", "2",
        "--activation-checkpointing", "full",
    ],
}  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(VERIFIES))
def test_verify_passes_with_mixtures_of_experts(capfd, case):
    done = polytrain_here(capfd, "verify", *SMALL, *VERIFIES[case], "--steps", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert "PASS" in done.stdout and len(rows) == 3 and all(float(row[3]) < 1e-12 for row in rows), (
        done.stdout
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--experts", "4", "--experts-per-token", "5"],
            ["--experts-per-token 5 is more than the 4 experts"],
        ),
        (["--experts", "1"], ["--experts 1: a mixture needs 2 experts or more"]),
        (["--experts-per-token", "2"], ["--experts-per-token describes a mixture of experts; add --experts"]),
        (["--experts", "4", "--shared-experts", "-1"], ["--shared-experts", "-1"]),
    ],
    ids=["more-per-token-than-experts", "one-expert", "no-experts", "negative-shared"],
)
def test_what_makes_no_mixture_is_refused_in_one_line(capsys, tmp_path, argv, words):
    base = ["--model", "llama", "--dataset", "shakespeare", "--max-steps", "1"]
    assert_refused_in_one_line(capsys, tmp_path / "out", base + argv, words)


def test_experts_on_a_model_without_them_are_refused(capsys, tmp_path):
    assert_refused_in_one_line(
        capsys,
        tmp_path / "out",
        ["--model", "gpt", "--dataset", "shakespeare", "--experts", "4"],
        ["--experts"],
    )


def test_a_run_with_experts_samples_and_is_not_written_as_a_dense_checkpoint(capfd, tmp_path):
    run = tmp_path / "run"
    done = polytrain_here(capfd, "train", *SMALL, "--max-steps", "2", "--out", run)
    assert done.returncode == 0, done.stdout + done.stderr
    sampled = polytrain_here(capfd, "generate", run, "--tokens", "8")
    assert sampled.returncode == 0 and sampled.stdout.strip(), sampled.stderr
    refused = polytrain_here(capfd, "export", run, "--format", "hf", "--out", tmp_path / "hf")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "mixture of 4 experts" in refused.stderr and not (tmp_path / "hf").exists()
    weights = polytrain_here(
        capfd, "export", run, "--format", "safetensors", "--out", tmp_path / "w.safetensors"
    )
    assert weights.returncode == 0, weights.stderr


def test_fewer_experts_than_shards_are_cut_along_their_width():
    """FSDP2 cuts dimension 0 by default: 2 stacked experts over 4 shards would leave two ranks none of them and
    the others half. They are cut along their second dimension instead: rank 0 holds a quarter (the plan builds the
    run's own sharding at full size on fake ranks)."""
    import math

    import polytrain
    from polytrain.models import build_model

    shape = dict(layers=2, heads=4, kv_heads=2, width=64, ffn_width=32, context=16)
    model = build_model("llama", (16,), VOCAB, dict(shape, experts=2))
    expected = 0
    for p in model.parameters():
        if p.dim() == 3:  # [E, F, D] with E < 4: torch.chunk of dimension 1
            expected += 4 * p.shape[0] * math.ceil(p.shape[1] / 4) * p.shape[2]
        else:
            expected += 4 * math.ceil(p.shape[0] / 4) * p[0].numel()
    (row,) = polytrain.plan(
        "llama", devices=4, batch_size=4, vocab_size=VOCAB, layout="dp_shard=4", experts=2, **shape
    )
    assert row["memory_split_gib"]["parameters"] * 2**30 == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_a_moe_config_json_is_planned_with_transformers_parameters(family, tmp_path):
    """`polytrain plan --hf-config` of Mixtral's and Qwen2-MoE's config.json builds the same parameters as
    transformers' model of that config (both on the meta device)."""
    transformers = pytest.importorskip("transformers")
    from polytrain.runtime.plan_report import make_request

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_experts_per_tok=2,
    )  # fmt: skip
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=48, num_local_experts=8, **common)
        architecture = transformers.MixtralForCausalLM
    else:  # every other block dense, a shared expert of 2 experts' width, the kept scores not renormalised
        config = transformers.Qwen2MoeConfig(
            intermediate_size=32, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
            decoder_sparse_step=2, **common,
        )  # fmt: skip
        architecture = transformers.Qwen2MoeForCausalLM
    config.architectures = [architecture.__name__]
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in architecture(config).parameters())
    request = make_request(str(tmp_path), devices=2, batch_size=2, context=16)
    assert sum(p.numel() for p in request.build().parameters()) == theirs
    # what the llama's mixture does not compute is refused in one line
    config.mlp_only_layers = [0] if family == "qwen2-moe" else None
    config.sliding_window = 4096 if family == "mixtral" else config.sliding_window
    config.save_pretrained(tmp_path)
    from polytrain.errors import UserError

    with pytest.raises(UserError, match="--hf-config: .*(mlp_only_layers|sliding_window)"):
        make_request(str(tmp_path), devices=2, batch_size=2, context=16)
