"""What expert parallelism costs (`--expert-parallel P`, parallel/experts.py), as one `DegreeCost` (`EXPERTS`):
the layouts that borrow P of their ranks for a mixture's experts, each predicted from the same layout with every
expert on every rank (planning/costmodel.py); the cost per all-to-all call fitted to a measured step; what a rank
holds less (DDP's copies each hold 1/P of the experts) and gathers less (FSDP2 gathers 1/P of them); and the
all-to-alls of a step on a cluster. Pure arithmetic on the cost model's inputs (the Workload's `mixtures`,
`experts`, `expert_bytes` and `routed_bytes`; the planner's `experts_per_token` and `expert_share`), tested
against values worked out by hand.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Tuple

from ..parallel.layout import Layout, divisors
from ..parallel.presets import SPLITTING_PRESETS
from .costmodel import Link, Prediction, Workload
from .degree_cost import DegreeCost

# the key of the fitted cost per all-to-all call among the costs per message by strategy (bench, --plan files):
# what an exchange costs beyond its bytes and messages (the calls' host work, waiting for the busiest rank)
ALL_TO_ALL = "all-to-all"


def all_to_all(ranks: int, nbytes: float, link: Link) -> float:
    """One all-to-all of `nbytes` per rank over `ranks`: (ranks-1)/ranks of them leave each rank, one message to
    each other rank."""
    if ranks == 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / link.beta + (ranks - 1) * link.alpha


# all-to-alls of each mixture in a step: its tokens out to their experts and back, in forward and in backward
EXCHANGES = 4


def with_experts(
    prediction: Prediction,
    work: Workload,
    link: Link,
    expert: int,
    *,
    scatter_by_allreduce: bool = False,
    call_cost: float = 0.0,
) -> Prediction:
    """`prediction` with each mixture's experts split over `expert` of the ranks that hold the same parameters
    (`Layout.expert_holders`): `EXCHANGES` all-to-alls per mixture of a rank's routed tokens over the expert group
    (the busiest rank's: `busiest_share`), each one message to every other rank of the group, and `call_cost` seconds of its
    own (fitted: `ALL_TO_ALL`). Where DDP's copies held every expert, the experts' part of the update is split
    `expert` ways; where FSDP2 sharded them over s ranks, it gathers and reduces a rank's experts (1/P of them) over
    the s/P ranks that hold the same ones instead of all of them over s (`sharded`'s rings)."""
    layout = replace(prediction.layout, expert=expert)  # (one line where the layout cannot borrow them)
    samples = work.batch_size / layout.data_degree
    # (routed bytes per sample, of which a rank routes its tokens' part)
    nbytes = samples * layout.tokens_per_rank(work.routed_bytes) * busiest_share(work.routed_counts, expert)
    exchanges = EXCHANGES * work.mixtures
    compute, communication = prediction.compute, prediction.communication
    if layout.data_parallel == "replicate" and work.parameter_bytes:
        compute -= work.update_seconds * work.expert_bytes / work.parameter_bytes * (1 - 1 / expert)
    elif layout.data_parallel == "shard" and layout.fsdp_ranks > 1:
        rings, shards = 2 + (2 if scatter_by_allreduce else 1), layout.fsdp_ranks
        same = shards // expert
        saved = (shards - 1) / shards - (same - 1) / same / expert
        communication -= rings * saved * work.expert_bytes / link.beta
    return replace(
        prediction,
        compute=compute,
        communication=communication + exchanges * (all_to_all(expert, nbytes, link) + call_cost),
        exchanges=prediction.exchanges + exchanges,  # (priced per call, not as the strategy's messages)
        layout=layout,
    )


def busiest_share(counts, expert: int) -> float:
    """The (token, choice) pairs the busiest of `expert` ranks gets over the mean rank's, rank r holding experts r
    E/P .. (r + 1) E/P - 1, from each expert's `counts` (a sample batch's routing; 1: even, where unknown)."""
    if not counts or len(counts) % expert or not sum(counts):
        return 1.0
    per = len(counts) // expert
    loads = [sum(counts[r * per : (r + 1) * per]) for r in range(expert)]
    return max(loads) / (sum(loads) / expert)


def expert_degrees(work: Workload, layout: Optional[Layout]) -> Tuple[int, ...]:
    """The expert degrees above 1 a layout of a model with mixtures can take: those dividing each mixture's
    experts and the ranks they would be borrowed from."""
    if not work.mixtures or layout is None or layout.expert > 1:
        return ()
    holders = layout.expert_holders
    return tuple(p for p in range(2, holders + 1) if holders % p == 0 and work.experts % p == 0)


def fit_exchange_cost(measured_seconds: float, prediction: Prediction) -> float:
    """The cost per all-to-all call that makes `prediction` (priced otherwise, without one) take the measured
    step; never negative."""
    if not prediction.exchanges or not math.isfinite(prediction.step_seconds):
        return 0.0
    return max(0.0, (measured_seconds - prediction.step_seconds) / prediction.exchanges)


class ExpertCost(DegreeCost):
    """Expert parallelism's cost, as the cost model, the memory check, the planner and bench ask it."""

    name, ranks, fitted = "experts", "expert ranks", ALL_TO_ALL

    def size(self, layout: Layout) -> int:
        return layout.expert

    def variants(
        self, work, layout: Layout, *, strategy: Optional[str] = None, per_node: Optional[int] = None
    ):
        """Each P dividing the ranks that hold the same parameters and each mixture's experts (`expert_degrees`),
        for the presets that have such ranks; on a cluster, of the layouts that shard with FSDP2 only, each expert
        group within a node."""
        if per_node is None:
            found = expert_degrees(work, layout) if strategy in SPLITTING_PRESETS else ()
            return [replace(layout, expert=p) for p in found]
        if not work.mixtures or layout.data_parallel != "shard":
            return []
        split = [replace(layout, expert=p) for p in divisors(layout.fsdp_ranks) if p > 1]
        return [each for each in split if each.expert_span <= per_node and work.experts % each.expert == 0]

    def priced(self, prediction, work, link, layout, *, costs, scatter_by_allreduce=False, share=None):
        return with_experts(
            prediction,
            work,
            link,
            layout.expert,
            scatter_by_allreduce=scatter_by_allreduce,
            call_cost=costs.get(ALL_TO_ALL, 0.0),
        )

    def states_saved(self, work, layout: Layout, *, per_weight: float, sharded: bool) -> float:
        """DDP's copies each hold 1/P of the experts (FSDP2 shards them anyway)."""
        return 0.0 if sharded else work.expert_bytes * per_weight * (1 - 1 / layout.expert)

    def gathered_share(self, work, layout: Layout) -> float:
        """An FSDP2 rank gathers its experts only, E/P of them, over the 1/P of the ranks that shard them."""
        return 1 - work.expert_share + work.expert_share / layout.expert

    def collectives(self, work, layout, *, samples, sequence, element, width, layers, checkpointing):
        """Per mixture of a rank's stage, a rank's tokens each to K experts and back in the forward, their
        gradients in the backward, and again in a full recomputation: all-to-alls over the expert group
        (consecutive FSDP2 ranks: the tensor ranks, and the stages, lie between them), routing taken as even."""
        if not work.mixtures:
            return []
        nbytes = samples * layout.tokens_per_rank(sequence) * work.experts_per_token * width * element
        count = (6 if checkpointing == "full" else EXCHANGES) * work.mixtures / layout.pipeline
        return [("all-to-all", layout.expert, nbytes, layout.expert_span, count)]

    def fit(self, measured_seconds: float, prediction) -> Optional[float]:
        return fit_exchange_cost(measured_seconds, prediction) if prediction.exchanges else None


EXPERTS = ExpertCost()
