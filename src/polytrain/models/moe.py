"""A mixture of experts in place of a transformer block's feed-forward (`--experts E --experts-per-token K`):
Mixtral's and Qwen2-MoE's design, as their Hugging Face models compute it.

    polytrain train --model llama --experts 8 --experts-per-token 2 --dataset shakespeare
    polytrain verify --model llama --experts 8 --experts-per-token 2 --dataset shakespeare --devices 2

**Routing.** A router (a linear layer without bias, `router`) scores each token against every expert; the
softmax of the scores (in float32, or the model's dtype where wider) gives each expert a probability, a token
goes to the K most probable, and the K kept probabilities weigh their outputs, renormalised to sum to one
(Mixtral, Qwen3-MoE; `renormalise=False` keeps them as they are: Qwen2-MoE's `norm_topk_prob` false). Dropless:
every token reaches its K experts, whatever the imbalance (no capacity factor), as Hugging Face's models compute.

**Experts.** E SwiGLU feed-forwards of the same width, held as three stacked weights (`GroupedExperts`:
w1 and w3 [E, F, D], w2 [E, D, F], torchtitan's layout; an expert's rows are its slice of dimension 0, which is
what a later expert-parallel split and FSDP2 cut). Computed grouped: the (token, choice) pairs sorted by expert,
one matrix product per expert over its tokens, the outputs weighed and added back to their tokens; a Python loop
over the experts, never over tokens. Under a fake tensor (the memory check measures activations without
computing) the routing is taken as even, the expected share of a balanced router.

**A shared expert** (`shared=S`, Qwen2-MoE's): one more SwiGLU of S times the experts' width that every token
goes through, its output scaled by a sigmoid gate (a linear layer to one score) and added.

**The load-balancing loss** (`balance=w`, `--router-aux-loss w`; Hugging Face's `router_aux_loss_coef`, which its
models add where `output_router_logits` is set): per sequence and mixture, E sum_e f_e P_e, with f_e the share of
the sequence's (token, choice) pairs routed to expert e (summing to K over the experts) and P_e the mean router
probability of expert e over its tokens; w times its mean over the mixtures is added to each sequence's loss
(`balance_loss`). It is K where routing is even, more where it is not. Hugging Face pools a pass's tokens and
layers into one f and P: equal for one sequence and one mixture; taken per sequence and per layer it is the same
on every layout (ranks, passes and stages each add their sequences', no collective over the batch). Where a
sequence is split over context ranks (`context_parallel`, set as on the attention), f counts the whole
sequence (its counts summed over the group) and each rank adds its tokens' part of P.

**Tokens per expert.** Every training forward adds each expert's (token, choice) pairs to `routed`, read and reset
by `routed_tokens` for the epoch's record.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's local tensor (a tensor plan keeps the mixtures whole on every tensor rank and hands
    their modules DTensors); a tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _is_fake(tensor: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(tensor, FakeTensor) or tensor.device.type == "meta"


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass (activation checkpointing recomputing a block): its
    routing was counted when the block first ran."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: expert e computes w2[e](silu(w1[e] x) * w3[e] x)."""

    # an ExpertGroup where the experts are split over ranks (parallel/experts.py): this rank holds its experts'
    # rows of the weights, and the tokens are exchanged with the group's other ranks
    expert_parallel = None

    def __init__(self, experts: int, width: int, hidden: int):
        super().__init__()
        self.experts, self.width, self.hidden = experts, width, hidden
        self.w1 = nn.Parameter(torch.empty(experts, hidden, width))
        self.w2 = nn.Parameter(torch.empty(experts, width, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, width))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, residual_std: float = 0.02) -> None:
        """N(0, 0.02) as the llama's linear layers; w2, a residual projection, N(0, `residual_std`)."""
        nn.init.normal_(self.w1, mean=0.0, std=0.02)
        nn.init.normal_(self.w3, mean=0.0, std=0.02)
        nn.init.normal_(self.w2, mean=0.0, std=residual_std)

    def forward(self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`tokens` (N, D); `chosen` (N, K) each token's experts; `weights` (N, K) their weights: (N, D)."""
        tokens, chosen, weights = _local(tokens), _local(chosen), _local(weights)
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if self.expert_parallel is not None and not _is_fake(tokens):
            return self.expert_parallel.run(self, tokens, chosen, weights, w1, w2, w3)
        held = w1.shape[
            0
        ]  # (a rank of an expert group holds E/P experts: under a fake tensor, as many pairs)
        picks = chosen.flatten() if held == self.experts else chosen.flatten() % held
        order = torch.argsort(picks, stable=True)  # the (token, choice) pairs grouped by expert
        owner = order // chosen.shape[1]  # the token of each pair, in that order
        if _is_fake(tokens):
            even, rest = divmod(picks.numel(), held)
            counts = [even + (e < rest) for e in range(held)]
        else:
            counts = torch.bincount(picks, minlength=held).tolist()
        grouped = tokens[owner]
        outputs = []
        for e, rows in enumerate(grouped.split(counts)):
            hidden = F.silu(rows @ w1[e].transpose(0, 1)) * (rows @ w3[e].transpose(0, 1))
            outputs.append(hidden @ w2[e].transpose(0, 1))
        weighed = torch.cat(outputs) * weights.flatten()[order, None]
        return torch.zeros_like(tokens).index_add_(0, owner, weighed.to(tokens.dtype))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x): the llama's dense feed-forward, and a shared expert's."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)
        self.w3 = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SharedExpert(FeedForward):
    """A SwiGLU every token goes through, scaled by sigmoid(gate(x)) (Qwen2-MoE's shared expert)."""

    def __init__(self, width: int, hidden: int):
        super().__init__(width, hidden)
        self.gate = nn.Linear(width, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * super().forward(x)


class MixtureOfExperts(nn.Module):
    """A block's feed-forward as a mixture: `router`, `experts` (GroupedExperts) and an optional `shared`
    expert; (B, T, D) in and out. `balance`: the load-balancing loss's weight (0: none); `block`: the index of
    the block it is in (the epoch record's tokens per expert are per block)."""

    # a ContextGroup where each sequence is split over ranks (parallel/context.py): the routing counts of a
    # sequence are then summed over the group
    context_parallel = None

    def __init__(
        self,
        width: int,
        hidden: int,
        experts: int,
        per_token: int,
        *,
        shared: int = 0,
        renormalise: bool = True,
        balance: float = 0.0,
        block: int = 0,
    ):
        super().__init__()
        self.per_token, self.renormalise = per_token, renormalise
        self.balance_weight, self.block = float(balance), block
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = GroupedExperts(experts, width, hidden)
        self.shared: Optional[SharedExpert] = SharedExpert(width, shared * hidden) if shared else None
        # the last forward's weighted load-balancing loss per sequence (B,), differentiable; and the (token, choice)
        # pairs each expert got in training since `routed_tokens` last read them
        self.balance: Optional[torch.Tensor] = None
        self.routed: Optional[torch.Tensor] = None

    def route(self, tokens: torch.Tensor):
        """(the experts each token goes to (N, K), their weights (N, K), every expert's probability (N, E))."""
        scores = self.router(tokens)
        probabilities = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        weights, chosen = torch.topk(probabilities, self.per_token, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights, probabilities

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        chosen, weights, probabilities = self.route(tokens)
        if self.balance_weight:
            self.balance = self.balance_weight * self.balance_of(
                _local(chosen), _local(probabilities), x.shape[0]
            )
        if self.training and not _is_fake(tokens) and not _recomputing():
            with torch.no_grad():
                picks = torch.bincount(_local(chosen).flatten(), minlength=self.experts.experts)
                self.routed = picks if self.routed is None else self.routed + picks
        out = self.experts(tokens, chosen, weights)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(x.shape)

    def balance_of(self, chosen: torch.Tensor, probabilities: torch.Tensor, sequences: int) -> torch.Tensor:
        """E sum_e f_e P_e of each of the `sequences` (the module's docstring): (B,), this rank's part of it where a
        context group splits the sequences."""
        experts = self.experts.experts
        length = chosen.shape[0] // sequences
        with torch.no_grad():
            counts = torch.zeros(sequences, experts, dtype=probabilities.dtype, device=chosen.device)
            counts.scatter_add_(
                1,
                chosen.reshape(sequences, -1),
                torch.ones_like(chosen, dtype=counts.dtype).view(sequences, -1),
            )
            if self.context_parallel is not None:
                counts = self.context_parallel.sum(counts)
                length *= self.context_parallel.size
        held = probabilities.reshape(sequences, -1, experts).sum(
            dim=1
        )  # this rank's part of the mean, times T
        return experts * (counts * held).sum(dim=-1) / length**2


def mixtures(model: nn.Module) -> list:
    """The mixtures of experts in `model` (none: a dense model)."""
    return [module for module in model.modules() if isinstance(module, MixtureOfExperts)]


def over_whole_sequences(model: nn.Module, per_sequence: torch.Tensor) -> torch.Tensor:
    """`per_sequence` (B,) summed over the ranks that hold parts of each sequence (the context group the
    mixtures were given), or as it is where every rank holds whole sequences."""
    group = next((m.context_parallel for m in mixtures(model) if m.context_parallel is not None), None)
    return per_sequence if group is None else group.sum(per_sequence)


def balance_loss(model: nn.Module) -> Optional[torch.Tensor]:
    """The weighted load-balancing loss of `model`'s last forward per sequence (B,): the mean over its mixtures
    that have one; taken from them (a later forward sets it again). None where no mixture has one."""
    found = []
    for module in mixtures(model):
        if module.balance is not None:
            found.append(module.balance)
            module.balance = None
    return torch.stack(found).mean(dim=0) if found else None


def routed_tokens(model: nn.Module) -> dict:
    """{block index: the (token, choice) pairs each expert of its mixture got in training since the last call}
    (int64 tensors of E), reset; {} for a dense model or before any training forward."""
    counts = {}
    for module in mixtures(model):
        if module.routed is not None:
            counts[module.block], module.routed = module.routed, None
    return counts
