"""Sharded data parallelism (FSDP2, `torch.distributed.fsdp.fully_shard`): every rank keeps only its shard
of each layer's parameters, gradients and optimizer state, gathers a layer's full weights just before using
it and frees them after; gradients are reduce-scattered (averaged) back into shards.

The loss is scaled as in data parallelism, so the averaged gradient is exactly the one-device gradient.
Checkpoints are shards: every rank writes its own part of the model and optimizer state under the original
parameter names (`shard_state`, written by torch.distributed.checkpoint, see runtime/shards.py), and loading
re-shards for any number of ranks. `state_dict`/`load_state_dict` gather and slice the whole state in
`torch.optim` numbering, for one-file checkpoints of other strategies and of earlier versions (both as every
strategy of DTensor parts does them: dtensor_model.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..parallel.fsdp import GATHERED_IN_BF16, mixed_precision
from ..plan.sharded import ShardedPlan
from .dtensor_model import DTensorModel
from .holdings import figures, heading, local_bytes, optimizer_slots


class Sharded(DTensorModel):
    name = "sharded"
    normalises_global_batch = True
    data_parallel = "shard"  # FSDP2 (parallelize.py apply_fsdp)

    def __init__(self, *, plan=None, **common):
        super().__init__(**common)
        self.cpu_offload = bool(plan and plan.cpu_offload)

    @classmethod
    def make_plan(cls, config, model: nn.Module, dataset, *, device: torch.device) -> ShardedPlan:
        if config.cpu_offload and device.type != "cuda":
            raise ConfigError(
                "--cpu-offload moves each GPU's shards to host memory; CPU processes keep them there "
                "already: drop --cpu-offload, or train on GPUs"
            )
        return ShardedPlan(cpu_offload=config.cpu_offload)

    def _memory_lines(self, full: int) -> list:
        """What each rank holds (parameters; gradients are the same size; optimizer state after its first
        step, estimated here from the optimizer's per-parameter slots) next to a data-parallel replica."""
        held = local_bytes(self.model.parameters())
        slots = optimizer_slots(self.optimizer)
        rows = self.gather_object((self.rank, str(self.device), held))
        if not self.is_main:
            return []
        layout, ranks = self.layout.sharding, f"{self.world_size} ranks"
        if layout.replicate > 1:
            ranks = f"{layout.replicate} replicas of {layout.shard} shards (hybrid sharding)"
        lines = [
            f"sharded: {ranks}; {heading(slots)}"
            + (", held in host memory (--cpu-offload)" if self.cpu_offload else "")
            + (GATHERED_IN_BF16 if mixed_precision(self.precision) else "")
        ]
        for rank, device, size in rows:
            lines.append(
                f"  rank {rank} ({device}): {figures(size, slots)}; data parallel would hold "
                f"{figures(full, slots)}"
            )
        return lines
