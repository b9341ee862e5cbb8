"""A strategy's model and optimizer state, read and written whole (one file on rank 0: `state_dict`, `model.pt`)
or as each rank's parts (`shard_state` for torch.distributed.checkpoint) where its parameters are DTensor parts
(FSDP2's shards, a tensor plan's slices): `ModelState`, which every strategy builds on.

The whole model and optimizer state (for `model.pt` and one-file checkpoints) are gathered and cut back by
torch.distributed.checkpoint's state-dict API (`get_model_state_dict`, `set_optimizer_state_dict`, ...) in
`torch.optim`'s numbering; checkpoints are each rank's parts, written by torch.distributed.checkpoint at their
places in the one-device tensors (`rank_parts`, runtime/shards.py), so `--resume` moves runs between any layouts
and device counts. A tensor plan's fused layers (a q/k/v Linear) hold their rows in the ranks' order: states put
them back in the one-device order (parallel/tensor.py `reordered`, checkpoint_parts.py `in_one_device_rows`).

Every function is called on every rank (they gather and scatter); `fused` maps a fused layer's parameter name to
its rows' order on the tensor ranks, `names` are the whole model's parameter names in `model.parameters()` order.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ..parallel.parallelize import mixed_parameters
from ..parallel.tensor import reordered, reordered_optimizer
from .checkpoint_parts import apply_groups, in_one_device_rows
from .optimizer_state import keep_speed, load_part, numbered_part, positions, whole_state


def _full(**extra):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


def whole_model(model: nn.Module, fused: dict, *, main: bool) -> dict:
    """The whole model's state dict by its one-device names, on the `main` rank ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_full(cpu_offload=True))
    return reordered(state, fused, back=True) if main else {}


def whole_optimizer(model: nn.Module, optimizer, fused: dict, names: list, *, main: bool) -> dict:
    """The whole optimizer state in `torch.optim`'s numbering over `names`, on the `main` rank ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_full(cpu_offload=True))
    if not main:
        return {}
    index = {name: i for i, name in enumerate(names)}
    numbered = {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [
            dict(group, params=[index[name] for name in group["params"]]) for group in state["param_groups"]
        ],
    }
    return reordered_optimizer(numbered, fused, names, back=True)


def load_whole(model: nn.Module, optimizer, state: dict, fused: dict, names: list) -> None:
    """Cut a whole model and optimizer state (`state["model"]`, `state["optimizer"]` in `torch.optim`'s numbering)
    into this rank's parts; each of its groups keeps this run's kernel choices."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model_state = reordered(state["model"], fused, back=False)
    saved = reordered_optimizer(state["optimizer"], fused, names, back=False)
    set_model_state_dict(model, model_state, options=_full())
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"it has {len(saved['param_groups'])} parameter group(s), this run "
            f"{len(optimizer.param_groups)} (--no-decay-norms-and-biases, --freeze or param_groups= differ)"
        )
    named = {
        "state": {names[i]: value for i, value in saved["state"].items()},
        "param_groups": [
            dict(group, params=[names[i] for i in group["params"]], **keep_speed(mine))
            for group, mine in zip(saved["param_groups"], optimizer.param_groups)
        ],
    }
    set_optimizer_state_dict(model, optimizer, optim_state_dict=named, options=_full())


def rank_parts(model: nn.Module, optimizer, fused: dict) -> dict:
    """This rank's parts by their one-device names (`{"model": ...}`, and `"optimizer"` unless `optimizer` is
    None), fused layers' rows at their one-device places."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return in_one_device_rows({"model": get_model_state_dict(model)}, fused)
    model_state, optim = get_state_dict(model, optimizer)
    return in_one_device_rows({"model": model_state, "optimizer": optim}, fused)


def load_rank_parts(model: nn.Module, optimizer, load, fused: dict) -> None:
    """torch.distributed.checkpoint reads each rank's parts into its parameters and optimizer state
    (`rank_parts`' tensors, filled in place by `load`); then the saved groups' settings, each group keeping its
    kernel choices."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    speeds = [keep_speed(group) for group in optimizer.param_groups]
    state = rank_parts(
        model, optimizer, fused
    )  # this rank's parts (optimizer slots created), filled in place
    load(state)
    if fused:  # (the fused rows' tensors are read in place; the state's groups are applied)
        apply_groups(optimizer, state["optimizer"]["param_groups"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for group, speed in zip(optimizer.param_groups, speeds):
        group.update(speed)


class ModelState:
    """The state methods of a strategy (strategies/base.py), whole or in parts as its layout holds the model; a
    pipeline and the parameter server write theirs otherwise and override them. Expects `layout`, `model`,
    `optimizer`, `scheduler`, `fused`, `parameter_names`, `full_meta` and `is_main` of the strategy."""

    mixed = False  # plain parameters beside DTensors (parallelize.py `Parallelized.mixed`)

    def mixed_parameters(self):
        """Where the parameters are plain tensors and DTensors (DDP's copies beside experts split over them), the
        context in which the optimizer steps and its state is created (parallelize.py `mixed_parameters`)."""
        return mixed_parameters(self.mixed)

    @property
    def writes_shards(self) -> bool:
        """True: each rank writes and reads its own part of checkpoints (shard_state, load_shards); False: state_dict
        gathers the whole state into one file on rank 0."""
        return self.layout.holds_parts

    def model_state(self) -> dict:
        """The whole model's state dict by its original names, on rank 0 ({} elsewhere); every rank calls it."""
        if self.layout.holds_parts:
            return whole_model(self.model, self.fused, main=self.is_main)
        return self.model.state_dict()

    def expected_state(self) -> dict:
        """Names and shapes a loaded state dict must have (tensors, possibly on the meta device)."""
        return self.full_meta if self.layout.holds_parts else self.model.state_dict()

    def flat_parameters(self):
        """All parameters of the whole model as one float64 CPU vector on rank 0 (None elsewhere); every rank
        calls it."""
        state = self.model_state()
        if not self.is_main:
            return None
        return torch.cat([state[name].detach().double().flatten().cpu() for name in self.parameter_names])

    def state_dict(self) -> dict:
        """The whole model, optimizer (in `torch.optim`'s numbering) and schedule on rank 0 ({} elsewhere)."""
        if self.layout.holds_parts:
            model = self.model_state()
            with self.mixed_parameters():  # (torch's API steps an optimizer without state to create it)
                optimizer = whole_optimizer(
                    self.model, self.optimizer, self.fused, self.parameter_names, main=self.is_main
                )
            if not self.is_main:
                return {}
        else:
            model = self.model_state()
            optimizer = whole_state(
                self.optimizer, [numbered_part(self.optimizer, positions(self.model.parameters()))]
            )
        return {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.layout.holds_parts:
            with self.mixed_parameters():
                load_whole(self.model, self.optimizer, state, self.fused, self.parameter_names)
        else:
            self.model.load_state_dict(state["model"])
            load_part(self.optimizer, state["optimizer"], positions(self.model.parameters()))
        self.scheduler.load_state_dict(state["scheduler"])

    def shard_state(self, *, optimizer: bool = True) -> dict:
        """{"model": ..., "optimizer": ...} (only "model" without `optimizer`): this rank's part of the state,
        keyed by the one-device names, fused layers' rows at their one-device places, for
        torch.distributed.checkpoint (where ranks hold parts: `writes_shards`)."""
        if not self.writes_shards:
            raise NotImplementedError(
                f"{type(self).__name__} on {self.layout.describe()} writes whole checkpoints"
            )
        with self.mixed_parameters():
            return rank_parts(self.model, self.optimizer if optimizer else None, self.fused)

    def load_shards(self, load: Callable, scheduler: dict) -> None:
        """Load a checkpoint of shards: `load(template)` fills `shard_state()`'s form in place, re-sharded for
        this layout (every rank calls it); `scheduler` is the schedule's state dict."""
        if not self.writes_shards:
            raise NotImplementedError(
                f"{type(self).__name__} on {self.layout.describe()} reads whole checkpoints"
            )
        with self.mixed_parameters():
            load_rank_parts(self.model, self.optimizer, load, self.fused)
        self.scheduler.load_state_dict(scheduler)
