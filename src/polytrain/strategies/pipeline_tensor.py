"""Pipeline x tensor parallelism: each pipeline stage split over T consecutive ranks (Megatron's layout), and
with `--pipeline-stages` several such pipelines side by side on a 3-D (data, pipeline, tensor) mesh.

    polytrain verify --model gpt --dataset shakespeare --strategy pipeline --devices 4 --tensor-parallel 2
    polytrain verify --model gpt --dataset shakespeare --strategy pipeline --devices 8 --pipeline-stages 2 \
        --tensor-parallel 2

Every rank of a stage applies the tensor plan (plan/tensor.py, the built-in one of the gpt and mlp) to its
stage's layers by their names in the whole model; everything else it holds becomes a replicated DTensor. Stages
exchange whole activations as plain tensors (no sequence parallelism): tensor slice t of stage s sends to slice
t of stage s + 1, over one pipeline process group per tensor index. The ranks of a tensor group compute the
same loss, so sums are counted from slice 0 only; the global norm is each stage's DTensor norm (every element
once), summed over the stages. Checkpoints hold the whole model by its original names, fused rows in their
original order, so `--resume` moves runs between this and any other strategy.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from .holdings import figures, heading, local_bytes, optimizer_slots, part_like, whole
from .optimizer_state import to_cpu
from .pipeline import Pipeline
from .tensor import reordered, reordered_optimizer, replicate_rest, split_layers


class PipelineTensor(Pipeline):
    """The pipeline whose plan splits its stages over tensor ranks (plan.layout.tensor > 1; see
    strategies.strategy_class)."""

    def __init__(self, *, plan, **common):
        super().__init__(plan=plan, **common)
        self.tensor_index = plan.layout.tensor_index(self.rank)
        self.fused = {}  # parameter name -> row order of a fused layer's rows on the ranks

    @property
    def overflow_group(self):
        """Each rank unscales its own slices, so all must agree on an fp16 overflow (replicas agree anyway)."""
        return dist.group.WORLD

    def split_stages(self) -> None:
        mesh = self.mesh["tp"]
        held = {name for name, _ in self.model.named_modules()}
        mine = replace(
            self.plan.tensor, styles=tuple(entry for entry in self.plan.tensor.styles if entry[0] in held)
        )
        if mine.styles:
            self.fused = split_layers(self.model, mesh, mine)
        replicate_rest(self.model, mesh)

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums over ranks, each tensor group counted once: its ranks hold the same figures."""
        return super().reduce(tensor if self.tensor_index == 0 else torch.zeros_like(tensor))

    def placement_lines(self, holds) -> list:
        """The pipeline's lines, then what each rank holds (its parameters, as many gradients, and the optimizer's
        slots per parameter) next to a replica of the whole model."""
        lines = super().placement_lines(holds)
        params = list(self.model.parameters())  # a tied copy is held too, but stepped by its owner
        held = self.gather_object(
            (local_bytes(params), local_bytes(p for p in params if not self.tied.is_copy(p)))
        )
        if not lines:
            return lines
        layout, slots = self.plan.layout, optimizer_slots(self.optimizer)
        full = sum(
            self.full_meta[name].numel() * self.full_meta[name].element_size()
            for name in self.parameter_names
        )
        lines.append(
            f"  each stage split over {layout.tensor} tensor ranks: "
            f"{self.plan.tensor.describe().split(': ', 1)[-1]}; {heading(slots)}, where a replica "
            f"would hold {figures(full, slots)}"
        )
        for rank in range(layout.devices):
            replica, pipeline_rank = layout.coords(rank)
            stages = "/".join(map(str, self.plan.stages_of_rank(pipeline_rank)))
            lines.append(
                f"  rank {rank}: replica {replica + 1}/{layout.replicas}, stage {stages}, tensor slice "
                f"{layout.tensor_index(rank) + 1}/{layout.tensor}: "
                f"{figures(held[rank][0], slots, stepped=held[rank][1])}"
            )
        return lines

    # -- the whole model, by its original names ---------------------------------------------------------
    def stage_state(self) -> dict:
        """The stages' whole tensors (every tensor rank of the stage gathers), fused rows in their original order;
        from tensor slice 0 of replica 0 only."""
        state = reordered(
            {key: whole(value) for key, value in self.model.state_dict().items()}, self.fused, back=True
        )
        return to_cpu(state) if self.tensor_index == 0 and self.replica == 0 else {}

    def stage_optimizer_state(self, numbers: dict) -> dict:
        """numbered_part's form of this rank's optimizer state, its tensors whole as in `stage_state`."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {
            numbers[id(p)]: {slot: to_cpu(whole(value)) for slot, value in self.optimizer.state[p].items()}
            for p in params
            if id(p) in numbers and p in self.optimizer.state
        }
        state = reordered_optimizer({"state": state}, self.fused, self.parameter_names, back=True)["state"]
        groups = [
            [numbers[id(p)] for p in group["params"] if id(p) in numbers]
            for group in self.optimizer.param_groups
        ]
        return {"state": state, "groups": groups} if self.tensor_index == 0 and self.replica == 0 else {}

    def load_state_dict(self, state: dict) -> None:
        """Whole-model state cut into this rank's slices (fused rows in the ranks' order) before loading."""
        own, names = self.model.state_dict(), self.parameter_names
        params = dict(self.model.named_parameters())
        model = reordered(state["model"], self.fused, back=False)
        model = {key: part_like(value, own[key]) if key in own else value for key, value in model.items()}
        saved = reordered_optimizer(state["optimizer"], self.fused, names, back=False)
        saved = dict(
            saved,
            state={
                number: {slot: part_like(value, params[names[number]]) for slot, value in slots.items()}
                if names[number] in params
                else slots
                for number, slots in saved["state"].items()
            },
        )
        super().load_state_dict(dict(state, model=model, optimizer=saved))
