"""A pipeline rank's stages as the whole model's tensors and back, and the start-up lines of where they run
and what each rank holds, whatever degrees split them: a tensor plan (each stage's layers split over `tp`, fused
rows in the ranks' order), FSDP2 shards over `dp_shard`, both, or neither (plain tensors, unchanged).

`whole` of a DTensor gathers it over its mesh (a 2-D (dp_shard, tp) DTensor included) and `part_like` cuts a
whole tensor back as it is placed; fused rows are put back in (or taken out of) their one-device order. Every
rank of a stage takes part in the gathers; the whole values come from one coordinate only (tensor slice 0 of
context rank 0 of data coordinate 0), so that each stage is counted once.

Checkpoints of shards (`Pipeline.shard_state`, `load_shards`) are each rank's stages as they are held, keyed by
their one-device names in the form strategies/checkpoint_parts.py gives every sharded layout.
"""

from __future__ import annotations

from ..strategies.checkpoint_parts import apply_groups, in_one_device_rows, named_optimizer
from ..strategies.holdings import figures, heading, local_bytes, optimizer_slots, part_like, whole
from ..strategies.optimizer_state import load_part, positions, to_cpu
from ..strategies.tensor import reordered, reordered_optimizer
from .plan import data_words, pipelines_words, runnable_schedule


def tensor_line(plan, layout, tail: str) -> str:
    """The start-up line of the tensor split of each stage on `layout`, `tail` after the plan's description."""
    return (
        f"  each stage split over {layout.tensor} tensor ranks: "
        f"{plan.tensor.describe(layout).split(': ', 1)[-1]}{tail}"
    )


class StageState:
    """What `Pipeline` holds as state: its stages whole and back, checkpoints of its shards, its start-up lines
    (a mixin of `Pipeline`, as strategies/model_state.py's `ModelState` is of `Strategy`)."""

    @property
    def contributes(self) -> bool:
        """Whether this rank's whole stages are the ones kept: tensor slice 0 of context rank 0 of replica (or shard)
        0."""
        return self.replica == 0 and self.tensor_index == 0 and self.context_index == 0

    def stage_state(self) -> dict:
        """This rank's stages' state dict, whole and on the CPU, fused rows in the one-device order; {} but from
        `contributes` (every rank calls it: the gathers are collectives)."""
        state = {key: whole(value) for key, value in self.model.state_dict().items()}
        state = reordered(state, self.fused, back=True)
        return to_cpu(state) if self.contributes else {}

    def stage_optimizer_state(self, numbers: dict) -> dict:
        """optimizer_state.numbered_part's form of this rank's optimizer state, its tensors whole as in
        `stage_state`; {} but from `contributes`."""
        optimizer = self.optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {
            numbers[id(p)]: {slot: to_cpu(whole(value)) for slot, value in optimizer.state[p].items()}
            for p in params
            if id(p) in numbers and p in optimizer.state
        }
        state = reordered_optimizer({"state": state}, self.fused, self.parameter_names, back=True)["state"]
        groups = [
            [numbers[id(p)] for p in group["params"] if id(p) in numbers] for group in optimizer.param_groups
        ]
        return {"state": state, "groups": groups} if self.contributes else {}

    def load_state_dict(self, state: dict) -> None:
        """Whole-model state (one device's names and numbers) cut into this rank's stages and their parts (fused
        rows in the ranks' order), then loaded."""
        own, names = self.model.state_dict(), self.parameter_names
        params = dict(self.model.named_parameters())
        model = reordered({key: state["model"][key] for key in own}, self.fused, back=False)
        self.model.load_state_dict({key: part_like(value, own[key]) for key, value in model.items()})
        saved = reordered_optimizer(state["optimizer"], self.fused, names, back=False)
        slots = {
            number: {slot: part_like(value, params[names[number]]) for slot, value in held.items()}
            if names[number] in params
            else held
            for number, held in saved["state"].items()
        }
        load_part(self.optimizer, dict(saved, state=slots), positions(self.trained, self.global_index))
        self.scheduler.load_state_dict(state["scheduler"])

    def placement_lines(self, holds) -> list:
        """Rank 0's lines of where each model stage runs (`holds(stage)` says what the stage holds), then what
        each rank holds of its stages where they are split or sharded."""
        devices = self.gather_object((self.rank, str(self.device)))
        held = self.stage_holding_lines()
        if not self.is_main:
            return []
        plan, layout, where = self.plan, self.layout, dict(devices)
        lines = [
            f"pipeline{' (traced)' if plan.split_at else ''}: {plan.model_stages} stages on {layout.pipeline} "
            f"ranks x {pipelines_words(layout)}, {plan.microbatches} micro-batches per step, schedule "
            f"{plan.schedule}"
        ]
        for stage in range(plan.model_stages):
            ranks = layout.ranks_where(pipeline=stage % layout.pipeline)
            lines.append(
                f"  stage {stage}: {'/'.join(where[r] for r in ranks)} (rank {'/'.join(map(str, ranks))}), "
                f"{holds(stage)}"
            )
        runs = runnable_schedule(plan.schedule, plan.microbatches, layout.pipeline)
        if runs != plan.schedule:
            lines.append(
                f"  note: 1f1b needs at least {layout.pipeline} micro-batches; with {plan.microbatches} "
                f"it runs as gpipe"
            )
        return lines + held

    def stage_holding_lines(self) -> list:
        """Rank 0's lines of what each rank holds of its stages (its parts: parameters, as many gradients, and the
        optimizer's slots per parameter) where a degree splits them; [] elsewhere (every rank calls it)."""
        layout = self.layout
        shards = layout.shard > 1
        if layout.tensor == 1 and not shards:
            return []
        params = list(self.model.parameters())  # a tied copy is held too, but stepped by its owner
        trained = [p for p in params if p.requires_grad]  # (frozen ones have no gradient, no state)
        stepped = [p for p in trained if not self.tied.is_copy(p)]
        # a DTensor's numel is the whole's
        stage_bytes = [sum(p.numel() * p.element_size() for p in some) for some in (params, trained)]
        held = self.gather_object(
            (local_bytes(params), local_bytes(stepped), stage_bytes, local_bytes(trained))
        )
        if not self.is_main:
            return []
        slots = optimizer_slots(self.optimizer)
        lines = []
        if layout.tensor > 1:
            meta = self.full_meta
            full = sum(meta[name].numel() * meta[name].element_size() for name in self.parameter_names)
            whole_model = f"; {heading(slots)}, where a replica would hold {figures(full, slots)}"
            lines.append(tensor_line(self.plan, layout, "" if shards else whole_model))
        if shards:
            lines.append(self.shard_line(heading(slots)))
        for rank in range(layout.world_size):
            at = layout.coordinates(rank)
            stages = "/".join(map(str, self.plan.stages_of_rank(at["pipeline"])))
            where = f"{data_words(layout, layout.data_rank(rank))}{' of' if shards else ','} stage {stages}"
            where += layout.place(rank)
            mine, stepped_bytes, stage, trained_bytes = held[rank]
            whole_stage = f"; the whole stage {figures(stage[0], slots, trained=stage[1])}" if shards else ""
            lines.append(
                f"  rank {rank}: {where}: {figures(mine, slots, stepped=stepped_bytes, trained=trained_bytes)}"
                f"{whole_stage}"
            )
        return lines

    # -- checkpoints of shards: each rank its stages' parameters and optimizer state ---------------------------

    def shard_state(self, *, optimizer: bool = True) -> dict:
        """A pipeline rank's part : its stages' tensors by their one-device names (split over
        tensor ranks: DTensors, fused rows as strategies/checkpoint_parts.py's `fused_rows`) and the optimizer state
        of the parameters it steps. Ranks that hold the same tensor (replicas, a tied copy, replicated slices) all
        offer it; DCP writes it once."""
        state = {"model": self.model.state_dict()}
        if optimizer:
            names = {id(p): self.parameter_names[i] for p, i in zip(self.trained, self.global_index)}
            state["optimizer"] = named_optimizer(self.optimizer, names, self._group_names(names))
        return in_one_device_rows(state, getattr(self, "fused", {}))

    def _group_names(self, names: dict) -> list:
        """The names of every parameter group's members over the whole model (each rank knows its own: gathered
        once, names only, in the one-device order), so that every rank writes the same groups."""
        if self.group_names is None:
            import torch.distributed as dist

            mine = [
                [names[id(p)] for p in g["params"] if id(p) in names] for g in self.optimizer.param_groups
            ]
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, mine)
            order = {name: i for i, name in enumerate(self.parameter_names)}
            self.group_names = [
                sorted({name for part in parts for name in part[g]}, key=order.get) for g in range(len(mine))
            ]
        return self.group_names

    def load_shards(self, load, scheduler: dict) -> None:
        """DCP reads the rank's stages and optimizer slots in place (slots created first)."""
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(self.optimizer)
        state = self.shard_state()
        load(state)
        apply_groups(self.optimizer, state["optimizer"]["param_groups"])
        self.scheduler.load_state_dict(scheduler)
