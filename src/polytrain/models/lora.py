"""LoRA adapters (`--lora R`): rank-R matrices beside the frozen weights of a model's projections, trained in
their place, as Hugging Face's `peft` adds them (its `LoraConfig` and `lora.Linear` layers: the same modules,
names and numbers, so that `peft` loads what polytrain trains).

`add_adapters` wraps each target layer (a `nn.Linear` whose one-device name matches `--lora-targets`, by
default the model's `LORA_TARGETS`: the llama's and the GPT's attention and feed-forward projections) in peft's
layer, which keeps the layer as its `base_layer` and adds `lora_A` (R x in) and `lora_B` (out x R): the output
is base(x) + B(A(dropout(x))) * alpha / R. Every parameter but the adapters' is frozen (no gradient, no
optimizer state). A (kaiming-uniform) and B (zeros, so that training starts from the base model) are given
their values as peft gives them, also where the model is built on the meta device (each adapter module's
`init_values`, which parallel/meta.py calls in place of the model's own initialisation).

A model built by name gets its adapters as it is built (models/__init__.py `build_model`), so every command that
builds a run's model from its config.json (generate, export, resume) builds the same one.
"""

from __future__ import annotations

import fnmatch
import math
import re
from typing import Optional, Sequence

import torch.nn as nn

from ..errors import UserError
from ..parallel.meta import INIT_VALUES, unwrapped

ADAPTER = "default"  # peft's name for the one adapter of a model
DEFAULT_ALPHA = 8  # peft's default lora_alpha


def one_device_name(name: str) -> str:
    """A tensor's name in the model without adapters: `1.attention.wq.base_layer.weight` -> `...wq.weight`
    (peft keeps the layer it adapts as `base_layer`: parallel/meta.py `unwrapped`)."""
    return unwrapped(name)


def is_adapter(name: str) -> bool:
    """Whether `name` (a parameter's) is an adapter's: `...wq.lora_A.default.weight`."""
    return ".lora_A." in name or ".lora_B." in name


def has_adapters(model: nn.Module) -> bool:
    return any(is_adapter(name) for name, _ in model.named_parameters())


def default_targets(model: nn.Module) -> Optional[Sequence[str]]:
    """The globs `--lora` adapts where `--lora-targets` is not given: the model's own `LORA_TARGETS` (its
    attention and feed-forward projections), or those of the language model a classifier wraps; None for a
    model that declares none."""
    return getattr(model, "LORA_TARGETS", None)


def _linear_names(model: nn.Module) -> list:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name]


def target_names(model: nn.Module, targets: Optional[str]) -> list:
    """The one-device names of the `nn.Linear` layers of `model` that `targets` (comma-separated globs; None:
    the model's default) matches; one line where a glob matches none, or there is nothing to adapt."""
    linear = _linear_names(model)
    shown = ", ".join(linear[:8]) + (", ..." if len(linear) > 8 else "")
    if targets is None:
        globs = default_targets(model)
        if globs is None:
            raise UserError(
                f"--lora: {type(model).__name__} declares no layers to adapt; give --lora-targets with globs over "
                f"its linear layers ({shown or 'it has none'})"
            )
    else:
        globs = [glob.strip() for glob in targets.split(",") if glob.strip()]
        if not globs:
            raise UserError(
                f"--lora-targets {targets!r} names no pattern; give globs such as '*.attention.wq'"
            )
    chosen = []
    for glob in globs:
        found = [name for name in linear if fnmatch.fnmatchcase(name, glob)]
        if not found and targets is not None:
            raise UserError(
                f"--lora-targets {glob!r} matches no linear layer of {type(model).__name__}; its linear layers "
                f"are {shown or 'none'}"
            )
        chosen += [name for name in found if name not in chosen]
    if not chosen:
        raise UserError(
            f"--lora: {type(model).__name__} has none of the layers it adapts by default ({', '.join(globs)}); "
            f"give --lora-targets with globs over its linear layers ({shown or 'it has none'})"
        )
    return chosen


def _init_a(module: nn.Linear) -> None:
    nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))  # (peft's init_lora_weights=True)


def _init_b(module: nn.Linear) -> None:
    nn.init.zeros_(module.weight)


def add_adapters(
    model: nn.Module,
    rank: int,
    *,
    alpha: Optional[float] = None,
    dropout: float = 0.0,
    targets: Optional[str] = None,
) -> nn.Module:
    """`model` with its target layers wrapped in peft's LoRA layers of `rank` (in place) and everything else
    frozen (`describe_adapters` says it). One line for a rank above a target's width. `alpha`: None is peft's
    default (8)."""
    names = target_names(model, targets)
    modules = dict(model.named_modules())
    for name in names:
        layer = modules[name]
        narrowest = min(layer.in_features, layer.out_features)
        if rank > narrowest:
            raise UserError(
                f"--lora {rank} is above the width of {name} ({layer.in_features} in, {layer.out_features} out): "
                f"an adapter's rank is at most {narrowest}; give --lora {min(narrowest, 8)}"
            )
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise UserError("--lora needs Hugging Face's peft: pip install 'polytrain[lora]' (or peft)") from None
    alpha = DEFAULT_ALPHA if alpha is None else alpha
    # the layers by their whole names (a regular expression peft matches in full: a list would also match a
    # deeper module whose name ends with one of them)
    exact = "|".join(re.escape(name) for name in names)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=exact, bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    whole = tuple(getattr(model, "LORA_TRAINED", ()))  # (a classifier's score head)
    for parameter_name, parameter in model.named_parameters():
        parameter.requires_grad_(
            is_adapter(parameter_name) or parameter_name.startswith(tuple(w + "." for w in whole))
        )
    for name in names:
        layer = model.get_submodule(name)
        setattr(layer.lora_A[ADAPTER], INIT_VALUES, _init_a)
        setattr(layer.lora_B[ADAPTER], INIT_VALUES, _init_b)
    return model


def adapters_of(options) -> Optional[dict]:
    """`add_adapters`' keywords from a run's settings (a TrainConfig, or a mapping such as its config.json), or
    None where --lora is not given."""
    read = options.get if isinstance(options, dict) else (lambda name: getattr(options, name, None))
    if options is None or read("lora") is None:
        return None
    return dict(
        rank=read("lora"),
        alpha=read("lora_alpha"),
        dropout=read("lora_dropout") or 0.0,
        targets=read("lora_targets"),
    )


def describe_adapters(model: nn.Module) -> Optional[str]:
    """The start-up line of a model with adapters (the layers adapted, rank, alpha, trainable and total
    parameters); None without."""
    from peft.tuners.lora import LoraLayer

    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    if not layers:
        return None
    first = layers[0][1]
    rank, alpha = first.r[ADAPTER], first.lora_alpha[ADAPTER]
    drop = first.lora_dropout[ADAPTER]
    dropout = drop.p if isinstance(drop, nn.Dropout) else 0.0
    named = list(model.named_parameters())
    trained = sum(p.numel() for _, p in named if p.requires_grad)
    total = sum(p.numel() for _, p in named)
    whole = tuple(getattr(model, "LORA_TRAINED", ()))
    also = f" and {', '.join(whole)} whole" if whole else ""
    return (
        f"LoRA: rank {rank} adapters (alpha {alpha:g}, scale {alpha / rank:g}, dropout {dropout:g}) on "
        f"{len(layers)} layers ({_summary([name for name, _ in layers])}){also}; trainable {trained:,} of "
        f"{total:,} parameters ({100 * trained / total:.2f}%), the rest frozen"
    )


def _summary(names: list) -> str:
    """`attention.wq, attention.wk, ... in 2 blocks`: the layers' names less their block's, in order."""
    tails = list(dict.fromkeys(name.split(".", 1)[-1] if "." in name else name for name in names))
    heads = {name.split(".", 1)[0] for name in names if "." in name}
    shown = ", ".join(tails[:8]) + (", ..." if len(tails) > 8 else "")
    return f"{shown} in {len(heads)} blocks" if len(heads) > 1 else shown
