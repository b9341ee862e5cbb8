"""The llama's Hugging Face forms: the parameter names of the checkpoints that hold it (LlamaForCausalLM, Qwen2's
and Qwen3's, and their mixtures of experts: Mixtral's, Qwen2-MoE's, Qwen3-MoE's), which architecture holds a given
llama (its attention's q/k/v biases, q/k norms and its mixtures decide), and the config.json an export writes
(runtime/pretrained.py reads with the names, runtime/export.py writes with both)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..errors import ConfigError
from .moe import MixtureOfExperts

if TYPE_CHECKING:
    from .llama import Llama

# Hugging Face LlamaForCausalLM parameter names -> this model's: `{i}` is block i (from 0) in theirs and the
# block's index in the Sequential (i + 1) in ours; `{last}` the final norm's index, `{head}` the head's.
HF_NAMES = {
    "model.embed_tokens.weight": "0.weight",
    "model.layers.{i}.input_layernorm.weight": "{i}.attention_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "{i}.attention.wq.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "{i}.attention.wk.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "{i}.attention.wv.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "{i}.attention.wo.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "{i}.feed_forward.w1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "{i}.feed_forward.w3.weight",
    "model.layers.{i}.mlp.down_proj.weight": "{i}.feed_forward.w2.weight",
    "model.norm.weight": "{last}.weight",
    "lm_head.weight": "{head}.weight",
}
# with --qkv-bias (Qwen2ForCausalLM's attention)
HF_BIAS_NAMES = {
    "model.layers.{i}.self_attn.q_proj.bias": "{i}.attention.wq.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "{i}.attention.wk.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "{i}.attention.wv.bias",
}
# with --qk-norm (Qwen3ForCausalLM's attention)
HF_QK_NORM_NAMES = {
    "model.layers.{i}.self_attn.q_norm.weight": "{i}.attention.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "{i}.attention.k_norm.weight",
}


# a mixture of experts' names in Mixtral's checkpoints (MixtralForCausalLM, whose attention has no biases) and in
# Qwen2-MoE's (Qwen2MoeForCausalLM, q/k/v biases), as save_pretrained writes them: each expert's weights apart
# (`{e}`), which our stacked weights ([E, ...]) hold one expert a row
HF_MIXTURE_NAMES = {
    "MixtralForCausalLM": {
        "model.layers.{i}.block_sparse_moe.gate.weight": "{i}.feed_forward.router.weight",
        "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight": "{i}.feed_forward.experts.w1",
        "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight": "{i}.feed_forward.experts.w2",
        "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight": "{i}.feed_forward.experts.w3",
    },
    "Qwen2MoeForCausalLM": {
        "model.layers.{i}.mlp.gate.weight": "{i}.feed_forward.router.weight",
        "model.layers.{i}.mlp.experts.{e}.gate_proj.weight": "{i}.feed_forward.experts.w1",
        "model.layers.{i}.mlp.experts.{e}.down_proj.weight": "{i}.feed_forward.experts.w2",
        "model.layers.{i}.mlp.experts.{e}.up_proj.weight": "{i}.feed_forward.experts.w3",
        "model.layers.{i}.mlp.shared_expert.gate_proj.weight": "{i}.feed_forward.shared.w1.weight",
        "model.layers.{i}.mlp.shared_expert.down_proj.weight": "{i}.feed_forward.shared.w2.weight",
        "model.layers.{i}.mlp.shared_expert.up_proj.weight": "{i}.feed_forward.shared.w3.weight",
        "model.layers.{i}.mlp.shared_expert_gate.weight": "{i}.feed_forward.shared.gate.weight",
    },
    "Qwen3MoeForCausalLM": {  # Qwen2-MoE's names, without a shared expert
        "model.layers.{i}.mlp.gate.weight": "{i}.feed_forward.router.weight",
        "model.layers.{i}.mlp.experts.{e}.gate_proj.weight": "{i}.feed_forward.experts.w1",
        "model.layers.{i}.mlp.experts.{e}.down_proj.weight": "{i}.feed_forward.experts.w2",
        "model.layers.{i}.mlp.experts.{e}.up_proj.weight": "{i}.feed_forward.experts.w3",
    },
}


def hf_architecture(model: "Llama") -> str:
    """The Hugging Face class whose checkpoints hold `model`: Mixtral's, Qwen2-MoE's or Qwen3-MoE's with mixtures
    of experts, else Llama's, Qwen2's or Qwen3's; which follows from the attention: Qwen2's has q/k/v biases,
    Qwen3's normalises each query and key head (one line for both: Qwen3's biases come with one on o_proj)."""
    attention = model[1].attention
    biased, normed = attention.wq.bias is not None, hasattr(attention, "q_norm")
    mixed = any(isinstance(block.feed_forward, MixtureOfExperts) for block in list(model)[1:-2])
    if normed and biased:
        raise ConfigError(
            "no Hugging Face architecture holds q/k norms beside q/k/v biases alone (Qwen3's attention_bias puts "
            "one on o_proj too); export this run with --format safetensors or pt"
        )
    if mixed:
        return "Qwen3MoeForCausalLM" if normed else "Qwen2MoeForCausalLM" if biased else "MixtralForCausalLM"
    return "Qwen3ForCausalLM" if normed else "Qwen2ForCausalLM" if biased else "LlamaForCausalLM"


def hf_names(model: "Llama") -> dict:
    """This model's parameter name -> its Hugging Face name (`HF_NAMES`, `HF_BIAS_NAMES` where the attention
    has biases, `HF_MIXTURE_NAMES` in a mixture's block): every parameter of the model, a tied head named by the
    embedding it shares, as Hugging Face ties it (the checkpoint may leave lm_head.weight out); a mixture's
    stacked experts' weight -> the tuple of its experts' names, in order."""
    attention = model[1].attention
    table = dict(
        HF_NAMES,
        **(HF_BIAS_NAMES if attention.wq.bias is not None else {}),
        **(HF_QK_NORM_NAMES if hasattr(attention, "q_norm") else {}),
    )
    mixture = HF_MIXTURE_NAMES.get(hf_architecture(model), {})
    names = {}
    for i in range(model.layers):
        mixed = isinstance(model[i + 1].feed_forward, MixtureOfExperts)
        blocks = {t: m for t, m in table.items() if "{i}" in t and not (mixed and ".mlp." in t)}
        for theirs, mine in {**blocks, **(mixture if mixed else {})}.items():
            if mixed and ".shared." in mine and model[i + 1].feed_forward.shared is None:
                continue
            experts = model[i + 1].feed_forward.experts.experts if mixed else 0
            names[mine.format(i=i + 1)] = (
                tuple(theirs.format(i=i, e=e) for e in range(experts))
                if "{e}" in theirs
                else theirs.format(i=i)
            )
    for theirs, mine in table.items():
        if "{i}" not in theirs:
            names[mine.format(last=model.layers + 1, head=model.layers + 2)] = theirs
    if model[-1].weight is model[0].weight:
        names[f"{model.layers + 2}.weight"] = names["0.weight"]
    return names


# keys of a source checkpoint's config.json that an export writes anew or that no longer hold
HF_CONFIG_DROPPED = ("transformers_version", "torch_dtype", "rope_scaling", "layer_types", "attention_bias")


def hf_config(model: "Llama", base: Optional[dict] = None) -> dict:
    """The config.json of a Hugging Face checkpoint of `model` (polytrain export --format hf): a
    Qwen2ForCausalLM where the attention has biases, else a LlamaForCausalLM (with mixtures of experts a
    Qwen2MoeForCausalLM or a MixtralForCausalLM: `hf_architecture`), with the sizes read off the model
    itself. `base`, the config.json of the checkpoint the run started from (--init-from), keeps its other keys
    (token ids, say). The rotary angle base is written both ways transformers reads it (rope_theta at the top
    level up to version 4, rope_parameters from 5)."""
    block = model[1]
    attention, biased = block.attention, block.attention.wq.bias is not None
    form = hf_architecture(model)
    dense = HF_DENSE[form]
    config = {key: value for key, value in (base or {}).items() if key not in HF_CONFIG_DROPPED}
    config.update(
        architectures=[dense],
        model_type=HF_MODEL_TYPES[dense],
        vocab_size=model.vocab,
        hidden_size=model[0].embedding_dim,
        num_hidden_layers=model.layers,
        num_attention_heads=attention.heads,
        num_key_value_heads=attention.kv_heads,
        head_dim=attention.head_dim,
        hidden_act="silu",
        max_position_embeddings=max(int(model.positions), int(config.get("max_position_embeddings") or 0)),
        rms_norm_eps=block.attention_norm.eps,
        rope_theta=attention.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": attention.rope_theta},
        tie_word_embeddings=model[-1].weight is model[0].weight,
        dtype=str(model[0].weight.dtype).removeprefix("torch."),
    )
    if dense != "LlamaForCausalLM":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=model.layers)
    if not biased:
        config.update(attention_bias=False, mlp_bias=False)
    blocks = [block.feed_forward for block in list(model)[1:-2]]
    mixtures = [ff for ff in blocks if isinstance(ff, MixtureOfExperts)]
    dense = [ff for ff in blocks if not isinstance(ff, MixtureOfExperts)]
    config.update(intermediate_size=dense[0].w1.out_features if dense else mixtures[0].experts.hidden)
    if mixtures:
        config.update(_mixture_config(mixtures[0], every=blocks.index(mixtures[0]) + 1, form=form))
    return config


# each architecture's dense form, and the model_type its config.json says
HF_DENSE = {
    "LlamaForCausalLM": "LlamaForCausalLM",
    "Qwen2ForCausalLM": "Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "Qwen3ForCausalLM",
    "MixtralForCausalLM": "LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "Qwen2ForCausalLM",
    "Qwen3MoeForCausalLM": "Qwen3ForCausalLM",
}
HF_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def _mixture_config(mixture: MixtureOfExperts, *, every: int, form: str) -> dict:
    """The keys of the config.json of `form` (Mixtral's, Qwen2-MoE's or Qwen3-MoE's) that describe the mixtures
    (every `every`th block's, `mixture` the first); one line for what that form cannot say."""
    experts, shared = mixture.experts, mixture.shared
    common = dict(
        num_experts_per_tok=mixture.per_token,
        router_aux_loss_coef=mixture.balance_weight,
        output_router_logits=mixture.balance_weight > 0,
    )
    if form in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        qwen3 = form == "Qwen3MoeForCausalLM"
        if qwen3 and shared is not None:
            raise ConfigError(
                "Qwen3-MoE's form (a llama with q/k norms) has no shared expert; export this run with --format "
                "safetensors or pt"
            )
        if not qwen3 and shared is None:
            raise ConfigError(
                "Qwen2-MoE's blocks always have a shared expert, and this llama's mixtures have none (--shared-experts "
                "0) beside q/k/v biases; export it with --format safetensors or pt"
            )
        return dict(
            common,
            architectures=[form],
            model_type=HF_MODEL_TYPES[form],
            num_experts=experts.experts,
            moe_intermediate_size=experts.hidden,
            **({} if qwen3 else dict(shared_expert_intermediate_size=shared.w1.out_features)),
            decoder_sparse_step=every,
            norm_topk_prob=mixture.renormalise,
            mlp_only_layers=[],
        )
    if shared is not None or every > 1 or not mixture.renormalise:
        what = (
            "a shared expert"
            if shared is not None
            else "dense blocks"
            if every > 1
            else "unnormalised weights"
        )
        raise ConfigError(
            f"Mixtral's form (a llama without q/k/v biases) has no {what}; export this run with --format "
            f"safetensors or pt"
        )
    return dict(
        common,
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=experts.experts,
        intermediate_size=experts.hidden,
        sliding_window=None,
    )
