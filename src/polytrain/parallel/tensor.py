"""How a tensor plan is applied to a model (torch's DTensor parallel styles): the layers split by columns or
rows, fused layers' rows put in the ranks' order, Megatron's sequence parallelism, the rest replicated; and
the reordering of a fused layer's rows between the ranks' order and the one-device order in state dicts."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.nn as nn

from ..errors import ConfigError
from .meta import WRAPPED, base_of
from .tensor_plan import TensorPlan, is_conv1d


def _permutation(size: int, parts: int, devices: int) -> torch.Tensor:
    """Rows of a fused `parts`-part output reordered so that rank r's contiguous slice is its rows of every
    part: [part 0 of rank 0, part 1 of rank 0, ..., part 0 of rank 1, ...]."""
    part, share = size // parts, size // parts // devices
    return torch.tensor(
        [k * part + r * share + j for r in range(devices) for k in range(parts) for j in range(share)]
    )


def split_layers(model: nn.Module, mesh, plan: TensorPlan) -> dict:
    """Split `model`'s layers as `plan` names them (colwise, rowwise; fused colwise:K rows interleaved first,
    a vocabulary as torchtitan splits it, and Megatron's sequence parallelism where the plan asks for it);
    returns parameter name -> the row order of each fused layer's parameters as the ranks hold them."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles, fused = {}, {}
    layer = lambda name: _base(model.get_submodule(name))  # noqa: E731  (a layer with adapters: its base)
    for name, style, parts in plan.styles:
        if name in plan.vocabulary:  # ids in (whole), the sum of the ranks' rows out; the head's scores whole
            styles[name] = (
                RowwiseParallel(input_layouts=Replicate())
                if style == "rowwise"
                else ColwiseParallel(output_layouts=Replicate())
            )
        elif style == "colwise":
            styles[name] = transposed_style("colwise") if is_conv1d(layer(name)) else ColwiseParallel()
            if parts > 1:
                for part in _split_parts(model, name):
                    fused.update(interleave(model, part, parts, mesh.size()))
        elif style == "rowwise":
            styles[name] = transposed_style("rowwise") if is_conv1d(layer(name)) else RowwiseParallel()
    if plan.sequence_parallel:
        sequence_styles(model, styles, vocabulary=plan.vocabulary)
    head_norm_styles(model, styles)
    adapter_styles(model, styles, vocabulary=plan.vocabulary)
    held = [
        (module, key, id(p))
        for module in map(model.get_submodule, plan.vocabulary)
        for key, p in module._parameters.items()
        if p is not None
    ]
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, mesh, styles)
    for name, parameter in model.named_parameters():  # (torch's SequenceParallel makes every one it takes
        if name in frozen:  # trainable: a norm frozen by --freeze or --lora stays frozen)
            parameter.requires_grad_(False)
    first = {}  # a tied embedding and head are split one by one: tie them again (both Shard(0) DTensors)
    for module, key, was in held:
        module._parameters[key] = first.setdefault(was, module._parameters[key])
    return fused


def _base(module: nn.Module) -> nn.Module:
    return base_of(module) or module


def _split_parts(model: nn.Module, name: str) -> list:
    """The layers whose outputs a colwise `name` splits: itself, or, where it has adapters (peft's LoRA), the
    layer it adapts and each adapter's B (whose outputs are the layer's)."""
    module = model.get_submodule(name)
    if base_of(module) is None:
        return [name]
    return [f"{name}{WRAPPED}"] + [f"{name}.lora_B.{key}" for key in module.lora_B]


def adapter_styles(model: nn.Module, styles: dict, *, vocabulary=()) -> None:
    """A split layer with adapters (peft's LoRA layer: base(x) + B(A(x)) * scale) splits as its base does, the
    adapters with it, so that the sum is made of parts the ranks hold alike: under a column split (outputs)
    each B by its outputs and A whole; under a row split (inputs, partial sums) each A by its inputs, summed
    as the base's are, and B whole (on a part of the sequence where the base's sums are scattered over it,
    torch's SequenceParallel, so that its gradient sums every rank's part)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    for name in [name for name in styles if base_of(model.get_submodule(name)) is not None]:
        if name in vocabulary:
            raise ConfigError(
                f"--lora adapts {name}, which the tensor plan splits by its vocabulary; leave it out of "
                f"--lora-targets, or replicate it"
            )
        style, module = styles.pop(name), model.get_submodule(name)
        styles[f"{name}{WRAPPED}"] = style
        for key in module.lora_A:
            a, b = f"{name}.lora_A.{key}", f"{name}.lora_B.{key}"
            if isinstance(style, ColwiseParallel):
                styles[b] = ColwiseParallel()
            elif isinstance(style, RowwiseParallel):
                scattered = style.output_layouts[0] == Shard(1)
                styles[a] = RowwiseParallel(output_layouts=style.output_layouts[0])
                if scattered:
                    styles[b] = SequenceParallel(use_local_output=True)


def head_norm_styles(model: nn.Module, styles: dict) -> None:
    """A norm over each head (the llama's q_norm and k_norm with --qk-norm, Qwen3's) whose projection is split by
    columns sees this rank's heads only, (B, T, heads / ranks, head_dim): it runs on them as torch's
    SequenceParallel runs a norm on a part of the sequence, its dimension 2 the part, so that its weight is one
    replicated DTensor whose gradient sums every rank's heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    for name, module in model.named_modules():
        for norm, projection in (("q_norm", "wq"), ("k_norm", "wk")):
            if isinstance(getattr(module, norm, None), nn.RMSNorm) and isinstance(
                styles.get(f"{name}.{projection}"), ColwiseParallel
            ):
                styles[f"{name}.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)


def sequence_styles(model: nn.Module, styles: dict, *, vocabulary=()) -> None:
    """Megatron's sequence parallelism, as torchtitan lays it out: between the split layers the residual
    stream stays cut along the sequence (each rank its T / ranks positions), the norms run on their part
    of it, the row-wise layers reduce-scatter into it instead of all-reducing, and the sequence is gathered
    before each attention and MLP, and before the head. A token embedding split by the vocabulary
    reduce-scatters into it too, and the (whole) position embedding beside it gives each rank its positions."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for name in [name for name in styles if name not in vocabulary]:
        if isinstance(styles[name], RowwiseParallel):
            styles[name] = RowwiseParallel(output_layouts=Shard(1))
        styles[name.rsplit(".", 1)[0]] = PrepareModuleInput(**gather)  # its attention or MLP
    for name, module in model.named_modules():  # (not a norm over each head: head_norm_styles)
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and not name.endswith(("q_norm", "k_norm")):
            styles[name] = SequenceParallel(use_local_output=True)
    *_, (head, _) = model.named_children()
    styles[head] = (
        ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        if head in vocabulary
        else PrepareModuleInput(**gather, use_local_output=True)
    )  # the head takes it whole
    for name in [name for name in vocabulary if isinstance(model.get_submodule(name), nn.Embedding)]:
        styles[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        parent = name.rpartition(".")[0]
        for other, table in model.get_submodule(
            parent
        ).named_children():  # (B, T, width) + positions (T, width)
            other = f"{parent}.{other}" if parent else other
            if isinstance(table, nn.Embedding) and other not in styles:
                styles[other] = PrepareModuleOutput(
                    output_layouts=Replicate(), desired_output_layouts=Shard(0), use_local_output=True
                )


@torch.no_grad()
def interleave(model: nn.Module, name: str, parts: int, devices: int) -> dict:
    """Put the rows of the fused layer `name` in the ranks' order (`_permutation`); returns its parameters'
    names -> that order."""
    module = model.get_submodule(name)
    order = _permutation(module.out_features, parts, devices)
    fused = {}
    for key, parameter in module.named_parameters(recurse=False):
        parameter.copy_(parameter[order.to(parameter.device)])
        fused[f"{name}.{key}"] = order
    return fused


def replicate_rest(model: nn.Module, mesh) -> dict:
    """Every parameter the plan did not split becomes a replicated DTensor (tied ones stay tied), and its
    module takes and gives local tensors: the optimizer and the global norm see one kind of tensor. Returns
    id(former parameter) -> its replacement."""
    from torch.distributed.tensor import DTensor, Replicate

    def to_replicated(module, inputs):
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    made = {}
    for module in model.modules():
        own = [
            (key, p) for key, p in module._parameters.items() if p is not None and not isinstance(p, DTensor)
        ]
        for key, parameter in own:
            if id(parameter) not in made:
                made[id(parameter)] = nn.Parameter(
                    DTensor.from_local(parameter.data, mesh, [Replicate()], run_check=False),
                    requires_grad=parameter.requires_grad,
                )
            module._parameters[key] = made[id(parameter)]
        if own:
            module.register_forward_pre_hook(to_replicated)
            module.register_forward_hook(_to_local)
    return made


def reordered(state: dict, fused: dict, *, back: bool) -> dict:
    """A whole-model state dict with the fused layers' rows in the original order (back) or the ranks'."""
    return {
        key: _rows(value, fused[key], back=back) if key in fused else value for key, value in state.items()
    }


def reordered_optimizer(saved: dict, fused: dict, names: list, *, back: bool) -> dict:
    """The same for a whole-model optimizer state dict (keyed by parameter number; `names` the parameters' by
    number): each fused parameter's per-row state (momentum, Adam's moments) follows its rows."""
    return dict(
        saved,
        state={
            number: {slot: _rows(value, fused[names[number]], back=back) for slot, value in slots.items()}
            if names[number] in fused
            else slots
            for number, slots in saved["state"].items()
        },
    )


def _rows(value, order: torch.Tensor, *, back: bool):
    """A tensor of the fused layer's shape with its first dimension put back in (or taken out of) `order`."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != len(order):
        return value
    if back:
        restored = torch.empty_like(value)
        restored[order.to(value.device)] = value
        return restored
    return value[order.to(value.device)]


def _to_local(module, inputs, output):
    """A forward hook: this rank's part of a DTensor output, as a plain tensor."""
    return output.to_local() if hasattr(output, "to_local") else output


def transposed_style(style: str):
    """torch's ColwiseParallel / RowwiseParallel for a Linear whose weight is stored [inputs, outputs]
    (Hugging Face's Conv1D): colwise splits the weight's columns and the bias, rowwise the weight's rows (the
    bias stays whole), with the same inputs and outputs as for an nn.Linear."""
    from functools import partial

    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    base = ColwiseParallel if style == "colwise" else RowwiseParallel
    placements = {"weight": Shard(1), "bias": Shard(0)} if style == "colwise" else {"weight": Shard(0)}

    class Transposed(base):
        def _apply(self, module: nn.Module, device_mesh):
            def partition(_, layer, mesh):
                for key, parameter in list(layer.named_parameters(recurse=False)):
                    where = [placements.get(key, Replicate())]
                    layer.register_parameter(
                        key,
                        nn.Parameter(
                            distribute_tensor(parameter, mesh, where),
                            requires_grad=parameter.requires_grad,
                        ),
                    )

            if style == "rowwise":
                self.desired_input_layouts = (Shard(-1),)  # the partial sums' inputs: each rank its columns
            return distribute_module(
                module,
                device_mesh,
                partition,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
            )

    return Transposed()


def apply_tensor_plan(model: nn.Module, mesh, plan: TensorPlan) -> dict:
    """`model` split over the tensor ranks of `mesh` (the run's `tp` dimension) as `plan` says, in place: its
    layers by the plan's styles (or the user's own `apply`), every other parameter a replicated DTensor, and,
    under sequence parallelism with whole embeddings, each rank keeping its part of the positions. Returns
    parameter name -> the row order of each fused layer as the ranks hold them. A part of the model (a pipeline
    rank's stages, under the whole model's names) takes the styles of the layers it holds."""
    fused = {}
    if plan.apply is not None:
        plan.apply(model, mesh)
    else:
        held = {name for name, _ in model.named_modules()}
        mine = replace(plan, styles=tuple(entry for entry in plan.styles if entry[0] in held))
        fused = split_layers(model, mesh, mine) if mine.styles else {}
    replicate_rest(model, mesh)
    if plan.sequence_parallel and not plan.vocabulary:  # (else sequence_styles cuts them)
        next(model.children()).register_forward_hook(partial(_my_positions, mesh))
    return fused


def _my_positions(mesh, module, inputs, output):
    """Embeddings whole on every rank (a vocabulary too small to split): each keeps its part of the sequence,
    through DTensor, so that backward gathers the parts' gradients for the embeddings."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    whole = DTensor.from_local(output, mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(1)]).to_local()
