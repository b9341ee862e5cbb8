"""What a degree that splits a step beside the ranks holding the parameters costs, said in one interface
(`DegreeCost`) that the cost model (`predict`, `weighed_layouts`), the memory check (`memory_per_rank`), the
planner on a cluster of GPUs (scaling/cluster_plan.py, scaling/cluster_time.py) and bench's fitted costs
(scaling/bench_predict.py) iterate over (planning/beside.py `BESIDE`), none of them naming the degree.

The ranks holding the parameters (DDP's copies, FSDP2's shards, a pipeline's stages, tensor groups) are priced
by planning/costmodel.py; a degree beside them (the context ranks that split each sequence, planning/context.py;
the experts split over the ranks that hold the same parameters, planning/experts.py) changes that step, what a
rank keeps and what it sends. A new such degree is one module that subclasses `DegreeCost`, overriding what it
changes (the defaults change nothing), and one line in `BESIDE`.

Pure arithmetic: numbers in, numbers out (no torch).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..parallel.layout import Layout

# one collective a rank issues in a step on a cluster: (kind: "all-gather", "reduce-scatter", "all-reduce" or
# "all-to-all"; its ranks; its bytes (the whole tensor; an all-to-all's, what one rank sends and keeps); the span
# of consecutive ranks its group lies within (NVLink within a node, the network across); how many per step)
Collective = Tuple[str, int, float, int, float]


class DegreeCost:
    """The cost of one degree beside the ranks holding the parameters. Every method takes the degree's layout
    (`Layout`) and the model's figures (`work`: planning/costmodel.py `Workload`, or the planner's `ModelWork`
    where said) and is called only where `size(layout)` is above 1, unless said."""

    name = ""  # how a plan's exposed communication names it ("context", "experts")
    ranks = ""  # how a note names the ranks it splits ("context ranks", "expert ranks")
    fitted: Optional[str] = None  # its key among the costs bench fits (per call; None: it fits none)

    def size(self, layout: Layout) -> int:
        """The degree in `layout` (1: nothing split this way)."""
        raise NotImplementedError

    def variants(
        self, work, layout: Layout, *, strategy: Optional[str] = None, per_node: Optional[int] = None
    ) -> Sequence[Layout]:
        """`layout` again with this degree above 1, where it borrows ranks `layout` already has (called where the
        degree is 1): each one the cost model weighs beside it, for the preset `strategy` that gave `layout`, or
        with `per_node` (the GPUs of a cluster's node) each one the planner builds. () where the degree is a
        dimension of its own that the layouts are enumerated with."""
        return ()

    def priceable(self, layout: Layout) -> bool:
        """Whether the cost model prices this degree beside the rest of `layout`."""
        return True

    def priced(
        self,
        prediction,
        work,
        link,
        layout: Layout,
        *,
        costs,
        scatter_by_allreduce: bool = False,
        share: Optional[float] = None,
    ):
        """`prediction` (the step of the ranks holding the parameters as `layout` places them, each splitting the
        batch, its fitted costs per message counted) with this degree's compute and communication; `costs`: the
        fitted costs by key (its own: `fitted`, and the strategy's per message); `share`: attention's measured
        share of one device's pass, where known."""
        return prediction

    def part(self, work, layout: Layout):
        """`work` (or the planner's `ModelWork`) with its activation figures per sample those a rank keeps of each
        sample (called at any degree)."""
        return work

    def states_saved(self, work, layout: Layout, *, per_weight: float, sharded: bool) -> float:
        """Bytes of weights, gradients and optimizer state a rank holds less than the ranks holding the
        parameters would (`per_weight`: the tensors kept per weight; `sharded`: FSDP2 shards them)."""
        return 0.0

    def gathered_share(self, work, layout: Layout) -> float:
        """The share of its parameters an FSDP2 rank gathers in a step (the planner's `ModelWork`)."""
        return 1.0

    def collectives(
        self,
        work,
        layout: Layout,
        *,
        samples: float,
        sequence: int,
        element: int,
        width: int,
        layers: float,
        checkpointing: str,
    ) -> List[Collective]:
        """The collectives this degree adds to a rank's step on a cluster, whose time is exposed (the planner's
        `ModelWork`; `samples` sequences of `sequence` tokens per rank, `element` bytes a value, `width` the
        residual stream's, `layers` the rank's attention layers)."""
        return []

    def fit(self, measured_seconds: float, prediction) -> Optional[float]:
        """The cost per call (`fitted`) that makes `prediction`, priced without one, take the measured step (never
        negative); None where the prediction makes no such call."""
        return None
