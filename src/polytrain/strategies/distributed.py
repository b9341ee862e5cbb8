"""A strategy whose ranks form one torch.distributed group: sums and objects go through it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Strategy


class Distributed(Strategy):
    """A strategy whose ranks form one torch.distributed group: sums and objects go through it."""

    needs_process_group = True
    reference = False

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums over ranks, each tensor group counted once: its ranks hold the same figures (from the layout)."""
        counted = self.layout.tensor == 1 or self.layout.coordinates(self.rank)["tensor"] == 0
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
