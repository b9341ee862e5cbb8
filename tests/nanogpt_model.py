"""A GPT written the nanoGPT way (not an nn.Sequential): forward(idx, targets=None) returns (logits, loss),
blocks in an nn.ModuleList under `transformer`, for the traced pipeline tests (importable: worker processes
unpickle it)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """`pair=False` returns the logits alone (the one-device reference of the built-in language objective);
    `tied=True` shares the head's weight with the token embedding, as nanoGPT does."""

    def __init__(
        self,
        vocab: int,
        context: int,
        *,
        layers: int = 2,
        heads: int = 2,
        width: int = 16,
        pair: bool = True,
        tied: bool = False,
    ):
        super().__init__()
        torch.manual_seed(0)
        self.pair = pair
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, width),
                wpe=nn.Embedding(context, width),
                h=nn.ModuleList([Block(width, heads) for _ in range(layers)]),
                ln_f=nn.LayerNorm(width),
            )
        )
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.transformer.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return (logits, loss) if self.pair else logits


class NanoGPTWithAux(NanoGPT):
    """Returns (logits, a scalar it computed besides), as a model giving (logits, loss) does."""

    def forward(self, idx, targets=None):
        logits = super().forward(idx)[0]
        return logits, logits.square().mean()


class Branchy(nn.Module):
    """Control flow on the data's values, which a tracer cannot capture."""

    def __init__(self, vocab: int, width: int = 8):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        if x.sum() > 0:
            x = x * 2
        return self.head(x)
