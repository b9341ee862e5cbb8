"""The key/value cache of text generation: what each layer of a model keeps of the tokens it has read, so that
a new token runs one position through the model instead of the whole sequence again (models/gpt.py
`generate`).

A layer that takes part declares `kv_cache = None` (as `context_parallel`, a hook the training code never
sets); `cached(model)` gives each such layer a `KVCache` of its own for the length of a `with` block. An
attention layer turns its new tokens by, or looks up, the positions after those it has read
(`KVCache.positions`), keeps their keys and values (`KVCache.extend`) and attends to all it keeps
(`attend`); the GPT's embeddings only count the tokens, to take the rows of their positions.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class KVCache:
    """One layer's count of the tokens it has read and, for an attention layer, their keys and values
    (B, kv_heads, tokens, head_dim), kept as the layer computed them (rotated, for the llama's keys)."""

    def __init__(self):
        self.length = 0
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def positions(self, count: int, *, device) -> torch.Tensor:
        """The positions of the next `count` tokens: those after the tokens read so far."""
        return torch.arange(self.length, self.length + count, device=device)

    def extend(self, count: int, keys=None, values=None) -> tuple:
        """Count `count` more tokens as read, keeping their `keys` and `values` where given; returns the keys
        and values of every token read (None where none are kept)."""
        if keys is not None:
            self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=2)
            self.values = values if self.values is None else torch.cat([self.values, values], dim=2)
        self.length += count
        return self.keys, self.values


def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention of the newest `queries` (B, heads, T, head_dim) over `keys` and `values` (B, kv_heads,
    S, head_dim) whose last T are theirs: query t sees the keys up to S - T + t. torch's `is_causal` lines the
    two up at their start, right only where S == T (the prompt); a single query sees every key."""
    count, total = queries.shape[2], keys.shape[2]
    grouped = queries.shape[1] != keys.shape[1]
    if count == total:
        return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=grouped)
    mask = None
    if count > 1:
        mask = torch.ones(count, total, dtype=torch.bool, device=queries.device).tril(total - count)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=grouped)


def caching_layers(model: nn.Module) -> list:
    """The layers of `model` that take a cache (none: a model of another kind, which reads whole sequences)."""
    return [module for module in model.modules() if hasattr(module, "kv_cache")]


@contextmanager
def cached(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with a fresh cache in each of its layers that takes one, for the `with` block: a forward then
    reads the tokens after those read before (the first, the sequence from position 0)."""
    layers = caching_layers(model)
    for layer in layers:
        layer.kv_cache = KVCache()
    try:
        yield model
    finally:
        for layer in layers:
            del layer.kv_cache  # back to the class's None
