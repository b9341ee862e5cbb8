"""Which layer of a model is split how across the T ranks of a tensor-parallel run, checked before any worker.

A plan maps module names (fnmatch patterns, `*` crossing dots) to a style: `colwise` splits a layer's
outputs (an `nn.Linear`'s rows, an `nn.Embedding`'s columns), `rowwise` its inputs (a Linear's columns, an
Embedding's vocabulary) and sums the partial outputs, `replicate` keeps it whole on every rank (the default
for every layer the plan does not name). `colwise:K` is a fused layer whose output is K stacked parts (a fused
q/k/v projection: `colwise:3`): each rank takes its slice of every part, so its local output is still K
stacked parts. A vocabulary (an Embedding split rowwise, and a head Linear tied to it split colwise) may split
unevenly, in torch.chunk's shares (65 entries over 2 ranks: 33 and 32): the head's scores are gathered whole,
so no layer downstream sees the uneven shares. Pure: module names, kinds and sizes in, a resolved plan out; no
torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Callable, Optional

from ..errors import ConfigError

STYLES = ("colwise", "rowwise", "replicate")
SPLITTABLE = ("linear", "embedding")

HEAD = "<head>"  # in a plan: the model's last top-level module (the GPT's output head)

# Megatron's split: attention projection and the first MLP layer by columns, the output projections by rows,
# so each block needs one all-reduce in its attention and one in its MLP; the GPT's token embedding by its
# vocabulary (rows) and its tied head by the same rows (as torchtitan); norms and positions stay whole on every
# rank. Keyed by the model class (module.qualname).
BUILTIN_PLANS = {
    "polytrain.models.mlp.MLP": {"1": "colwise", "3": "rowwise"},
    "polytrain.models.gpt.GPT": {
        "0.token": "rowwise",
        "*.attention.qkv": "colwise:3",
        "*.attention.proj": "rowwise",
        "*.mlp.0": "colwise",
        "*.mlp.2": "rowwise",
        HEAD: "colwise",
    },
    # the Llama's separate projections need no interleaving; its untied head would give each rank a slice of
    # the scores, so it and the embedding stay whole; its RMSNorms run on parts of the sequence, as the GPT's
    # LayerNorms (strategies/tensor.py `_cuts_sequence`)
    "polytrain.models.llama.Llama": {
        "*.attention.wq": "colwise",
        "*.attention.wk": "colwise",
        "*.attention.wv": "colwise",
        "*.attention.wo": "rowwise",
        "*.feed_forward.w1": "colwise",
        "*.feed_forward.w3": "colwise",
        "*.feed_forward.w2": "rowwise",
    },
}


def is_conv1d(module) -> bool:
    """Hugging Face's `Conv1D` (GPT-2): a Linear whose weight is stored [inputs, outputs] (`x @ W + b`)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and getattr(weight, "dim", lambda: 0)() == 2
    )


def shares(size: int, devices: int) -> tuple:
    """Each rank's part of `size` rows as torch.chunk (and DTensor's Shard) cuts them: 65 over 2 is (33, 32)."""
    chunk = -(-size // devices)
    return tuple(max(0, min(chunk, size - rank * chunk)) for rank in range(devices))


@dataclass(frozen=True)
class Layer:
    """What the plan needs to know of one module: its kind (linear, embedding, other), its input and output
    sizes (in_features/out_features; num_embeddings/embedding_dim) and whether it holds parameters itself."""

    kind: str
    inputs: int = 0
    outputs: int = 0
    holds_parameters: bool = False
    tied_embedding: bool = False  # a Linear whose weight is an Embedding's [vocab, width] (a tied head)
    transposed: bool = False  # a Linear with its weight stored [inputs, outputs] (Hugging Face's Conv1D)


@dataclass(frozen=True)
class TensorPlan:
    styles: tuple  # ((module name, style, parts), ...) for every split module, in model order
    model: str = "your model"
    # attention heads per layer, where known (each of the layout's T tensor ranks runs heads / T)
    heads: Optional[int] = None
    apply: Optional[Callable] = None  # the user's fn(model, mesh) that splits the model itself (styles: ())
    sequence_parallel: bool = False  # the norms on parts of the sequence (the built-in GPT's plan)
    vocabulary: tuple = ()  # the layers split by their vocabulary (an embedding rowwise, its tied head colwise)
    vocabulary_size: int = 0  # ... and its entries

    def describe(self, layout) -> str:
        """How one tensor group of `layout` (its `tensor` ranks) splits the model (the groups beside it are the
        layout's to describe)."""
        ranks = layout.tensor
        if self.apply is not None:
            return f"{self.model} split over {ranks} ranks by {getattr(self.apply, '__name__', 'a function')}"
        split = sum(1 for _, style, _ in self.styles if style != "replicate")
        heads = f", {self.heads // ranks} of {self.heads} attention heads per rank" if self.heads else ""
        norms = ", norms sequence-parallel" if self.sequence_parallel else ""
        words = ", ".join(self.vocabulary)
        vocabulary = (
            f", the vocabulary ({words}) by {'/'.join(map(str, shares(self.vocabulary_size, ranks)))} "
            f"of its {self.vocabulary_size} entries"
            if self.vocabulary
            else ""
        )
        return (
            f"{self.model} split over {ranks} ranks: {split} layers split{heads}{vocabulary}{norms}, the "
            f"rest replicated"
        )

    def for_data_ranks(self, tensor: int, data: int, *, builtin: bool) -> "TensorPlan":
        """The plan for `data` ranks beside each tensor group of `tensor` ranks (FSDP2 over them). FSDP2 cuts each
        rank's part of a vocabulary again over those ranks, and torch (2.13) cannot place a whole checkpoint's rows
        into such parts unless the ranks divide the vocabulary: a built-in plan keeps it whole then."""
        if data == 1 or self.vocabulary_size % (tensor * data) == 0:
            return self
        if builtin:
            return self.without_vocabulary()
        devices = tensor * data
        raise ConfigError(
            f"--devices {devices} --tensor-parallel {tensor}: tensor_plan splits the vocabulary "
            f"({', '.join(self.vocabulary)}) of {self.vocabulary_size} entries, which {devices} ranks "
            f"(data x tensor) do not divide, so a checkpoint could not be loaded into it; use "
            f"--devices {tensor} (tensor only), or replicate those layers"
        )

    def without_vocabulary(self) -> "TensorPlan":
        """The plan with its vocabulary layers kept whole (replicated)."""
        return replace(
            self,
            styles=tuple(entry for entry in self.styles if entry[0] not in self.vocabulary),
            vocabulary=(),
            vocabulary_size=0,
        )

    def record(self) -> dict:
        if self.apply is not None:
            return {}
        return {
            "tensor_plan": {
                name: style if parts == 1 else f"{style}:{parts}" for name, style, parts in self.styles
            }
        }


def parse_style(text, name: str) -> tuple:
    """`colwise`, `rowwise`, `replicate` or `colwise:K` as (style, K)."""
    style, _, parts = str(text).partition(":")
    if style not in STYLES or (parts and (style != "colwise" or not parts.isdigit() or int(parts) < 1)):
        raise ConfigError(
            f"tensor_plan[{name!r}] is {text!r}; use one of {', '.join(STYLES)} (or colwise:K for a "
            f"layer whose output is K fused parts, e.g. colwise:3 for a fused q/k/v)"
        )
    return style, int(parts) if parts else 1


def by_vocabulary(layer: Layer, style: str, parts: int = 1) -> bool:
    """Whether `style` splits `layer` by its vocabulary: an Embedding's rows, or a tied head's outputs."""
    return (layer.kind, style) == ("embedding", "rowwise") or (
        layer.tied_embedding and style == "colwise" and parts == 1
    )


def _divisible(name: str, layer: Layer, style: str, parts: int, devices: int, run: str, divisor: str) -> None:
    if style == "replicate":
        return
    linear = layer.kind == "linear"
    # colwise splits a Linear's outputs and an Embedding's width; rowwise a Linear's inputs and the vocabulary
    size, what = {
        ("linear", "colwise"): (
            layer.outputs // parts,
            "output features" + (" per part" if parts > 1 else ""),
        ),
        ("linear", "rowwise"): (layer.inputs, "input features"),
        ("embedding", "colwise"): (layer.outputs, "embedding width"),
        ("embedding", "rowwise"): (layer.inputs, "vocabulary entries"),
    }[(layer.kind, style)]
    if layer.transposed and parts > 1:
        raise ConfigError(
            f"tensor_plan: {name} is a Conv1D (a Linear with its weight transposed), whose fused parts "
            f"(colwise:{parts}) are not split here; replicate it, or split separate q/k/v Linear layers"
        )
    if linear and style == "colwise" and layer.outputs % parts:
        raise ConfigError(
            f"tensor_plan: {name} has {layer.outputs} outputs, which do not split into {parts} "
            f"fused parts; fix the :{parts}"
        )
    if by_vocabulary(layer, style, parts):
        if min(shares(size, devices)):
            return  # a vocabulary may split unevenly (torch.chunk's shares)
        raise ConfigError(
            f"{run}: {name} ({style}) has {size} {what}, of which "
            f"torch's chunks of {-(-size // devices)} leave a rank none; use fewer --devices, or "
            f"replicate it"
        )
    if size % devices:
        raise ConfigError(
            f"{run}: {name} ({style}) has {size} {what}, which {devices} ranks do not divide; use "
            f"{divisor} that divides {size}, or replicate it"
        )


def resolve(
    patterns: dict,
    layers: dict,
    *,
    devices: int,
    model: str = "your model",
    heads: Optional[int] = None,
    kv_heads: Optional[int] = None,
    run: Optional[str] = None,
    divisor: str = "--devices",
) -> TensorPlan:
    """The plan for a model whose modules are `layers` (name -> Layer, in model order), given as
    {pattern: style}; one-line errors for a pattern that names nothing, a style on a layer that is not an
    nn.Linear or nn.Embedding, a size `devices` does not divide, or `heads` it does not divide. The errors
    name the run as `run` (default `--strategy tensor --devices N`) and the setting to change as `divisor`;
    `kv_heads`, where fewer than `heads` (grouped-query attention), must split evenly too."""
    run = run or f"--strategy tensor --devices {devices}"
    if not isinstance(patterns, dict) or not patterns:
        raise ConfigError(
            "tensor_plan must be a dict of module names (fnmatch patterns) to colwise, rowwise or "
            "replicate, e.g. {'blocks.*.attn.q': 'colwise', 'blocks.*.attn.out': 'rowwise'}"
        )
    if heads is not None and heads % devices:
        raise ConfigError(
            f"{run}: the model's {heads} attention heads do not split evenly; use {divisor} that "
            f"divides {heads} (or --heads a multiple of {devices})"
        )
    if kv_heads is not None and kv_heads != heads and kv_heads % devices:  # each rank needs whole ones
        raise ConfigError(
            f"{run}: the model's {kv_heads} key/value heads do not split evenly; use {divisor} that "
            f"divides {kv_heads} (or --kv-heads a multiple of {devices})"
        )
    chosen = {}
    for pattern, text in patterns.items():
        style, parts = parse_style(text, pattern)
        top = [name for name in layers if name and "." not in name]
        matched = (
            top[-1:]
            if pattern == HEAD
            else [name for name in layers if name and fnmatchcase(name, str(pattern))]
        )
        if not matched:
            nearby = ", ".join(name for name, layer in layers.items() if layer.kind in SPLITTABLE)
            raise ConfigError(
                f"tensor_plan names {pattern!r}, which matches no module of {model}; its Linear and "
                f"Embedding modules are: {nearby or 'none'}"
            )
        for name in matched:
            layer = layers[name]
            if style != "replicate" and layer.kind not in SPLITTABLE:
                raise ConfigError(
                    f"tensor_plan: {name} is not an nn.Linear or nn.Embedding, which are the layers "
                    f"--strategy tensor can split; name its Linear/Embedding layers instead"
                )
            _divisible(name, layer, style, parts, devices, run, divisor)
            chosen[name] = (style, parts)
    for name, (style, _) in chosen.items():
        inside = [other for other in chosen if other != name and other.startswith(name + ".")]
        if style != "replicate" and inside:
            raise ConfigError(
                f"tensor_plan splits {name} and also {inside[0]} inside it; name leaf layers only"
            )
    if all(style == "replicate" for style, _ in chosen.values()):
        raise ConfigError(
            "tensor_plan splits nothing (every layer replicate); name some layers colwise/rowwise"
        )
    vocabulary = [name for name in layers if name in chosen and by_vocabulary(layers[name], *chosen[name])]
    size = max(
        (
            layers[name].inputs if layers[name].kind == "embedding" else layers[name].outputs
            for name in vocabulary
        ),
        default=0,
    )
    return TensorPlan(
        tuple((name, *chosen[name]) for name in layers if name in chosen),
        model,
        heads,
        vocabulary=tuple(vocabulary),
        vocabulary_size=size,
    )
