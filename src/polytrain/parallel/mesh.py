"""The one DeviceMesh of a run, built from its layout, and the named parts of it each step of preparation works over.

`RunMesh(layout, device_type, shard=..., tensor=...)` lays the mesh out in the layout's order (`parallel/layout.py`:
dp_replicate, dp_shard, pp, cp, tp; the tensor dimension innermost), those of size 1 left out unless a step needs
them all the same: FSDP2's dp_shard (`shard`: FSDP2 is applied, even over one rank of a layout of replicas and
context) and the tensor plan's tp (`tensor`: a plan is applied, of one rank where a test asks). Every part is asked
of it by what it is for: `tensor`, `context` and `pipeline` (the tp, cp and pp dimensions), `fsdp` (what FSDP2
shards over), `expert_views` (the ranks the experts are split over, and those that hold the same ones), `copies` (the group whose whole copies sum their gradients), `replicas` (dp_replicate). Nothing
else builds a mesh or slices one by name.
"""

from __future__ import annotations

from functools import cached_property
from typing import Collection

from .layout import DEGREES, MESH_NAMES, Layout


def mesh_dims(layout: Layout, keep: Collection[str] = ()) -> tuple:
    """((name, size), ...) of the mesh: the degrees above 1 and those in `keep`, in the layout's order."""
    return tuple(
        (MESH_NAMES[name], getattr(layout, name))
        for name in DEGREES
        if getattr(layout, name) > 1 or name in keep
    )


SHARD_AND_CONTEXT = "dp_shard_cp"  # the name of the flattened (dp_shard, cp) dimension (torchtitan's)


def fsdp_submesh(mesh, layout: Layout):
    """The part of the run's `mesh` FSDP2 shards over: dp_shard, within each dp_replicate copy for hybrid
    sharding (2-D). The ranks of a context group hold the same parameters, so under context parallelism they
    shard too: dp_shard and cp flattened into one dimension, the same ranks as `layout.sharding`'s (torch's
    private `DeviceMesh._flatten` and `_unflatten`, as torchtitan uses them; torch has no public spelling yet)."""
    hybrid = layout.replicate > 1
    if layout.context == 1:
        return mesh["dp_replicate", "dp_shard"] if hybrid else mesh["dp_shard"]
    names = tuple(name for name in ("dp_shard", "cp") if name in mesh.mesh_dim_names)
    if not hybrid:
        return mesh[names]._flatten(SHARD_AND_CONTEXT)
    copies, shards = layout.replicate, layout.fsdp_ranks
    if not hasattr(mesh, "_unflatten"):  # an older torch: slice the flattened dimension from the mesh
        mesh[names]._flatten(SHARD_AND_CONTEXT)
        return mesh["dp_replicate", SHARD_AND_CONTEXT]
    # (torch 2.11 and later warn that slicing a flattened dimension from the mesh will go: unflatten instead)
    data = mesh[("dp_replicate", *names)]._flatten("dp_replicate_shard_cp")
    return data._unflatten(0, (copies, shards), ("dp_replicate", SHARD_AND_CONTEXT))


def copies_group(mesh):
    """The process group over which whole copies of a part of the model sum their gradients (a pipeline's stages
    as DDP modules): dp_replicate, with the context ranks folded in, since each holds a part of every sequence's
    gradient (flattened as `fsdp_submesh` flattens them for FSDP2)."""
    names = tuple(name for name in ("dp_replicate", "cp") if name in (mesh.mesh_dim_names or ()))
    if len(names) == 1:
        return mesh[names[0]].get_group()
    return mesh[names]._flatten("dp_replicate_cp").get_group()


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


class RunMesh:
    """The run's DeviceMesh (`world`) for `layout` over every rank of the process group, and its named parts."""

    def __init__(self, layout: Layout, device_type: str, *, shard: bool = False, tensor: bool = False):
        self.layout = layout
        keep = ("shard",) * shard + ("tensor",) * tensor
        self.world = device_mesh(layout, device_type, keep=keep)

    @property
    def tensor(self):
        """The tp dimension: the ranks each layer of the tensor plan is split over."""
        return self.world["tp"]

    @property
    def context(self):
        """The cp dimension: the ranks each sequence is split over."""
        return self.world["cp"]

    @property
    def pipeline(self):
        """The pp dimension: the stages of one pipeline."""
        return self.world["pp"]

    @property
    def replicas(self):
        """The dp_replicate dimension: whole copies side by side."""
        return self.world["dp_replicate"]

    @cached_property
    def fsdp(self):
        """What FSDP2 shards over (`fsdp_submesh`)."""
        return fsdp_submesh(self.world, self.layout)

    @cached_property
    def expert_views(self) -> tuple:
        """(`ep`: the ranks one mixture's experts are split over, `expert_fsdp`: the ranks that hold the same experts,
        which FSDP2 shards them over): what FSDP2 shards over (`fsdp`) unflattened into (dp_shard_mod_ep, ep), ep
        innermost, as torchtitan borrows its expert ranks (within each dp_replicate copy for hybrid sharding).
        Where DDP's copies hold the model (`layout.data_parallel == "replicate"`), dp_replicate is unflattened so,
        the second view the copies of the same experts."""
        copies = self.layout.data_parallel == "replicate"
        fsdp, size = (self.replicas if copies else self.fsdp), self.layout.expert
        if not hasattr(fsdp, "_unflatten"):
            from ..errors import ConfigError

            raise ConfigError(
                "--expert-parallel needs torch 2.9 or later (DeviceMesh._unflatten); upgrade torch"
            )
        if fsdp.ndim == 1:
            rest = "dp_replicate_mod_ep" if copies else "dp_shard_mod_ep"
            two = fsdp._unflatten(0, (fsdp.size() // size, size), (rest, "ep"))
            return two["ep"], two[rest]
        three = fsdp._unflatten(1, (fsdp.shape[1] // size, size), ("dp_shard_mod_ep", "ep"))
        return three["ep"], three["dp_replicate", "dp_shard_mod_ep"]

    @cached_property
    def copies(self):
        """The process group over which whole copies of a pipeline's stages sum their gradients (`copies_group`)."""
        return copies_group(self.world)
