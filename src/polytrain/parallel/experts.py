"""Expert parallelism (`--expert-parallel P`): the experts of every mixture (models/moe.py) split over the P ranks
of an expert group, E/P each, and the tokens a rank holds sent to the ranks of their experts and back.

**Where the ranks come from.** As torchtitan borrows its EP ranks from dp_shard x cp, an expert group is P of the
ranks FSDP2 shards over (`Layout.fsdp_ranks`: the shard ranks, with the context ranks beside them): the run's mesh
gives the view `experts` (the ep dimension of the FSDP2 ranks unflattened into (dp_shard_mod_ep, ep)) and
`expert_fsdp` (the ranks that hold the same experts: dp_shard_mod_ep, within each dp_replicate copy). Each rank
holds its experts' rows of the stacked weights as a DTensor cut along dimension 0 over ep (`apply_expert_parallel`),
which FSDP2 then shards over the ranks that hold the same experts; checkpoints keep the one-device names and
shapes, so a run resumes on another expert degree, or on none.

**The exchange** (`ExpertGroup.run`, in place of GroupedExperts' own computation). The (token, choice) pairs are
sorted by expert; one all-to-all tells each rank how many pairs every other rank sends for each of its experts,
and torch's autograd-aware `all_to_all_single_autograd` sends them (its backward sends their gradients back). A
rank groups what it received by its experts, computes one matrix product per expert over its tokens, and the
outputs go back by the reverse all-to-all to be weighed and added to their tokens, as one device does.

**Gradients.** A rank's experts receive the gradients of every rank's tokens routed to them, divided by P: the
mean over the group's ranks, as if each held a copy of them (the tokens' own gradients are not divided). FSDP2
then averages them over the ranks that hold the same experts, as it averages the rest of the model over all of its
ranks, so that they are the one-device gradient as the rest's are. Where FSDP2 sums the ranks' gradients instead (a
pipeline's stages, whose loss is divided by the global batch already), they are not divided.

**Beside DDP** (`--strategy data`: the expert ranks borrowed from DDP's copies). DDP leaves the split experts out
(they are not the same on every rank), and the copies that hold the same experts average their gradients at the
end of each backward DDP synchronises, as DDP averages the rest (`average_copies`); where P is every copy, none
holds the same experts and nothing is averaged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError
from .fsdp import SHARD_OVER
from .layout import experts_not_divided


def _exchange(tensor: torch.Tensor, output_sizes: list, input_sizes: list, group) -> torch.Tensor:
    """`tensor`'s rows sent to the group's ranks (`input_sizes` each) and theirs received (`output_sizes`),
    differentiable: torch's functional collective, whose backward sends the gradients back the same way."""
    import torch.distributed._functional_collectives as funcol

    sent = funcol.all_to_all_single_autograd(tensor, output_sizes, input_sizes, group)
    wait = getattr(
        sent, "trigger_wait", None
    )  # (torch's asynchronous result: waited here, where it is timed)
    return wait() if wait is not None else sent


def _scale_gradient(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """`tensor` itself forward (x - x.detach() is exactly zero), its gradient times `factor` backward."""
    held = tensor.detach()
    return held + (tensor - held) * factor


@dataclass(frozen=True)
class ExpertGroup:
    """The expert group of a rank: `group` (a process group) of `size` ranks, this rank's place in it (`rank`);
    rank r holds experts r E/size .. (r + 1) E/size - 1 of each mixture."""

    group: Any
    rank: int
    size: int
    # what a rank's experts' gradients are multiplied by: 1/size where FSDP2 then averages them over the ranks that
    # hold the same experts (as it averages the rest of the model's), 1 where it sums them (a pipeline's stages,
    # whose loss is divided by the global batch already)
    scale: float = 1.0
    # what the exchanges did since `exchange_figures` last read them: the (token, choice) pairs this rank's experts
    # computed, and the seconds spent in all-to-alls (forward: the calls; backward: from a gradient reaching an
    # exchange's output to its input's)
    spent: list = field(default_factory=lambda: [0, 0.0], compare=False, repr=False)

    @classmethod
    def of(cls, mesh, *, sums: bool = False) -> "ExpertGroup":
        """The ExpertGroup of a 1-D DeviceMesh (the run mesh's `experts` view); `sums`: FSDP2 sums the gradients."""
        return cls(mesh.get_group(), mesh.get_local_rank(), mesh.size(), 1.0 if sums else 1.0 / mesh.size())

    def __deepcopy__(self, memo) -> "ExpertGroup":
        return self  # a copy of a model on this rank exchanges tokens over the same group

    @torch.compiler.disable
    def run(self, experts, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, w1, w2, w3):
        """GroupedExperts' output (N, D) for `tokens` (N, D), their experts `chosen` (N, K) and `weights` (N, K),
        this rank holding the rows w1, w2, w3 of its experts only (their local tensors). Eager under --compile
        (a compiled block runs the rest): its exchanges' sizes are known only as they run, and a traced graph
        would meet the experts' DTensors as FSDP2 holds them."""
        w1, w2, w3 = (
            w.to_local() if hasattr(w, "to_local") else w for w in (w1, w2, w3)
        )  # (as traced: whole)
        count, local = experts.experts, experts.experts // self.size
        picks = chosen.flatten()
        order = torch.argsort(picks, stable=True)  # the (token, choice) pairs grouped by expert
        owner = order // chosen.shape[1]
        counts = torch.bincount(picks, minlength=count)
        sent = counts.view(self.size, local)  # to rank s: the pairs for each of its experts
        received = torch.empty_like(sent)
        began = time.perf_counter()
        dist.all_to_all_single(received, sent, group=self.group)  # from rank s: the pairs for each of mine
        send_sizes, receive_sizes = sent.sum(dim=1).tolist(), received.sum(dim=1).tolist()
        sending = tokens[owner]
        arrived = _exchange(sending, receive_sizes, send_sizes, self.group)
        self.spent[0] += sum(receive_sizes)
        self.spent[1] += time.perf_counter() - began
        self._time_backward(sending, arrived)
        # what arrived lies by source rank, then by expert: regroup it by expert, then by source rank
        block = torch.arange(self.size * local, device=received.device)  # s * local + j: from s, for j
        by_expert = (block % local) * self.size + block // local
        regroup = torch.argsort(torch.repeat_interleave(by_expert, received.flatten()), stable=True)
        # the experts' gradients averaged over the group's ranks (as the ranks' copies of a parameter average
        # theirs; summed where FSDP2 sums), the tokens' summed as one device's: the same value forward, gradients
        # scaled by `scale` then back
        rows, outputs = _scale_gradient(arrived[regroup], 1.0 / self.scale), []
        for j, part in enumerate(rows.split(received.sum(dim=0).tolist())):
            hidden = F.silu(part @ w1[j].transpose(0, 1)) * (part @ w3[j].transpose(0, 1))
            outputs.append(hidden @ w2[j].transpose(0, 1))
        computed = _scale_gradient(torch.cat(outputs), self.scale)[torch.argsort(regroup)]
        began = time.perf_counter()
        returned = _exchange(computed, send_sizes, receive_sizes, self.group)
        self.spent[1] += time.perf_counter() - began
        self._time_backward(computed, returned)
        weighed = returned * weights.flatten()[order, None]
        return torch.zeros_like(tokens).index_add_(0, owner, weighed.to(tokens.dtype))

    def _time_backward(self, sent: torch.Tensor, got: torch.Tensor) -> None:
        """Add to `spent` the backward of the exchange that sent `sent` and got `got`: from the gradient reaching
        `got` to `sent`'s (the engine may run other ready work between them: an upper bound). Not inside a graph
        torch.compile traces (--compile), which keeps no clock."""
        if not got.requires_grad or torch.compiler.is_compiling():
            return
        reached = []
        got.register_hook(lambda grad: reached.append(time.perf_counter()))

        def left(grad) -> None:
            if reached:
                self.spent[1] += time.perf_counter() - reached.pop()

        sent.register_hook(left)


def exchange_figures(model: nn.Module) -> Optional[tuple]:
    """((token, choice) pairs this rank's experts computed, seconds in all-to-alls) of `model`'s expert groups since
    the last call, which resets them; None where no mixture's experts are split."""
    groups = {id(m.expert_parallel): m.expert_parallel for m in mixtures_of(model) if m.expert_parallel}
    if not groups:
        return None
    pairs = sum(group.spent[0] for group in groups.values())
    seconds = sum(group.spent[1] for group in groups.values())
    for group in groups.values():
        group.spent[:] = [0, 0.0]
    return pairs, seconds


def mixtures_of(model: nn.Module) -> list:
    """The modules whose experts expert parallelism splits (models/moe.py's GroupedExperts: those that declare
    `expert_parallel`)."""
    return [module for module in model.modules() if hasattr(type(module), "expert_parallel")]


def expert_parameters(model: nn.Module) -> list:
    """(name, parameter) of every mixture's stacked experts in `model`, by their names in it."""
    found = {id(module) for module in mixtures_of(model)}
    return [
        (f"{name}.{key}" if name else key, parameter)
        for name, module in model.named_modules()
        if id(module) in found
        for key, parameter in module.named_parameters(recurse=False)
    ]


def average_copies(runner, parameters: list, mesh) -> None:
    """The copies of the same experts (`mesh`: the run mesh's second expert view) average their `parameters`'
    gradients once the backward is done, where DDP's `runner` synchronises its own (not in the earlier passes of
    --accumulate, under its `no_sync`): one all-reduce of them all, queued to autograd's end of the backward by the
    first of them whose gradient is complete, as DDP queues its own. Nothing where each copy's experts are its own
    (a mesh of one rank)."""
    if mesh.size() == 1:
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    from torch.autograd import Variable

    group, copies, queued = mesh.get_group(), mesh.size(), [False]

    def average() -> None:
        queued[0] = False
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in parameters]
        grads = [grad for grad in grads if grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for grad, summed in zip(grads, _unflatten_dense_tensors(flat.div_(copies), grads)):
            grad.copy_(summed)

    def done(_parameter) -> None:
        if runner.require_backward_grad_sync and not queued[0]:
            queued[0] = True
            Variable._execution_engine.queue_callback(average)

    for parameter in parameters:
        if parameter.requires_grad:
            parameter.register_post_accumulate_grad_hook(done)


def check_expert_parallel(model: nn.Module, size: int, *, name: str) -> None:
    """One line where `model` has no experts to split, or a mixture's experts do not divide over `size` ranks."""
    found = mixtures_of(model)
    if not found:
        raise ConfigError(
            f"--expert-parallel splits the experts of --model llama --experts E; {name} has no mixture of experts"
        )
    for module in found:
        if module.experts % size:
            raise ConfigError(experts_not_divided(size, module.experts))


def apply_expert_parallel(model: nn.Module, mesh, *, shard_over=None, sums: bool = False) -> nn.Module:
    """Split every mixture's stacked experts over the ranks of `mesh` (the run mesh's 1-D ep view): each weight a
    DTensor cut along dimension 0, this rank's experts' rows its local tensor, and the mixture switched to
    exchanging tokens over the group (`ExpertGroup`; `sums`: FSDP2 sums the gradients rather than averaging them).
    `shard_over` (the ranks that hold the same experts) is given to FSDP2 for the experts (fsdp.py `SHARD_OVER`).
    A model on the meta device stays there."""
    from torch.distributed.tensor import Shard, distribute_tensor

    group = ExpertGroup.of(mesh, sums=sums)
    for module in mixtures_of(model):
        for key, parameter in list(module._parameters.items()):
            whole = parameter.data  # (under a tensor plan, a DTensor replicated over the tensor ranks)
            whole = whole.to_local() if hasattr(whole, "to_local") else whole
            split = distribute_tensor(whole, mesh, [Shard(0)], src_data_rank=None)
            module._parameters[key] = nn.Parameter(split, requires_grad=parameter.requires_grad)
        module.expert_parallel = group
        if shard_over is not None:
            setattr(module, SHARD_OVER, shard_over)
    return model
