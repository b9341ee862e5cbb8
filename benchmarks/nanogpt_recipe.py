"""nanoGPT's CPU recipe as a plain loop, the reference for `polytrain train --model gpt --dataset shakespeare`.

Run (about 2 minutes on an idle 2-core CPU):

    python benchmarks/nanogpt_recipe.py

nanoGPT's config/train_shakespeare_char.py with its README's CPU overrides: batch 12, context 64, 4 layers,
4 heads, width 128, 2,000 iterations, lr 1e-3 with 100 warm-up iterations and a cosine to 1e-4 at 2,000, AdamW
betas (0.9, 0.99), weight decay 0.1 on 2-D weights, gradient clipping at 1.0, dropout 0, random windows drawn
with replacement. The model is polytrain's `GPT` (the same architecture, with biases); the data are polytrain's
`shakespeare` split (the first 90% of the characters). After training, the loss on the whole validation split
(windows every 64 characters, as polytrain's validation reads it). Results: docs/benchmarks.md.
"""

import math
import time

import torch
import torch.nn.functional as F

from polytrain.data import load_dataset
from polytrain.models.gpt import GPT

torch.manual_seed(1337)
data = load_dataset("shakespeare", context=64)
train, val = data.train_tokens, data.val_tokens
model = GPT(65)
decay = [p for p in model.parameters() if p.dim() >= 2]
other = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
    lr=1e-3,
    betas=(0.9, 0.99),
)


def lr_at(it, warmup=100, decay_iters=2000, lr=1e-3, min_lr=1e-4):
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - min_lr)


began = time.perf_counter()
for it in range(2000):
    for group in opt.param_groups:
        group["lr"] = lr_at(it)
    ix = torch.randint(len(train) - 64, (12,))
    x = torch.stack([train[i : i + 64] for i in ix])
    y = torch.stack([train[i + 1 : i + 65] for i in ix])
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if it % 250 == 0:
        print(f"iter {it} loss {loss.item():.4f} {time.perf_counter() - began:.0f}s", flush=True)
trained = time.perf_counter() - began
model.eval()
starts = 64 * torch.arange((len(val) - 1) // 64)
windows = val[starts[:, None] + torch.arange(65)]
with torch.no_grad():
    total = sum(
        F.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        for w in windows.split(256)
    )
print(
    f"trained 2000 steps in {trained:.0f} s; validation loss {total / windows[:, 1:].numel():.4f} "
    f"(whole split); total {time.perf_counter() - began:.0f} s",
    flush=True,
)
