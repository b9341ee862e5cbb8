"""Context parallelism's predicted step (planning/context.py) against one worked out by hand."""

import dataclasses
import math

import pytest

from polytrain.planning.activations import AttentionShape
from polytrain.planning.context import attention_share, busiest_attention, context_parallel
from polytrain.planning.costmodel import Link, Workload, data_parallel, sharded

LINK = Link(alpha=1e-3, beta=1e9)  # 1 ms a message, 1 GB/s
# 2 attention layers of 4 heads over 2 key/value heads of width 32, T = 1024, float32; the parameters chosen
# so that attention does as many FLOPs as the matrix products: 6 N T = 2 x 7 x 4 x 32 x 1024^2
SHAPE = AttentionShape(2, 4, 2, 32, 1024, 4, parameters=2 * 7 * 4 * 32 * 1024 / 6)
WORK = Workload(
    compute_seconds=10.1, parameter_bytes=4e6, batch_size=4, update_seconds=0.1, layers=4, attention=SHAPE,
    replica_seconds={2: 5.0, 4: 2.5},
)  # fmt: skip


def test_a_rank_s_attention_counts_its_chunks_zero_rows():
    assert attention_share(WORK) == pytest.approx(0.5)
    # rank 0 of 2: chunks of c = T/4 ending at c and 4c, (1 + 16) c^2 / 2 pairs a sequence against one
    # device's (4c)^2 / 2, for 2 sequences' parts where a C = 1 rank has one sequence: 2 x 17/16
    assert busiest_attention(2) == 2 * 17 / 16
    assert busiest_attention(4) == 4 * (1 + 64) / 64  # chunks of T/8 ending at T/8 and T
    assert busiest_attention(1) == 1.0


def test_sharded_with_sequences_split_over_two_ranks_worked_by_hand():
    base = sharded(WORK, 2, LINK)
    split = context_parallel(WORK, 2, LINK, context=2)
    assert (split.strategy, split.label) == ("sharded", "sharded cp2")
    # matrix products at 1/C (half the pass's 5 s as a C = 1 rank), attention 2 x 17/16 of its half; the
    # update sharded over both ranks as without context parallelism
    assert split.compute == pytest.approx(5.0 * (0.5 + 0.5 * 17 / 8) + 0.1 / 2)
    # per layer the keys and the values (4 sequences x 2 heads x 1024 tokens x 32 x 4 bytes, 1 MiB each)
    # gathered, then their gradients reduce-scattered: 2 layers x 2 tensors x 2 rings x 1 message, half of
    # each tensor moved
    gathered = 4 * 2 * 1024 * 32 * 4
    assert split.messages == base.messages + 8
    assert split.communication == pytest.approx(base.communication + 8 * gathered / 2 / 1e9 + 8 * 1e-3)
    # attention's measured share of the pass in place of its FLOPs'
    measured = context_parallel(WORK, 2, LINK, context=2, share=0.25)
    assert measured.compute == pytest.approx(5.0 * (0.75 + 0.25 * 17 / 8) + 0.1 / 2)
    # gloo reduce-scatters by all-reducing: twice the gradients' bytes and messages
    gloo = context_parallel(WORK, 2, LINK, context=2, scatter_by_allreduce=True)
    base = sharded(WORK, 2, LINK, scatter_by_allreduce=True)
    assert gloo.communication == pytest.approx(base.communication + 12 * gathered / 2 / 1e9 + 12 * 1e-3)


def test_data_parallel_of_two_slices_each_split_over_two_ranks_worked_by_hand():
    base = data_parallel(WORK, 4, LINK)
    split = context_parallel(WORK, 4, LINK, context=2, strategy="data")
    assert (split.strategy, split.label) == ("data", "data cp2")
    # every rank repeats the update; a slice of 2 sequences, 2 tensors of 2 x 2 x 1024 x 32 x 4 bytes a
    # layer
    assert split.compute == pytest.approx(2.5 * (0.5 + 0.5 * 17 / 8) + 0.1)
    gathered = 2 * 2 * 1024 * 32 * 4
    assert split.communication == pytest.approx(base.communication + 8 * gathered / 2 / 1e9 + 8 * 1e-3)
    # four ranks of one group: rank 0's chunks end at T/8 and T; 3 messages a ring, 3/4 of each tensor
    whole = context_parallel(WORK, 4, LINK, context=4)
    assert whole.compute == pytest.approx(2.5 * (0.5 + 0.5 * 65 / 16) + 0.1 / 4)
    gathered = 4 * 2 * 1024 * 32 * 4
    extra = 8 * 3 / 4 * gathered / 1e9 + 24 * 1e-3
    assert whole.communication == pytest.approx(sharded(WORK, 4, LINK).communication + extra)


def test_without_a_split_it_is_the_strategy_and_without_an_attention_impossible():
    assert context_parallel(WORK, 2, LINK, context=1) == sharded(WORK, 2, LINK)
    unseen = context_parallel(dataclasses.replace(WORK, attention=None), 2, LINK, context=2)
    assert math.isinf(unseen.step_seconds) and "attention" in unseen.note


def test_attending_block_by_block_costs_a_rank_one_c_of_the_pairs_and_passes_the_keys_around_the_ring():
    """Block by block (parallel/block_attention.py, CPUs) every rank computes 1/C of each sequence's attention
    pairs, as a rank that splits the batch: its pass is the C = 1 rank's; the keys and values go around the ring
    in the forward and again in the backward, their gradients with them to the rank that holds them."""
    blocks = dataclasses.replace(WORK, attention=dataclasses.replace(SHAPE, blockwise=True))
    base = sharded(blocks, 2, LINK)
    split = context_parallel(blocks, 2, LINK, context=2)
    assert split.compute == pytest.approx(base.compute) == pytest.approx(5.0 + 0.1 / 2)
    gathered = 4 * 2 * 1024 * 32 * 4
    # 2 layers x 2 tensors x 4 steps of the ring (C - 1 forward, C - 1 backward, C for the gradients), each one
    # message of a rank's part: half the gathered bytes
    assert split.messages == base.messages + 16
    assert split.communication == pytest.approx(base.communication + 16 * gathered / 2 / 1e9 + 16 * 1e-3)
    over_gathered = context_parallel(WORK, 2, LINK, context=2)
    assert split.compute < over_gathered.compute  # (17/8 of attention's half there)


def test_the_cost_model_prices_a_layout_with_context_ranks_as_worked_by_hand_above():
    """`predict` takes any layout: on one with context ranks it is the step worked by hand above (sharded and
    data beside them), and with mixtures' experts split over the same ranks both degrees are priced; a layout
    the model cannot cost is an infinite step that says why."""
    from polytrain.parallel.layout import Layout
    from polytrain.parallel.presets import layout_of
    from polytrain.planning.experts import with_experts
    from polytrain.planning.predict import predict

    shards = predict(WORK, "sharded", layout_of("sharded", 4, context_parallel=2), LINK)
    assert shards == context_parallel(WORK, 4, LINK, context=2)
    assert shards.label == "sharded cp2" and shards.compute > sharded(WORK, 4, LINK).compute
    copies = predict(WORK, "data", layout_of("data", 4, context_parallel=2), LINK)
    assert copies == context_parallel(WORK, 4, LINK, context=2, strategy="data")
    assert copies.step_seconds == pytest.approx(
        2.5 * (0.5 + 0.5 * 17 / 8) + 0.1 + data_parallel(WORK, 4, LINK).communication + 8 * 2 * 2 * 1024 * 32 * 4 / 2 / 1e9
        + 8 * 1e-3
    )  # fmt: skip
    moe = dataclasses.replace(WORK, mixtures=2, experts=4, expert_bytes=1e6, routed_bytes=4000.0)
    both = predict(moe, "sharded", Layout(shard=2, context=2, expert=2), LINK)
    assert both == with_experts(context_parallel(moe, 4, LINK, context=2), moe, LINK, 2)
    assert both.label == "sharded cp2 ep2" and both.exchanges == 8
    piped = predict(WORK, "pipeline", Layout(pipeline=2, context=2), LINK)
    assert math.isinf(piped.step_seconds) and "beside context ranks" in piped.note
