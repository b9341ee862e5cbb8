"""The cost model against step times worked out by hand."""

import dataclasses

import pytest

from polytrain.parallel.layout import Layout
from polytrain.parallel.presets import plain_layout
from polytrain.planning.costmodel import (
    Link,
    Workload,
    bubble,
    choose,
    data_parallel,
    fit_message_cost,
    parameter_server,
    pipeline,
    ring_allreduce,
    sharded,
    with_message_cost,
)
from polytrain.planning.memory import memory_per_rank
from polytrain.planning.predict import predict_all

LINK = Link(alpha=1e-4, beta=1e9)  # 0.1 ms per message, 1 GB/s
WORK = Workload(
    compute_seconds=0.1,
    parameter_bytes=4e6,
    batch_size=64,
    update_seconds=0.01,
    layers=4,
    boundary_bytes=(1000.0, 4000.0, 500.0),
)


def test_ring_allreduce_is_two_n_minus_one_over_n_bytes_and_two_n_minus_one_messages():
    assert ring_allreduce(1, 4e6, LINK) == 0.0
    # n = 4: 2 * 3/4 * 4e6 / 1e9 = 6 ms, plus 2 * 3 * 0.1 ms = 0.6 ms
    assert ring_allreduce(4, 4e6, LINK) == pytest.approx(0.0066)


def test_data_parallel_splits_the_passes_and_repeats_the_update():
    p = data_parallel(WORK, 4, LINK)
    assert p.compute == pytest.approx(0.09 / 4 + 0.01)  # 32.5 ms
    assert p.communication == pytest.approx(0.0066)
    assert p.step_seconds == pytest.approx(0.0391)
    assert p.speedup(0.1) == pytest.approx(0.1 / 0.0391)


def test_parameter_server_link_carries_every_other_ranks_push_and_pull():
    p = parameter_server(WORK, 4, LINK)
    # 2 * 3 * 4e6 / 1e9 = 24 ms, plus 2 * 3 * 0.1 ms
    assert p.communication == pytest.approx(0.0246)
    assert p.compute == pytest.approx(0.0225 + 0.01)
    two = parameter_server(WORK, 4, LINK, servers=2)
    assert two.communication == pytest.approx(0.012 + 0.0006)
    assert two.compute == pytest.approx(0.0225 + 0.005)


def test_sharded_pays_three_collectives_per_layer_and_splits_the_update():
    p = sharded(WORK, 4, LINK)
    # 3 * 3/4 * 4 ms = 9 ms; 3 * 3 * 0.1 ms * 4 layers = 3.6 ms
    assert p.communication == pytest.approx(0.0126)
    assert p.compute == pytest.approx(0.09 / 4 + 0.01 / 4)


def test_sharded_on_a_backend_that_reduce_scatters_by_all_reducing_pays_a_whole_all_reduce_for_the_gradients():
    p = sharded(WORK, 4, LINK, scatter_by_allreduce=True)
    # two all-gathers (3/4 * 4 ms and 3 messages each) and an all-reduce (2 * 3/4 * 4 ms, 6 messages) per
    # step: 12 ms; (3 + 3 + 6) * 0.1 ms * 4 layers = 4.8 ms
    assert p.communication == pytest.approx(0.0168)
    assert p.compute == sharded(WORK, 4, LINK).compute
    gloo = predict_all(WORK, 4, LINK, scatter_by_allreduce=True)
    assert gloo["sharded"] == p and gloo["data"] == predict_all(WORK, 4, LINK)["data"]


def test_hybrid_sharding_gathers_within_a_copy_and_all_reduces_each_shard_across_the_copies():
    p = sharded(WORK, 4, LINK, replicas=2)  # 2 copies of 2 shards
    # within a copy: 3 * 1/2 * 4 ms = 6 ms; across: 2 * 1/2 * (4 MB / 2) / 1 GB/s = 2 ms;
    # (3 * 1 + 2 * 1) messages * 4 layers * 0.1 ms = 2 ms
    assert (p.strategy, p.layout, p.label) == ("sharded", Layout(replicate=2, shard=2), "sharded 2x2")
    assert p.messages == 20
    assert p.communication == pytest.approx(0.010)
    assert p.compute == pytest.approx(0.09 / 4 + 0.01 / 2)  # the update split over a copy's 2 shards
    priced = predict_all(WORK, 4, LINK, message_costs={"sharded": 1e-3})  # FSDP2's cost per message
    assert priced["sharded 2x2"].communication == pytest.approx(0.010 + 20 * 1e-3)
    # a half of weights, gradients and momentum, a layer gathered whole (the model: no layer sizes known), and
    # the activations at the cuts of a quarter of the batch
    expected = 4e6 * 3 / 2 + 4e6 + 5500 * 64 / 4
    assert memory_per_rank(WORK, p.layout) == pytest.approx(expected)
    eight = predict_all(WORK, 8, LINK)  # shard groups of 2 and 4 ranks; 8 is `sharded`
    assert [name for name in eight if name.startswith("sharded")] == ["sharded", "sharded 4x2", "sharded 2x4"]
    assert "sharded 2x4" not in predict_all(WORK, 8, LINK, meshes=False)


def test_pipeline_step_is_m_plus_p_minus_one_slots():
    p = pipeline(WORK, 2, LINK, microbatches=4)
    slot = 0.09 / 8  # passes split over 2 stages and 4 micro-batches
    transfer = 2 * (1e-4 + 4000 * 16 / 1e9)  # forward + backward, 16 samples, widest cut
    assert p.compute == pytest.approx(4 * slot + 0.005)
    assert p.idle == pytest.approx(slot)
    assert p.communication == pytest.approx(5 * transfer)
    assert p.idle / (p.compute - 0.005 + p.idle) == pytest.approx(bubble(2, 4)) == pytest.approx(0.2)


def test_a_pipeline_with_more_stages_than_cuts_is_impossible_and_says_why():
    p = pipeline(WORK, 5, LINK, microbatches=4)
    assert p.step_seconds == float("inf") and "5 stages need 4 cuts; the model has 3" in p.note


def test_choose_the_fastest_that_fits():
    predictions = predict_all(WORK, 4, LINK, meshes=False)
    assert set(predictions) == {"data", "parameter-server", "sharded", "pipeline"}
    fastest = min(predictions.values(), key=lambda p: p.step_seconds)
    assert choose(predictions) is fastest
    assert choose(predictions, fits={"parameter-server": True}).strategy == "parameter-server"
    assert choose(predictions, fits={}) is None
    assert predict_all(WORK, 1, LINK)["single"].step_seconds == 0.1


def test_link_fit_recovers_alpha_and_beta():
    sizes = [1e3, 1e5, 1e6, 1e7]
    link = Link.fit(sizes, [LINK.seconds(s) for s in sizes])
    assert link.alpha == pytest.approx(1e-4) and link.beta == pytest.approx(1e9)
    with pytest.raises(ValueError):
        Link.fit([5.0, 5.0], [1.0, 2.0])


def test_strategies_that_train_contiguous_are_predicted_from_the_plain_measurement():
    from dataclasses import replace

    plain = replace(WORK, compute_seconds=0.15, update_seconds=0.01)  # default memory format: slower passes
    work = replace(WORK, plain=plain)
    mixed = predict_all(work, 2, LINK, contiguous=("sharded", "pipeline"))
    alike = predict_all(WORK, 2, LINK)
    assert mixed["data"] == alike["data"] and mixed["parameter-server"] == alike["parameter-server"]
    assert mixed["sharded"] == sharded(plain, 2, LINK)
    assert mixed["sharded"].compute == pytest.approx(0.14 / 2 + 0.01 / 2)
    assert mixed["pipeline"] == pipeline(plain, 2, LINK, microbatches=4)
    # no plain measurement (a model without convolutions): every strategy uses the one there is
    assert predict_all(WORK, 2, LINK, contiguous=("sharded",)) == alike
    assert predict_all(work, 1, LINK, contiguous=("single",))["single"].step_seconds == 0.15


def test_each_strategy_counts_the_messages_of_its_step():
    assert data_parallel(WORK, 4, LINK).messages == 6  # ring all-reduce: 2 (n-1)
    assert parameter_server(WORK, 4, LINK).messages == 6  # 3 pushes in, 3 pulls out
    assert sharded(WORK, 4, LINK).messages == 3 * 3 * 4  # 3 rings of n-1 per layer, 4 layers
    assert sharded(WORK, 4, LINK, scatter_by_allreduce=True).messages == 4 * 3 * 4
    assert (
        pipeline(WORK, 2, LINK, microbatches=4).messages == 2 * 5
    )  # forward and backward in each of 5 slots
    assert data_parallel(WORK, 1, LINK).messages == 0 and sharded(WORK, 1, LINK).messages == 0
    # alpha is paid once per message
    for p in (data_parallel(WORK, 4, LINK), sharded(WORK, 4, LINK)):
        slower = {"data": data_parallel, "sharded": sharded}[p.strategy](WORK, 4, Link(alpha=2e-4, beta=1e9))
        assert slower.communication - p.communication == pytest.approx(p.messages * 1e-4)


def test_a_cost_per_message_fitted_to_one_step_predicts_another():
    two = sharded(WORK, 2, LINK)  # 3 * 1/2 * 4 ms + 3 * 0.1 ms * 4 layers = 7.2 ms; 12 messages
    assert two.communication == pytest.approx(0.0072) and two.messages == 12
    measured = two.step_seconds + 12 * 1.5e-3  # the step took 1.5 ms more per message than the link says
    cost = fit_message_cost(measured, two)
    assert cost == pytest.approx(1.5e-3)
    assert with_message_cost(two, cost).step_seconds == pytest.approx(measured)
    four = predict_all(WORK, 4, LINK, message_costs={"sharded": cost})
    assert four["sharded"].communication == pytest.approx(0.0126 + 36 * 1.5e-3)
    assert four["data"] == predict_all(WORK, 4, LINK)["data"]  # no cost given: unchanged
    assert fit_message_cost(two.step_seconds / 2, two) == 0.0  # never negative
    assert fit_message_cost(1.0, predict_all(WORK, 1, LINK)["single"]) == 0.0  # no messages, nothing to fit


# a mixture-of-experts model: 2 mixtures of 8 experts holding 3 of its 4 MB, each sending 4 KB per sample in an
# all-to-all (a sample's tokens x K x width x 4 bytes)
MOE = Workload(
    compute_seconds=0.1,
    parameter_bytes=4e6,
    batch_size=64,
    update_seconds=0.01,
    layers=4,
    mixtures=2,
    experts=8,
    expert_bytes=3e6,
    routed_bytes=4000.0,
)


def with_experts(work: Workload, devices: int, **options) -> dict:
    """Every prediction at `devices`, each also with a mixture's experts split where a layout can lend ranks."""
    return predict_all(work, devices, LINK, **options)


def test_experts_split_over_ddp_copies_pay_their_all_to_alls_and_split_their_update():
    plain, split = data_parallel(MOE, 4, LINK), with_experts(MOE, 4)["data ep2"]
    assert split.layout == Layout(replicate=4, expert=2)
    # a rank's 16 samples x 4 KB = 64 KB per all-to-all, half of it leaving the rank (32 us) in one message to
    # each other rank of the group (0.1 ms), 4 per mixture
    assert split.communication == pytest.approx(plain.communication + 8 * (0.5 * 64e3 / 1e9 + 1e-4))
    assert (
        split.messages == plain.messages and split.exchanges == 8
    )  # (priced per call, not as DDP's messages)
    # the experts' 3/4 of the 10 ms update split over 2 copies
    assert split.compute == pytest.approx(plain.compute - 0.01 * 0.75 * 0.5)
    assert split.label == "data ep2" and set(with_experts(MOE, 4)) >= {"data ep4", "sharded ep2"}
    assert not any(
        " ep" in name for name in predict_all(WORK, 4, LINK)
    )  # a dense model has no experts to split


def test_experts_split_over_fsdp2_shards_gather_only_a_rank_s_experts_over_the_ranks_that_hold_them():
    plain, split = sharded(MOE, 4, LINK), with_experts(MOE, 4)["sharded ep2"]
    # 3 rings moved 3/4 of the experts' 3 MB; now 1/2 of their half: 3 x (3/4 - 1/4) x 3 MB / 1 GB/s = 4.5 ms less
    exchanges = 8 * (0.5 * 64e3 / 1e9 + 1e-4)
    assert split.communication == pytest.approx(plain.communication - 0.0045 + exchanges)
    assert split.compute == pytest.approx(plain.compute)  # FSDP2 split the update already


def test_the_memory_check_holds_a_pth_of_the_experts_on_each_ddp_copy():
    whole = memory_per_rank(MOE, plain_layout("data", 4), optimizer_slots=2)
    split = memory_per_rank(MOE, Layout(replicate=4, expert=2), optimizer_slots=2)
    # weights, gradients and 2 slots of state: 4 bytes per weight byte, of half the experts' 3 MB
    assert whole - split == pytest.approx(4 * 3e6 / 2)
    sharded_split = memory_per_rank(MOE, Layout(shard=4, expert=2), optimizer_slots=2)
    assert sharded_split == memory_per_rank(
        MOE, plain_layout("sharded", 4), optimizer_slots=2
    )  # FSDP2 shards them anyway


def test_auto_trains_a_layout_with_experts_by_its_flags():
    from polytrain.parallel.presets import flags_of, layout_of

    layout = Layout(replicate=4, expert=2)
    assert flags_of("data", layout) == {"expert_parallel": 2}
    assert layout_of("data", 4, **flags_of("data", layout)) == layout


def test_auto_splits_the_experts_over_ddp_copies_where_whole_copies_do_not_fit():
    from polytrain.scaling.auto import pick

    # a copy holds 16 MB with every expert (weights, gradients, AdamW's 2 slots), 10 with half, 7 with a quarter;
    # FSDP2's shards 8
    best, predictions, fits = pick(
        MOE, LINK, devices=4, device_type="cuda", refused={}, available=7.5e6, optimizer="adamw"
    )
    assert not fits["data"] and not fits["data ep2"] and not fits["sharded"] and fits["data ep4"]
    assert best.label == "data ep4" and best.layout == Layout(replicate=4, expert=4)


def test_an_all_to_all_s_cost_per_call_fitted_to_one_row_prices_the_layouts_with_experts():
    from polytrain.planning.experts import ALL_TO_ALL, fit_exchange_cost

    split = with_experts(MOE, 4)["data ep2"]
    assert split.exchanges == 8  # 2 mixtures x 4 all-to-alls
    # measured 4 ms slower than predicted: 0.5 ms per call
    cost = fit_exchange_cost(split.step_seconds + 0.004, split)
    assert cost == pytest.approx(0.0005)
    assert with_experts(MOE, 4, message_costs={ALL_TO_ALL: cost})["data ep2"].step_seconds == pytest.approx(
        split.step_seconds + 0.004
    )
    four = with_experts(MOE, 4, message_costs={ALL_TO_ALL: cost})
    assert four["data ep4"].communication == pytest.approx(
        with_experts(MOE, 4)["data ep4"].communication + 0.004
    )
    assert four["data"] == with_experts(MOE, 4)["data"]  # (whole experts: no all-to-all)


def test_the_all_to_all_moves_the_busiest_expert_rank_s_tokens():
    from polytrain.planning.experts import busiest_share

    # 8 experts, the first twice as busy: over 2 ranks 5 of 9 pairs on rank 0 against a mean of 4.5
    counts = (2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    assert busiest_share(counts, 2) == pytest.approx(5 / 4.5) and busiest_share(counts, 8) == pytest.approx(
        2 / 1.125
    )
    assert busiest_share((), 2) == 1.0  # (unknown: even)
    uneven = dataclasses.replace(MOE, routed_counts=counts)
    even, busy = with_experts(MOE, 4)["data ep2"], with_experts(uneven, 4)["data ep2"]
    moved = 8 * 0.5 * 64e3 / 1e9  # the even routing's bytes over the link
    assert busy.communication - even.communication == pytest.approx(moved * (5 / 4.5 - 1))


def test_every_layout_weighed_is_priced_from_its_degrees_and_printed_from_them():
    """`predict_all` is `predict` on each layout `weighed_layouts` gives, by the label made from it; the steps of
    the plain layouts are the strategies' worked by hand above."""
    from polytrain.parallel.presets import label
    from polytrain.planning.predict import predict, weighed_layouts

    weighed = list(weighed_layouts(MOE, 4))
    assert [label(s, layout) for s, layout in weighed] == [
        "data", "parameter-server", "sharded", "pipeline", "sharded 2x2", "data ep2", "data ep4", "sharded ep2",
        "sharded ep4", "sharded 2x2 ep2",
    ]  # fmt: skip
    every = predict_all(MOE, 4, LINK)
    assert list(every) == [label(s, layout) for s, layout in weighed]
    for strategy, layout in weighed:
        assert every[label(strategy, layout)] == predict(MOE, strategy, layout, LINK)
    assert every["data"] == data_parallel(MOE, 4, LINK)
    assert every["sharded 2x2"] == sharded(MOE, 4, LINK, replicas=2)
    assert every["parameter-server"] == parameter_server(MOE, 4, LINK)
    assert predict(MOE, "data", Layout(), LINK).step_seconds == MOE.compute_seconds
