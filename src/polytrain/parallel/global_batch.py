"""Layers that look at the whole batch behave as on one device when data-parallel ranks each hold a slice.

On one device a BatchNorm layer normalises over the whole batch and a Dropout layer draws one mask for it. Each
data-parallel rank sees only its slice, so by default BatchNorm would normalise over the slice and every rank
would draw its own masks: another model than the one written, and one that `verify` cannot equal. Here:

- **BatchNorm** (1d, 2d, 3d) in training gathers every rank's per-channel count, mean and variance
  (an all-gather that carries gradients back to every rank), combines them as
  the whole batch's (Chan's parallel formula: no cancellation) and normalises with those; running statistics
  are updated from them, so every rank keeps the one-device buffers. One small collective per layer and pass.
- **Dropout** draws the mask of the whole global batch and applies this rank's rows of it. Each layer draws
  from a generator of its own, seeded by its one-device name and one number drawn per step from torch's
  global generator (every rank seeds alike and resumes its generator's state, so every rank draws the same):
  a layer's mask depends neither on the other layers' draws nor on their order, so the stages of a pipeline,
  each holding some of the layers, draw what one device draws. The mask is drawn in the step's first pass and later passes of an
  accumulated step use their rows of it, so masks depend neither on the passes nor on the layout, and in the
  default memory format whatever the model's, so a channels-last replica (data) and a contiguous one (sharded)
  draw alike. One device draws its masks the same way (the reference every layout is compared with); they
  are Bernoulli(1 - p) masks scaled by 1 / (1 - p), as `F.dropout`'s. The batch dimension is the first whose
  size is the pass's sample count (`batch_dimension`: 0 in batch-first code, 1 in sequence-first `(T, B, ...)`
  code); a layer whose input has none (batch and time flattened into one) is torch's own dropout, drawn on
  each rank, and the first data rank says so in one line at its first step.

Both change the layer's `forward` on the module object only: its parameters, buffers and names stay as they
are, and evaluation (running statistics, no dropout) is the layer's own.
"""

from __future__ import annotations

import zlib
from typing import List, Optional, Tuple

import torch
import torch.nn as nn


def is_attention(module: nn.Module) -> bool:
    """Whether `module` is an attention layer as a model writes one: torch's nn.MultiheadAttention, or a class
    named for attention (Hugging Face's LlamaAttention, GPT-2's GPT2Attention)."""
    return isinstance(module, nn.MultiheadAttention) or "attention" in type(module).__name__.lower()


class GlobalRows:
    """Which rows of the step's global batch this rank's current pass holds (set by the strategy per pass)."""

    def __init__(self):
        self.start, self.stop, self.total, self.step = 0, 0, 0, 0
        self.key, self.keyed = 0, None  # the number that seeds the masks, and the step it was drawn for
        self.active = False  # only within a training step: elsewhere the layers are torch's own
        self.loud = False  # whether this rank says which layers cannot draw over the global batch
        self.told: set = set()  # the layers it has named

    def set(self, start: int, stop: int, total: int, *, step: int) -> None:
        self.start, self.stop, self.total, self.step = start, stop, total, step
        self.active = True

    def step_key(self) -> int:
        """The step's number from torch's global generator: drawn by the first mask of each step (a model
        without Dropout draws nothing), the same on every rank that holds a Dropout layer."""
        if self.keyed != self.step:
            self.key, self.keyed = int(torch.randint(0, 2**62, (1,))), self.step
        return self.key


def slice_offsets(total: int, parts: int) -> List[Tuple[int, int]]:
    """(start, stop) of each of `parts` near-equal parts of `total` rows, as torch.tensor_split cuts them."""
    size, extra = divmod(total, parts)
    bounds, start = [], 0
    for part in range(parts):
        stop = start + size + (1 if part < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _batchnorm_forward(module: nn.modules.batchnorm._BatchNorm, group, x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as collectives

    # (named all_gather_tensor_autograd before torch 2.13)
    gather = (
        getattr(collectives, "all_gather_single_autograd", None) or collectives.all_gather_tensor_autograd
    )
    if not module.training:
        return type(module).forward(module, x)
    dims = [0] + list(range(2, x.dim()))
    count = x.new_full((1,), x.numel() // max(x.shape[1], 1))
    var, mean = torch.var_mean(x, dim=dims, correction=0)
    # every rank's (count, mean, variance); its backward sums each rank's gradients back (reduce-scatter)
    stats = torch.cat([count, mean, var]).unsqueeze(0)
    parts = gather(stats, gather_dim=0, group=group or dist.group.WORLD)
    channels = x.shape[1]
    counts, means, variances = parts[:, 0], parts[:, 1 : 1 + channels], parts[:, 1 + channels :]
    total = counts.sum()
    weights = (counts / total).unsqueeze(1)
    global_mean = (weights * means).sum(0)
    global_var = (weights * (variances + (means - global_mean) ** 2)).sum(0)
    if module.track_running_stats and module.running_mean is not None:
        with torch.no_grad():
            module.num_batches_tracked.add_(1)
            momentum = 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum
            unbiased = global_var * (total / (total - 1)) if float(total) > 1 else global_var
            module.running_mean.mul_(1 - momentum).add_(global_mean.detach(), alpha=momentum)
            module.running_var.mul_(1 - momentum).add_(unbiased.detach(), alpha=momentum)
    shape = [1, channels] + [1] * (x.dim() - 2)
    y = (x - global_mean.reshape(shape)) / torch.sqrt(global_var.reshape(shape) + module.eps)
    if module.affine:
        y = y * module.weight.reshape(shape) + module.bias.reshape(shape)
    return y


def batch_dimension(shape: torch.Size, held: int, remembered: Optional[int] = None) -> Optional[int]:
    """Which dimension of a tensor of `shape` runs over the `held` samples of this rank's pass: the one this
    layer used before (`remembered`) where it still fits, else the first of that size: dimension 0 in batch-first
    code, 1 in sequence-first code (`(T, B, width)`, also where the width equals the samples; where the
    sequence length does, dimension 0 is taken). None where no dimension has that size: e.g. batch and time
    flattened into one."""
    matches = [dim for dim, size in enumerate(shape) if size == held]
    if remembered in matches:
        return remembered
    return matches[0] if matches else None


def _dropout_forward(
    module: nn.Dropout, name: str, rows: GlobalRows, cache: dict, x: torch.Tensor
) -> torch.Tensor:
    if not module.training or module.p == 0:
        return x
    if module.p == 1:
        return x * 0
    held = rows.stop - rows.start
    dim = batch_dimension(x.shape, held, cache.get("dim"))
    if dim is None:  # no dimension of this pass's samples: torch's own dropout, drawn on this rank
        if rows.loud and name not in rows.told:
            rows.told.add(name)
            print(per_rank_note(name, tuple(x.shape), held), flush=True)
        return torch.nn.functional.dropout(x, module.p, training=True)
    if x.numel() == 0:
        return x
    cache["dim"] = dim
    others = x.shape[:dim] + x.shape[dim + 1 :]
    key = rows.step_key()
    if cache.get("step") != (rows.step, key) or cache.get("shape") != (dim, others):
        generator = torch.Generator(device=x.device)
        generator.manual_seed((key * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        whole = (*x.shape[:dim], rows.total, *x.shape[dim + 1 :])
        noise = x.new_empty(whole).bernoulli_(1 - module.p, generator=generator)
        noise.div_(1 - module.p)
        cache.update(step=(rows.step, key), shape=(dim, others), noise=noise)
    return x * cache["noise"].narrow(dim, rows.start, held)


def per_rank_note(name: str, shape: tuple, held: int) -> str:
    """The line saying that the dropout layer `name` draws its masks on each rank."""
    return (
        f"note: dropout {name or 'layer'} gets a {tuple(shape)} tensor with no dimension of this pass's {held} "
        f"samples, so it draws its masks on each rank as torch does: several devices train with other masks "
        f"than one"
    )


def whole_batch_layers(model: nn.Module, rows: GlobalRows, *, batchnorm: bool, group=None) -> List[str]:
    """Make `model`'s Dropout layers (and with `batchnorm` its BatchNorm layers, over the process `group`)
    compute over the global batch, in place; their names."""
    changed = []
    for name, module in model.named_modules():
        if (
            batchnorm
            and isinstance(module, nn.modules.batchnorm._BatchNorm)
            and not isinstance(module, nn.SyncBatchNorm)
        ):
            module.forward = _WholeBatch(module, name, rows, group=group)
            changed.append(name)
        elif type(module) is nn.Dropout:
            module.forward = _WholeBatch(module, name, rows)
            changed.append(name)
    return changed


class _WholeBatch:
    """A layer's forward over the global batch within polytrain's training steps, and its class's own elsewhere
    (an object holding the layer, not a closure: the model still deep-copies and pickles)."""

    def __init__(self, module: nn.Module, name: str, rows: GlobalRows, *, group=None):
        self.module, self.name, self.rows, self.group, self.cache = module, name, rows, group, {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rows.active:
            return type(self.module).forward(self.module, x)
        if isinstance(self.module, nn.modules.batchnorm._BatchNorm):
            return _batchnorm_forward(self.module, self.group, x)
        return _dropout_forward(self.module, self.name, self.rows, self.cache, x)


def uses_whole_batch(model: nn.Module) -> set:
    """The kinds of layer whose output depends on the whole batch or its random draws ("BatchNorm",
    "Dropout") that `model` holds."""
    kinds = set()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            kinds.add("BatchNorm")
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            kinds.add("Dropout")
    return kinds


# the names of an attention module's dropout probability where it hands it to its attention kernel
# (scaled_dot_product_attention, or F.dropout on the weights), as Hugging Face's and nanoGPT's attention do; an
# nn.Dropout of these names counts only in a module with a `config` (Hugging Face's, which pass its `p` on)
ATTENTION_DROPOUT_NAMES = (
    "attention_dropout",
    "attn_dropout",
    "attn_pdrop",
    "dropout",
    "dropout_p",
    "dropout_prob",
)


def _attention_dropout(module: nn.Module) -> float:
    if isinstance(module, nn.MultiheadAttention):
        return module.dropout
    if not is_attention(module):
        return 0.0
    for name in ATTENTION_DROPOUT_NAMES:
        value = module.__dict__.get(name, module._modules.get(name))
        if isinstance(value, float) and not isinstance(value, bool):
            return value
        if type(value) is nn.Dropout and hasattr(module, "config"):
            return value.p
    return 0.0


def per_rank_dropout(model: nn.Module) -> List[Tuple[str, str]]:
    """The layers that draw dropout masks on each rank, whose masks no layout draws as one device does: inside a
    kernel (LSTM/GRU dropout between layers, attention dropout) or dropout classes other than nn.Dropout
    (Dropout2d, AlphaDropout, ...). Each as (name, what: "LSTM dropout 0.2", "attention", "Dropout2d 0.1")."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and type(module) is not nn.Dropout:
            if module.p > 0:
                found.append((name, f"{type(module).__name__} {module.p:g}"))
        elif isinstance(module, nn.RNNBase):
            if module.dropout > 0 and module.num_layers > 1:
                found.append((name, f"{type(module).__name__} dropout {module.dropout:g}"))
        elif _attention_dropout(module) > 0:
            found.append((name, "attention"))
    return found


def per_rank_dropout_words(model: nn.Module) -> Optional[str]:
    """The layers of `per_rank_dropout` and their verb in words ("rnn (LSTM dropout 0.2) and 4 attention layers
    draw"), or None."""
    found = per_rank_dropout(model)
    named = [f"{name or 'the model'} ({what})" for name, what in found if what != "attention"]
    if len(named) > 3:
        named = named[:2] + [f"{len(named) - 2} more"]
    attention = sum(1 for _, what in found if what == "attention")
    if attention:
        named.append(f"{attention} attention layer{'s' if attention > 1 else ''}")
    if not named:
        return None
    verb = "draws" if len(found) == 1 else "draw"
    return (named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]) + " " + verb


def per_rank_dropout_line(model: nn.Module, devices: int) -> Optional[str]:
    """One line naming the layers that draw their dropout masks on each rank, for a run on `devices` > 1."""
    words = per_rank_dropout_words(model) if devices > 1 else None
    if words is None:
        return None
    return (
        f"note: {words} dropout masks on each rank: {devices} devices train with other masks than one "
        f"device; set their dropout to 0 for identical results"
    )
