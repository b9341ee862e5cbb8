"""The one DeviceMesh of a layout: every strategy that needs a mesh builds it here from its degrees.

Dimensions in the layout's order (`plan/layout.py`: dp_replicate, dp_shard, pp, tp; the tensor dimension
innermost), those of size 1 left out unless a strategy asks to `keep` them (so that its code can always ask
for, say, the data dimension's process group).
"""

from __future__ import annotations

from typing import Collection

from ..plan.layout import DEGREES, MESH_NAMES, Layout


def mesh_dims(layout: Layout, keep: Collection[str] = ()) -> tuple:
    """((name, size), ...) of the mesh: the degrees above 1 and those in `keep`, in the layout's order."""
    return tuple(
        (MESH_NAMES[name], getattr(layout, name))
        for name in DEGREES
        if getattr(layout, name) > 1 or name in keep
    )


def data_dims(hybrid: bool) -> tuple:
    """The mesh dimensions FSDP2 shards over: (dp_replicate, dp_shard) for copies of shard groups (hybrid
    sharding), else dp_shard."""
    return ("dp_replicate", "dp_shard") if hybrid else ("dp_shard",)


def data_submesh(mesh, hybrid: bool):
    """The part of `mesh` FSDP2 shards over (`data_dims`): 2-D for hybrid sharding, else 1-D."""
    return mesh[data_dims(hybrid)] if hybrid else mesh["dp_shard"]


def forget_earlier_meshes() -> None:
    """Drop what DTensor cached about the meshes of an earlier run in this process (a second `fit` under
    torchrun, a notebook): a DeviceMesh equals another of the same ranks, shape and names whatever its process
    groups, so sharding decisions cached for the earlier run's mesh would send this run's collectives to
    process groups that were destroyed with it ("Could not resolve the process group registered under the
    name 8"). The caches are torch's own and private: those a torch release lacks are skipped."""
    import torch
    from torch.distributed.tensor import DTensor, _redistribute

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # its C++ fast path
    if clear_native is not None:
        clear_native()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (
        getattr(propagator, "propagate_op_sharding", None),
        getattr(type(propagator), "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),
    ):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    planners = getattr(_redistribute, "_planner_cache", None)
    if isinstance(planners, dict):
        planners.clear()


def device_mesh(layout: Layout, device_type: str, *, keep: Collection[str] = ()):
    """The layout's `torch.distributed.device_mesh.DeviceMesh` over every rank of the process group (built
    after forgetting what DTensor cached about the meshes of an earlier run in the same process)."""
    from torch.distributed.device_mesh import init_device_mesh

    forget_earlier_meshes()
    dims = mesh_dims(layout, keep) or (("dp_replicate", 1),)
    names, shape = zip(*dims)
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
