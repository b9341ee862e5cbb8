"""A decoder-only transformer (GPT) for character-level language modelling.

The model is an `nn.Sequential` of [embeddings, block x L, final LayerNorm, head] so that the pipeline
strategy can split it between blocks. It takes token ids (B, T) as int64 and returns scores (B, T, vocab).
The head's weight is the token embedding's (tied, as in GPT-2); the attention keeps heads as a dimension of
its own (`view(B, T, heads, head_dim)`), so heads can later be split across devices.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError

# nanoGPT's CPU-sized model ("baby GPT" on Shakespeare)
DEFAULT_SIZES = dict(layers=4, heads=4, width=128, context=64)


class Embeddings(nn.Module):
    """Token plus position embeddings: (B, T) ids -> (B, T, width)."""

    def __init__(self, vocab: int, context: int, width: int, dropout: float = 0.0):
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout) if dropout else None  # (no layer at all without dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.token(idx) + self.position(positions)
        return x if self.drop is None else self.drop(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.head_dim = width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout) if dropout else None  # (no layer at all without dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (part.view(B, T, -1, self.head_dim).transpose(1, 2) for part in self.qkv(x).chunk(3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return y if self.drop is None else self.drop(y)


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x)) with a 4x GELU MLP."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, dropout)
        self.norm2 = nn.LayerNorm(width)
        mlp = [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
        self.mlp = nn.Sequential(*mlp, *([nn.Dropout(dropout)] if dropout else []))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Sequential):
    """[Embeddings, Block x layers, LayerNorm, Linear head tied to the token embedding (`tied=False`: a head
    of its own, which a pipeline can put on another stage than the embedding)]."""

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
        embeddings = Embeddings(vocab, context, width, dropout)
        head = nn.Linear(width, vocab, bias=False)
        if tied:
            head.weight = embeddings.token.weight  # tied input and output embeddings
        blocks = (Block(width, heads, dropout) for _ in range(layers))
        super().__init__(embeddings, *blocks, nn.LayerNorm(width), head)
        self.vocab, self.context, self.layers = vocab, context, layers
        self._init_weights(layers)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """The initialisation of `_init_weights` for one module, `name` in this model (models built on the
        meta device are initialised module by module: models/meta.py)."""
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
    input_shape, num_classes: int, *, layers=None, heads=None, width=None, context=None, dropout=None
) -> GPT:
    """The registry's builder: `input_shape` is (context,), `num_classes` the vocabulary size."""
    if len(input_shape) != 1:
        raise ConfigError(
            f"--model gpt reads text, not images of shape {tuple(input_shape)}; use --dataset "
            f"shakespeare or --dataset text --data-dir FILE"
        )
    given = dict(layers=layers, heads=heads, width=width)
    sizes = {name: DEFAULT_SIZES[name] if value is None else value for name, value in given.items()}
    context = int(input_shape[0]) if context is None else context
    return GPT(num_classes, context=context, dropout=dropout or 0.0, **sizes)


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    tokens: int,
    *,
    temperature: float = 1.0,
    top_k=None,
    generator=None,
    vocabulary: Optional[int] = None,
) -> torch.Tensor:
    """Extend the ids `idx` (1, T) by `tokens` samples, each conditioned on the last `context` ids. With
    `vocabulary`, only ids below it are drawn: a model with more rows than the data's tokens (--vocab-size)
    never emits one the tokenizer cannot decode (the other rows' scores are dropped before sampling)."""
    model.eval()
    for _ in range(tokens):
        logits = model(idx[:, -model.context :])[:, -1, :vocabulary].float()
        if temperature == 0:
            following = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            following = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, following], dim=1)
    return idx
