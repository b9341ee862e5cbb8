"""The cost model's one entry: the predicted step of a strategy on a `Layout` (`predict`), and the layouts `bench`,
`--strategy auto` and the memory check's advice weigh on n devices (`predict_all`).

A layout's step is built from its degrees, each priced where it is written: the ranks that split the batch and
hold the parameters (DDP's copies, FSDP2's shards and their copies, a parameter server, a pipeline of whole
stages, groups of tensor ranks: planning/costmodel.py), with the cost per message a bench fitted for the strategy
(`costmodel.priced`), then each degree beside them (planning/beside.py `BESIDE`: the context ranks that split each
sequence, the experts split over the ranks that hold the same parameters), each by its own module's `DegreeCost`.
A new degree beside them is one such module; nothing here names it, and nothing is keyed by a label, which is made
from the layout for printing (parallel/presets.py `label`).

Pure arithmetic, tested against values worked out by hand (tests/test_plan_costmodel.py and the degrees' own).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Collection, Dict, Iterator, Mapping, Optional, Tuple

from ..parallel.layout import Layout
from ..parallel.presets import plain_layout
from .beside import borrowed, split_beside
from .costmodel import (
    HYBRID_SHARDS,
    Link,
    Prediction,
    Workload,
    data_parallel,
    parameter_server,
    pipeline,
    priced,
    sharded,
    tensor_parallel,
)


def predict(
    work: Workload,
    strategy: str,
    layout: Layout,
    link: Link,
    *,
    microbatches: int = 4,
    servers: int = 1,
    contiguous: Collection[str] = (),
    scatter_by_allreduce: bool = False,
    message_costs: Optional[Mapping[str, float]] = None,
    turns: float = 1.0,
    share: Optional[float] = None,
) -> Prediction:
    """The step of `strategy` on `layout` (its devices: `layout.world_size`; one device is `single`, the reference).
    `strategy` says what the degrees do not: a parameter server, and whether it trains in the default memory
    format (named in `contiguous`: `work.plain`). `message_costs`: seconds per message by strategy, and per call
    of a degree beside them (its `DegreeCost.fitted` key: `all-to-all`); `share`: attention's measured share of
    one device's pass (context ranks; default its share of the FLOPs); the rest as `predict_all`. A layout the
    model cannot cost (a pipeline beside other degrees, tensor ranks beside context ranks:
    `DegreeCost.priceable`) is an infinite step whose note says so."""
    work = work.in_format(strategy in contiguous)
    devices, costs = layout.world_size, message_costs or {}
    if devices == 1:
        return Prediction("single", 1, work.compute_seconds, 0.0)
    if strategy == "parameter-server":
        base = parameter_server(work, devices, link, servers=servers)
    elif layout.pipeline > 1:
        base = pipeline(work, layout.pipeline, link, microbatches=microbatches)
    elif layout.tensor > 1:
        base = tensor_parallel(
            work, devices, link, tensor=layout.tensor, scatter_by_allreduce=scatter_by_allreduce, turns=turns
        )
    elif layout.data_parallel == "shard":
        base = sharded(
            work, devices, link, scatter_by_allreduce=scatter_by_allreduce, replicas=layout.replicate
        )
    else:
        base = data_parallel(work, devices, link)
    beside = split_beside(layout)
    if beside and (
        layout.pipeline > 1
        or strategy == "parameter-server"
        or not all(degree.priceable(layout) for degree in beside)
    ):
        ranks = " and ".join(degree.ranks for degree in beside)
        return replace(
            base,
            idle=float("inf"),
            layout=layout,
            note=f"the cost model does not price {base.strategy} beside {ranks}",
        )
    base = priced(base, costs)
    for degree in beside:
        base = degree.priced(
            base, work, link, layout, costs=costs, scatter_by_allreduce=scatter_by_allreduce, share=share
        )
    return base


def weighed_layouts(work: Workload, devices: int, *, meshes: bool = True) -> Iterator[Tuple[str, Layout]]:
    """(strategy, layout) of every layout `predict_all` weighs on `devices`: each strategy's plain layout; with
    `meshes`, hybrid sharding in shard groups of `HYBRID_SHARDS` ranks and the (data, tensor) meshes of the
    tensor plan's splits (one group of all devices always, where the plan splits over them); and each of them
    again with a degree beside them that borrows its ranks (`DegreeCost.variants`: for a model with mixtures,
    the experts split over each count of the ranks holding the same parameters that divides them and the
    experts)."""
    if devices == 1:
        yield "single", Layout()
        return
    found = [
        (strategy, plain_layout(strategy, devices))
        for strategy in ("data", "parameter-server", "sharded", "pipeline")
    ]
    found += [
        ("sharded", Layout(replicate=devices // shards, shard=shards))
        for shards in (HYBRID_SHARDS if meshes else ())
        if shards < devices and devices % shards == 0
    ]
    found += [
        ("tensor", Layout(shard=devices // tensor, tensor=tensor))
        for tensor in work.tensor_splits
        if devices % tensor == 0 and (tensor == devices or meshes)
    ]
    for strategy, layout in found:
        yield strategy, layout
    for strategy, layout in found:
        for variant in borrowed(work, layout, strategy=strategy):
            yield strategy, variant


def predict_all(
    work: Workload, devices: int, link: Link, *, meshes: bool = True, **options
) -> Dict[str, Prediction]:
    """The prediction of every layout `weighed_layouts` gives on `devices` (`meshes`: its meshes too), by its label
    (`sharded 2x2`, `data ep2`), each by `predict` with `options`: `microbatches`, `servers`, `contiguous` (the
    strategies that train in the default memory format, `work.plain`), `scatter_by_allreduce` (the backend
    reduce-scatters by all-reducing: gloo), `message_costs` (seconds per message by strategy, `tensor`'s per
    collective for every tensor layout, and per all-to-all call) and `turns` (CPU processes per core)."""
    predictions = {}
    for strategy, layout in weighed_layouts(work, devices, meshes=meshes):
        predicted = predict(work, strategy, layout, link, **options)
        predictions[predicted.label] = predicted
    return predictions
