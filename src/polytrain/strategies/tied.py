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

from .layers import shared_between


class TiedWeights:
    """The ties of one pipeline rank: built on every rank, in the same order (process groups are made by all)."""

    def __init__(self, plan, layers, *, replica: int, pipeline_rank: int):
        stage_of = {i: s for s in range(plan.model_stages) for i in plan.stage_layers(s)}
        ranks = plan.layout.ranks
        # (parameter, group, owner rank, whether this rank holds a copy), in the same order on every rank, so
        # that two ranks tied twice call their collectives in one order
        self.ties: List[tuple] = []
        for first, later, name in shared_between(layers):
            owner_stage, copy_stage = stage_of[first], stage_of[later]
            if owner_stage % ranks == copy_stage % ranks:
                continue                   # one rank holds both stages: they share the parameter itself
            parameter = dict(layers[first][1].named_parameters(prefix=layers[first][0], remove_duplicate=False))[name]
            for r in range(plan.layout.replicas):
                owner, holder = r * ranks + owner_stage % ranks, r * ranks + copy_stage % ranks
                group = dist.new_group([owner, holder])
                if r == replica and pipeline_rank in (owner_stage % ranks, copy_stage % ranks):
                    self.ties.append((parameter, group, owner, pipeline_rank == copy_stage % ranks))

    def is_copy(self, parameter) -> bool:
        return any(parameter is held and copy for held, _, _, copy in self.ties)

    def send_gradients(self) -> None:
        """Sum each copy's gradient into its owner's; the copy's is then dropped."""
        for parameter, group, _, copy in self.ties:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad, group=group)
            if copy:
                parameter.grad = None

    @torch.no_grad()
    def share_weights(self) -> None:
        """The owners' weights after their step, on every copy."""
        for parameter, group, owner, _ in self.ties:
            dist.broadcast(parameter.data, src=owner, group=group)
