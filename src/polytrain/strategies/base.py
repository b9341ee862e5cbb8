"""What every strategy offers the trainer: set up a model, take a training step, evaluate, reduce, save.

The trainer calls only these methods and never asks which strategy it holds.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..data.order import split_rows
from ..errors import UserError
from ..models.moe import mixtures
from ..objective import Objective
from ..optim import step_per_epoch
from ..parallel.ddp import release_reducers
from ..parallel.global_batch import slice_offsets
from ..parallel.layout import Layout
from ..parallel.materialise import is_meta, materialise
from ..parallel.parallelize import Preparation, parallelize
from ..planning.sharded import sharded_plan
from . import cuda_graphs
from .epoch_figures import EpochFigures
from .gradients import Gradients
from .holdings import holding_lines, local_bytes, optimizer_slots
from .model_state import ModelState
from .tensor import run_plan


@dataclass
class StepStats:
    loss_sum: torch.Tensor  # summed over this rank's samples, detached, still on the device
    metrics: torch.Tensor  # one sum over this rank's samples per metric of the objective, on the device
    count: int  # this rank's samples
    grad_norm: Optional[torch.Tensor] = None  # with clipping: the global gradient norm before clipping
    loss_count: object = None  # how many elements loss_sum covers (a (sum, count) loss; else the samples)

    def __post_init__(self):
        if self.loss_count is None:
            self.loss_count = self.count


class Strategy(ModelState, EpochFigures):
    """One training step for every layout whose ranks all run it (one device, data parallelism, FSDP2 shards, a
    tensor plan, context ranks, their meshes): `setup` prepares the model with `parallelize` for the run's
    `Layout`, and what differs between layouts is asked of the layout. The pipeline (pipeline/strategy.py) and the
    parameter server (parameter_server.py) build on it with steps of their own."""

    # What the algorithm is, asked of it rather than decided by its name; what the layout decides is asked of the
    # layout (parallel/layout.py: whether a rank's parameters are parts, how the data ranks hold them).
    keeps_channels_last = True  # False: trains in the default memory format even when asked otherwise
    # True: each data-parallel rank computes a slice of the batch through the whole model (where the layout splits
    # no layer), so BatchNorm and Dropout are made to compute over the global batch (parallel/global_batch.py)
    normalises_global_batch = True
    waits_on_servers = False  # True: workers pull weights from server ranks (their waiting is the servers')
    keeps_model_whole = True  # False: splits the module or moves its optimizer away from it
    loss_from_outputs_only = False  # True: the loss is computed from the outputs and targets (no own step)
    # the degrees whose ranks hold the same figures of a step (`reduce` counts each such group once): a tensor
    # group's ranks each compute their slice's whole loss; a pipeline's share its last stage's (pipeline/strategy.py)
    figures_shared_by = ("tensor",)

    def __init__(
        self,
        *,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        precision: str = "fp32",
        compile: bool = False,
        channels_last: bool = False,
        objective: Objective = None,
        plan=None,
        accumulate: int = 1,
        clip_grad_norm=None,
        clip_grad_value=None,
        activation_checkpointing: str = "none",
        seed: int = 0,
        cuda_graphs: bool = False,
        layout: Optional[Layout] = None,
    ):
        self.device = torch.device(device)
        self.seed = seed  # the run's: a model built on the meta device is initialised from it (materialise)
        self.blueprint = None  # such a model before it was split: its shapes and names, for `materialise`
        self.pretrained = None  # a checkpoint whose values replace the initial ones (--init-from)
        self.activation_checkpointing = activation_checkpointing  # none | full | selective | selective:K
        # fp16 loss scaling, clipping and their figures; `accumulate` passes per optimizer step
        self.gradients = Gradients(
            device=self.device,
            accumulate=accumulate,
            clip_norm=clip_grad_norm,
            clip_value=clip_grad_value,
            fp16=precision == "fp16",
        )
        self.rank, self.world_size = rank, world_size
        self.plan = plan  # what the launching process planned for the workers (make_plan), or None
        # FSDP2 keeps shards in host memory between uses (--cpu-offload: planning/sharded.py)
        self.cpu_offload = bool(getattr(plan, "cpu_offload", False))
        self.schedule_per_step = True  # False: the schedule steps once per epoch (end_of_epoch), not per step
        # the run's degrees of parallelism (parallel/layout.py), the one description of them: the batch's slices, the
        # gradient ranks and the mesh derive from it (made without one, in tests: every rank a replica)
        self.layout = layout if layout is not None else Layout(replicate=world_size)
        if self.layout.world_size != world_size:
            raise ValueError(
                f"a layout of {self.layout.world_size} ranks ({self.layout.describe()}) on {world_size}"
            )
        self.mesh = None  # the run's RunMesh (parallel/mesh.py), where preparing the model needed one
        self.fused = {}  # parameter name -> the row order of a fused layer's rows on the tensor ranks
        # this rank's ContextGroup under context parallelism (parallel/context.py)
        self.context = None
        self.precision = precision
        self.compile = compile
        # (FSDP2 shards contiguous parameters only)
        self.channels_last = channels_last and self.keeps_channels_last and not self.layout.holds_parts
        self.objective = objective or Objective()
        self.model: nn.Module = None  # the plain module: its state_dict is what gets saved
        self.runner: nn.Module = None  # what the training step calls (compiled or wrapped)
        self.optimizer = None
        self.scheduler = None
        self.parameter_names: list = []  # the whole model's, in `model.parameters()` order
        self.placement: list = []  # lines that say where each part of the model runs (rank 0)
        # seconds of the latest train_step that this strategy can attribute ("communication", "idle": waiting
        # on other ranks); `polytrain bench` clears it before each step and calls the rest compute
        self.phases: dict = {}
        self.global_rows = None  # which rows of the global batch a pass holds (whole-batch layers only)
        # CUDA graphs asked for (strategies/cuda_graphs.py), and what replays them where they are used
        self.wants_cuda_graphs, self.graphed = cuda_graphs, None
        self.whole_batch_steps = 0

    @classmethod
    def make_plan(cls, config, model: nn.Module, dataset, *, device=None):
        """Check this strategy's options and compute what its workers execute, in the launching process,
        before any worker starts (None: nothing to plan): the tensor plan of a layout with a tensor degree, where
        FSDP2's shards live for one whose data ranks shard."""
        offload, device_type = bool(getattr(config, "cpu_offload", False)), getattr(device, "type", None)
        sharded = sharded_plan(config.layout, cpu_offload=offload, device_type=device_type)
        return run_plan(config, model, dataset) if config.layout.tensor > 1 else sharded

    @classmethod
    def settle_phases(cls, ranks: list) -> list:
        """Every rank's `phases` of each measured step (`ranks[r][i]`), completed with what only the ranks
        together know (e.g. how long a worker waited for another rank's work)."""
        return ranks

    def add_phase(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def samples_counted(self, samples: int) -> int:
        """The samples of its slice this rank counts in the figures (a context group's first rank only)."""
        return samples if self.context is None or self.context.rank == 0 else 0

    @property
    def data_rank(self) -> int:
        """Which slice of each global batch this rank reads (the ranks of one pipeline, of one context group or
        of one tensor group read the same)."""
        return self.layout.data_rank(self.rank)

    @property
    def data_world(self) -> int:
        """Into how many slices each global batch is cut."""
        return self.layout.data_degree

    @property
    def replicas(self) -> int:
        """Over how many ranks' gradients the one-device gradient is the average: each rank's loss is divided
        by the global batch over this (the ranks of a tensor group each compute their slice's whole loss and
        count once; those of a context group a part of it each, and count each)."""
        return self.layout.gradient_ranks

    def setup(self, model: nn.Module, make_optimizer: Callable, make_scheduler: Callable) -> None:
        """Place the model, prepare it for the run's layout (parallel/parallelize.py: tensor plan, context
        parallelism, activation checkpointing, the global batch, FSDP2 or DDP, materialise), then build the
        optimizer and scheduler over it. A model built on the meta device is split and wrapped without storage,
        then each rank materialises what it holds."""
        full = tuple(
            sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not trained)
            for trained in (False, True)
        )
        self.full_meta = {  # the whole model's names and shapes, which a rank of parts no longer has
            k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in model.state_dict().items()
        }
        self.routes = bool(mixtures(model))
        model = self.place(model)
        self.model = model
        self.parameter_names = [name for name, _ in model.named_parameters()]
        done = parallelize(model, self.layout, self.preparation(), objective=self.objective)
        self.mesh, self.runner, self.context, self.mixed = done.mesh, done.runner, done.context, done.mixed
        self.global_rows = done.global_rows
        self.fused.update(done.fused)
        if self.is_main:
            self.placement += done.lines
        if done.compile_whole:  # (a model with blocks had them compiled in place by parallelize)
            self.runner = torch.compile(self.runner)
        self.optimizer = make_optimizer(list(self.model.named_parameters()))
        self.scheduler = make_scheduler(self.optimizer)
        self.graphed = cuda_graphs.graph_passes(self, model)
        if self.layout.holds_parts:
            self.placement += self.holding_lines(full)

    def holding_lines(self, full: tuple) -> list:
        """Rank 0's start-up lines of what each rank holds beside `full` (bytes, trained bytes) of a whole replica
        (holdings.py); every rank calls it."""
        slots = optimizer_slots(self.optimizer)
        params = list(self.model.parameters())
        trained = [p for p in params if p.requires_grad]
        rows = self.gather_object((self.rank, str(self.device), local_bytes(params), local_bytes(trained)))
        if not self.is_main:
            return []
        plan = self.plan if self.layout.tensor > 1 else None
        return holding_lines(
            self.layout,
            rows,
            slots,
            full,
            tensor_plan=plan,
            offload=self.cpu_offload,
            precision=self.precision,
        )

    def preparation(self) -> Preparation:
        """What this run's settings ask of each step of `parallelize`."""
        return Preparation(
            device=self.device,
            data_parallel=self.data_parallel,
            tensor_plan=self.plan if self.layout.tensor > 1 else None,
            activation_checkpointing=self.activation_checkpointing,
            global_batch=self.global_batch,
            loud=self.global_batch == "across" and self.data_rank == 0,
            precision=self.precision,
            compile=self.compile,
            cpu_offload=self.cpu_offload,
            blueprint=self.blueprint,
            seed=self.seed,
            weights=self.pretrained,
            home=self.home_device,
        )

    @property
    def data_parallel(self) -> str:
        """How the ranks that hold the same parameters hold them (parallelize.py DATA_PARALLEL): the layout's."""
        return self.layout.data_parallel

    @property
    def global_batch(self) -> str:
        """Whether BatchNorm and Dropout compute over the global batch (parallelize.py GLOBAL_BATCH): across the
        data ranks where each computes a slice through the whole model (`normalises_global_batch`, no layer split),
        and one device draws its dropout masks alike (the reference)."""
        if self.normalises_global_batch and self.layout.tensor == 1 and self.data_world > 1:
            return "across"
        return "masks" if self.world_size == 1 else "off"

    def place(self, model: nn.Module) -> nn.Module:
        """`model` on this rank's device (channels-last where asked); one built on the meta device stays there,
        its blueprint kept, until `materialise`."""
        if is_meta(model):
            self.blueprint = copy.deepcopy(model)
        else:
            model = model.to(self.home_device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        return model

    @property
    def home_device(self) -> torch.device:
        """Where the model's parameters live between steps: the GPU itself, but host memory under --cpu-offload,
        from the start (FSDP2 keeps each shard there and gathers a layer onto the GPU only while it computes; it
        refuses parameters placed on the GPU first)."""
        return torch.device("cpu") if self.cpu_offload else self.device

    def materialise(self, model: nn.Module) -> None:
        """Storage for what this rank holds of a meta-device `model` (its shards, slices or stage), filled with
        its part of the one-device initial values (parallel/materialise.py), or of the pretrained checkpoint's
        (--init-from); nothing for a model with values."""
        if self.blueprint is not None:
            reorder = getattr(self, "fused", None)
            materialise(
                model,
                self.blueprint,
                device=self.home_device,
                seed=self.seed,
                reorder=reorder,
                weights=self.pretrained,
            )

    def own_tokens(self, x, y) -> tuple:
        """This rank's head and tail chunks of each sequence of (x, y) under context parallelism, else (x, y)."""
        return (x, y) if self.context is None else (self.context.own_tokens(x), self.context.own_tokens(y))

    def first_global_row(self, batch) -> int:
        """Where this rank's slice of the step's global batch starts (as the loader cuts it)."""
        return slice_offsets(batch.global_count, self.data_world)[self.data_rank][0]

    def _mark_rows(self, batch, index: int, passes: int) -> None:
        """Tell the whole-batch layers which rows of the global batch this pass holds."""
        if self.global_rows is None:
            return
        if index == 0:
            self.whole_batch_steps += 1
        start = self.first_global_row(batch)
        first, last = slice_offsets(len(batch), passes)[index]
        self.global_rows.set(start + first, start + last, batch.global_count, step=self.whole_batch_steps)

    def autocast(self):
        if self.precision in ("bf16", "fp16"):
            return torch.autocast(
                self.device.type, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16
            )
        return contextlib.nullcontext()

    def train_step(self, batch) -> StepStats:
        """One optimizer step on the global batch; this rank computes its slice, in `accumulate` passes.

        Each pass's loss is its summed loss over the global batch's mean share, so that summing the passes'
        gradients and averaging those of W ranks gives exactly the gradient of the mean loss over the whole
        global batch, also when the last batch splits unevenly. Every rank makes the same number of passes
        (some may be empty in a short last batch): sharded ranks gather weights together in each.
        """
        if not self.model.training:  # only after an evaluation: train() walks every submodule
            self.runner.train()
        self.zero_grad()
        share = batch.global_count / self.replicas
        passes = self.gradients.accumulate
        loss_total, metric_total, count_total = None, None, 0
        for i, (x, y) in enumerate(zip(split_rows(batch.x, passes), split_rows(batch.y, passes))):
            self._mark_rows(batch, i, passes)
            with self.gradient_sync(last=i == passes - 1):
                loss_sum, count, metrics, replayed = self._pass(*self.own_tokens(x, y))
                self.gradients.scale(loss_sum / share).backward()
            if replayed and i < passes - 1:  # the next replay would overwrite the gradients it handed over
                cuda_graphs.release_gradients(list(self.model.parameters()))
            loss_total = loss_sum.detach() if loss_total is None else loss_total + loss_sum.detach()
            metric_total = metrics if metric_total is None else metric_total + metrics
            count_total = count_total + count
        if self.global_rows is not None:
            self.global_rows.active = False
        self.per_counted_element(count_total, batch.global_count)
        self.apply_gradients()
        return StepStats(
            loss_total, metric_total, self.samples_counted(len(batch)), self.gradients.last_norm, count_total
        )

    def _pass(self, x, y) -> tuple:
        """(summed loss, what it covers, metric sums, whether it replayed a CUDA graph) of one pass's forward:
        replayed from its graph where one is captured (strategies/cuda_graphs.py), else eager."""
        replayed = self.graphed(x, y) if self.graphed is not None else None
        if replayed is not None:
            loss_sum, count, metrics = replayed
            return loss_sum, count, self.no_metrics if metrics is None else metrics, True
        loss_sum, count, outputs = self.objective.compute(self.runner, x, y, autocast=self.autocast)
        metrics = self.objective.metric_sums(outputs, y) if self.objective.names else self.no_metrics
        return loss_sum, count, metrics, False

    @property
    def no_metrics(self) -> torch.Tensor:
        return torch.zeros(0, device=self.device)

    def per_counted_element(self, count, global_count: int) -> None:
        """With a (sum, count) loss: turn this rank's gradients, taken per sample of the global batch, into
        gradients per counted element of the global batch (the counts summed over ranks: one all-reduce)."""
        if not self.objective.counted:
            return
        total = float(self.reduce(torch.as_tensor(count, dtype=torch.float64, device=self.device).reshape(1)))
        if not total > 0:
            raise UserError(
                f"the loss counted {total:g} elements in a whole global batch of {global_count} samples "
                f"(its (sum, count) pairs); every batch needs at least one counted element (e.g. not "
                f"only padding): check the count, or drop such samples"
            )
        if total != global_count:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(global_count / total)

    @contextlib.contextmanager
    def gradient_sync(self, *, last: bool):
        """A context for one pass of an accumulated step: gradients are synchronised across ranks only in the
        last (DDP all-reduces, FSDP2 reduce-scatters then; a tensor plan alone has nothing to synchronise)."""
        if last or self.data_parallel == "none":
            yield
        elif self.data_parallel == "replicate":
            with self.runner.no_sync():
                yield
        else:
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)

    # The ranks over which local gradients are parts of the whole model's (see gradients.py); None: every rank
    # holds the whole gradient, or DTensors whose norm torch sums itself (shards, slices)
    norm_group = None

    @property
    def overflow_group(self):
        """The ranks that must agree on an fp16 overflow (gradients.py): all, where each unscales its own part of
        the gradients (FSDP2's shards, a tensor plan's slices); None where each holds the whole, identical one."""
        return torch.distributed.group.WORLD if self.layout.holds_parts else None

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def apply_gradients(self) -> None:
        """Turn this rank's gradients into the step's new weights: unscale and clip them where asked, the
        optimizer (skipped after an fp16 overflow), then the schedule."""
        with self.mixed_parameters():
            self.gradients.step(
                self.optimizer,
                list(self.model.parameters()),
                norm_group=self.norm_group,
                overflow_group=self.overflow_group,
            )
        if self.schedule_per_step:
            self.scheduler.step()

    def end_of_epoch(self, record: dict) -> None:
        """Called on every rank after an epoch's validation, with its record (per-epoch schedules step here)."""
        if not self.schedule_per_step:
            step_per_epoch(self.scheduler, record)

    def before_evaluation(self) -> None:
        """Called on every rank before an evaluation pass (strategies whose replicas may lag catch up)."""

    def close(self) -> None:
        """Called on every rank after training finished normally (background work ends here)."""
        self.graphed = None  # the CUDA graphs' memory goes back with them
        release_reducers([getattr(self, "runner", None)])

    @torch.no_grad()
    def eval_step(self, batch) -> StepStats:
        if self.model.training:
            self.model.eval()
        x, y = self.own_tokens(batch.x, batch.y)
        loss_sum, count, outputs = self.objective.compute(
            self.model, x, y, training=False, autocast=self.autocast
        )
        metrics = self.objective.metric_sums(outputs, y) if self.objective.names else self.no_metrics
        return StepStats(loss_sum, metrics, self.samples_counted(len(batch)), loss_count=count)

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums over ranks, each group of ranks that hold the same figures (`figures_shared_by`, from the layout)
        counted once (one rank: unchanged)."""
        if self.world_size == 1:
            return tensor
        where = self.layout.coordinates(self.rank)
        counted = all(where[degree] == 0 for degree in self.figures_shared_by)
        tensor = tensor.clone() if counted else torch.zeros_like(tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def broadcast_object(self, value):
        """Rank 0's value on every rank."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_object(self, value) -> list:
        """Every rank's value, in rank order, on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return [value]
        gathered = [None] * self.world_size if self.is_main else None
        dist.gather_object(value, gathered, dst=0)
        return gathered

    def start_trace(self) -> None:
        """Begin recording when this rank runs what (strategies that have something to show)."""

    def stop_trace(self) -> list:
        """The events recorded since `start_trace`: (rank, step, kind, microbatch, stage, start, end)."""
        return []

    def trace_layout(self):
        """(schedule, ranks per pipeline, micro-batches) the recorded events follow."""
        return "single", 1, 1

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
