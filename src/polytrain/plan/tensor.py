"""Which layer of a model is split how across the T ranks of a tensor-parallel run, checked before any worker.

A plan maps module names (fnmatch patterns, `*` crossing dots) to a style: `colwise` splits a layer's
outputs (an `nn.Linear`'s rows, an `nn.Embedding`'s columns), `rowwise` its inputs (a Linear's columns, an
Embedding's vocabulary) and sums the partial outputs, `replicate` keeps it whole on every rank (the default
for every layer the plan does not name). `colwise:K` is a fused layer whose output is K stacked parts (a fused
q/k/v projection: `colwise:3`): each rank takes its slice of every part, so its local output is still K
stacked parts. Pure: module names, kinds and sizes in, a resolved plan out; no torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Callable, Optional

from ..errors import ConfigError

STYLES = ("colwise", "rowwise", "replicate")
SPLITTABLE = ("linear", "embedding")

# Megatron's split: attention projection and the first MLP layer by columns, the output projections by rows,
# so each block needs one all-reduce in its attention and one in its MLP; embeddings, norms and the (tied)
# head stay whole on every rank. Keyed by the model class (module.qualname).
BUILTIN_PLANS = {
    "polytrain.models.mlp.MLP": {"1": "colwise", "3": "rowwise"},
    "polytrain.models.gpt.GPT": {"*.attention.qkv": "colwise:3", "*.attention.proj": "rowwise",
                                 "*.mlp.0": "colwise", "*.mlp.2": "rowwise"},
}


@dataclass(frozen=True)
class Layer:
    """What the plan needs to know of one module: its kind (linear, embedding, other), its input and output
    sizes (in_features/out_features; num_embeddings/embedding_dim) and whether it holds parameters itself."""
    kind: str
    inputs: int = 0
    outputs: int = 0
    holds_parameters: bool = False


@dataclass(frozen=True)
class TensorPlan:
    devices: int
    styles: tuple                  # ((module name, style, parts), ...) for every split module, in model order
    model: str = "your model"
    heads: Optional[int] = None    # attention heads per layer, where known (each rank runs heads / devices)
    apply: Optional[Callable] = None   # the user's fn(model, mesh) that splits the model itself (styles: ())
    replicas: int = 1              # tensor groups side by side on a 2-D (data, tensor) mesh, sharded over data
    sequence_parallel: bool = False    # the norms on parts of the sequence (the built-in GPT's plan)

    def describe(self) -> str:
        mesh = f"; {self.replicas} such groups shard the data dimension (FSDP2)" if self.replicas > 1 else ""
        if self.apply is not None:
            return (f"{self.model} split over {self.devices} ranks by {getattr(self.apply, '__name__', 'a function')}"
                    + mesh)
        split = sum(1 for _, style, _ in self.styles if style != "replicate")
        heads = f", {self.heads // self.devices} of {self.heads} attention heads per rank" if self.heads else ""
        norms = ", norms sequence-parallel" if self.sequence_parallel else ""
        return (f"{self.model} split over {self.devices} ranks: {split} layers split{heads}{norms}, the rest "
                f"replicated" + mesh)

    def coords(self, rank: int) -> tuple:
        """(data index, tensor index) of a rank on the (data, tensor) mesh: tensor groups are consecutive ranks."""
        return divmod(rank, self.devices)

    def layout_lines(self) -> list:
        """Which rank holds which shard: one line per rank."""
        return [f"  rank {r}: data shard {r // self.devices} of {self.replicas}, tensor slice {r % self.devices} of "
                f"{self.devices}" for r in range(self.devices * self.replicas)]

    def record(self) -> dict:
        if self.apply is not None:
            return {}
        return {"tensor_plan": {name: style if parts == 1 else f"{style}:{parts}"
                                for name, style, parts in self.styles}}


def parse_style(text, name: str) -> tuple:
    """`colwise`, `rowwise`, `replicate` or `colwise:K` as (style, K)."""
    style, _, parts = str(text).partition(":")
    if style not in STYLES or (parts and (style != "colwise" or not parts.isdigit() or int(parts) < 1)):
        raise ConfigError(f"tensor_plan[{name!r}] is {text!r}; use one of {', '.join(STYLES)} (or colwise:K for a "
                          f"layer whose output is K fused parts, e.g. colwise:3 for a fused q/k/v)")
    return style, int(parts) if parts else 1


def _divisible(name: str, layer: Layer, style: str, parts: int, devices: int) -> None:
    if style == "replicate":
        return
    linear = layer.kind == "linear"
    # colwise splits a Linear's outputs and an Embedding's width; rowwise a Linear's inputs and the vocabulary
    size, what = {("linear", "colwise"): (layer.outputs // parts, "output features" + (" per part" if parts > 1
                                                                                    else "")),
                  ("linear", "rowwise"): (layer.inputs, "input features"),
                  ("embedding", "colwise"): (layer.outputs, "embedding width"),
                  ("embedding", "rowwise"): (layer.inputs, "vocabulary entries")}[(layer.kind, style)]
    if linear and style == "colwise" and layer.outputs % parts:
        raise ConfigError(f"tensor_plan: {name} has {layer.outputs} outputs, which do not split into {parts} "
                          f"fused parts; fix the :{parts}")
    if size % devices:
        raise ConfigError(f"--strategy tensor --devices {devices}: {name} ({style}) has {size} {what}, which "
                          f"{devices} ranks do not divide; use --devices that divides {size}, or replicate it")


def resolve(patterns: dict, layers: dict, *, devices: int, model: str = "your model",
            heads: Optional[int] = None) -> TensorPlan:
    """The plan for a model whose modules are `layers` (name -> Layer, in model order), given as
    {pattern: style}; one-line errors for a pattern that names nothing, a style on a layer that is not an
    nn.Linear or nn.Embedding, a size `devices` does not divide, or `heads` it does not divide."""
    if not isinstance(patterns, dict) or not patterns:
        raise ConfigError("tensor_plan must be a dict of module names (fnmatch patterns) to colwise, rowwise or "
                          "replicate, e.g. {'blocks.*.attn.q': 'colwise', 'blocks.*.attn.out': 'rowwise'}")
    if heads is not None and heads % devices:
        raise ConfigError(f"--strategy tensor --devices {devices}: the model's {heads} attention heads do not "
                          f"split evenly; use --devices that divides {heads} (or --heads a multiple of {devices})")
    chosen = {}
    for pattern, text in patterns.items():
        style, parts = parse_style(text, pattern)
        matched = [name for name in layers if name and fnmatchcase(name, str(pattern))]
        if not matched:
            nearby = ", ".join(name for name, layer in layers.items() if layer.kind in SPLITTABLE)
            raise ConfigError(f"tensor_plan names {pattern!r}, which matches no module of {model}; its Linear and "
                              f"Embedding modules are: {nearby or 'none'}")
        for name in matched:
            layer = layers[name]
            if style != "replicate" and layer.kind not in SPLITTABLE:
                raise ConfigError(f"tensor_plan: {name} is not an nn.Linear or nn.Embedding, which are the layers "
                                  f"--strategy tensor can split; name its Linear/Embedding layers instead")
            _divisible(name, layer, style, parts, devices)
            chosen[name] = (style, parts)
    for name, (style, _) in chosen.items():
        inside = [other for other in chosen if other != name and other.startswith(name + ".")]
        if style != "replicate" and inside:
            raise ConfigError(f"tensor_plan splits {name} and also {inside[0]} inside it; name leaf layers only")
    if all(style == "replicate" for style, _ in chosen.values()):
        raise ConfigError("tensor_plan splits nothing (every layer replicate); name some layers colwise/rowwise")
    return TensorPlan(devices, tuple((name, *chosen[name]) for name in layers if name in chosen), model, heads)
