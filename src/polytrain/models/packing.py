"""Packed rows (`--pack`, data/token_rows.py `PackedRows`): several short rows in one window of `--context` tokens,
each row attending to its own tokens only, at positions that start again at 0 with each row, as transformers'
packing with position ids does (its `DataCollatorWithFlattening`).

A packed batch's inputs are `(ids, positions)`, both (B, T) (models/__init__.py `call_model` passes a tuple as
arguments): the llama's and the GPT's `forward(ids, positions)` (`PackedSequential`) hand the positions to their layers for the pass
through the `Rows` they share. Each attention layer masks a query to the keys of its own row before it (a
block-diagonal causal mask) and turns queries and keys by the rotary angles of their positions in the row; the
GPT reads its table of positions at them. Without positions (an unpacked batch, generation) nothing changes.

The positions stay set until the next pass, so that activation checkpointing recomputes a layer with the pass's
own. Under context parallelism each rank holds its head and tail chunks of the ids and the positions, and its
queries attend over the whole window's keys and values, gathered, under the mask of their rows (`Rows.mask`). A
pipeline, whose stages run micro-batches out of turn, is refused with --pack (config/train.py). The mask is a
(B, 1, T, T) boolean tensor per pass, which attention keeps for its backward in each layer: packing is meant for
windows of moderate length. A packed window's loss and gradients are those of its rows each alone, in float64
(tests/test_pack.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UserError
from ..parallel.context import gather_sequence


class Rows:
    """The positions (B, T) of the pass a model is in, shared by its layers (None: unpacked), and the mask that
    keeps each row's queries to its own keys before them."""

    def __init__(self):
        self.positions: Optional[torch.Tensor] = None
        self._mask: Optional[torch.Tensor] = None

    def set(self, positions: Optional[torch.Tensor]) -> None:
        self.positions, self._mask = positions, None

    def mask(self, split=None) -> torch.Tensor:
        """(B, 1, T, T) booleans: query t sees key s where s <= t and both are of the same row (a row starts where
        its position is 0). Under context parallelism (`split`, a ContextGroup: the positions are this rank's
        head-tail part of each window) the rows of this rank's queries over the whole window's keys,
        (B, 1, T / C, T)."""
        if self._mask is None:
            positions = self.positions
            if split is not None:  # the whole windows' positions, gathered from every rank's part
                positions = gather_sequence(positions, split, dim=1)
            row = (positions == 0).cumsum(dim=1)
            T = row.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=row.device).tril()
            mask = (row[:, :, None] == row[:, None, :]) & causal
            if split is not None:
                mask = mask[:, split.positions(self.positions.shape[1], device=row.device)]
            self._mask = mask.unsqueeze(1)
        return self._mask

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split=None) -> torch.Tensor:
        """Attention of packed rows: q (B, heads, T, d), k and v (B, kv_heads, T, d), each query over the keys of
        its own row before it; under context parallelism (`split`) this rank's queries over the whole window's
        keys and values, gathered with autograd (each rank's gradients summed back to its own)."""
        if split is not None:
            k, v = gather_sequence(k, split), gather_sequence(v, split)
        grouped = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(split), enable_gqa=grouped)

    def __deepcopy__(self, memo) -> "Rows":  # (a copy of the model shares a fresh one among its layers)
        return memo.setdefault(id(self), Rows())


def check_packs(model: torch.nn.Module) -> None:
    """One line for `--pack` with a model that cannot keep packed rows apart (its forward takes no positions)."""
    if not isinstance(model, PackedSequential):
        raise UserError(
            f"--pack gives the model the positions of the rows packed into each window, and "
            f"{type(model).__name__} takes none (the llama and the gpt do); drop --pack"
        )


class PackedSequential(nn.Sequential):
    """An `nn.Sequential` whose forward also takes the positions of the rows packed into its inputs, and hands
    them to its layers that read them (a class attribute `rows`: each gets the model's one `Rows`). Without
    positions it is nn.Sequential's forward, so that a pipeline splits it as one (pipeline/layers.py)."""

    rows = None

    def __init__(self, *layers: nn.Module):
        super().__init__(*layers)
        self.rows = Rows()
        for module in self.modules():
            if "rows" in type(module).__dict__:
                module.rows = self.rows

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layers on ids `x` (B, T); `positions` (B, T): those of rows packed into them."""
        self.rows.set(positions)
        return super().forward(x)
