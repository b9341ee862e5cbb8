"""Preparing a module for a run's layout: one function, `parallelize`, that applies each degree in one order.

    parallelize(module, layout, options, objective=...)

`options` is what the settings ask (`Preparation`). The run's one mesh is built from `layout` here, where a step
needs one (parallel/mesh.py `RunMesh`, its dimensions those the layout and the steps need; a pipeline passes the
one it built for its stages), and kept in what `parallelize` returns. Each step is a function that takes the module
and the part of the mesh it works over, never a strategy, and changes the module in place; a step whose degree is 1
does nothing:

  0. precision                under --precision bf16 or fp16, the layers whose kernels this processor lacks
                              under autocast (a probe: an LSTM on a CPU without bf16 instructions) run in
                              float32, and a start-up line says so (precision.py)
  1. tensor plan              each named layer split over the `tp` ranks, the rest replicated on them
                              (tensor_split.py `apply_tensor_plan`)
  2. context parallelism      attention and positions over the `cp` ranks, the loss a part of each window's
                              (context.py `split_model_sequences`)
     expert parallelism       each mixture's experts split over the `ep` ranks, tokens exchanged by all-to-all
                              (experts.py `apply_expert_parallel`)
  3. activation checkpointing the model's blocks recomputed in backward (activation_checkpoint.py)
  4. the global batch         BatchNorm and Dropout computed over the global batch where the data ranks each
                              compute a slice, Dropout drawn as one device draws it (global_batch.py)
  5. compile                  with --compile, each block compiled in place (compiled.py); a model without
                              blocks is compiled whole after step 6 (`Parallelized.compile_whole`), a
                              pipeline's stages each in place
  6. data parallelism         FSDP2 over the data dimensions (with the context ranks folded in), or DDP copies
                              (ddp.py; split experts left to their own copies: experts.py `average_copies`)
  7. materialise              a model built on the meta device given storage and its one-device values (or a
                              checkpoint's): after FSDP2, which shards what it wraps; before DDP, which starts
                              every copy from rank 0's values (materialise.py)

The order is torchtitan's: a layer is split before its blocks are wrapped for recomputation, a block is compiled
with its recomputation inside, and FSDP2 wraps what the tensor plan made DTensors. The strategies
that run every rank through one training step (single, data, sharded, tensor) prepare their module with it
(`Strategy.setup`); a pipeline prepares the layers of its rank's stages with it (`Preparation.stages`: each stage
its own FSDP2 root or DDP module, as torch's schedules drive them), the parameter server applies steps 3 and 4 to
its replica.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
import torch.nn as nn

from .activation_checkpoint import apply_activation_checkpointing, check_activation_checkpointing
from .ddp import apply_ddp
from .fsdp import apply_fsdp
from .global_batch import GlobalRows, whole_batch_layers
from .layout import Layout
from .materialise import materialise
from .mesh import RunMesh
from .precision import apply_precision

DATA_PARALLEL = ("none", "replicate", "shard")  # how the data dimensions hold the model: one, DDP, FSDP2
GLOBAL_BATCH = ("off", "masks", "across")  # off; Dropout drawn as one device draws it; BatchNorm across too


@dataclass
class Preparation:
    """What the settings ask of each step of `parallelize` (the layout says where each degree is above 1)."""

    device: torch.device
    data_parallel: str = "none"  # DATA_PARALLEL
    tensor_plan: Any = None  # parallel/tensor_plan.py TensorPlan: the layers split over the tp dimension
    activation_checkpointing: str = "none"  # none | full | selective | selective:K
    global_batch: str = "off"  # GLOBAL_BATCH
    loud: bool = False  # the global batch's layers say what they do (one rank)
    precision: str = "fp32"
    compile: bool = False  # --compile
    cpu_offload: bool = False  # FSDP2's shards in host memory between uses (GPUs)
    # a model built on the meta device: its blueprint, the run's seed, a pretrained checkpoint, where it lives
    blueprint: Optional[nn.Module] = None
    seed: int = 0
    weights: Any = None
    home: Optional[torch.device] = None
    # a pipeline rank's part of the model: its stage modules (each an FSDP2 root or a DDP module of its own), the
    # whole model whose blocks are counted for `selective:K`, and FSDP2 as a pipeline drives it (gradients summed,
    # the loss already divided by the global batch; weights kept gathered from the first forward to the last
    # backward)
    stages: tuple = ()
    whole: Optional[nn.Module] = None
    sum_gradients: bool = False
    keep_gathered: bool = False


@dataclass
class Parallelized:
    """What `parallelize` made: the module the training step calls, and what the steps need of it later."""

    runner: nn.Module
    mesh: Optional[RunMesh] = None  # the run's mesh, where a step needed one
    context: Any = None  # this rank's ContextGroup under context parallelism
    global_rows: Optional[GlobalRows] = None  # the rows of the global batch a pass holds (step 4)
    fused: dict = field(default_factory=dict)  # parameter name -> row order of a fused layer (step 1)
    stages: tuple = ()  # a pipeline rank's stage modules as its schedule runs them (DDP copies: wrapped)
    # --compile on a model without blocks: the caller compiles the runner (step 5)
    compile_whole: bool = False
    # DDP's plain parameters beside DTensors (experts split over its copies): the optimizer's multi-tensor kernels
    # take both kinds at once under torch's implicit replication (`mixed_parameters`)
    mixed: bool = False
    lines: List[str] = field(default_factory=list)  # start-up lines that say what was done


def parallelize(
    module: nn.Module, layout: Layout, options: Preparation, *, objective, mesh: Optional[RunMesh] = None
) -> Parallelized:
    """`module` prepared in place for `layout`, in the order above, over the run's `mesh` (built here where a step
    needs one and none is given: `mesh_for`); `objective` takes the loss's part under context parallelism."""
    if mesh is None:
        mesh = mesh_for(layout, options)
    done = Parallelized(runner=module, mesh=mesh, stages=tuple(options.stages))
    line = apply_precision(module, options.device, options.precision)
    done.lines += [line] if line else []
    if options.tensor_plan is not None:  # (a tp dimension, of one rank where a test asks)
        from .tensor import apply_tensor_plan

        done.fused = apply_tensor_plan(module, mesh.tensor, options.tensor_plan)
    if layout.context > 1:
        from .context import split_model_sequences

        done.context, line = split_model_sequences(
            module, objective, mesh.context, layout.data_degree, part=options.whole is not None
        )
        done.lines.append(line)
    if layout.expert > 1:
        from .experts import apply_expert_parallel

        ep, same = mesh.expert_views
        shards = options.data_parallel == "shard"  # else DDP's copies: `same` averages their experts below
        apply_expert_parallel(module, ep, shard_over=same if shards else None, sums=options.sum_gradients)
        done.lines.append(
            f"expert parallel: each mixture's experts split over {layout.expert} ranks, tokens exchanged with "
            f"them by all-to-all"
        )
    apply_activation_checkpointing(
        module if options.whole is None else options.whole, options.activation_checkpointing
    )
    done.global_rows = apply_global_batch(module, options.global_batch, loud=options.loud)
    if options.compile:
        from .compile import apply_compile

        done.compile_whole = not apply_compile(module, whole=options.whole, stages=options.stages)
    if options.data_parallel == "replicate":
        # DDP starts from rank 0's values: every rank holds them all
        _materialise(module, options, done.fused)
        if options.stages:  # a pipeline's copies: each stage over the ranks that hold it in every pipeline
            group = mesh.copies
            done.stages = tuple(apply_ddp(s, options.device, group=group, stage=True) for s in options.stages)
        else:
            experts = []
            if layout.expert > 1:  # DDP's copies of the same experts average their gradients apart
                from .experts import expert_parameters

                experts = expert_parameters(module)
            done.runner = apply_ddp(module, options.device, leave_out=[name for name, _ in experts])
            if experts:
                from .experts import average_copies

                average_copies(done.runner, [p for _, p in experts], mesh.expert_views[1])
                done.mixed = True
    else:
        if options.data_parallel == "shard":
            apply_fsdp(
                module,
                mesh,
                precision=options.precision,
                cpu_offload=options.cpu_offload,
                roots=options.stages,
                sums=options.sum_gradients,
                keep_gathered=options.keep_gathered,
            )
        _materialise(module, options, done.fused)
    return done


def mixed_parameters(mixed: bool):
    """A context in which the optimizer's multi-tensor kernels take plain tensors and DTensors at once, where
    `parallelize` made them `mixed` (in its steps, and as torch's state-dict API creates its state): torch's
    implicit replication, the plain ones read as replicated DTensors and updated in place. Nothing elsewhere."""
    if not mixed:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


def check_model(model: nn.Module, layout: Layout, *, activation_checkpointing: str) -> None:
    """One line each, in the launching process before any worker starts, where `model` cannot be prepared for
    `layout` as asked: activation checkpointing without the blocks it means, sequences context parallelism cannot
    split (by the model's class, as the other checks name it: fit()'s own module is not --model's default)."""
    check_activation_checkpointing(model, activation_checkpointing)
    if layout.context > 1:
        from .context import check_context_parallel

        check_context_parallel(model, layout.context, name=type(model).__name__)
    if layout.expert > 1:
        from .experts import check_expert_parallel

        check_expert_parallel(model, layout.expert, name=type(model).__name__)


def mesh_for(layout: Layout, options: Preparation) -> Optional[RunMesh]:
    """The run's mesh where `parallelize` needs one for this layout and these options (a tensor plan: a tp
    dimension, of one rank where a test asks; context parallelism; expert parallelism; FSDP2: a dp_shard dimension,
    of one rank where the layout has replicas and context ranks only), else None (DDP takes the world group)."""
    shard, tensor = options.data_parallel == "shard", options.tensor_plan is not None
    if not (shard or tensor or layout.context > 1 or layout.expert > 1):
        return None
    return RunMesh(layout, options.device.type, shard=shard, tensor=tensor)


def apply_global_batch(module: nn.Module, how: str, *, loud: bool = False) -> Optional[GlobalRows]:
    """Step 4: Dropout draws one device's masks for the rows a pass holds (`masks`), and BatchNorm normalises
    over the global batch too (`across`); the rows to set before each pass, or None (`off`)."""
    if how == "off":
        return None
    rows = GlobalRows()
    rows.loud = loud
    whole_batch_layers(module, rows, batchnorm=how == "across")
    return rows


def _materialise(module: nn.Module, options: Preparation, fused: dict) -> None:
    """Step 7, where the module was built on the meta device (`options.blueprint`)."""
    if options.blueprint is not None:
        materialise(
            module,
            options.blueprint,
            device=options.home or options.device,
            seed=options.seed,
            reorder=fused,
            weights=options.weights,
        )
