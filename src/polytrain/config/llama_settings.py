"""The settings of --model llama beside the sizes it shares with the GPT (--layers, --heads, --width, --context
in settings.py), and the GPT's --dropout, --gelu and --positions, in the model group of --help (--vocab-size
and --norm-eps serve both). Declared as in settings.py; none has a default of its own here (None: the model's,
see config/model_defaults.py), so another model given none of them is never refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .declare import setting


@dataclass
class LlamaSettings:
    size: Optional[str] = setting(
        None,
        "--model llama: a named shape whose sizes fill those not given: tiny (the default: 4 layers, "
        "width 128, 4 heads, 2 key/value heads; trains on a CPU in seconds), 8b, 70b or 405b (Llama 3's "
        "published shapes, vocabulary 128256 and context 8192: for planning, as built on the meta device)",
        group="model",
        metavar="NAME",
    )
    kv_heads: Optional[int] = setting(
        None,
        "--model llama: key/value heads, dividing --heads (grouped-query attention; default: half of --heads)",
        group="model",
        metavar="K",
        check="count",
        example=2,
    )
    ffn_width: Optional[int] = setting(
        None,
        "--model llama: hidden width of the SwiGLU MLP (default: 8/3 of --width, up to a multiple of 64)",
        group="model",
        metavar="F",
        check="count",
        example=384,
    )
    vocab_size: Optional[int] = setting(
        None,
        "--model llama, gpt: token embedding and head rows, at least the dataset's vocabulary (default: the "
        "dataset's; more rows are never a target)",
        group="model",
        metavar="V",
        check="count",
        example=128256,
    )
    rope_theta: Optional[float] = setting(
        None,
        "--model llama: base of the rotary position embedding's wavelengths (default: 500000, Llama 3's)",
        group="model",
        metavar="X",
        check="positive",
        example=500000,
    )
    tie_embeddings: Optional[bool] = setting(
        None,
        "--model llama: the output head shares the token embedding's weight (default: off, a head of its own)",
        group="model",
        flag="toggle",
    )
    norm_eps: Optional[float] = setting(
        None,
        "--model llama, gpt: epsilon of the llama's RMSNorms or the GPT's LayerNorms (default: 1e-05, "
        "Llama 3's and GPT-2's; Hugging Face's rms_norm_eps, layer_norm_epsilon)",
        group="model",
        metavar="E",
        check="positive",
        example=1e-5,
    )
    qkv_bias: Optional[bool] = setting(
        None,
        "--model llama: the query, key and value projections have biases, as Qwen2's (default: off, none)",
        group="model",
        flag="toggle",
    )
    head_dim: Optional[int] = setting(
        None,
        "--model llama: the width of each attention head, its own where --width / --heads is not it (Qwen3's; "
        "default: --width / --heads)",
        group="model",
        metavar="D",
        check="count",
        example=128,
    )
    qk_norm: Optional[bool] = setting(
        None,
        "--model llama: each query and key head normalised (an RMSNorm over --head-dim) before the rotary "
        "angles, as Qwen3's (default: off)",
        group="model",
        flag="toggle",
    )
    experts: Optional[int] = setting(
        None,
        "--model llama: a mixture of E experts in place of each block's feed-forward (each a SwiGLU of "
        "--ffn-width; a router sends every token to --experts-per-token of them, dropless, as Mixtral and "
        "Qwen2-MoE compute; default: none, dense blocks)",
        group="model",
        metavar="E",
        check="count",
        example=8,
    )
    experts_per_token: Optional[int] = setting(
        None,
        "--model llama --experts: the experts each token goes to, their router probabilities as weights "
        "(default: 2)",
        group="model",
        metavar="K",
        check="count",
        example=2,
    )
    shared_experts: Optional[int] = setting(
        None,
        "--model llama --experts: a shared expert of S times --ffn-width that every token goes through, "
        "behind a sigmoid gate (Qwen2-MoE's; default: 0, none)",
        group="model",
        metavar="S",
        check="count0",
        example=1,
    )
    moe_every: Optional[int] = setting(
        None,
        "--model llama --experts: every Nth block has the mixture, the others a dense feed-forward (Qwen2-MoE's "
        "decoder_sparse_step; default: 1, every block)",
        group="model",
        metavar="N",
        check="count",
        example=2,
    )
    experts_renormalise: Optional[bool] = setting(
        None,
        "--model llama --experts: the kept router probabilities renormalised to sum to one (default: on, "
        "Mixtral's and Qwen3-MoE's; off: Qwen2-MoE's norm_topk_prob false)",
        group="model",
        flag="toggle",
    )
    router_aux_loss: Optional[float] = setting(
        None,
        "--model llama --experts: weight W of the load-balancing loss added to each sequence's loss, W times "
        "E sum_e f_e P_e per mixture (f_e the share of its tokens routed to expert e, P_e its mean router "
        "probability), averaged over the mixtures; shown apart as balance (Hugging Face's "
        "router_aux_loss_coef, pooled there over a pass's tokens and layers; Mixtral's 0.02; default: 0, none)",
        group="model",
        metavar="W",
        check="nonneg",
        example=0.02,
    )
    dropout: Optional[float] = setting(
        None,
        "--model gpt: probability of zeroing an activation in training, after the embeddings and after each "
        "block's attention and MLP (nn.Dropout layers, drawn over the global batch on every strategy; "
        "nanoGPT's GPU recipe uses 0.2; default: 0, no dropout layers)",
        group="model",
        metavar="P",
        check="probability",
        example=0.2,
    )
    gelu: Optional[str] = setting(
        None,
        "--model gpt: the MLP's GELU: exact (the default) or tanh, its tanh approximation (GPT-2's gelu_new)",
        group="model",
        choices=("exact", "tanh"),
    )
    positions: Optional[int] = setting(
        None,
        "the longest --context the model reads: --model gpt's rows of its table of learned positions (a GPT-2 "
        "checkpoint's n_positions), --model llama's max_position_embeddings (a checkpoint's; generate reads "
        "that far, and export writes it) (default: --context)",
        group="model",
        metavar="P",
        check="count",
        example=1024,
    )
