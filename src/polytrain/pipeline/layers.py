"""A model as a chain of layers: flattened from nested `nn.Sequential`s, cut into stages that keep each
layer's name in the model, and timed layer by layer for balancing."""

from __future__ import annotations

import statistics
import time
from typing import List, Sequence, Tuple

import torch
import torch.nn as nn

from ..errors import UserError
from ..models.packing import PackedSequential

Layers = List[Tuple[str, nn.Module]]  # (name in the model, module), in the order data flows


def _plain_sequential(module: nn.Module) -> bool:
    """An nn.Sequential whose forward chains its layers (also the llama's and the GPT's, which take packed rows'
    positions beside: a pipeline refuses --pack)."""
    forward = type(module).forward
    return isinstance(module, nn.Sequential) and forward in (nn.Sequential.forward, PackedSequential.forward)


def flatten_layers(model: nn.Module) -> Layers:
    """The layers of an `nn.Sequential`, nested Sequentials expanded, each named as in `model.state_dict()`."""
    if not _plain_sequential(model):
        raise UserError(
            f"the pipeline strategy splits an nn.Sequential, and {type(model).__name__} is not one; "
            f"write the model as nn.Sequential(layer, layer, ...) (nested Sequentials are "
            f"flattened; put code of forward() into small modules), or name the modules where stages begin "
            f"with --split-at NAME,... (torch's tracer), or use --strategy data"
        )
    layers: Layers = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if _plain_sequential(child):
                if child._parameters or child._buffers:
                    raise UserError(
                        f"the Sequential {path!r} holds its own parameters or buffers, which a split "
                        f"would lose; move them into a layer of their own"
                    )
                visit(child, path + ".")
            else:
                layers.append((path, child))

    visit(model, "")
    if model._parameters or model._buffers:
        raise UserError(
            "the model holds parameters or buffers outside its layers, which a split would lose; "
            "move them into a layer of their own"
        )
    if not layers:
        raise UserError(
            "the model has no layers to split; give it at least as many layers as pipeline stages"
        )
    return layers


def describe_stage(layers: Layers, span, costs=None, unit: str = "seconds") -> str:
    """What a pipeline stage of `layers[span]` holds, and its measured cost where the plan has one."""
    count = sum(p.numel() for i in span for p in layers[i][1].parameters())
    timed = ""
    if costs and unit == "seconds":
        timed = f", {sum(costs[i] for i in span) * 1e3:.2f} ms per micro-batch (measured)"
    elif costs:
        timed = f", {sum(costs[i] for i in span) / 2**20:.1f} MiB held per step (measured)"
    return f"layers {describe_layers(layers, span)}, {count:,} parameters{timed}"


def shared_between(layers: Layers) -> List[Tuple[int, int, str, str]]:
    """(first layer, later layer, parameter name in the first, in the later) for every parameter two layers
    share (names relative to the layer)."""
    owner, shared = {}, []
    for i, (_, layer) in enumerate(layers):
        for name, parameter in layer.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(parameter), (i, name))
            if first[0] != i:
                shared.append((first[0], i, first[1], name))
    return shared


class Stage(nn.Module):
    """Some consecutive layers run one after another (the module a pipeline stage executes)."""

    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def named_subset(layers: Layers) -> nn.Module:
    """A module holding `layers` under their original dotted names, so its `state_dict()` keys are exactly
    the model's keys for those layers (e.g. "stages.3.conv1.weight")."""
    root = nn.Module()
    for path, layer in layers:
        *parents, leaf = path.split(".")
        node = root
        for part in parents:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        node.add_module(leaf, layer)
    return root


def _class_name(cls: type) -> str:
    """A layer's class name; a layer sharded by FSDP2 (of its class FSDP<Name>) by its own class's."""
    own = cls.__bases__[-1]
    return own.__name__ if cls.__name__ == f"FSDP{own.__name__}" else cls.__name__


def describe_layers(layers: Layers, indices: range) -> str:
    first, last = layers[indices[0]], layers[indices[-1]]
    kind = lambda entry: _class_name(type(entry[1]))  # noqa: E731
    if len(indices) == 1:
        return f"{indices[0]} {kind(first)}"
    return f"{indices[0]}-{indices[-1]} ({kind(first)} .. {kind(last)})"


def _run(layer: nn.Module, x: torch.Tensor, *, first: bool) -> torch.Tensor:
    inp = x.detach().requires_grad_(not first and x.is_floating_point())  # stage 0 needs no input grad
    out = layer(inp)
    if out.requires_grad:
        out.backward(torch.ones_like(out))
    return out.detach()


def time_layers(layers, sample: torch.Tensor, *, repeats: int = 5) -> List[float]:
    """Seconds each layer takes for forward + backward on `sample` (a micro-batch, on the device the layers
    are on): after two untimed runs (first calls pay for kernel selection), the median of `repeats` runs, each
    layer fed the previous one's output. `layers` is read once, in order, and no layer is kept after its turn:
    an iterable that materialises each in turn (meta.py `one_by_one`) keeps one layer at a time."""
    device = sample.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    costs, x = [], sample
    for i, (_, layer) in enumerate(layers):
        for _ in range(2):
            _run(layer, x, first=i == 0)
        runs = []
        for _ in range(repeats):
            sync()
            began = time.perf_counter()
            out = _run(layer, x, first=i == 0)
            sync()
            runs.append(time.perf_counter() - began)
        costs.append(statistics.median(runs))
        layer.zero_grad(set_to_none=True)
        x = out
        del layer
    return costs


def layer_memory(layers, sample: torch.Tensor, *, optimizer_slots: int) -> List[float]:
    """Bytes each layer holds during a step on `sample`: the tensors autograd saves for its backward (the
    activations a stage keeps per micro-batch in flight), plus its parameters, their gradients and
    `optimizer_slots` optimizer tensors per parameter (momentum: 1, Adam: 2)."""
    sizes, x = [], sample
    for i, (_, layer) in enumerate(layers):
        saved = {}

        def keep(tensor, saved=saved):
            saved[(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))] = (
                tensor.numel() * tensor.element_size()
            )
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            inp = x.detach().requires_grad_(i > 0 and x.is_floating_point())
            out = layer(inp)
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        sizes.append(float(sum(saved.values()) + params * (2 + optimizer_slots)))
        x = out.detach()
        del layer, out, keep  # read in turn (meta.py `one_by_one`): one layer at a time
    return sizes
