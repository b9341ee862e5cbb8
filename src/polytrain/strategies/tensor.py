"""A model's tensor plan (Megatron-style tensor parallelism, on PyTorch's DTensor): which layers each group of
T tensor ranks splits column-wise (its outputs) or row-wise (its inputs, partial outputs summed by an all-reduce),
from the user's `tensor_plan` or the built-in one of polytrain's mlp, gpt and llama; every other parameter is a
replicated DTensor on the same mesh. `parallelize` applies it (parallel/tensor.py).

    polytrain train --model gpt --dataset shakespeare --strategy tensor --devices 2
    polytrain verify --model mlp --strategy tensor --devices 2

The ranks of a tensor group read the same slice of the global batch and compute the same loss; DTensor sums the
split layers' gradients itself. Groups side by side (`--devices` above `--tensor-parallel`) are the data
dimensions, FSDP2 over them, and with `--context-parallel C` each sequence is split over C groups. Checkpoints are
each rank's parts (model_state.py): slices under the original names, fused layers' rows at their one-device
places, so `--resume` moves runs between any strategies and device counts.
"""

from __future__ import annotations

from dataclasses import replace
from fnmatch import fnmatchcase
from typing import Optional

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..parallel.context import tensor_plan_beside
from ..parallel.experts import mixtures_of
from ..parallel.meta import base_of
from ..parallel.tensor import (  # noqa: F401  (tests take them from here)
    _permutation,
    interleave,
    reordered,
    reordered_optimizer,
    replicate_rest,
    sequence_styles,
    split_layers,
)
from ..parallel.tensor_plan import BUILTIN_PLANS, HEAD, Layer, TensorPlan, is_conv1d, resolve, shares
from .rank_slice import check_rank_slice

NEEDS = "2.5"  # torch.distributed.tensor (public DTensor) and its parallel styles


def check_torch() -> None:
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: F401
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa
    except ImportError:
        raise ConfigError(
            f"--strategy tensor needs torch {NEEDS} or newer (DTensor tensor parallelism); this is "
            f"{torch.__version__}: upgrade torch, or use --strategy sharded or data"
        ) from None


def model_layers(model: nn.Module) -> dict:
    """name -> Layer for every module, in model order (the plan's view of the model)."""
    layers = {}
    tables = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    wrappers = {}  # a layer with adapters (peft's) is planned as the layer it adapts, its parts not at all
    for name, module in model.named_modules():
        if any(name.startswith(wrapper + ".") for wrapper in wrappers):
            continue
        base = base_of(module)
        if base is not None:
            wrappers[name] = module
            module = base
        holds = any(p is not None for p in module._parameters.values())
        if isinstance(module, nn.Linear):
            layers[name] = Layer(
                "linear",
                module.in_features,
                module.out_features,
                holds,
                tied_embedding=id(module.weight) in tables,
            )
        elif is_conv1d(module):
            inputs, outputs = module.weight.shape
            layers[name] = Layer("linear", inputs, outputs, holds, transposed=True)
        elif isinstance(module, nn.Embedding):
            layers[name] = Layer("embedding", module.num_embeddings, module.embedding_dim, holds)
        else:
            layers[name] = Layer("other", holds_parameters=holds)
    return layers


def _heads(model: nn.Module) -> dict:
    """`resolve`'s heads= of polytrain's GPT (a fused q/k/v Linear and `head_dim`), or heads= and kv_heads= of
    its Llama; {} for another model."""
    for module in model.modules():
        qkv, wq = (getattr(module, key, None) for key in ("qkv", "wq"))
        qkv, wq = (base_of(layer) or layer if isinstance(layer, nn.Module) else None for layer in (qkv, wq))
        if isinstance(qkv, nn.Linear) and getattr(module, "head_dim", None):
            return dict(heads=qkv.out_features // 3 // module.head_dim)
        if isinstance(wq, nn.Linear) and getattr(module, "kv_heads", None):
            return dict(heads=module.heads, kv_heads=module.kv_heads)
    return {}


def _check_shapes(model: nn.Module, plan: TensorPlan) -> None:
    """Parameters a split layer shares with another module, or a module whose own parameters sit beside
    children that hold theirs, cannot be split or replicated layer by layer: one line each."""
    owners = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for parameter in module._parameters.values():
            if parameter is not None:
                owners.setdefault(id(parameter), set()).add(name)
    for name, style, _ in plan.styles:
        if style != "replicate":
            for parameter in model.get_submodule(name)._parameters.values():
                if (
                    parameter is not None
                    and len(owners[id(parameter)]) > 1
                    and not owners[id(parameter)] <= set(plan.vocabulary)
                ):  # (a vocabulary: one DTensor)
                    others = sorted(owners[id(parameter)] - {name})
                    raise ConfigError(
                        f"tensor_plan splits {name}, whose weight is shared with {others[0]} (tied); "
                        f"split the embedding rowwise and the head colwise (by the vocabulary), "
                        f"replicate both, or untie them"
                    )
    for name, module in model.named_modules():
        # a buffer outside the state dict (a rotary embedding's frequencies) is a constant every rank keeps as it
        # is; one in it (running statistics) would be the ranks' to agree on
        persistent = module._buffers.keys() - module._non_persistent_buffers_set
        if any(module._buffers[key] is not None for key in persistent):
            raise ConfigError(
                f"--strategy tensor: {name or 'the model'} ({type(module).__name__}) keeps buffers "
                f"such as running statistics, which tensor parallelism does not handle yet; use "
                f"--strategy data or sharded"
            )
        if any(p is not None for p in module._parameters.values()) and any(
            p is not None for child in module.children() for p in child.parameters()
        ):
            raise ConfigError(
                f"--strategy tensor: {name or 'the model'} holds parameters of its own beside layers "
                f"that hold theirs; move them into a layer (e.g. an nn.Embedding) so each layer "
                f"can be split or replicated on its own"
            )


def plan_for(
    config, model: nn.Module, *, devices: int, run: Optional[str] = None, divisor: str = "--devices"
) -> TensorPlan:
    """The plan from `tensor_plan` (a dict, or a function fn(model, mesh) that applies its own) or the
    built-in one for polytrain's mlp, gpt and llama; one line for a model that has none (`run`, `divisor`: how
    its errors name the run and the setting to change, as `resolve`'s)."""
    given = getattr(config, "tensor_plan", None)
    kind = f"{type(model).__module__}.{type(model).__qualname__}"
    name = type(model).__name__
    if callable(given):
        return TensorPlan((), name, apply=given)
    if isinstance(given, str):
        raise ConfigError(
            f"this run's tensor_plan was a function given from Python ({given}); pass it again: "
            f"polytrain.fit(..., tensor_plan=fn, resume=RUN_DIR)"
        )
    patterns = given if given is not None else BUILTIN_PLANS.get(kind)
    if given is None and kind == "polytrain.models.gpt.GPT" and not min(shares(model.vocab, devices)):
        # torch's chunks of a vocabulary smaller than about devices**2 leave a rank none: keep it whole
        patterns = {key: style for key, style in patterns.items() if key not in ("0.token", HEAD)}
    if patterns is None:
        raise ConfigError(
            f"--strategy tensor needs a plan for {name}: pass fit(tensor_plan={{'layer.name': "
            f"'colwise', 'other.layer': 'rowwise'}}) naming its nn.Linear/nn.Embedding layers, or a "
            f"function fn(model, mesh) that calls parallelize_module"
        )
    layers = model_layers(model)
    # a built-in plan names what its model may have: a llama's mixtures keep their experts whole
    if given is None:
        patterns = {
            key: style
            for key, style in patterns.items()
            if key == HEAD or any(fnmatchcase(layer, key) for layer in layers if layer)
        }
    heads = _heads(model) if given is None else {}
    plan = resolve(patterns, layers, devices=devices, model=name, run=run, divisor=divisor, **heads)
    _check_shapes(model, plan)
    return replace(plan, sequence_parallel=given is None and _cuts_sequence(config, model, kind, devices))


def _cuts_sequence(config, model: nn.Module, kind: str, devices: int) -> bool:
    """Whether the built-in plan of `model` runs its norms sequence-parallel (parallel/tensor.py
    `sequence_styles`): the GPT's and the Llama's, where the run's windows (--context, which a table of positions,
    --positions, may exceed) split evenly over the tensor ranks; not a Llama with mixtures of experts, whose
    router would see a part of each sequence (its load-balancing loss is not a sum over tokens) and whose experts
    the plan keeps whole."""
    if kind not in ("polytrain.models.gpt.GPT", "polytrain.models.llama.Llama"):
        return False
    if mixtures_of(model):
        return False
    return (getattr(config, "context", None) or model.context) % devices == 0


def plan_for_stages(config, model: nn.Module, *, tensor: int) -> TensorPlan:
    """The plan every stage of a pipeline applies to its layers, by their names in the whole model (the
    built-in one; --tensor-parallel `tensor` ranks per stage): no sequence parallelism, stages exchange whole
    activations."""
    check_torch()
    kind = f"{type(model).__module__}.{type(model).__qualname__}"
    if kind not in BUILTIN_PLANS:
        raise ConfigError(
            f"--strategy pipeline --tensor-parallel splits the stages of --model "
            f"{', '.join(k.split('.')[-2] for k in BUILTIN_PLANS)} (their tensor plans are built in), "
            f"not your {type(model).__name__}; drop --tensor-parallel, or use --strategy tensor with "
            f"fit(tensor_plan=...)"
        )
    plan = plan_for(
        config,
        model,
        devices=tensor,
        run=f"--strategy pipeline --tensor-parallel {tensor}",
        divisor="a --tensor-parallel",
    )
    # the first and last stages hold the embedding and the head whole (tied across stages by pipeline/tied.py)
    return replace(plan.without_vocabulary(), sequence_parallel=False)


def run_plan(config, model: nn.Module, dataset) -> TensorPlan:
    """The tensor plan of a run whose layout has a tensor degree (checked in the launching process): the
    layers each group of `--tensor-parallel` ranks splits, a user's plan tried on a rank's slice first."""
    check_torch()
    group = config.layout.tensor
    named = dict(run=f"--strategy tensor --tensor-parallel {group}", divisor="a --tensor-parallel")
    plan = plan_for(config, model, devices=group, **(named if config.tensor_parallel else {}))
    if isinstance(config.tensor_plan, dict) and dataset is not None:  # the user's: tried on a rank's slice
        check_rank_slice(model, plan, group, dataset.sample_inputs(2))
    plan = tensor_plan_beside(plan, config.layout)
    return plan.for_data_ranks(group, config.devices // group, builtin=config.tensor_plan is None)
