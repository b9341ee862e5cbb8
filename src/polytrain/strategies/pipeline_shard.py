"""Pipeline x sharded data parallelism: the pipelines side by side (`--devices N --pipeline-stages S`: N / S of
them) are FSDP2 shard groups instead of whole copies that all-reduce their gradients (torchtitan's pp x fsdp).

    polytrain verify --strategy pipeline --devices 4 --pipeline-stages 2 --data-parallel shard

On a (dp_shard, pp) mesh every rank `fully_shard`s each of its stage modules over the dp_shard dimension, one
unit per layer that holds parameters (sharded.py `shard_layers`), after activation checkpointing: the ranks that
hold one stage in every pipeline keep one shard each of its weights, gradients and optimizer state, and a model
built on the meta device gets storage for those shards only (materialise.py). torch's PipelineStage and
schedules drive FSDP2 themselves: no gradient sync in the step's backward passes but the last, then one
reduce-scatter per unit and a reshard. The reduce-scatter sums (the loss of every micro-batch is already divided
by the global batch) instead of FSDP2's default average. As torchtitan does under a pipeline, the units keep the
weights they gathered from the first micro-batch's forward to the end of the step's backward, instead of
gathering them again for every micro-batch; evaluation reshards them after each batch.

Checkpoints are each rank's shards of its stages, written by torch.distributed.checkpoint at their places in the
one-device tensors (checkpoint_parts.py, as every sharded layout writes them), so `--resume` moves a run to any
layout; `model.pt` and whole-state checkpoints gather each stage over its shards first.
"""

from __future__ import annotations

import torch.distributed as dist

from .holdings import figures, heading, local_bytes, optimizer_slots, part_like, whole
from .optimizer_state import to_cpu
from .pipeline import Pipeline
from .sharded import own_tensor, shard_layers


class PipelineSharded(Pipeline):
    """The pipeline whose plan shards each stage over the pipelines (plan.layout.shard; see
    strategies.strategy_class). A rank's `replica` coordinate is its shard index."""

    @property
    def overflow_group(self):
        """Each rank unscales its own shards, so all must agree on an fp16 overflow."""
        return dist.group.WORLD

    def wrap(self, model):
        """Each of this rank's stages sharded over the dp_shard dimension; their gradients summed, not averaged."""
        from torch.distributed.fsdp import FSDPModule

        for stage in self.stage_modules:
            stage.register_forward_hook(own_tensor)  # a stage may end in a view (Flatten); FSDP2 warns of it
            shard_layers(stage, mesh=self.mesh["dp_shard"], reshard_after_forward=False)
            for unit in stage.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_gradient_divide_factor(1.0)
                    if hasattr(unit, "set_force_sum_reduction_for_comms"):  # a plain sum (gloo has no other)
                        unit.set_force_sum_reduction_for_comms(True)
        return model

    def reshard(self) -> None:
        """Free the gathered weights of every unit (kept after a forward pass outside the schedule)."""
        from torch.distributed.fsdp import FSDPModule

        for stage in self.stage_modules:
            for unit in stage.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()

    def eval_step(self, batch):
        stats = super().eval_step(batch)
        self.reshard()  # the units keep what they gathered: parameters would be whole until the next step
        return stats

    def placement_lines(self, holds) -> list:
        """The pipeline's lines, then what each rank holds (its shards: parameters, as many gradients, and the
        optimizer's slots per parameter) next to its whole stages."""
        lines = super().placement_lines(holds)
        params = list(self.model.parameters())  # a tied copy is held too, but stepped by its owner
        stepped = [p for p in params if not self.tied.is_copy(p)]
        whole_bytes = sum(p.numel() * p.element_size() for p in params)  # a DTensor's numel is the whole's
        held = self.gather_object((local_bytes(params), local_bytes(stepped), whole_bytes))
        if not lines:
            return lines
        layout, slots = self.plan.layout, optimizer_slots(self.optimizer)
        lines.append(
            f"  each stage sharded over {layout.replicas} ranks (FSDP2; within a step a rank gathers its stages' "
            f"weights and gradients whole, from the first forward to the last backward); {heading(slots)}"
        )
        for rank in range(layout.devices):
            shard, pipeline_rank = layout.coords(rank)
            stages = "/".join(map(str, self.plan.stages_of_rank(pipeline_rank)))
            mine, stepped_bytes, stage_bytes = held[rank]
            lines.append(
                f"  rank {rank}: shard {shard + 1}/{layout.replicas} of stage {stages}: "
                f"{figures(mine, slots, stepped=stepped_bytes)}; the whole stage {figures(stage_bytes, slots)}"
            )
        return lines

    # -- the whole model, by its original names ---------------------------------------------------------
    def stage_state(self) -> dict:
        """The stages' whole tensors (the ranks of each stage gather its shards), from shard 0 only."""
        state = {key: whole(value) for key, value in self.model.state_dict().items()}
        return to_cpu(state) if self.replica == 0 else {}

    def stage_optimizer_state(self, numbers: dict) -> dict:
        """numbered_part's form of this rank's optimizer state, its tensors whole as in `stage_state`."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {
            numbers[id(p)]: {slot: to_cpu(whole(value)) for slot, value in self.optimizer.state[p].items()}
            for p in params
            if id(p) in numbers and p in self.optimizer.state
        }
        groups = [
            [numbers[id(p)] for p in group["params"] if id(p) in numbers]
            for group in self.optimizer.param_groups
        ]
        return {"state": state, "groups": groups} if self.replica == 0 else {}

    def load_state_dict(self, state: dict) -> None:
        """Whole-model state cut into this rank's shards before loading."""
        own, names = self.model.state_dict(), self.parameter_names
        params = dict(self.model.named_parameters())
        model = {
            key: part_like(value, own[key]) if key in own else value for key, value in state["model"].items()
        }
        saved = state["optimizer"]
        slots = {
            number: {slot: part_like(value, params[names[number]]) for slot, value in held.items()}
            if names[number] in params
            else held
            for number, held in saved["state"].items()
        }
        super().load_state_dict(dict(state, model=model, optimizer=dict(saved, state=slots)))
