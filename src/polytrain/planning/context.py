"""Predicted step time of context parallelism (`--context-parallel C` with --strategy data or sharded,
parallel/context.py): n ranks in n/C data slices, each slice's sequences split over a context group
of C ranks. Pure arithmetic on the cost model's inputs (planning/costmodel.py), tested against values worked out
by hand; what a context rank holds is planning/activations.py's (`context_part`).

- **Compute.** A rank computes T/C tokens of each sequence of its slice, C times the sequences of a rank
  that splits the batch over n (C = 1, `Workload.replica_pass(n)`): as many tokens. Its matrix products,
  norms and the rest cost as much as that rank's; its attention does not. Each of its two chunks (c = T/2C
  queries from position a) attends with `is_causal` over the keys before its end, its queries after a zero
  rows, so it costs a causal attention of a + c rows: (a + c)^2 / 2 pairs, the zero rows' included. Rank r's
  chunks end at (r + 1) c and (2C - r) c; rank 0's are the most, (1 + 4C^2) c^2 / 2 pairs per sequence
  against one device's (2C c)^2 / 2 = 2 C^2 c^2. A synchronous step waits for rank 0, whose parts of C
  sequences cost C (1 + 4C^2) / 4C^2 = (4C^2 + 1) / 4C times the attention of one sequence on a C = 1 rank
  (2.125 at C = 2, 4.06 at C = 4, where 1/C would make it 1). With a the attention's share of one device's
  pass, a rank's pass is

      replica_pass(n) ((1 - a) + a (4C^2 + 1) / 4C)

  a is the share of FLOPs unless a measured one is given: causal attention does 7 h d T^2 per layer and
  sample (forward QK^T and PV over half the pairs, 2 h d T^2; backward, flash attention's recomputed QK^T and
  four products, 5 h d T^2), the matrix products 6 per parameter and token. The FLOPs' share overstates
  attention's time where the rest is slow per FLOP: on 2 CPU cores (a 2-layer width-128 Llama, T = 4096)
  attention did 0.75 of the FLOPs in about 0.3 of the pass (docs/benchmarks.md), so there the prediction is
  an upper bound. Counting pairs misses a cost per query row: there rank 0's chunks took 1.18x one device's
  attention per layer, not 1.06x. Where CPU processes share cores the lighter ranks lend theirs to rank 0.
- **Communication.** Per attention layer the forward all-gathers the keys and the values over the context
  group (a ring: (C - 1)/C of the gathered tensor, b g T d e bytes for b sequences of the rank's slice, g
  key/value heads, e bytes an element, and C - 1 messages each), and the backward reduce-scatters their
  gradients alike (gloo reduce-scatters by all-reducing: twice the bytes and messages,
  `scatter_by_allreduce`).
  The gradients and weights move as the strategy moves them over all n ranks (data parallelism all-reduces
  the gradients over every rank, FSDP2 shards over the context ranks too): `data_parallel` or `sharded` on n.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..parallel.layout import Layout
from .costmodel import Link, Prediction, Workload, data_parallel, sharded


def attention_share(work: Workload) -> float:
    """The share of one device's forward + backward FLOPs that attention does (`a`, module docstring)."""
    shape = work.attention
    attention = shape.layers * 7 * shape.heads * shape.head_dim * shape.context**2
    return attention / (attention + 6 * shape.parameters * shape.context)


def busiest_attention(size: int) -> float:
    """Rank 0's attention over its parts of C sequences against one sample's on a rank that splits the batch:
    (4C^2 + 1) / 4C (1 at C = 1)."""
    return (4 * size**2 + 1) / (4 * size) if size > 1 else 1.0


def context_parallel(
    work: Workload,
    devices: int,
    link: Link,
    *,
    context: int,
    strategy: str = "sharded",
    scatter_by_allreduce: bool = False,
    share: Optional[float] = None,
) -> Prediction:
    """The step of `strategy` (data or sharded) on `devices` ranks with each sequence split over `context` of
    them (the module's docstring), printed `<strategy> cp<C>`. `share`: attention's measured share of one device's
    pass (default: its share of the FLOPs). Impossible where the workload has no attention shape."""
    if strategy == "sharded":
        base = sharded(work, devices, link, scatter_by_allreduce=scatter_by_allreduce)
    else:
        base = data_parallel(work, devices, link)
    if context == 1:
        return base
    slices = devices // context  # the data degree: a sharded one's FSDP2 ranks, a data one's replicas
    layout = (
        Layout(**{"shard" if strategy == "sharded" else "replicate": slices}, context=context)
        if devices % context == 0
        else None
    )
    shape = work.attention
    if shape is None or devices % context:
        why = (
            "no causal attention was seen in the model"
            if shape is None
            else f"{context} does not divide {devices}"
        )
        return Prediction(strategy, devices, 0.0, 0.0, float("inf"), note=why, layout=layout)
    share, replica = attention_share(work) if share is None else share, work.replica_pass(devices)
    compute = base.compute - replica + replica * ((1 - share) + share * busiest_attention(context))
    sequences = work.batch_size / (devices // context)  # each rank's slice: its part of each of them
    gathered = sequences * shape.kv_heads * shape.context * shape.head_dim * shape.element_bytes
    rings = 1 + (2 if scatter_by_allreduce else 1)  # the gather, then the gradients' reduce-scatter
    collectives = 2 * shape.layers  # the keys and the values of every attention layer
    messages = collectives * rings * (context - 1)
    moved = collectives * rings * (context - 1) / context * gathered
    return replace(
        base,
        layout=layout,
        compute=compute,
        communication=base.communication + moved / link.beta + messages * link.alpha,
        messages=base.messages + messages,
    )
