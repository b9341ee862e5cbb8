"""A Llama-style decoder (Llama 3's design, as torchtitan's llama3 model lays it out): RMSNorm before attention
and MLP, rotary position embeddings, grouped-query attention (fewer key/value heads than query heads), a SwiGLU
MLP, no biases (Qwen2's q/k/v biases with --qkv-bias), and an output head of its own (tied to the token
embedding with --tie-embeddings).

    polytrain train --model llama --dataset shakespeare
    polytrain verify --model llama --dataset shakespeare --devices 2 --strategy tensor
    polytrain train --model llama --size 8b ...     (Llama 3 8B's shape; 70b too: for planning)
    polytrain train --init-from DIR --dataset shakespeare   (a Hugging Face Llama or Qwen2 checkpoint)

As the GPT, the model is an `nn.Sequential` of [token embedding, block x L, final RMSNorm, head], so the
pipeline splits it between blocks, and its attention reshapes with `view(B, T, -1, head_dim)`, so a rank of a
tensor-parallel run that holds some of the wq/wk/wv rows (and wo columns) runs those heads only. The rotary
angles are computed in each forward from the positions 0..T-1 (no buffer: a tensor plan replicates
parameters only, and a model built on the meta device needs nothing restored), and they rotate the two halves
of each head (Hugging Face's layout: its LlamaForCausalLM's weights load by name, see models/llama_hf.py; Meta's and
torchtitan's turn neighbouring pairs, so their wq and wk rows would need Hugging Face's permutation). Token ids
(B, T) as int64 in, scores (B, T, vocab) out.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config.declare import flag_name
from ..config.model_defaults import MODEL_DEFAULTS, Mixture, derived_sizes, mixture_of, preset
from ..errors import ConfigError
from .kv_cache import attend
from .moe import FeedForward, GroupedExperts, MixtureOfExperts
from .packing import PackedSequential

NORM_EPS = 1e-5  # Llama 3's RMSNorm epsilon (--norm-eps; Hugging Face's rms_norm_eps)


def rotary(positions, head_dim: int, theta: float, *, like: torch.Tensor) -> tuple:
    """cos and sin (positions, head_dim) of the rotary embedding: position p turns the pair (j, j + head_dim/2)
    of a head by p * theta ** (-2j / head_dim). `positions` is a count (the positions 0..positions-1) or a
    tensor of positions (a rank's tokens of a sequence split across ranks). Computed in float32 (float64 for
    float64 activations), then given the activations' dtype, as Llama's reference does."""
    exact = torch.float64 if like.dtype == torch.float64 else torch.float32
    steps = torch.arange(0, head_dim, 2, device=like.device, dtype=exact) / head_dim
    if not isinstance(positions, torch.Tensor):
        positions = torch.arange(positions, device=like.device, dtype=exact)
    angles = positions.to(like.device, exact)[..., None] * (1.0 / theta**steps)  # ((B,) T, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, head_dim) with each head's halves turned by the rotary angles."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class HeadNorm(nn.RMSNorm):
    """An RMSNorm over each head's width (--qk-norm) that runs in its input's precision: under autocast the
    projection before it gives bf16 (Qwen3's bf16 weights do the same), where a float32 weight would leave
    torch's fused kernel with a warning."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


class Attention(nn.Module):
    """Causal grouped-query attention: `heads` query heads share `kv_heads` key/value heads in groups. With
    `context_parallel` set (a ContextGroup) over a sequence split across ranks, its tokens are turned by the
    rotary angles of their global positions and its queries attend to the whole sequence's keys and values
    (parallel/context.py). With `kv_cache` set (a KVCache, while models/gpt.py `generate` runs), its
    tokens follow those read before: turned by the angles of their true positions, their queries attend to
    the cached keys and values and their own (models/kv_cache.py)."""

    context_parallel = None
    kv_cache = None
    rows = None  # the positions of rows packed into the windows (models/packing.py)

    def __init__(
        self,
        width: int,
        heads: int,
        kv_heads: int,
        rope_theta: float,
        qkv_bias: bool = False,
        *,
        head_dim: Optional[int] = None,
        qk_norm: bool = False,
        norm_eps: float = NORM_EPS,
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim or width // heads
        self.rope_theta = rope_theta
        self.wq = nn.Linear(width, heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(width, kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(width, kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(heads * self.head_dim, width, bias=False)
        if qk_norm:  # Qwen3's: each query and key head normalised over its head_dim before the rotary angles
            self.q_norm = HeadNorm(self.head_dim, eps=norm_eps)
            self.k_norm = HeadNorm(self.head_dim, eps=norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (layer(x).view(B, T, -1, self.head_dim) for layer in (self.wq, self.wk, self.wv))
        if hasattr(self, "q_norm"):  # (B, T, heads, head_dim): a tensor plan's rank holds whole heads
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (part.transpose(1, 2) for part in (q, k, v))
        split, cache = self.context_parallel, self.kv_cache
        packed = self.rows is not None and self.rows.positions is not None
        if cache is not None:
            positions = cache.positions(T, device=x.device)
        elif packed:  # (B, T): each row's own, turning (B, 1, T, head_dim)
            positions = self.rows.positions
        else:
            positions = T if split is None else split.positions(T, device=x.device)
        cos, sin = rotary(positions, self.head_dim, self.rope_theta, like=q)
        if cos.dim() == 3:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            y = attend(q, *cache.extend(T, k, v))
        elif packed:
            y = self.rows.attention(q, k, v, split)
        elif split is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        else:
            y = split.attention(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    """x + attention(norm(x)), then x + feed_forward(norm(x)); the feed-forward a mixture of experts where
    `experts` gives its (E, K, shared, renormalise) (models/moe.py)."""

    def __init__(
        self,
        width: int,
        heads: int,
        kv_heads: int,
        ffn_width: int,
        rope_theta: float,
        *,
        norm_eps: float = NORM_EPS,
        qkv_bias: bool = False,
        head_dim: Optional[int] = None,
        qk_norm: bool = False,
        mixture: Optional[Mixture] = None,
        block: int = 0,
    ):
        super().__init__()
        self.attention_norm = nn.RMSNorm(width, eps=norm_eps)
        self.attention = Attention(
            width,
            heads,
            kv_heads,
            rope_theta,
            qkv_bias,
            head_dim=head_dim,
            qk_norm=qk_norm,
            norm_eps=norm_eps,
        )
        self.ffn_norm = nn.RMSNorm(width, eps=norm_eps)
        if mixture:
            self.feed_forward = MixtureOfExperts(
                width,
                ffn_width,
                mixture.experts,
                mixture.per_token,
                shared=mixture.shared,
                renormalise=mixture.renormalise,
                balance=mixture.balance,
                block=block,
            )
        else:
            self.feed_forward = FeedForward(width, ffn_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


def _check_sizes(*, head_dim=None, **sizes) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{flag_name(name)} must be a positive whole number, got {value!r}")
    heads, kv_heads, width = sizes["heads"], sizes["kv_heads"], sizes["width"]
    if head_dim is not None:
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 2 or head_dim % 2:
            raise ConfigError(
                f"--head-dim must be an even whole number above 0 (rotary embeddings turn pairs), got {head_dim!r}"
            )
    elif width % heads or (width // heads) % 2:
        near = 2 * heads * max(1, round(width / heads / 2))
        raise ConfigError(
            f"--width {width} over --heads {heads} must give each head an even width (rotary embeddings turn "
            f"pairs); give a --width that is a multiple of {2 * heads}, such as {near}"
        )
    if heads % kv_heads:
        divisor = max(d for d in range(1, kv_heads + 1) if heads % d == 0)
        raise ConfigError(
            f"--kv-heads {kv_heads} does not divide --heads {heads} (each key/value head serves a group of "
            f"query heads); give a divisor of {heads} such as {divisor}"
        )


class Llama(PackedSequential):
    """[nn.Embedding, Block x layers, RMSNorm, Linear head] (the head tied to the embedding with
    `tie_embeddings=True`), whose forward takes the positions of packed rows beside the ids. `kv_heads` and `ffn_width` default as `derived_sizes` says; `norm_eps` is the
    RMSNorms' epsilon, `qkv_bias` gives the query, key and value projections biases (Qwen2's); `head_dim` the
    width of a head (default: width / heads; Qwen3's differ), `qk_norm` an RMSNorm of each query and key head
    (Qwen3's)."""

    # the layers --lora adapts by default (models/lora.py): every projection of the attention and feed-forward
    LORA_TARGETS = (
        "*.attention.wq",
        "*.attention.wk",
        "*.attention.wv",
        "*.attention.wo",
        "*.feed_forward.w1",
        "*.feed_forward.w2",
        "*.feed_forward.w3",
        "*.feed_forward.shared.w1",
        "*.feed_forward.shared.w2",
        "*.feed_forward.shared.w3",
    )

    def __init__(
        self,
        vocab: int,
        *,
        context: int = 64,
        layers: int = 4,
        heads: int = 4,
        kv_heads=None,
        width: int = 128,
        ffn_width=None,
        rope_theta: float = 500000.0,
        tie_embeddings: bool = False,
        norm_eps: float = NORM_EPS,
        qkv_bias: bool = False,
        head_dim=None,
        qk_norm: bool = False,
        positions=None,
        experts=None,
        experts_per_token=None,
        shared_experts=None,
        moe_every=None,
        experts_renormalise=None,
        router_aux_loss=None,
    ):
        derived = derived_sizes(heads, width)
        kv_heads = derived.get("kv_heads") if kv_heads is None else kv_heads
        ffn_width = derived.get("ffn_width") if ffn_width is None else ffn_width
        _check_sizes(
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            width=width,
            ffn_width=ffn_width,
            context=context,
            vocab_size=vocab,
            head_dim=head_dim,
        )
        if not isinstance(rope_theta, (int, float)) or isinstance(rope_theta, bool) or not rope_theta > 0:
            raise ConfigError(
                f"--rope-theta must be a number above 0, got {rope_theta!r}; Llama 3's is 500000"
            )
        if not isinstance(norm_eps, (int, float)) or isinstance(norm_eps, bool) or not norm_eps > 0:
            raise ConfigError(f"--norm-eps must be a number above 0, got {norm_eps!r}; Llama 3's is 1e-05")
        mixture = mixture_of(
            experts, experts_per_token, shared_experts, moe_every, experts_renormalise, router_aux_loss
        )
        if mixture and mixture.every > layers:
            raise ConfigError(
                f"--moe-every {mixture.every} leaves none of the {layers} blocks a mixture of experts; give at most "
                f"--moe-every {layers}"
            )
        embedding = nn.Embedding(vocab, width)
        head = nn.Linear(width, vocab, bias=False)
        if tie_embeddings:
            head.weight = embedding.weight
        blocks = (
            Block(
                width,
                heads,
                kv_heads,
                ffn_width,
                float(rope_theta),
                norm_eps=float(norm_eps),
                qkv_bias=qkv_bias,
                head_dim=head_dim,
                qk_norm=bool(qk_norm),
                mixture=mixture if mixture and (i + 1) % mixture.every == 0 else None,
                block=i,
            )
            for i in range(layers)
        )
        super().__init__(embedding, *blocks, nn.RMSNorm(width, eps=float(norm_eps)), head)
        self.vocab, self.context, self.layers = vocab, context, layers
        # the longest sequence it reads (a checkpoint's max_position_embeddings; default: the training context)
        self.positions = context if positions is None else positions
        self._init_weights(layers)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """The initialisation of `_init_weights` for one module, `name` in this model (models built on the
        meta device are initialised module by module: parallel/meta.py)."""
        if isinstance(module, GroupedExperts):
            module.reset_parameters(residual_std=0.02 / (2 * self.layers) ** 0.5)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            residual = name.endswith(("attention.wo", "feed_forward.w2", "feed_forward.shared.w2"))
            nn.init.normal_(
                module.weight, mean=0.0, std=0.02 / (2 * self.layers) ** 0.5 if residual else 0.02
            )
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()

    @torch.no_grad()
    def _init_weights(self, layers: int) -> None:
        """The GPT's initialisation: N(0, 0.02), the residual projections (wo, w2) scaled by
        1/sqrt(2 * layers); the norms' weights one, biases (--qkv-bias) zero."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, GroupedExperts):
                module.reset_parameters(residual_std=0.02 / (2 * layers) ** 0.5)
        for name, parameter in self.named_parameters():
            if name.endswith(
                ("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.shared.w2.weight")
            ):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / (2 * layers) ** 0.5)


def build_llama(input_shape, num_classes: int, *, size=None, vocab_size=None, context=None, **sizes) -> Llama:
    """The registry's builder: `input_shape` is (context,), `num_classes` the dataset's vocabulary; `size` a
    named shape whose sizes fill those not given; --vocab-size may exceed the dataset's vocabulary."""
    if len(input_shape) != 1:
        raise ConfigError(
            f"--model llama reads text, not images of shape {tuple(input_shape)}; use --dataset "
            f"shakespeare or --dataset text --data-dir FILE"
        )
    named = preset("llama", size)
    shape = {key: MODEL_DEFAULTS["llama"][key] for key in ("layers", "heads", "width", "rope_theta")}
    shape.update({key: named[key] for key in named if key not in ("vocab_size", "context")})
    shape.update({key: value for key, value in sizes.items() if value is not None})
    vocab = vocab_size if vocab_size is not None else named.get("vocab_size", num_classes)
    if isinstance(vocab, int) and vocab < num_classes:
        raise ConfigError(
            f"--vocab-size {vocab} is smaller than the dataset's {num_classes} tokens; give --vocab-size "
            f"{num_classes} or more, or leave it out (default: the dataset's)"
        )
    context = context if context is not None else named.get("context", int(input_shape[0]))
    positions = shape.get("positions")
    if positions is not None and isinstance(context, int) and context > positions:
        raise ConfigError(
            f"--context {context} is longer than the {positions} positions the llama reads (--positions: a "
            f"checkpoint's max_position_embeddings); its rotary angles past them were never trained, and the "
            f"checkpoint does not scale them (rope_scaling): give --context {positions} or less"
        )
    return Llama(vocab, context=context, **shape)
