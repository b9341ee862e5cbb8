"""A layout built at full size without its devices: the run's own preparation (`parallelize` over the one mesh, the
tensor plan and the layout checks the launching process makes) on torch's fake process group and a model on the
meta device, in this process, as rank 0 of the real world size.

`torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=512)` gives a 512-rank
DeviceMesh whose collectives return at once and send nothing; a model built on the meta device has shapes and no
storage, and `fully_shard` and the tensor plan give each parameter this rank's local part, still without storage.
What the code creates there is what a rank of the real run holds, exact to the byte (its shards and slices, the
FSDP2 units it gathers); what it refuses there (a mesh or a plan that does not divide, a layer that cannot be
split) it refuses in a real run, with the same line. Rank 0 holds the largest parts: torch cuts uneven shards and
slices with the larger ones first. torch keeps `FakeStore` in a private module (torch.testing); torch 2.6 and later
have it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..errors import UserError
from ..parallel.layout import Layout


@dataclass(frozen=True)
class Holdings:
    """What rank 0 of a layout holds, as the code made it: bytes of its parts of the parameters (as built: the
    float32 masters under mixed precision), of them those that train (as many gradient bytes, and the optimizer's
    state per slot), and the largest FSDP2 unit's weights gathered whole for its computation (its tensor-parallel
    part where a plan splits it; 0 without FSDP2), with the number of units."""

    parameter_bytes: int
    trained_bytes: int
    unit_parameters: int  # elements of the largest FSDP2 unit, gathered
    units: int


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """This process as `rank` of a fake process group of `world_size` ranks, for the duration; one line where it is
    in a process group already (a run's worker, a notebook that trains)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..parallel.mesh import forget_earlier_meshes

    if dist.is_initialized():
        raise UserError(
            "planning builds each layout on torch's fake process group, and this process is in a process group "
            "already; plan from a process of its own (polytrain plan, or a script that does not train)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_earlier_meshes()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _units(model: nn.Module, shard_ranks: int) -> list:
    """Elements each FSDP2 unit of `model` gathers: the parameters it manages (not a nested unit's), each this
    rank's part times the ranks it is sharded over (a tensor plan's slice stays a slice)."""
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    owned, sizes = set(), []
    for unit in reversed(units):  # the innermost first: the root keeps what no other unit took
        size = 0
        for parameter in unit.parameters():
            if id(parameter) not in owned:
                owned.add(id(parameter))
                size += _local(parameter).numel() * shard_ranks
        sizes.append(size)
    return sizes


def _pipeline_holdings(build, layout: Layout, plan, *, rank: int, precision: str) -> Holdings:
    """`rank`'s holdings of a pipeline, set up by the pipeline strategy itself (its stages cut, tied weights, the
    tensor plan and FSDP2 per stage), its model left on the meta device."""
    from ..pipeline.strategy import Pipeline

    class Unfilled(Pipeline):
        """The pipeline's own set-up, with nothing given storage and no start-up lines (which gather every rank's
        device, and a fake group gathers none)."""

        def place(self, model):
            return model

        def placement_lines(self, holds):
            return []

        def _boundary_shapes(self, layers):
            # no step runs here, so no stage exchanges activations (the plan sizes its sends from the model's
            # width, cluster_time.py): running each layer of the full-size model once for them cost half the plan
            return [((), torch.float32, True)] * (len(layers) + 1)

        @property
        def data_parallel(self) -> str:  # (DDP's copies are the stages themselves: DDP cannot wrap meta ones)
            kind = Pipeline.data_parallel.fget(self)
            return "none" if kind == "replicate" else kind

    strategy = Unfilled(
        plan=plan,
        layout=layout,
        device=torch.device("cpu"),
        rank=rank,
        world_size=layout.world_size,
        precision=precision,
    )
    strategy.setup(build(), lambda named: None, lambda optimizer: None)
    parts = list(strategy.model.parameters())
    held = sum(_local(p).numel() * _local(p).element_size() for p in parts)
    trains = sum(_local(p).numel() * _local(p).element_size() for p in parts if p.requires_grad)
    shards = strategy.data_parallel == "shard"
    # a pipeline of shards keeps its stages' weights gathered through a step (pipeline/sharding.py)
    gathered = sum(_local(p).numel() for p in parts) * layout.fsdp_ranks if shards else 0
    return Holdings(held, trains, gathered, len(strategy.stage_modules))


def holdings_at_full_size(
    build: Callable[[], nn.Module],
    layout: Layout,
    *,
    tensor_plan=None,
    precision: str = "bf16",
    objective=None,
    pipeline_plan=None,
    rank: int = 0,
) -> Holdings:
    """`rank`'s holdings (rank 0 by default) of the model `build()` makes (on the meta device) prepared for `layout`
    at its full world size as a run prepares it: by `parallelize` (`tensor_plan`: the run's, where the layout has a
    tensor degree), or by the pipeline strategy (`pipeline_plan`, where it has stages)."""
    from ..objective import Objective
    from ..parallel.parallelize import Preparation, parallelize

    if layout.pipeline > 1:
        with fake_world(layout.world_size, rank):
            return _pipeline_holdings(build, layout, pipeline_plan, rank=rank, precision=precision)
    with fake_world(layout.world_size, rank):
        model = build()
        options = Preparation(
            device=torch.device("cpu"),
            # DDP's whole copies are the model itself (torch's DDP cannot wrap a model on the meta device)
            data_parallel="none" if layout.data_parallel == "replicate" else layout.data_parallel,
            tensor_plan=tensor_plan if layout.tensor > 1 else None,
            precision="fp32" if precision == "fp32" else precision,
        )
        done = parallelize(model, layout, options, objective=objective or Objective(kind="language"))
        parts = list(model.parameters())
        held = sum(_local(p).numel() * _local(p).element_size() for p in parts)
        trains = sum(_local(p).numel() * _local(p).element_size() for p in parts if p.requires_grad)
        units = []
        if layout.data_parallel == "shard":  # (hybrid sharding: the shards' dimension is the mesh's last)
            fsdp = done.mesh.fsdp
            units = _units(model, fsdp.size(fsdp.ndim - 1))
    return Holdings(held, trains, max(units, default=0), len(units))
