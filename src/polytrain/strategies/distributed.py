"""A strategy whose ranks form one torch.distributed group: sums and objects go through it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Strategy


class Distributed(Strategy):
    """A strategy whose ranks form one torch.distributed group: sums and objects go through it."""

    needs_process_group = True
    # the degrees whose ranks hold the same figures of a step (`reduce` counts each such group once): a tensor
    # group's ranks each compute their slice's whole loss; a pipeline's share its last stage's (pipeline/strategy.py)
    figures_shared_by = ("tensor",)

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums over ranks, each group of ranks that hold the same figures (`figures_shared_by`, from the layout)
        counted once."""
        where = self.layout.coordinates(self.rank)
        counted = all(where[degree] == 0 for degree in self.figures_shared_by)
        tensor = tensor.clone() if counted else torch.zeros_like(tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def broadcast_object(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_object(self, value) -> list:
        gathered = [None] * self.world_size if self.is_main else None
        dist.gather_object(value, gathered, dst=0)
        return gathered
