"""Sharded data parallelism (FSDP2, `torch.distributed.fsdp.fully_shard`): every rank keeps only its shard
of each layer's parameters, gradients and optimizer state, gathers a layer's full weights just before using
it and frees them after; gradients are reduce-scattered (averaged) back into shards.

The loss is scaled as in data parallelism, so the averaged gradient is exactly the one-device gradient.
Checkpoints are shards: every rank writes its own part of the model and optimizer state under the original
parameter names (`shard_state`, written by torch.distributed.checkpoint, see runtime/shards.py), and loading
re-shards for any number of ranks. `state_dict`/`load_state_dict` gather and slice the whole state in
`torch.optim` numbering, for one-file checkpoints of other strategies and of earlier versions.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..plan.layout import Layout
from ..plan.sharded import ShardedPlan
from .distributed import Distributed
from .fsdp import GATHERED_IN_BF16, mixed_precision
from .holdings import figures, heading, local_bytes, optimizer_slots
from .optimizer_state import keep_speed


def _full(**extra):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


class Sharded(Distributed):
    name = "sharded"
    normalises_global_batch = True
    keeps_channels_last = False  # FSDP2 shards contiguous parameters only
    writes_shards = True
    bench_copies = True
    mesh_keeps = ("shard",)  # FSDP2 shards over dp_shard, even of one rank (a layout of replicas and context)
    data_parallel = "shard"  # FSDP2 (parallelize.py apply_fsdp)

    def __init__(self, *, plan=None, **common):
        super().__init__(**common)
        self.cpu_offload = bool(plan and plan.cpu_offload)
        self.copies = getattr(plan, "replicas", 1)  # of the sharded model (hybrid sharding where above 1)

    @classmethod
    def make_plan(cls, config, model: nn.Module, dataset, *, device: torch.device) -> ShardedPlan:
        if config.cpu_offload and device.type != "cuda":
            raise ConfigError(
                "--cpu-offload moves each GPU's shards to host memory; CPU processes keep them there "
                "already: drop --cpu-offload, or train on GPUs"
            )
        return ShardedPlan(cpu_offload=config.cpu_offload, replicas=config.replicas or 1)

    @property
    def home_device(self) -> torch.device:
        """Under --cpu-offload the model stays in host memory from the start: FSDP2 keeps each shard there and
        gathers a layer onto the GPU only while it computes (it refuses parameters placed on the GPU first)."""
        return torch.device("cpu") if self.cpu_offload else self.device

    def default_layout(self) -> Layout:
        """`copies` replicas of `world_size / copies` shards (one replica: plain FSDP2)."""
        return Layout(replicate=self.copies, shard=self.world_size // self.copies)

    @contextlib.contextmanager
    def gradient_sync(self, *, last: bool):
        """FSDP2 reduce-scatters in the last pass of an accumulated step only."""
        if not last:
            self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            if not last:
                self.model.set_requires_gradient_sync(True)

    def setup(self, model, make_optimizer, make_scheduler) -> None:
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        self.full_meta = {
            k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in model.state_dict().items()
        }
        super().setup(model, make_optimizer, make_scheduler)
        self.placement = self.placement + self._memory_lines(full)

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

    def epoch_extras(self) -> dict:
        """On a GPU, the most device memory any rank had allocated this epoch."""
        if self.device.type != "cuda":
            return {}
        peak = torch.tensor(
            [torch.cuda.max_memory_allocated(self.device)], dtype=torch.float64, device=self.device
        )
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        torch.cuda.reset_peak_memory_stats(self.device)
        mib = float(peak) / 2**20
        return {"peak_device_memory_mib": mib, "note": f"peak device memory {mib:,.0f} MiB (largest rank)"}

    def model_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(self.model, options=_full(cpu_offload=True))
        return state if self.is_main else {}

    def expected_state(self) -> dict:
        return self.full_meta

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        model = self.model_state()
        optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=_full(cpu_offload=True))
        if not self.is_main:
            return {}
        index = {name: i for i, name in enumerate(self.parameter_names)}
        numbered = {
            "state": {index[name]: value for name, value in optimizer["state"].items()},
            "param_groups": [
                dict(group, params=[index[name] for name in group["params"]])
                for group in optimizer["param_groups"]
            ],
        }
        return {"model": model, "optimizer": numbered, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, state["model"], options=_full())
        names, saved = self.parameter_names, state["optimizer"]
        if len(saved["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(
                f"it has {len(saved['param_groups'])} parameter group(s), this run "
                f"{len(self.optimizer.param_groups)} (--no-decay-norms-and-biases or param_groups= "
                f"differ)"
            )
        named = {
            "state": {names[i]: value for i, value in saved["state"].items()},
            "param_groups": [
                dict(group, params=[names[i] for i in group["params"]], **keep_speed(mine))
                for group, mine in zip(saved["param_groups"], self.optimizer.param_groups)
            ],
        }
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=named, options=_full())
        self.scheduler.load_state_dict(state["scheduler"])

    def shard_state(self, *, optimizer: bool = True) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not optimizer:
            return {"model": get_model_state_dict(self.model)}
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optim}

    def load_shards(self, load, scheduler: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        speeds = [keep_speed(group) for group in self.optimizer.param_groups]
        state = self.shard_state()  # this rank's shards (optimizer slots created), filled in place
        load(state)
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        for group, speed in zip(self.optimizer.param_groups, speeds):
            group.update(speed)
        self.scheduler.load_state_dict(scheduler)
