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
        tensor = tensor.clone()
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
