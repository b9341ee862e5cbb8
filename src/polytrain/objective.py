"""What training minimises and what it reports, as sums over samples so ranks and micro-batches add up.

The loss is a *per-sample mean*: a step minimises the mean over the whole global batch, whichever way the
batch is cut across ranks or micro-batches. Every part therefore reports its loss as a sum over its samples
(its mean times its sample count); the strategy divides by the global batch size, and the trainer reduces
sums and counts, never means of means. Metrics follow the same rule: `fn(outputs, targets)` returns one value
per sample (shape (n,)) or the batch mean (a scalar); polytrain sums them over samples, ranks and steps and
reports sum / count.

Without `loss=` the objective is classification: cross-entropy on class scores, with accuracy; or, for text
(`kind="language"`, chosen by the dataset, or by a `Dataset` whose targets are token ids (N, T) and a model
that scores every position, (N, T, vocab)), next-token cross-entropy. Positions labelled -100 (`IGNORE_INDEX`,
Hugging Face's convention for padding and prompts) count in neither the loss nor its count: the step minimises
the loss summed over the global batch's other tokens over their number, on any layout. The count is kept in
samples (trained tokens / T), so that without such labels it is the sample count and each sample's loss the
mean over its T tokens, as before masking existed.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .data.order import leaves, rows
from .data.token_rows import IGNORE_INDEX
from .errors import UserError
from .models import call_model, first_output
from .models.moe import balance_loss, mixtures, over_whole_sequences, routed_tokens
from .models.own_loss import token_labels, with_num_items

Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KINDS = ("classification", "language", "model")  # model: the model returns its loss


class Objective:
    def __init__(
        self,
        loss: Optional[Callable] = None,
        metrics: Optional[Dict[str, Metric]] = None,
        *,
        label_smoothing: float = 0.0,
        kind: str = "classification",
        step: Optional[Callable] = None,
        eval_step: Optional[Callable] = None,
        masks_labels: bool = True,
    ):
        for name, fn in (("loss", loss), ("step", step), ("eval_step", eval_step)):
            if fn is not None and not callable(fn):
                raise UserError(f"{name}= must be a callable, got {type(fn).__name__}")
        if eval_step is not None and step is None:
            raise UserError("eval_step= replaces step= in validation; give step= too (or neither)")
        if step is not None and loss is not None:
            raise UserError(
                "give either loss=fn(outputs, targets) or step=fn(model, batch), not both: the step "
                "computes the loss itself"
            )
        if isinstance(metrics, (list, tuple, set, str)):
            raise UserError(
                f"metrics= takes a dict {{name: fn(outputs, targets)}}, not names such as Keras's "
                f"metrics=['accuracy'] ({sorted(metrics) if not isinstance(metrics, str) else metrics!r}): "
                f"classification reports acc already; pass e.g. metrics={{'top5': fn}} for more"
            )
        metrics = dict(metrics or {})
        for name, fn in metrics.items():
            if not isinstance(name, str) or not name.isidentifier() or not callable(fn):
                raise UserError(
                    f"metrics= must map names (letters, digits, _) to callables fn(outputs, targets); "
                    f"got {name!r}: {type(fn).__name__}"
                )
        if kind not in KINDS:
            raise UserError(f"unknown objective kind {kind!r}; choose one of {', '.join(KINDS)}")
        if metrics and (step is not None or kind == "model"):
            raise UserError(
                "metrics= are computed from outputs and targets, which a "
                f"{'step=' if step is not None else 'model that returns its loss'} does not hand over; "
                f"drop metrics= (a callback can compute them from trainer.model)"
            )
        self.loss, self.step, self.eval_step = loss, step, eval_step
        self.label_smoothing = label_smoothing
        self.kind = kind
        builtin = loss is None and step is None and kind != "model"
        self.language = builtin and kind == "language"  # next-token cross-entropy, no accuracy
        self.classification = builtin and not self.language
        # the loss gives (sum, count) pairs (learnt on a sample): each step then divides by the global count;
        # next-token cross-entropy does where labels may be IGNORE_INDEX (`masks_labels`; the built-in text's
        # never are: its steps then need no global count)
        self.counted = self.language and masks_labels
        # a model's own token loss that takes num_items_in_batch: how many places it shifts the labels before
        # counting them (models/own_loss.py; set by check_objective), its passes then give (sum, count) pairs
        self.label_shift: Optional[int] = None
        self.note: Optional[str] = None  # a line the run says at its start about how the loss is weighed
        if self.classification and "acc" in metrics:
            raise UserError("metrics= names 'acc', which classification already reports; choose another name")
        self.metrics = metrics
        self.names: Tuple[str, ...] = (("acc",) if self.classification else ()) + tuple(metrics)
        # the parts each window's tokens are split into across ranks (context parallelism): a rank holds T / parts
        # of a window's T tokens, and its token loss is its part of the window's mean over all T
        self.sequence_parts = 1
        # the model's mixtures of experts add a load-balancing loss (models/moe.py; set by `watch_balance`),
        # reported apart as "balance": the last pass's, summed over its sequences
        self.balances, self.balance_sum = False, None

    def watch_balance(self, model) -> None:
        """Add the load-balancing loss of `model`'s mixtures of experts, where they have one, to the training loss,
        and report it apart (a metric named balance); forget what its check on a sample routed."""
        routed_tokens(model)
        if self.balances or not (self.classification or self.language):
            return
        if any(module.balance_weight for module in mixtures(model)):
            self.balances = True
            self.names = self.names + ("balance",)

    @property
    def custom(self) -> bool:
        """The user's code computes the loss (loss=, step=, or the model itself)."""
        return not (self.classification or self.language)

    @property
    def logs_more(self) -> bool:
        """Whether the step logs figures of its own (a LightningModule's self.log), beyond `names`."""
        return hasattr(self.step, "logged") or hasattr(self.eval_step, "logged")

    @property
    def validates(self) -> bool:
        """Whether validation runs: not for a step that says it has nothing to validate with (a LightningModule
        without validation_step trains without validation, as in Lightning)."""
        return self.eval_step is not None or getattr(self.step, "validates", True)

    def describe_loss(self) -> str:
        if self.step is not None:
            return f"step={name_of(self.step)}"
        if self.kind == "model":
            return "the model's own loss"
        if self.language:
            return "next-token cross-entropy"
        return "cross-entropy" if self.loss is None else name_of(self.loss)

    def compute(self, model, x, y, *, training: bool = True, autocast=contextlib.nullcontext):
        """(loss summed over what it covers, how many elements it covers, outputs or None) of one part of a
        batch: the step's, the model's own, or the loss of the model's outputs. Differentiable."""
        samples = rows(x) if y is None else len(y)
        step = self.step if training or self.eval_step is None else self.eval_step
        if step is not None:
            with autocast(), shards_outside_forward(step):
                value = step(model, x if y is None else (x, y))
            return (*self.sum_and_count(value, samples, "step="), None)
        labels = token_labels(x) if self.kind == "model" and self.label_shift is not None else None
        if labels is not None:  # the model divides its token losses' sum by the count given: multiplied back
            x, trained = with_num_items(x, labels, self.label_shift)
        with autocast():
            outputs = call_model(model, x)
        if self.kind == "model":
            value = carried_loss(outputs)
            if value is None:
                raise UserError(
                    f"the model returned {describe_value(outputs)} without a loss, after returning "
                    f"one on a sample; return an output with .loss (or a dict with 'loss') every time"
                )
            if labels is not None:
                total = at_least_float32(value) * x["num_items_in_batch"]
                return total, trained.to(torch.float64), outputs
            return (*self.sum_and_count(value, samples, "the model's loss"), outputs)
        outputs = first_output(outputs)
        loss_sum, count = self.outputs_loss(outputs, y, training=training)
        balance = balance_loss(model) if self.balances else None
        if balance is not None:
            self.balance_sum = balance.detach().sum()
            if training:
                loss_sum = loss_sum + self.weighed_balance(balance, y, model)
        return loss_sum, count, outputs

    def weighed_balance(self, balance: torch.Tensor, targets: torch.Tensor, model) -> torch.Tensor:
        """The load-balancing loss of each sequence (B,) summed as its token loss counts it: each sequence once,
        or, where labels may be masked (a (sum, count) loss, divided by the trained tokens), by its share of
        trained tokens (over the whole sequence where context ranks split it), so that a step minimises the same
        mean on any layout."""
        if not self.counted:
            return balance.sum()
        trained = (targets != IGNORE_INDEX).sum(dim=-1).to(balance.dtype)
        trained = over_whole_sequences(model, trained)
        return (balance * trained / max(1, targets.shape[-1] * self.sequence_parts)).sum()

    def outputs_loss(self, outputs, targets: torch.Tensor, *, training: bool = True):
        """(summed loss, elements covered) of the model's outputs against the targets."""
        count = len(targets)
        if self.kind == "model":
            return self.sum_and_count(carried_loss(outputs), count, "the model's loss")
        if self.language:
            return self.token_loss(outputs, targets, training=training)
        if self.loss is None:
            return self.loss_sum(outputs, targets, training=training), count
        if count == 0 and isinstance(outputs, torch.Tensor):  # a rank with no samples in a short last batch
            return at_least_float32(outputs).sum() * 0.0, 0
        return self.sum_and_count(self.loss(outputs, targets), count, "loss=")

    def learn(self, value, samples: int, what: str):
        """`sum_and_count` of the user's loss on a sample before training, learning from it whether the loss
        gives (sum, count) pairs (training then expects them)."""
        self.counted = gives_pair(value)
        return self.sum_and_count(value, samples, what)

    def sum_and_count(self, value, samples: int, what: str):
        """A loss as a step or loss function gives it (the batch mean, a (sum, count) pair, or an output with
        .loss / a dict with "loss", as Lightning's training_step returns) as (sum, count)."""
        value = unwrapped(value)
        if self.counted is None:  # not checked before training (a LightningModule's step): its first value
            self.counted = gives_pair(value)
        if gives_pair(value):
            if not self.counted:
                raise UserError(
                    f"{what} returned a (sum, count) pair during training but a mean on the sample "
                    f"checked before it; return the same kind every time"
                )
            total, count = value
            if isinstance(count, torch.Tensor):
                count = count.detach().to(torch.float64)
            return at_least_float32(total), count
        if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
            if samples == 0:  # an empty part: a mean of nothing is NaN; it adds nothing
                return at_least_float32(value).nan_to_num(0.0) * 0.0, 0
            return at_least_float32(value) * samples, samples
        raise UserError(
            f"{what} returned {describe_value(value)}; return the batch's mean loss (a scalar tensor) "
            f"or a pair (sum of the per-element losses, how many elements), e.g. (loss.sum(), "
            f"mask.sum())"
        )

    def loss_sum(
        self, outputs: torch.Tensor, targets: torch.Tensor, *, training: bool = True
    ) -> torch.Tensor:
        """The built-in losses summed over the samples of `outputs` (differentiable); a user's loss= as
        sum of its per-sample mean."""
        if self.language:
            return self.token_loss(outputs, targets, training=training)[0]
        if self.loss is None:
            return F.cross_entropy(
                at_least_float32(outputs),
                targets,
                reduction="sum",
                label_smoothing=self.label_smoothing if training else 0.0,
            )
        return self.outputs_loss(outputs, targets, training=training)[0]

    def token_loss(self, outputs: torch.Tensor, targets: torch.Tensor, *, training: bool = True):
        """(summed loss, count) of next-token cross-entropy, both in samples: the loss summed over the tokens
        not labelled IGNORE_INDEX, over the T tokens of a window, and how many windows of T such tokens there
        are (a float64 tensor; N where no label is masked). Without masks, each sample's mean over its tokens,
        summed over the samples. Where a rank holds 1 / `sequence_parts` of each window (context parallelism),
        both are its part of them (the window's T is all its parts' tokens), which summed over the parts are
        one device's."""
        tokens = max(1, targets.shape[-1]) * self.sequence_parts if targets.dim() > 1 else 1
        total = (
            F.cross_entropy(
                at_least_float32(outputs).flatten(0, -2),
                targets.flatten(),
                reduction="sum",
                ignore_index=IGNORE_INDEX,
                label_smoothing=self.label_smoothing if training else 0.0,
            )
            / tokens
        )
        trained = (targets != IGNORE_INDEX).sum().to(torch.float64)
        return total, trained / tokens

    @torch.no_grad()
    def metric_sums(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        """One sum over this batch's samples per metric name, as a float tensor on the outputs' device."""
        if not self.names:
            return torch.zeros(0, device=leaves(outputs)[0].device if leaves(outputs) else None)
        outputs = outputs.detach()
        sums = []
        if self.classification:
            sums.append((outputs.argmax(1) == targets).sum().float())
        for name, fn in self.metrics.items():
            sums.append(per_sample_sum(name, fn(outputs, targets), outputs.shape[0], outputs.device))
        if self.balances:
            last = self.balance_sum if self.balance_sum is not None else torch.zeros(())
            sums.append(last.to(device=outputs.device, dtype=torch.float32))
            self.balance_sum = None
        return torch.stack(sums)


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """Half-precision losses and logits in float32; float32 and float64 as they are (a float64 run, as verify
    trains, must not round its loss to float32: the gradient of a division by the batch would then carry
    float32's rounding of 1/24, and N devices, dividing by 8 and then 3, another)."""
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


def unwrapped(value):
    """A loss as given, or the loss an output carries (an object with .loss, a dict with "loss")."""
    carried = carried_loss(value)
    return carried if carried is not None and not isinstance(value, torch.Tensor) else value


def gives_pair(value) -> bool:
    """Whether a step's or loss's value is a (sum, count) pair (also inside an output's .loss)."""
    value = unwrapped(value)
    return (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and isinstance(value[0], torch.Tensor)
        and value[0].dim() == 0
    )


@contextlib.contextmanager
def shards_outside_forward(step):
    """A step= that makes a tensor from the model's parameters outside its forward (pytorch/examples'
    `init_hidden`: `next(self.parameters()).new_zeros(...)`) gets a DTensor where the parameters are shards or
    slices (FSDP2, tensor parallelism), which torch refuses to mix with plain tensors: said in one line."""
    try:
        yield
    except RuntimeError as error:
        if "mixed torch.Tensor and DTensor" not in str(error):
            raise
        raise UserError(
            f"step={name_of(step)} mixed a plain tensor with a DTensor: outside the model's forward its "
            f"parameters are shards (FSDP2) or slices (tensor parallelism), so a tensor made from one (such as "
            f"next(model.parameters()).new_zeros(...) in an init_hidden) is a DTensor too; make it with "
            f"torch.zeros(..., device=inputs.device) instead, or use --strategy data"
        ) from None


def carried_loss(output):
    """The loss a model's output carries (`.loss`, as Hugging Face's outputs; or a dict's "loss"), else None."""
    if isinstance(output, dict):
        return output.get("loss")
    if isinstance(output, torch.Tensor):
        return None
    value = getattr(output, "loss", None)
    return value if isinstance(value, torch.Tensor) else None


def describe_value(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def name_of(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def per_sample_sum(name: str, value, count: int, device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value, dtype=torch.float32, device=device)
    if value.dim() == 0:
        return at_least_float32(value) * count if count else torch.zeros((), device=device)
    if value.shape == (count,):
        return at_least_float32(value).sum()
    raise UserError(
        f"metric {name!r} returned shape {tuple(value.shape)} for {count} samples; return one value "
        f"per sample, shape ({count},), or the batch mean (a scalar)"
    )
