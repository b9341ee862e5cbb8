"""The degrees that split a step beside the ranks holding the parameters, each priced by a module of its own
(planning/degree_cost.py `DegreeCost`), in the order the cost model applies them: the context ranks that split
each sequence (planning/context.py), then the experts split over the ranks that hold the same parameters
(planning/experts.py). The cost model, the memory check, the planner and bench ask through the functions below,
which iterate `BESIDE`; a new degree beside them is one module and one entry here."""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..parallel.layout import Layout
from .context import CONTEXT
from .degree_cost import DegreeCost
from .experts import EXPERTS

BESIDE: Tuple[DegreeCost, ...] = (CONTEXT, EXPERTS)


def split_beside(layout: Layout) -> Tuple[DegreeCost, ...]:
    """The degrees of `BESIDE` that `layout` splits (above 1)."""
    return tuple(degree for degree in BESIDE if degree.size(layout) > 1)


def rank_part(work, layout: Layout):
    """`work` with its activation figures per sample those a rank of `layout` keeps of each sample, as the degrees
    beside the parameter holders cut it (the context ranks: their part of each sequence)."""
    for degree in BESIDE:
        work = degree.part(work, layout)
    return work


def borrowed(
    work, layout: Layout, *, strategy: Optional[str] = None, per_node: Optional[int] = None
) -> List[Layout]:
    """`layout` again with each degree beside that borrows its ranks (`DegreeCost.variants`), degree by degree."""
    return [
        variant
        for degree in BESIDE
        for variant in degree.variants(work, layout, strategy=strategy, per_node=per_node)
    ]


def fitted_beside() -> Tuple[DegreeCost, ...]:
    """The degrees beside whose cost per call bench fits (`DegreeCost.fitted`)."""
    return tuple(degree for degree in BESIDE if degree.fitted)


def sizes_beside(layout: Optional[Layout]) -> Tuple[int, ...]:
    """Each degree beside in `layout` (1 where not split; every one for None), in `BESIDE`'s order."""
    return tuple(degree.size(layout) if layout is not None else 1 for degree in BESIDE)
