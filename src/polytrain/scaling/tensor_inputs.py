"""What the cost model needs to predict tensor parallelism for a model, read from the model and its plan in
this process (no process group): the group sizes its plan splits it into, the bytes of the layers it splits,
the activations a step all-reduces or gathers, and a stand-in for one rank's compute: the model with every split
Linear narrowed to its 1/T (a column-wise one to 1/T of its outputs, a row-wise one to 1/T of its inputs),
which runs what a rank of the group runs, without its collectives. `workload.measure` times the stand-in as it
times the replicas; `StepClock` uses it as the compute reference of a tensor-parallel row.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.nn as nn

from ..errors import UserError
from ..parallel.tensor_plan import TensorPlan


def tensor_plans(model: nn.Module, counts: Iterable[int], *, tensor_plan=None) -> Dict[int, TensorPlan]:
    """Group size T -> the model's plan over T ranks, for every T of 2 or more dividing one of `counts` that
    the plan (`tensor_plan`, or the built-in one) splits evenly; empty for a model without a plan, or with a
    plan given as a function (which only the workers can apply)."""
    from ..strategies.tensor import plan_for

    config = SimpleNamespace(tensor_plan=tensor_plan)
    plans = {}
    for tensor in sorted({t for n in counts for t in range(2, n + 1) if n % t == 0}):
        try:
            plan = plan_for(config, model, devices=tensor)
        except (UserError, ImportError):
            continue
        if plan.apply is not None:
            return {}
        plans[tensor] = plan
    return plans


class _Gathered(nn.Module):
    """A rank's share of a layer whose outputs are gathered whole (a head split by the vocabulary): its columns,
    repeated to the whole width, as the gather hands them on."""

    def __init__(self, share: nn.Linear, width: int):
        super().__init__()
        self.share, self.width = share, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.share(x)
        return torch.cat([part] * -(-self.width // part.shape[-1]), dim=-1)[..., : self.width]


def narrowed(model: nn.Module, plan: TensorPlan, ranks: int) -> Optional[nn.Module]:
    """A copy of `model` with each Linear `plan` splits cut to one rank's share of `ranks` (a vocabulary's head to
    its rows of scores, gathered whole); an embedding split by its vocabulary stays whole (a lookup costs the same,
    and a share could not look up the ids it does not hold). None where another embedding is split."""
    own = copy.deepcopy(model)
    vocabulary = getattr(plan, "vocabulary", ())
    for name, style, _ in plan.styles:
        if style == "replicate" or (name in vocabulary and isinstance(own.get_submodule(name), nn.Embedding)):
            continue
        layer = own.get_submodule(name)
        if not isinstance(layer, nn.Linear):
            return None
        ins, outs = layer.in_features, layer.out_features
        ins, outs = (ins, -(-outs // ranks)) if style == "colwise" else (ins // ranks, outs)
        share = nn.Linear(
            ins, outs, bias=layer.bias is not None, device=layer.weight.device, dtype=layer.weight.dtype
        )
        parent, _, leaf = name.rpartition(".")
        setattr(
            own.get_submodule(parent) if parent else own,
            leaf,
            _Gathered(share, layer.out_features) if name in vocabulary else share,
        )
    return own


def runs(model: Optional[nn.Module], objective, x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the stand-in trains on a sample (a model whose code assumes the whole width may not)."""
    if model is None:
        return False
    try:
        objective.loss_sum(model(x[:1]), y[:1]).backward()
    except Exception:
        return False
    model.zero_grad(set_to_none=True)
    return True


def _unique_bytes(modules: Iterable[nn.Module]) -> float:
    seen = {}
    for module in modules:
        for parameter in module.parameters(recurse=False):
            seen[id(parameter)] = parameter.numel() * parameter.element_size()
    return float(sum(seen.values()))


def collectives(
    model: nn.Module, plan: TensorPlan, objective, x: torch.Tensor, y: torch.Tensor
) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """Bytes per sample of each activation all-reduce of a training step: the output of every row-wise layer
    (its ranks' partial sums, in forward) and the input of every column-wise layer whose input needs a gradient
    (the ranks' partial gradients, in backward; not the model's own inputs); and of each output gathered whole
    (a head split by the vocabulary: its scores)."""
    own = copy.deepcopy(model).train()
    styles = {name: style for name, style, _ in plan.styles}
    vocabulary = getattr(plan, "vocabulary", ())
    sizes, gathered = [], []

    def forward(module, inputs, output):
        sizes.append(output.numel() * output.element_size())

    def backward(module, inputs):
        if isinstance(inputs[0], torch.Tensor) and inputs[0].requires_grad:
            sizes.append(inputs[0].numel() * inputs[0].element_size())

    def whole(module, inputs, output):
        gathered.append(output.numel() * output.element_size())

    hooks = [
        own.get_submodule(name).register_forward_hook(forward)
        if style == "rowwise"
        else own.get_submodule(name).register_forward_pre_hook(backward)
        for name, style in styles.items()
        if style in ("rowwise", "colwise")
    ]
    hooks += [
        own.get_submodule(name).register_forward_hook(whole)
        for name in vocabulary
        if styles.get(name) == "colwise"
    ]
    count = min(2, len(x))
    try:
        with torch.enable_grad():
            objective.loss_sum(own(x[:count]), y[:count])
    finally:
        for hook in hooks:
            hook.remove()
    return tuple(size / count for size in sizes), tuple(size / count for size in gathered)


def tensor_fields(
    model: nn.Module, plans: Dict[int, TensorPlan], objective, x: torch.Tensor, y: torch.Tensor
) -> dict:
    """The `Workload` fields of tensor parallelism that sizes give (none where there is no plan)."""
    if not plans:
        return {}
    plan = plans[min(plans)]
    split = [model.get_submodule(name) for name, style, _ in plan.styles if style != "replicate"]
    sequence = tuple(t for t, p in plans.items() if p.sequence_parallel)
    norms = sum(
        1
        for m in model.modules()
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm))
        for _ in m.parameters(recurse=False)
    )
    reduced, gathered = collectives(model, plan, objective, x, y)
    # sequence-parallel, the built-in GPT's whole embeddings and head gather the sequence twice more (into the
    # head, out of the embeddings); split by the vocabulary, they reduce-scatter and gather it as the blocks do
    return dict(
        tensor_splits=tuple(sorted(plans)),
        split_bytes=_unique_bytes(split),
        tensor_reductions=reduced,
        tensor_gathers=gathered,
        sequence_splits=sequence,
        sequence_parameters=norms if sequence else 0,
        sequence_gathers=2 if sequence and not getattr(plan, "vocabulary", ()) else 0,
    )


def split_share(
    pass_seconds: float, narrow_seconds: Optional[float], *, tensor: int, fallback: float
) -> float:
    """The share of a pass spent in the split layers, from the pass with them narrowed to 1/`tensor`
    (pass - narrow = share x pass x (1 - 1/T)), between 0 and 1; `fallback` where there is no such timing."""
    if narrow_seconds is None or pass_seconds <= 0:
        return fallback
    return min(1.0, max(0.0, (pass_seconds - narrow_seconds) / (pass_seconds * (1 - 1 / tensor))))
