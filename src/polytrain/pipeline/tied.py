"""Weights that layers on different pipeline stages share (tied input and output embeddings), tied as Megatron
ties them: the earliest stage that uses a weight owns it, and only its optimizer steps it. Every later stage
holds a copy: after the backward pass the copy's gradient is summed into the owner's (and dropped, so the global
norm counts the weight once), and after the optimizer step the owner sends the new weight to the copy. Stages
on the same rank share the parameter itself and need neither.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from ..strategies.holdings import local_part
from .layers import shared_between


class TiedWeights:
    """The ties of one pipeline rank: built on every rank, in the same order (process groups are made by all).

    With stages split over tensor ranks (the weight a replicated DTensor on each), tensor slice t of the owner's
    stage pairs with slice t of the copy's. Each rank finds its parameter by name in the layer it holds when it
    uses it, so a split after this (which replaces parameters) is seen."""

    def __init__(self, plan, layout, layers, *, rank: int):
        stage_of = {i: s for s in range(plan.model_stages) for i in plan.stage_layers(s)}
        pipeline_rank = layout.coordinates(rank)["pipeline"]
        # ((layer, parameter name in it), group, owner rank, whether this rank holds a copy), in the same order
        # on every rank, so that two ranks tied twice call their collectives in one order
        self.ties: List[tuple] = []
        for first, later, name, later_name in shared_between(layers):
            owner_rank, copy_rank = stage_of[first] % layout.pipeline, stage_of[later] % layout.pipeline
            if owner_rank == copy_rank:
                continue  # one rank holds both stages: they share the parameter itself
            for owner in layout.ranks_where(pipeline=owner_rank):  # each pipeline's, each tensor slice's
                holder = layout.rank_with(owner, pipeline=copy_rank)
                group = dist.new_group([owner, holder])
                if rank in (owner, holder):
                    copy = pipeline_rank == copy_rank
                    held = (layers[later][1], later_name) if copy else (layers[first][1], name)
                    self.ties.append((held, group, owner, copy))

    def is_copy(self, parameter) -> bool:
        return any(parameter is layer.get_parameter(name) and copy for (layer, name), _, _, copy in self.ties)

    @torch.no_grad()
    def send_gradients(self) -> None:
        """Sum each copy's gradient into its owner's; the copy's is then dropped."""
        for (layer, name), group, _, copy in self.ties:
            parameter = layer.get_parameter(name)
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(local_part(parameter.grad), group=group)
            if copy:
                parameter.grad = None

    @torch.no_grad()
    def share_weights(self) -> None:
        """The owners' weights after their step, on every copy."""
        for (layer, name), group, owner, _ in self.ties:
            dist.broadcast(local_part(layer.get_parameter(name).data), src=owner, group=group)
