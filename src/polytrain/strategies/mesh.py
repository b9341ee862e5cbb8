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


def device_mesh(layout: Layout, device_type: str, *, keep: Collection[str] = ()):
    """The layout's `torch.distributed.device_mesh.DeviceMesh` over every rank of the process group."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = mesh_dims(layout, keep) or (("dp_replicate", 1),)
    names, shape = zip(*dims)
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
