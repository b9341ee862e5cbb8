"""What context parallelism costs (`--context-parallel C`, parallel/context.py), as one `DegreeCost` (`CONTEXT`):
the predicted step time, what a context rank gathers, and the memory it holds. n ranks in n/C data slices, each
slice's sequences split over a context group of C ranks. Pure arithmetic on the cost model's inputs
(planning/costmodel.py) and on the figures of planning/activations.py, tested against values worked out by hand
and against a context rank's forward on fake tensors.

Two ways of attending are counted, told apart by `AttentionShape.blockwise`: block by block over the keys each
chunk sees (parallel/block_attention.py, CPUs), and over the gathered keys with zero rows in front (context.py's
`causal_attention` elsewhere: GPUs). The figures below are the second's; block by block a rank computes 1/C of
each sequence's attention pairs (compute as a rank that splits the batch), passes the keys and values around the
ring in the forward and again in the backward with their gradients, keeps nothing beyond 1/C of one device's but,
under selective checkpointing, each block's output and log-sum-exp (`context_bytes`), and holds for one layer's
backward two ranks' keys and values and their gradients in flight (`blockwise_transient`): never the whole
sequence's.

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

**Memory.** A rank of a context group holds T/C tokens of each
sample: 1/C of every figure of planning/activations.py, plus what its attention keeps beyond 1/C of one device's
(`context_part`). Per attention layer and sample, with h query heads, g key/value heads of width d, e bytes an
element, L = T/C the rank's tokens and P the rows its two chunks' attention sees with their zero rows in front
(chunk r over the keys before (r+1) T/2C, chunk 2C-1-r before (2C-r) T/2C: P = T + T/2C in all):

    gathered keys and values       2 g T d e      (its own 2 g L d e no longer kept beside them)
    padded queries and outputs     2 h P d e      (its own queries h L d e no longer kept)
    log-sum-exp                    h P f          (f = 4 bytes, float64's 8; its own h L f no longer kept)

so x = e d (2 g (T - L) + h (2P - L)) + f h (P - L) more per layer, of which the attention's outputs,
m' = (e d + f) h (P - L), are among what selective checkpointing keeps. Every block then keeps b/C + x (one
attention a block), every figure else is 1/C: with full checkpointing only the recomputed block's x comes on
top of 1/C. The attention's shape (`AttentionShape`) is read off one device's forward
(activation_memory.py); counted so, the figures equal what a context rank's forward keeps on fake tensors
(tests/test_context_memory.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Tuple

from ..parallel.layout import Layout
from ..parallel.presets import layout_or_none
from .activations import AttentionShape
from .costmodel import Link, Prediction, Workload, data_parallel, sharded
from .degree_cost import DegreeCost


def attention_share(work: Workload) -> float:
    """The share of one device's forward + backward FLOPs that attention does (`a`, module docstring)."""
    shape = work.attention
    attention = shape.layers * 7 * shape.heads * shape.head_dim * shape.context**2
    return attention / (attention + 6 * shape.parameters * shape.context)


def busiest_attention(size: int) -> float:
    """Rank 0's attention over its parts of C sequences against one sample's on a rank that splits the batch:
    (4C^2 + 1) / 4C (1 at C = 1)."""
    return (4 * size**2 + 1) / (4 * size) if size > 1 else 1.0


MIN_CHUNK = 64  # tokens of a head or tail chunk below which splitting a sequence further is not proposed


def context_splits(devices: int, batch_size: int, sequence: int, layout: Layout):
    """The sharded layouts with more context ranks than `layout`'s that the memory check's advice tries, each
    with the flags beside `--strategy sharded` that give it: on these devices and on more, every slice of the
    batch whole (as many slices as the batch allows, a power of two) and its sequences split over the rest,
    where each sequence cuts into 2C chunks of at least MIN_CHUNK tokens."""
    for n in (2**k for k in range(0, 17)):
        if n < devices or n % devices:
            continue
        slices = 1
        while slices * 2 <= min(n, batch_size) and batch_size % (slices * 2) == 0 and n % (slices * 2) == 0:
            slices *= 2
        context = n // slices
        if (
            context <= max(1, layout.context)
            or sequence % (2 * context)
            or sequence // (2 * context) < MIN_CHUNK
        ):
            continue
        split = layout_or_none("sharded", n, context_parallel=context)
        if split is not None:
            yield split, [f"--devices {n}"] * (n != devices) + [f"--context-parallel {context}"]


def context_exchange(shape, layout: Layout, samples: float, sequence: int, element: int):
    """What a context rank gathers per attention layer under `layout` (a GPU cluster's step,
    scaling/cluster_time.py): (the context group's ranks, the bytes of the gathered keys and values of `samples`
    whole `sequence`s, `element` bytes each, for the key/value heads of one tensor rank, the span of consecutive
    ranks the group lies within); None without context ranks. Its backward reduce-scatters as many bytes."""
    if layout.context == 1:
        return None
    kv = max(1, shape.kv_heads // layout.tensor) * shape.head_dim
    return layout.context, 2 * samples * sequence * kv * element, layout.stage_ranks


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
    if devices % context:
        return Prediction(
            strategy, devices, 0.0, 0.0, float("inf"), note=f"{context} does not divide {devices}"
        )
    slices = devices // context  # the data degree: a sharded one's FSDP2 ranks, a data one's replicas
    layout = Layout(
        **{"shard" if strategy == "sharded" else "replicate": slices},
        context=context,
        context_in="shard" if strategy == "sharded" else "replicate",
    )
    return with_context(base, work, link, layout, scatter_by_allreduce=scatter_by_allreduce, share=share)


def with_context(
    base: Prediction,
    work: Workload,
    link: Link,
    layout: Layout,
    *,
    scatter_by_allreduce: bool = False,
    share: Optional[float] = None,
) -> Prediction:
    """`base` (the step of the same ranks holding the parameters as `layout` does, each splitting the batch) with
    each sequence split over `layout.context` of them instead: attention's work as a context rank does it, and its
    keys and values around the ring (or gathered). Impossible where the workload has no attention shape."""
    context, devices, shape = layout.context, layout.world_size, work.attention
    if shape is None:
        return replace(
            base, idle=float("inf"), note="no causal attention was seen in the model", layout=layout
        )
    share, replica = attention_share(work) if share is None else share, work.replica_pass(devices)
    # block by block every rank computes 1/C of each sequence's attention pairs, as a rank that splits the batch
    busiest = 1.0 if shape.blockwise else busiest_attention(context)
    compute = base.compute - replica + replica * ((1 - share) + share * busiest)
    sequences = work.batch_size / layout.data_degree  # each rank's slice: its part of each of them
    gathered = sequences * shape.kv_heads * shape.context * shape.head_dim * shape.element_bytes
    collectives = 2 * shape.layers  # the keys and the values of every attention layer
    if shape.blockwise:
        # around the ring in the forward and again in the backward (C - 1 steps of a rank's part each), and the
        # gradients with them, C steps to their rank: C - 1 + C - 1 + C parts of 1/C of the gathered bytes
        parts = 3 * context - 2
        messages = collectives * parts
        moved = collectives * parts / context * gathered
    else:  # the gather, then the gradients' reduce-scatter (twice the bytes where gloo all-reduces for it)
        rings = 1 + (2 if scatter_by_allreduce else 1)
        messages = collectives * rings * (context - 1)
        moved = collectives * rings * (context - 1) / context * gathered
    return replace(
        base,
        layout=layout,
        compute=compute,
        communication=base.communication + moved / link.beta + messages * link.alpha,
        messages=base.messages + messages,
    )


def context_bytes(shape: AttentionShape, size: int) -> Tuple[float, float]:
    """(x, m'): bytes per sample and attention layer that a rank of a context group of `size` keeps beyond
    1/size of one device's, and of them the attention's outputs (the table in the module's docstring). Block by
    block around the ring (`shape.blockwise`) it keeps none more; selective checkpointing keeps each block's
    output and log-sum-exp, of c = T/2C rows each: rank r attends in r + C + 2 blocks (its head chunk over the r
    ranks' before it and its own, its tail chunk over each other rank's part, its own head and its own), the
    busiest (r = C - 1) in 2C + 1, where its share of one device's would be 2: (2C - 1) c rows more."""
    if size == 1:
        return 0.0, 0.0
    if shape.blockwise:
        rows = (2 * size - 1) * shape.context / (2 * size)
        return 0.0, (shape.element_bytes * shape.head_dim + max(4, shape.element_bytes)) * shape.heads * rows
    tokens, local = shape.context, shape.context / size
    padded = tokens + tokens / (2 * size)
    log_sum_exp = max(4, shape.element_bytes)  # float32, or float64 for float64 queries
    width = shape.element_bytes * shape.head_dim
    kept = width * (2 * shape.kv_heads * (tokens - local) + shape.heads * (2 * padded - local))
    outputs = (width + log_sum_exp) * shape.heads * (padded - local)
    return kept + log_sum_exp * shape.heads * (padded - local), outputs


def blockwise_transient(shape: AttentionShape, size: int) -> float:
    """Bytes per sample that one attention layer's backward holds for a while where a context rank attends block
    by block around the ring (`shape.blockwise`; 0 else): a part of T/C tokens is a rank's keys or values, and the
    backward holds another rank's keys and values with the next ones in flight (4 parts), the gradients travelling
    with them and those arriving (4 parts), one block's key and value gradients (2 g c d e, c = T/2C), the queries'
    gradient of a chunk (h c d e) and, where query heads share key/value heads, a diagonal block's keys and values
    repeated for them with their gradients (4 h c d e). One layer at a time: counted once."""
    if size == 1 or not shape.blockwise:
        return 0.0
    part, chunk = shape.context / size, shape.context / (2 * size)
    held = 8 * shape.kv_heads * part + 2 * shape.kv_heads * chunk + shape.heads * chunk
    held += 4 * shape.heads * chunk if shape.heads > shape.kv_heads else 0
    return shape.element_bytes * shape.head_dim * held


def context_part(work, layout):
    """`work` with its per-sample figures those of a context rank's part of each sample under `layout` (its
    context ranks split each sequence): 1/C of one device's (the cuts' too), and the attention's extra
    (`context_bytes`) in every block and in the whole, for the heads a rank of the layout's tensor ranks runs (the
    tensor plan splits the query heads, and the key/value heads where the ranks divide them). Without
    `work.attention` (a model whose attention was not seen) only 1/C: a lower bound."""
    size, tensor = layout.context, layout.tensor
    if size == 1:
        return work
    attention: Optional[AttentionShape] = getattr(work, "attention", None)
    if attention and tensor > 1:
        kv_heads = attention.kv_heads // tensor if attention.kv_heads % tensor == 0 else attention.kv_heads
        attention = replace(attention, heads=max(1, attention.heads // tensor), kv_heads=kv_heads)
    extra, outputs = context_bytes(attention, size) if attention else (0.0, 0.0)
    transient = blockwise_transient(attention, size) if attention else 0.0
    per_block = attention.layers / work.blocks if attention and work.blocks else 0.0
    return replace(
        work,
        # (a transient counted in what is kept outside the blocks is counted once in every mode's peak)
        activation_bytes=work.activation_bytes / size
        + (attention.layers * extra + transient if attention else 0.0),
        block_bytes=work.block_bytes / size + per_block * extra,
        block_input_bytes=work.block_input_bytes / size,
        block_matmul_bytes=work.block_matmul_bytes / size + per_block * outputs,
        boundary_bytes=tuple(cut / size for cut in work.boundary_bytes),
        # block by block, the ring's transient above stands for one whole layer's backward; else 1/C of it
        backward_bytes=0.0 if transient else work.backward_bytes / size,
    )


class ContextCost(DegreeCost):
    """Context parallelism's cost, as the cost model, the memory check and the planner ask it."""

    name, ranks = "context", "context ranks"

    def size(self, layout: Layout) -> int:
        return layout.context

    def priceable(self, layout: Layout) -> bool:
        """Not beside tensor ranks: the cost model has no step for a context rank's share of a split layer."""
        return layout.tensor == 1

    def priced(self, prediction, work, link, layout, *, costs, scatter_by_allreduce=False, share=None):
        """`with_context`, its messages at the strategy's fitted cost per message as the rest of its step."""
        split = with_context(
            prediction, work, link, layout, scatter_by_allreduce=scatter_by_allreduce, share=share
        )
        own = costs.get(prediction.strategy, 0.0) * (split.messages - prediction.messages)
        return replace(split, communication=split.communication + own) if own else split

    def part(self, work, layout: Layout):
        return context_part(work, layout)

    def collectives(self, work, layout, *, samples, sequence, element, width, layers, checkpointing):
        """Per attention layer of a rank's stage, the gather of the keys and values and the reduce-scatter of
        their gradients (`context_exchange`)."""
        shape = work.attention
        exchange = context_exchange(shape, layout, samples, sequence, element) if shape else None
        if not exchange:
            return []
        ranks, nbytes, span = exchange
        return [("all-gather", ranks, nbytes, span, layers), ("reduce-scatter", ranks, nbytes, span, layers)]


CONTEXT = ContextCost()
