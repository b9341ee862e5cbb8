"""A model's own token loss summed, not averaged, so that N devices and accumulation train what one device does.

A Hugging Face model given `labels` of shape (N, T) returns the mean of its token losses over the labels it
trains: those not -100, after shifting them one place left in a causal LM. polytrain cuts each global batch
into ranks' slices and accumulation passes whose label counts differ (padding, prompts), so weighting each
part's mean by its samples is not the global batch's token mean: 2 ranks trained a tiny Llama 4e-2 away from
one device in 4 SGD steps, and a pass whose labels were all -100 made the loss NaN (tests/test_own_loss.py).

A model whose forward takes `num_items_in_batch` (Hugging Face's loss keyword, which its Trainer passes for the
same reason) divides its token losses' sum by that number instead. Each pass therefore counts the labels its
model trains, as Hugging Face's Trainer counts them (`trained_labels`), passes that count (1 where it is 0, so
that an empty pass adds 0, not NaN) and multiplies the loss back into a (sum, count) pair: the step then
minimises the global batch's sum over its count, as for any (sum, count) loss (objective.py), with the one
all-reduce of counts per step those already make, and reports train_loss and val_loss as global token means.
The rule is checked once on two samples (`label_shift`): the loss given `num_items_in_batch` must be the sum of
what the mean covers. A model that fails it, or takes no such keyword, keeps its mean weighted by samples, and
the run says so in one line (`NOT_TOKEN_EXACT`).
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn

from ..data.token_rows import IGNORE_INDEX

NOT_TOKEN_EXACT = (
    "note: the model's own loss is its mean over each micro-batch's labels (-100 left out), and {why}, so "
    "polytrain weighs each micro-batch's mean by its samples: where parts hold different numbers of labels, "
    "N devices and --accumulate train other weights than one device. {remedy}"
)
REMEDY = (
    "For the global token mean on any layout, use a model whose forward takes num_items_in_batch (as Hugging "
    "Face's models do), or a step= that returns (sum of the token losses, their count), or a model that "
    "returns logits on (input, next-token labels) pairs, whose token loss polytrain computes"
)


def token_labels(x) -> Optional[torch.Tensor]:
    """The batch's token labels, shape (N, T, ...) of integers, where `x` is a dict that holds them; else None
    (a dict without labels, labels per sample: a mean over samples is already what polytrain weighs)."""
    labels = x.get("labels") if isinstance(x, dict) else None
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and not labels.is_floating_point():
        return labels
    return None


def takes_num_items(model: nn.Module) -> bool:
    """Whether the model's forward accepts `num_items_in_batch`, decided as Hugging Face's Trainer decides it:
    the model's `accepts_loss_kwargs` where it has one, else a forward with **kwargs (or the keyword itself)."""
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is not None:
        return bool(accepts)
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD or p.name == "num_items_in_batch" for p in parameters)


def shifts_labels(model: nn.Module) -> bool:
    """Whether the model's loss shifts the labels one place left before counting them: a causal LM's
    (Hugging Face's ForCausalLMLoss), not an encoder-decoder's, a masked LM's or a token classifier's."""
    loss_type = getattr(model, "loss_type", None)
    if loss_type is None:
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    decoder_only = not getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return LOSS_MAPPING.get(loss_type) is ForCausalLMLoss and decoder_only


def trained_labels(labels: torch.Tensor, shift: int) -> torch.Tensor:
    """How many labels the loss trains (not -100, after dropping the first `shift` of each row), as an integer
    tensor on the labels' device (no read on the host)."""
    return (labels[..., shift:] != IGNORE_INDEX).sum()


def label_shift(
    model: nn.Module, x, mean: torch.Tensor, loss_on: Callable
) -> Tuple[Optional[int], Optional[str]]:
    """(shift, note) for a model whose own loss on the sample batch `x` was the scalar `mean`: `shift` (0, or 1
    for a causal LM) where each pass can pass `num_items_in_batch` and sum the loss, else None with the line
    that says why not (None where `x` holds no token labels: nothing to say). `loss_on(batch)` is the model's
    own loss on a batch."""
    labels = token_labels(x)
    if labels is None:
        return None, None
    if not takes_num_items(model):
        return None, NOT_TOKEN_EXACT.format(
            why=f"{type(model).__name__}.forward takes no num_items_in_batch", remedy=REMEDY
        )
    shift = 1 if shifts_labels(model) else 0
    if mean.is_meta:  # a model built on the meta device gives shapes, no values to check: its keyword decides
        return shift, None
    count = int(trained_labels(labels, shift))
    if honours_num_items(loss_on, x, mean, count):
        return shift, None
    why = (
        f"given num_items_in_batch, {type(model).__name__}'s loss on two samples was not its token losses' sum "
        f"over it"
    )
    return None, NOT_TOKEN_EXACT.format(why=why, remedy=REMEDY)


def weighed_by_samples(objective, *, why: str, remedy: str):
    """`objective` with a model's own loss taken as its mean again, weighed by samples, and the note that says
    so: where a run cannot sum it (asynchronous servers have no global step over which to count labels)."""
    objective.label_shift, objective.counted = None, False
    objective.note = NOT_TOKEN_EXACT.format(why=why, remedy=remedy)
    return objective


@torch.no_grad()
def honours_num_items(loss_on: Callable, x: dict, mean: torch.Tensor, count: int) -> bool:
    """Whether the model's loss (`loss_on(batch)`) on `x` given num_items_in_batch = count + 1 is its `count`
    labels' losses summed over that (`mean` x count / (count + 1)): it follows the keyword and counts what
    `trained_labels` counts. (With no trained label the sum is 0, where the mean is NaN.)"""
    from ..errors import UserError

    given = dict(x, num_items_in_batch=torch.tensor(count + 1))
    try:
        value = loss_on(given)
    except UserError:  # e.g. **kwargs handed on to a module that takes no such keyword
        return False
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        return False
    value, mean = float(value), float(mean)
    expected = 0.0 if count == 0 else mean * count / (count + 1)
    return abs(value - expected) <= 1e-4 * max(abs(expected), 1e-6)


def with_num_items(x: dict, labels: torch.Tensor, shift: int) -> Tuple[dict, torch.Tensor]:
    """(the batch `x` with num_items_in_batch: its trained labels' count, at least 1; that count, which may
    be 0): the model's loss times the keyword's value is then the sum of its token losses (0 where none)."""
    count = trained_labels(labels, shift)
    return dict(x, num_items_in_batch=count.clamp(min=1)), count
