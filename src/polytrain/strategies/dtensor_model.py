"""The strategies whose ranks each hold parts of the parameters, as DTensors: `sharded` (FSDP2 shards) and
`tensor` (a tensor plan's slices, FSDP2 over the groups side by side). They run the one training step every
strategy shares (base.py) and are prepared by `parallelize`; what they have in common is how the whole state is
read and written from parts.

The whole model and optimizer state (for `model.pt` and one-file checkpoints) are gathered and cut back by
torch.distributed.checkpoint's state-dict API (`get_model_state_dict`, `set_optimizer_state_dict`, ...) in
`torch.optim`'s numbering; checkpoints are each rank's parts, written by torch.distributed.checkpoint at their
places in the one-device tensors (`shard_state`, runtime/shards.py), so `--resume` moves runs between any
strategies and device counts. A tensor plan's fused layers (a q/k/v Linear) hold their rows in the ranks' order:
states put them back in the one-device order (tensor_split.py `reordered`, checkpoint_parts.py
`in_one_device_rows`).
"""

from __future__ import annotations

import contextlib

import torch

from ..parallel.tensor import reordered, reordered_optimizer
from .checkpoint_parts import apply_groups, in_one_device_rows
from .distributed import Distributed
from .optimizer_state import keep_speed


def _full(**extra):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


class DTensorModel(Distributed):
    """A strategy whose parameters are DTensors each rank holds a part of."""

    writes_shards = True
    keeps_channels_last = False  # FSDP2 shards contiguous parameters only

    @property
    def home_device(self) -> torch.device:
        """Under --cpu-offload the model stays in host memory from the start: FSDP2 keeps each shard there and
        gathers a layer onto the GPU only while it computes (it refuses parameters placed on the GPU first)."""
        return torch.device("cpu") if self.cpu_offload else self.device

    @contextlib.contextmanager
    def gradient_sync(self, *, last: bool):
        """FSDP2 reduce-scatters in the last pass of an accumulated step only (a tensor plan alone, without
        FSDP2, has nothing to synchronise)."""
        skip = not last and self.data_parallel == "shard"
        if skip:
            self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            if skip:
                self.model.set_requires_gradient_sync(True)

    def setup(self, model, make_optimizer, make_scheduler) -> None:
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        self.full_meta = {
            k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in model.state_dict().items()
        }
        super().setup(model, make_optimizer, make_scheduler)
        self.placement = self.placement + self._memory_lines(full)

    def _memory_lines(self, full: int) -> list:
        """Rank 0's start-up lines of what each rank holds, beside `full` bytes of a whole replica."""
        raise NotImplementedError

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

    # -- the whole state, gathered from the parts and cut back ------------------------------------------
    def model_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(self.model, options=_full(cpu_offload=True))
        return reordered(state, self.fused, back=True) if self.is_main else {}

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
        numbered = reordered_optimizer(numbered, self.fused, self.parameter_names, back=True)
        return {"model": model, "optimizer": numbered, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        names = self.parameter_names
        model = reordered(state["model"], self.fused, back=False)
        saved = reordered_optimizer(state["optimizer"], self.fused, names, back=False)
        set_model_state_dict(self.model, model, options=_full())
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

    # -- checkpoints of parts ---------------------------------------------------------------------------
    def shard_state(self, *, optimizer: bool = True) -> dict:
        """This rank's parts by their one-device names, fused layers' rows at their one-device places."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not optimizer:
            return in_one_device_rows({"model": get_model_state_dict(self.model)}, self.fused)
        model, optim = get_state_dict(self.model, self.optimizer)
        return in_one_device_rows({"model": model, "optimizer": optim}, self.fused)

    def load_shards(self, load, scheduler: dict) -> None:
        """torch.distributed.checkpoint reads each rank's parts into its parameters and optimizer state
        (`shard_state`'s tensors); then the saved groups' settings, each group keeping its kernel choices."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        speeds = [keep_speed(group) for group in self.optimizer.param_groups]
        state = self.shard_state()  # this rank's parts (optimizer slots created), filled in place
        load(state)
        if self.fused:  # (the fused rows' tensors are read in place; the state's groups are applied)
            apply_groups(self.optimizer, state["optimizer"]["param_groups"])
        else:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )
        for group, speed in zip(self.optimizer.param_groups, speeds):
            group.update(speed)
        self.scheduler.load_state_dict(scheduler)
