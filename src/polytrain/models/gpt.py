"""A decoder-only transformer (GPT) for character-level language modelling, in GPT-2's design.

    polytrain train --model gpt --dataset shakespeare
    polytrain train --init-from DIR --dataset shakespeare   (a Hugging Face GPT-2 checkpoint)

The model is an `nn.Sequential` of [embeddings, block x L, final LayerNorm, head] so that the pipeline
strategy can split it between blocks. It takes token ids (B, T) as int64 and returns scores (B, T, vocab).
The head's weight is the token embedding's (tied, as in GPT-2); the attention keeps heads as a dimension of
its own (`view(B, T, heads, head_dim)`), so heads can later be split across devices. The table of learned
positions has `context` rows (--positions, default --context): the longest sequence the model reads.

Its layers are GPT-2's, so a GPT2LMHeadModel's weights load into it (`hf_names`; --init-from DIR) and it is
written as one (`hf_config`; polytrain export --format hf). GPT-2 stores its linear layers as `Conv1D`, whose
weight is the transpose of an nn.Linear's ([in, out]; `HF_TRANSPOSED`), and its q, k and v as one `c_attn`
layer, whose rows (our order) are q's, then k's, then v's, as the fused `qkv` here. GPT-2's MLP uses the tanh
approximation of GELU (`gelu_new`): `gelu="tanh"` (--gelu tanh); polytrain's own GPT keeps the exact GELU.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError
from .kv_cache import attend, cached, caching_layers
from .packing import PackedSequential

# nanoGPT's CPU-sized model ("baby GPT" on Shakespeare)
DEFAULT_SIZES = dict(layers=4, heads=4, width=128, context=64)
NORM_EPS = 1e-5  # the LayerNorms' epsilon (torch's default, GPT-2's layer_norm_epsilon; --norm-eps)
GELUS = ("exact", "tanh")  # --gelu: torch's GELU exact (approximate="none") or its tanh approximation

# Hugging Face GPT2LMHeadModel parameter names -> this model's: `{i}` is block i (from 0) in theirs and the
# block's index in the Sequential (i + 1) in ours; `{last}` the final norm's index. The head is tied to the
# token embedding (GPT-2 stores it once, as transformer.wte.weight).
HF_NAMES = {
    "transformer.wte.weight": "0.token.weight",
    "transformer.wpe.weight": "0.position.weight",
    "transformer.h.{i}.ln_1.weight": "{i}.norm1.weight",
    "transformer.h.{i}.ln_1.bias": "{i}.norm1.bias",
    "transformer.h.{i}.attn.c_attn.weight": "{i}.attention.qkv.weight",
    "transformer.h.{i}.attn.c_attn.bias": "{i}.attention.qkv.bias",
    "transformer.h.{i}.attn.c_proj.weight": "{i}.attention.proj.weight",
    "transformer.h.{i}.attn.c_proj.bias": "{i}.attention.proj.bias",
    "transformer.h.{i}.ln_2.weight": "{i}.norm2.weight",
    "transformer.h.{i}.ln_2.bias": "{i}.norm2.bias",
    "transformer.h.{i}.mlp.c_fc.weight": "{i}.mlp.0.weight",
    "transformer.h.{i}.mlp.c_fc.bias": "{i}.mlp.0.bias",
    "transformer.h.{i}.mlp.c_proj.weight": "{i}.mlp.2.weight",
    "transformer.h.{i}.mlp.c_proj.bias": "{i}.mlp.2.bias",
    "transformer.ln_f.weight": "{last}.weight",
    "transformer.ln_f.bias": "{last}.bias",
}
# GPT-2's Conv1D weights: stored as the transpose of this model's nn.Linear weights ([in, out])
HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# what GPT2LMHeadModel's names start with; a checkpoint saved from the bare GPT2Model (as the Hub's gpt2 is)
# leaves it out, and transformers loads either
HF_PREFIX = "transformer."


class Embeddings(nn.Module):
    """Token plus position embeddings: (B, T) ids -> (B, T, width). With `context_parallel` set (a ContextGroup,
    parallel/context.py) the ids are this rank's part of each sequence, and their rows of the table
    of positions are those of their global positions; with `kv_cache` set (a KVCache, while `generate` runs)
    they follow the tokens read before, and take the rows of the positions after theirs."""

    context_parallel = None
    kv_cache = None
    rows = None  # the positions of rows packed into the windows (models/packing.py)

    def __init__(self, vocab: int, context: int, width: int, dropout: float = 0.0):
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout) if dropout else None  # (no layer at all without dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.kv_cache is not None:
            positions = self.kv_cache.positions(idx.shape[1], device=idx.device)
            self.kv_cache.extend(idx.shape[1])
        elif self.rows is not None and self.rows.positions is not None:
            # (B, T): each packed row's own, read as (T, B) so that the table's rows come sequence first, as
            # for one window's positions (a tensor plan's sequence parallelism cuts them along it), then (B, T)
            x = self.token(idx) + self.position(self.rows.positions.t()).transpose(0, 1)
            return x if self.drop is None else self.drop(x)
        elif self.context_parallel is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        else:
            positions = self.context_parallel.positions(idx.shape[1], device=idx.device)
        x = self.token(idx) + self.position(positions)
        return x if self.drop is None else self.drop(x)


def hf_names(model: "GPT", *, prefix: str = HF_PREFIX) -> dict:
    """This model's parameter name -> its Hugging Face GPT2LMHeadModel name (`HF_NAMES`, their
    "transformer." replaced by `prefix`): every parameter, the tied head named by the embedding it shares."""
    names = {}
    for theirs, mine in HF_NAMES.items():
        for i in range(model.layers) if "{i}" in theirs else [0]:
            stored = prefix + theirs.removeprefix(HF_PREFIX).format(i=i)
            names[mine.format(i=i + 1, last=model.layers + 1)] = stored
    names[f"{model.layers + 2}.weight"] = names["0.token.weight"]
    return names


def hf_transposed(names: dict) -> set:
    """The names (this model's) of `names` whose stored tensor is the transpose of this model's (Conv1D)."""
    return {mine for mine, theirs in names.items() if theirs.endswith(HF_TRANSPOSED)}


# keys of a source checkpoint's config.json that an export writes anew or that no longer hold
HF_CONFIG_DROPPED = ("transformers_version", "torch_dtype", "n_ctx")


def hf_config(model: "GPT", base: Optional[dict] = None) -> dict:
    """The config.json of a Hugging Face GPT2LMHeadModel checkpoint of `model` (polytrain export --format hf),
    its sizes read off the model itself. `base`, the config.json of the checkpoint the run started from
    (--init-from), keeps its other keys (token ids, say) and its dropout probabilities. Without one, they are
    the model's: after the embeddings and each block's attention and MLP (embd_pdrop, resid_pdrop), none on
    the attention weights."""
    block = model[1]
    dropout = block.attention.drop.p if block.attention.drop is not None else 0.0
    config = {key: value for key, value in (base or {}).items() if key not in HF_CONFIG_DROPPED}
    config.update(
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        vocab_size=model.vocab,
        n_embd=model[0].token.embedding_dim,
        n_layer=model.layers,
        n_head=block.attention.qkv.out_features // 3 // block.attention.head_dim,
        n_positions=model.context,
        n_inner=block.mlp[0].out_features,
        activation_function="gelu_new" if block.mlp[1].approximate == "tanh" else "gelu",
        layer_norm_epsilon=block.norm1.eps,
        tie_word_embeddings=True,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        add_cross_attention=False,
        dtype=str(model[0].token.weight.dtype).removeprefix("torch."),
    )
    # a checkpoint's dropouts are kept (a later fine-tune in transformers inherits them: writing the run's 0.0
    # switched them off silently); a model trained from scratch has its own
    for key, value in (("embd_pdrop", dropout), ("resid_pdrop", dropout), ("attn_pdrop", 0.0)):
        config.setdefault(key, value)
    return config


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention; with `context_parallel` set (a ContextGroup) over a sequence split across
    ranks, its queries against the whole sequence's keys and values (parallel/context.py); with
    `kv_cache` set (a KVCache, while `generate` runs), its queries against the keys and values of the tokens
    read before and their own (models/kv_cache.py)."""

    context_parallel = None
    kv_cache = None
    rows = None  # the positions of rows packed into the windows (models/packing.py)

    def __init__(self, width: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.head_dim = width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout) if dropout else None  # (no layer at all without dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (part.view(B, T, -1, self.head_dim).transpose(1, 2) for part in self.qkv(x).chunk(3, dim=2))
        if self.kv_cache is not None:
            y = attend(q, *self.kv_cache.extend(T, k, v))
        elif self.rows is not None and self.rows.positions is not None:
            y = self.rows.attention(q, k, v, self.context_parallel)
        elif self.context_parallel is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = self.context_parallel.attention(q, k, v)
        y = self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return y if self.drop is None else self.drop(y)


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x)) with a 4x GELU MLP (`gelu`:
    "exact", or "tanh", its tanh approximation)."""

    def __init__(
        self, width: int, heads: int, dropout: float = 0.0, *, norm_eps: float = NORM_EPS, gelu: str = "exact"
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=norm_eps)
        self.attention = CausalSelfAttention(width, heads, dropout)
        self.norm2 = nn.LayerNorm(width, eps=norm_eps)
        approximate = "tanh" if gelu == "tanh" else "none"
        mlp = [nn.Linear(width, 4 * width), nn.GELU(approximate=approximate), nn.Linear(4 * width, width)]
        self.mlp = nn.Sequential(*mlp, *([nn.Dropout(dropout)] if dropout else []))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(PackedSequential):
    """[Embeddings, Block x layers, LayerNorm, Linear head tied to the token embedding (`tied=False`: a head
    of its own, which a pipeline can put on another stage than the embedding)]. `context` is the length of the
    table of positions, `norm_eps` the LayerNorms' epsilon, `gelu` the MLP's GELU ("exact" or "tanh")."""

    # the layers --lora adapts by default (models/lora.py): the attention's and the MLP's projections
    LORA_TARGETS = ("*.attention.qkv", "*.attention.proj", "*.mlp.0", "*.mlp.2")

    def __init__(
        self,
        vocab: int,
        *,
        context: int = 64,
        layers: int = 4,
        heads: int = 4,
        width: int = 128,
        tied: bool = True,
        dropout: float = 0.0,
        norm_eps: float = NORM_EPS,
        gelu: str = "exact",
    ):
        for name, value in (
            ("layers", layers),
            ("heads", heads),
            ("width", width),
            ("context", context),
            ("vocab", vocab),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{name} must be a positive whole number, got {value!r}")
        if width % heads:
            near = min((h for h in range(1, width + 1) if width % h == 0), key=lambda h: (abs(h - heads), -h))
            raise ConfigError(
                f"--heads {heads} does not divide --width {width}; give --heads {near}, or a "
                f"--width that is a multiple of {heads} such as {heads * max(1, round(width / heads))}"
            )
        if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
            raise ConfigError(f"--dropout must be a probability from 0 up to 1, got {dropout!r}")
        if not isinstance(norm_eps, (int, float)) or isinstance(norm_eps, bool) or not norm_eps > 0:
            raise ConfigError(f"--norm-eps must be a number above 0, got {norm_eps!r}; GPT-2's is 1e-05")
        if gelu not in GELUS:
            raise ConfigError(f"--gelu must be one of {', '.join(GELUS)}, got {gelu!r}")
        embeddings = Embeddings(vocab, context, width, dropout)
        head = nn.Linear(width, vocab, bias=False)
        if tied:
            head.weight = embeddings.token.weight  # tied input and output embeddings
        blocks = (Block(width, heads, dropout, norm_eps=float(norm_eps), gelu=gelu) for _ in range(layers))
        super().__init__(embeddings, *blocks, nn.LayerNorm(width, eps=float(norm_eps)), head)
        self.vocab, self.context, self.layers = vocab, context, layers
        self._init_weights(layers)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """The initialisation of `_init_weights` for one module, `name` in this model (models built on the
        meta device are initialised module by module: parallel/meta.py)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = name.endswith(("attention.proj", "mlp.2"))
            std = 0.02 / math.sqrt(2 * self.layers) if residual else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()

    @torch.no_grad()
    def _init_weights(self, layers: int) -> None:
        """GPT-2's initialisation: N(0, 0.02), the residual projections scaled by 1/sqrt(2 * layers)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for name, parameter in self.named_parameters():
            if name.endswith("attention.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * layers))


def build_gpt(
    input_shape,
    num_classes: int,
    *,
    layers=None,
    heads=None,
    width=None,
    context=None,
    dropout=None,
    vocab_size=None,
    norm_eps=None,
    gelu=None,
    positions=None,
) -> GPT:
    """The registry's builder: `input_shape` is (context,), `num_classes` the dataset's vocabulary; --vocab-size
    may exceed it, and --positions (the table of positions; default: --context) may exceed the context."""
    if len(input_shape) != 1:
        raise ConfigError(
            f"--model gpt reads text, not images of shape {tuple(input_shape)}; use --dataset "
            f"shakespeare or --dataset text --data-dir FILE"
        )
    given = dict(layers=layers, heads=heads, width=width)
    sizes = {name: DEFAULT_SIZES[name] if value is None else value for name, value in given.items()}
    context = int(input_shape[0]) if context is None else context
    if positions is not None and isinstance(context, int) and context > positions:
        raise ConfigError(
            f"--context {context} is longer than the GPT's table of {positions} positions (--positions); give "
            f"--context {positions} or less"
        )
    vocab = num_classes if vocab_size is None else vocab_size
    if isinstance(vocab, int) and vocab < num_classes:
        raise ConfigError(
            f"--vocab-size {vocab} is smaller than the dataset's {num_classes} tokens; give --vocab-size "
            f"{num_classes} or more, or leave it out (default: the dataset's)"
        )
    return GPT(
        vocab,
        context=context if positions is None else positions,
        dropout=dropout or 0.0,
        norm_eps=NORM_EPS if norm_eps is None else norm_eps,
        gelu=gelu or "exact",
        **sizes,
    )


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    tokens: int,
    *,
    temperature: float = 1.0,
    top_k=None,
    generator=None,
    vocabulary: Optional[int] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Extend the ids `idx` (1, T) by `tokens` samples, as transformers' `generate` does: the prompt runs
    through the model once, then each new token alone, at its position, against the keys and values its
    layers keep of the tokens before (models/kv_cache.py). With `vocabulary`, only ids below it are drawn: a
    model with more rows than the data's tokens (--vocab-size) never emits one the tokenizer cannot decode
    (the other rows' scores are dropped before sampling).

    `window` (default: the model's `context`) is the longest sequence the model reads: the GPT's table of
    positions, or a llama's max_position_embeddings (runtime/sampling.py). Once the text is longer, each
    token is drawn from the last `window` ids, run anew (no cache: their first token now starts the
    sequence, at position 0). transformers does not slide there: a GPT-2 fails for want of a position row,
    and a Llama goes on at positions it was never trained on; up to `window` + 1 tokens in all, the two agree
    (tested). A model that keeps no cache (no layer with a `kv_cache`) reruns the whole text per token."""
    model.eval()
    window = model.context if window is None else window
    with_cache = min(tokens, max(0, window + 1 - idx.shape[1]))  # tokens drawn from at most `window` ids
    if not caching_layers(model):
        with_cache = 0
    with cached(model):
        logits = model(idx) if with_cache else None
        for drawn in range(1, with_cache + 1):
            following = _next_token(logits[:, -1, :vocabulary], temperature, top_k, generator)
            idx = torch.cat([idx, following], dim=1)
            if drawn < with_cache:
                logits = model(following)
    for _ in range(tokens - with_cache):
        logits = model(idx[:, -window:])
        following = _next_token(logits[:, -1, :vocabulary], temperature, top_k, generator)
        idx = torch.cat([idx, following], dim=1)
    return idx


def _next_token(logits: torch.Tensor, temperature: float, top_k, generator) -> torch.Tensor:
    """The id (1, 1) drawn from the scores (1, vocab) of the next token: the likeliest at `temperature` 0."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
