"""Pipeline parallelism: the model cut into stages on different devices, each global batch cut into
micro-batches that flow through the stages (torch.distributed.pipelining runs the schedule).

With `--pipeline-stages` below `--devices`, several pipelines (replicas) run side by side on a 2-D mesh
and average their gradients stage by stage. The loss of each micro-batch is its summed cross-entropy over
the whole global batch's size, and gradients are summed (never rescaled): the step is exactly the
one-device step. Evaluation sends activations rank to rank without gradients (transfer.py); checkpoints are
each rank's stages, written as shards (state.py).

The degrees of the layout are applied by `parallelize` (parallel/parallelize.py) to the layers of this rank's
stages, in torchtitan's order after the split into stages: the tensor plan over `tp` (`--tensor-parallel T`:
Megatron's layout, each stage split over T consecutive ranks; stages exchange whole activations as plain tensors,
tensor slice t of stage s sending to slice t of stage s + 1), activation checkpointing (the whole model's blocks
counted), whole-batch dropout, FSDP2 over the pipelines side by side (sharding.py), materialise. With
`--context-parallel C` every stage runs on C ranks that each hold a head and a tail chunk of every sequence (the
activations crossing a cut are T/C tokens long), their gradients summed as those of pipelines side by side. The
whole-model state methods handle any mix of them (state.py).
"""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config.model_defaults import BALANCE_IN_TRACED_STAGES
from ..errors import UserError
from ..models.moe import mixtures
from ..parallel.context import rank_sample_shape
from ..parallel.ddp import release_reducers
from ..parallel.global_batch import slice_offsets
from ..parallel.mesh import RunMesh
from ..parallel.meta import to_empty
from ..parallel.parallelize import parallelize
from ..strategies.base import StepStats, Strategy
from ..strategies.holdings import local_part
from ..strategies.optimizer_state import positions, whole_state
from .aux_loss import StageBalance
from .layers import Stage, describe_stage, flatten_layers, named_subset
from .plan import PipelinePlan, microbatches_for, runnable_schedule
from .planning import plan_pipeline
from .sharding import StageSharding
from .state import StageState
from .tied import TiedWeights
from .timeline import record_calls
from .traced import forward_only, traced_holdings, traced_stages
from .transfer import receive, send


def _schedule_class(kind: str):
    from torch.distributed import pipelining

    return {
        "gpipe": pipelining.ScheduleGPipe,
        "1f1b": pipelining.Schedule1F1B,
        "interleaved-1f1b": pipelining.ScheduleInterleaved1F1B,
    }[kind]


class Pipeline(StageState, StageSharding, Strategy):
    name = "pipeline"
    keeps_model_whole = False
    loss_from_outputs_only = True  # on the last stage, per micro-batch
    # BatchNorm normalises over each micro-batch, Dropout draws one device's masks (`global_batch`)
    normalises_global_batch = False
    # the last stage's figures of a step on each rank of its pipeline (`shared_sums`), as on a tensor group's
    figures_shared_by = ("tensor", "pipeline")
    keeps_channels_last = False  # activations cross processes as plain contiguous tensors
    writes_shards = property(lambda self: not self.plan.split_at)  # (traced stages: the tracer's names)

    def __init__(self, *, plan: PipelinePlan, **common):
        super().__init__(**common)
        self.plan = plan
        if plan.ranks != self.layout.pipeline:
            raise ValueError(
                f"a pipeline planned for {plan.ranks} pipeline ranks runs on {self.layout.describe()}"
            )
        # (with --data-parallel shard, `replica` is the rank's shard index)
        where = self.layout.coordinates(self.rank)
        self.replica, self.pipeline_rank = self.layout.data_rank(self.rank), where["pipeline"]
        self.tensor_index, self.context_index = where["tensor"], where["context"]
        self.fused = {}  # parameter name -> the order of a fused layer's rows on the tensor ranks
        self.my_stages = plan.stages_of_rank(self.pipeline_rank)
        self.is_first, self.is_last = 0 in self.my_stages, plan.model_stages - 1 in self.my_stages
        self.pp_group = self.dp_group = None
        self.schedules = {}  # (micro-batches, their size) -> schedule over this rank's stages
        self.trace, self.tracing, self.traced_steps = [], False, 0
        self.tied = None  # weights shared across stages (tied.py)
        # the stages' parts of the mixtures' balance loss (aux_loss.py), where it is weighted, and the targets of
        # the step's micro-batches that weigh them where labels may be masked
        self.balance, self.balance_targets = None, None
        self.group_names = None  # every optimizer group's members over the whole model, once known (state.py)
        self.chunk_rows = None  # (offset, each micro-batch's rows, global count) within a training step

    @property
    def norm_group(self):
        """The ranks of this pipeline: each holds some stages' gradients (replicas have summed theirs)."""
        return self.pp_group if self.pp_group is not None else dist.group.WORLD

    @property
    def overflow_group(self):
        """The stages' gradients overflow apart and replicas share theirs; ranks that unscale their own slices or
        shards must all agree."""
        split = self.layout.tensor > 1 or self.data_parallel == "shard"
        return dist.group.WORLD if split else self.norm_group

    @property
    def data_parallel(self) -> str:
        """How the pipelines side by side hold their stages (sharding.py), as the layout says: FSDP2 shards; whole
        copies as DDP modules, or, where a tensor plan makes the stages' parameters DTensors (which DDP does not
        take), as FSDP2 over a dp_shard dimension of one rank. Traced stages' copies sum their gradients in the
        step."""
        return "none" if self.plan.split_at else self.layout.data_parallel

    @property
    def global_batch(self) -> str:
        """nn.Dropout draws one device's masks, each micro-batch applying its rows of them (`mark_chunk`), so
        that stages draw what one device draws; BatchNorm normalises over each micro-batch (verify compares
        with one device in as many passes)."""
        return "masks" if self.plan.draws_dropout_as_one_device(self.layout) else "off"

    @property
    def data_rank(self) -> int:
        return self.replica

    @property
    def data_world(self) -> int:
        return self.layout.data_degree

    # -- planning, in the launching process -------------------------------------------------------------
    @classmethod
    def make_plan(cls, config, model: nn.Module, dataset, *, device: torch.device) -> PipelinePlan:
        return plan_pipeline(config, model, dataset, device=device)

    # -- set-up on every rank ---------------------------------------------------------------------------
    def setup(self, model: nn.Module, make_optimizer, make_scheduler) -> None:
        self.routes = bool(mixtures(model))
        # the mixtures whose balance loss the objective adds (as one device: not to a loss= or step= of the user's)
        weighted = (
            sum(1 for module in mixtures(model) if module.balance_weight) if self.objective.balances else 0
        )
        if weighted and self.plan.split_at:
            raise UserError(BALANCE_IN_TRACED_STAGES)
        layout = self.layout
        model = self.place(model)  # a model built on the meta device stays there until its stages are known
        self.parameter_names = [name for name, _ in model.named_parameters()]
        self.full_meta = {
            k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in model.state_dict().items()
        }
        if self.plan.split_at:  # the tracer runs the whole model: it is materialised first
            self.materialise(model)
            self.traced, self.model = traced_stages(
                model,
                self.plan,
                held=self.my_stages,
                device=self.device,
                keys=self.full_meta,
            )
            self.join_mesh()
            self.stage_modules = []  # `_schedule` takes the traced stages instead
            # traced stages refuse tied weights: this rank steps every parameter it holds
            self.build_optimizer(list(self.model.named_parameters()), make_optimizer, make_scheduler)
            self.placement = self.placement_lines(traced_holdings(self.plan))
            return
        layers = flatten_layers(model)
        self.boundaries = self._boundary_shapes(layers)
        self.stage_modules = [
            Stage([layers[i][1] for i in self.plan.stage_layers(s)]) for s in self.my_stages
        ]
        self.model = named_subset([layers[i] for s in self.my_stages for i in self.plan.stage_layers(s)])
        self.tied = TiedWeights(self.plan, self.layout, layers, rank=self.rank)
        self.join_mesh()
        if self.data_parallel == "shard":
            self.stage_hooks()  # (before FSDP2's own)
        options = replace(
            self.preparation(),
            tensor_plan=self.plan.tensor if layout.tensor > 1 else None,
            loud=self.data_rank == 0,
            precision=self.stage_precision,
            stages=tuple(self.stage_modules),
            whole=model,
            sum_gradients=True,
            keep_gathered=True,
        )
        done = parallelize(self.model, self.layout, options, objective=self.objective, mesh=self.mesh)
        self.fused.update(done.fused)
        self.global_rows, self.stage_modules = done.global_rows, list(done.stages)
        self.context = done.context  # (each rank's head and tail chunks of every sequence: `own_tokens`)
        if weighted:  # each stage's mixtures add their part of the balance loss (aux_loss.py)
            self.balance = StageBalance(
                self.stage_modules,
                count=weighted,
                weigh=self._weighed_balance,
                scale=lambda weighed: self.gradients.scale(weighed / self._global_count),
            )
        self.build_optimizer(
            [(name, p) for name, p in self.model.named_parameters() if not self.tied.is_copy(p)],
            make_optimizer,
            make_scheduler,
        )
        self.placement = self.placement_lines(
            lambda stage: describe_stage(
                layers, self.plan.stage_layers(stage), self.plan.costs, self.plan.cost_unit
            )
        )
        if self.is_main:
            self.placement += done.lines

    def join_mesh(self) -> None:
        """The run's mesh and this rank's groups in it, where the layout has more than one pipeline (or stages
        split over tensor ranks): its pipeline's, and the replicas' where traced stages sum their gradients by hand.
        Whole copies of stages split over tensor ranks are FSDP2 over a dp_shard dimension of one rank."""
        layout = self.layout
        if layout.gradient_ranks > 1 or layout.tensor > 1:  # a ([data,] pipeline[, context][, tensor]) mesh
            self.mesh = RunMesh(layout, self.device.type, shard=self.data_parallel == "shard")
            self.pp_group = self.mesh.pipeline.get_group()
            if layout.data_degree > 1 and self.data_parallel == "none":
                self.dp_group = self.mesh.replicas.get_group()

    def close(self) -> None:
        super().close()
        release_reducers(self.stage_modules)  # (copies of stages are DDP modules)

    def mark_chunk(self, chunk: int) -> None:
        """Tell the whole-batch Dropout layers which rows of the global batch micro-batch `chunk` holds (before
        its forward, and its backward: a recomputed block draws the same rows)."""
        if self.global_rows is not None and self.chunk_rows is not None:
            offset, bounds, total = self.chunk_rows
            start, stop = bounds[chunk]
            self.global_rows.set(offset + start, offset + stop, total, step=self.whole_batch_steps)

    def build_optimizer(self, trained: list, make_optimizer, make_scheduler) -> None:
        """The optimizer over `trained` ((name, parameter) this rank steps), numbered as in the whole model."""
        index = {name: i for i, name in enumerate(self.parameter_names)}
        self.global_index, self.trained = [index[name] for name, _ in trained], [p for _, p in trained]
        # a stage of parameter-free layers (Flatten, pooling) still keeps the learning-rate schedule's state
        self.optimizer = make_optimizer(trained or [("", nn.Parameter(torch.zeros(0)))])
        self.scheduler = make_scheduler(self.optimizer)

    @torch.no_grad()
    def _boundary_shapes(self, layers) -> list:
        """(shape without the batch, dtype, whether it carries gradients) of what enters each layer, and of
        the model's output, from one sample in evaluation mode (no statistics change). Given to the stages up
        front, so they need not infer shapes by running training-mode forwards that would update BatchNorm
        statistics."""
        shape = rank_sample_shape(self.plan.input_shape, self.layout)
        x = torch.zeros(1, *shape, dtype=getattr(torch, self.plan.input_dtype), device=self.device)
        grads = False
        shapes = []
        for _, layer in layers:
            shapes.append((tuple(x.shape[1:]), x.dtype, grads))
            was_training = layer.training
            # built on meta: each layer in turn gets storage, no values (only shapes and autocast's dtypes count)
            run = (to_empty(copy.deepcopy(layer), device=self.device) if self.blueprint else layer).eval()
            with self.autocast():
                x = run(x)
            layer.train(was_training)
            grads = grads or any(p.requires_grad for p in layer.parameters())
        return shapes + [(tuple(x.shape[1:]), x.dtype, grads)]

    def _stage_tensors(self, stage: int, batch: int):
        """Empty tensors like a micro-batch's input to and output of a model stage."""
        span = self.plan.stage_layers(stage)

        def make(shape, dtype, grads):
            return torch.empty((batch, *shape), dtype=dtype, device=self.device, requires_grad=grads)

        return make(*self.boundaries[span[0]]), make(*self.boundaries[span[-1] + 1])

    def _schedule(self, samples: int):
        """The schedule for a batch of `samples`: stages infer the shapes they exchange once, so each size of
        micro-batch (the smaller last batch of an epoch has its own) gets its own stages and schedule."""
        # accumulation multiplies the micro-batches of one schedule step: several step() calls would each
        # rescale the whole accumulated gradient
        microbatches = microbatches_for(
            samples,
            self.plan.microbatches * self.gradients.accumulate,
            schedule=self.plan.schedule,
            ranks=self.layout.pipeline,
        )
        key = (microbatches, samples // microbatches)
        if key not in self.schedules:
            from torch.distributed.pipelining import PipelineStage

            kind = runnable_schedule(self.plan.schedule, microbatches, self.layout.pipeline)
            stages = (
                self.traced.stages(samples // microbatches, self.pp_group) if self.plan.split_at else []
            )  # or below
            for s, module in zip(self.my_stages, self.stage_modules):
                inputs, outputs = self._stage_tensors(s, samples // microbatches)
                stages.append(
                    PipelineStage(
                        module,
                        s,
                        self.plan.model_stages,
                        self.device,
                        input_args=inputs,
                        output_args=outputs,
                        group=self.pp_group,
                    )
                )
            for stage, index in zip(stages, self.my_stages):
                record_calls(self, stage, index)
            schedule_class = _schedule_class(kind)
            options = (
                {"scale_grads": False}
                if "scale_grads" in inspect.signature(schedule_class).parameters
                else {}
            )
            self.schedules[key] = schedule_class(
                stages if kind == "interleaved-1f1b" else stages[0],
                microbatches,
                loss_fn=self.microbatch_loss,
                **options,
            )
        return self.schedules[key], microbatches

    # -- what each rank ran when (--timeline) -----------------------------------------------------------
    def start_trace(self) -> None:
        self.trace, self.tracing = [], True

    def stop_trace(self) -> list:
        self.tracing = False
        return self.trace

    def trace_layout(self):
        return self.plan.schedule, self.layout.pipeline, self.plan.microbatches

    # -- steps ------------------------------------------------------------------------------------------
    def microbatch_loss(self, logits, target):
        """The last stage's loss of one micro-batch (the schedule's `loss_fn`, and evaluation's): its figures are
        kept in `microbatch_sums`; it returns its summed loss over the global batch's count, for the backward."""
        loss_sum, count = self.objective.outputs_loss(logits, target, training=self.model.training)
        metrics = self.objective.metric_sums(logits, target) if self.objective.names else self.no_metrics
        count = torch.as_tensor(count, dtype=loss_sum.dtype, device=loss_sum.device).reshape(1)
        self.microbatch_sums.append(
            torch.cat([loss_sum.detach().reshape(1), count, metrics.to(loss_sum.dtype)])
        )
        return self.gradients.scale(loss_sum / self._global_count)

    def train_step(self, batch) -> StepStats:
        if not self.model.training:
            self.model.train()
        self.microbatch_sums, self._global_count = [], batch.global_count
        schedule, microbatches = self._schedule(len(batch.y))
        x, y = self.own_tokens(batch.x, batch.y)
        if self.balance is not None:  # its micro-batches' targets weigh each stage's part of the balance loss
            self.balance.taken()
            self.balance_targets = torch.tensor_split(y, microbatches) if self.objective.counted else None
        inputs = (x,) if self.is_first else ()
        self.optimizer.zero_grad(set_to_none=True)
        if self.tracing:  # the ranks of a pipeline start the step's clock together
            self.synchronize()
            dist.barrier(group=self.pp_group)
            self.trace_origin, self.traced_steps = time.perf_counter(), self.traced_steps + 1
        if self.global_rows is not None:  # the rows of the global batch of each micro-batch (mark_chunk)
            self.whole_batch_steps += 1
            offset = self.first_global_row(batch)
            self.chunk_rows = (offset, slice_offsets(len(batch.y), microbatches), batch.global_count)
        began = time.perf_counter()
        with self.autocast():
            schedule.step(*inputs, target=y if self.is_last else None)
        if self.global_rows is not None:
            self.global_rows.active, self.chunk_rows = False, None
        if self.tracing:  # what the schedule did besides this rank's passes: waiting
            self.synchronize()
            busy = sum(e[6] - e[5] for e in self.trace if e[1] == self.traced_steps)
            self.phases["idle"] = max(0.0, time.perf_counter() - began - busy)
        sums = self.shared_sums(last=microbatches)  # (the last stage's, on every rank of the pipeline)
        if self.objective.counted:
            self.per_counted_element(sums[1], batch.global_count)
        if self.tied is not None:  # tied weights: the copies' gradients join the owners'
            self.tied.send_gradients()
        if self.dp_group is not None:
            summing = time.perf_counter()
            self._sum_gradients_over_replicas()
            self.phases["communication"] = time.perf_counter() - summing
        self.apply_gradients()
        if self.tied is not None:
            self.tied.share_weights()
        # the stages' first step may call the loss once more, on sample outputs, to infer gradient shapes
        return self.step_stats(len(batch.y), sums)

    def _sum_gradients_over_replicas(self) -> None:
        grads = [local_part(p.grad) for p in self.model.parameters() if p.grad is not None]
        if grads:
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(summed)

    def _weighed_balance(self, part: torch.Tensor, stage: nn.Module, index: int) -> torch.Tensor:
        """A stage's part of the balance loss per sequence (B,) of the step's `index`-th micro-batch, summed as the
        objective sums it (`Objective.weighed_balance`: by each sequence's trained tokens where labels may be
        masked)."""
        targets = self.balance_targets[index] if self.balance_targets is not None else None
        return self.objective.weighed_balance(part, targets, stage)

    def shared_sums(self, *, last: int = 0) -> torch.Tensor:
        """(loss sum, what it covers, metric sums) of a step's `last` micro-batches, or of an evaluation batch
        (all), on every rank of this pipeline: the last stage's, shared over the pipeline's ranks (one small
        all-reduce), so that rank 0, which runs the first stage, shows and logs the step's loss; `reduce` counts
        each pipeline once (`figures_shared_by`)."""
        if self.is_last:
            sums = torch.stack(self.microbatch_sums[-last:]).sum(0).double()
        else:
            sums = torch.zeros(2 + len(self.objective.names), dtype=torch.float64, device=self.device)
        if self.balance is not None:  # this rank's stages' parts, in the figure and, training, in the loss
            part, weighed = self.balance.taken().to(sums.device)
            sums[2 + self.objective.names.index("balance")] += part
            if self.model.training:
                sums[0] += weighed
        dist.all_reduce(sums, group=self.norm_group)
        return sums

    def step_stats(self, count: int, sums: torch.Tensor) -> StepStats:
        """A step's StepStats from `shared_sums`' figures of its `count` samples."""
        return StepStats(sums[0], sums[2:], self.samples_counted(count), self.gradients.last_norm, sums[1])

    @torch.no_grad()
    def eval_step(self, batch) -> StepStats:
        if self.model.training:
            self.model.eval()
        if self.plan.split_at:
            return self._traced_eval_step(batch)
        ranks, layout = self.layout.pipeline, self.layout
        self.microbatch_sums, pending = [], []
        parts = min(self.plan.microbatches, len(batch.y))  # a small last batch: no empty micro-batches
        inputs, targets = self.own_tokens(batch.x, batch.y)
        for chunk, target in zip(torch.tensor_split(inputs, parts), torch.tensor_split(targets, parts)):
            x = chunk
            for stage in range(self.plan.model_stages):
                if stage % ranks != self.pipeline_rank:
                    continue
                if stage > 0:
                    x = receive(layout.rank_with(self.rank, pipeline=(stage - 1) % ranks), self.device)
                with self.autocast():
                    x = self.stage_modules[self.my_stages.index(stage)](x)
                if stage < self.plan.model_stages - 1:
                    pending.append(send(x, layout.rank_with(self.rank, pipeline=(stage + 1) % ranks)))
                else:
                    self.microbatch_loss(x, target)
        for works, _ in pending:  # the tensors stay referenced until their sends complete
            for work in works:
                work.wait()
        # the units keep what they gathered: whole until the next step otherwise
        if self.data_parallel == "shard":
            self.reshard()
        return self.step_stats(len(batch.y), self.shared_sums())

    @torch.no_grad()
    def _traced_eval_step(self, batch) -> StepStats:
        """Validation of traced stages: a forward-only schedule over eval-mode traces of this batch's
        micro-batches."""
        microbatches = microbatches_for(
            len(batch.y), self.plan.microbatches, schedule=self.plan.schedule, ranks=self.layout.pipeline
        )
        key = ("eval", microbatches, len(batch.y) // microbatches)
        if key not in self.schedules:
            self.schedules[key] = self.traced.evaluation(
                microbatches, key[2], self.pp_group, self.microbatch_loss
            )
        schedule, self.microbatch_sums = self.schedules[key], []
        with self.autocast():
            forward_only(schedule, (batch.x,) if self.is_first else (), batch.y if self.is_last else None)
        return self.step_stats(len(batch.y), self.shared_sums())

    # -- the whole model, by its original names ---------------------------------------------------------
    def model_state(self) -> dict:
        pieces = self.gather_object(self.stage_state())
        if not self.is_main:
            return {}
        merged = {key: value for piece in pieces for key, value in piece.items()}
        return {key: merged[key] for key in self.full_meta}

    def expected_state(self) -> dict:
        return self.full_meta

    def state_dict(self) -> dict:
        numbers = positions(self.trained, self.global_index)
        mine = self.stage_optimizer_state(numbers)
        model, pieces = self.model_state(), self.gather_object(mine)
        if not self.is_main:
            return {}
        optimizer = whole_state(self.optimizer, pieces)
        return {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}
