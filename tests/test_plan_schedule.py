"""Pipeline schedule tables: orders per rank, the tick-by-tick simulation, bubbles, and rendering."""

import pytest

from polytrain.errors import ConfigError
from polytrain.pipeline.schedule import (
    Action,
    bubble_fraction,
    rank_orders,
    render,
    simulate,
    theoretical_bubble,
)


def table_of(kind, *, p, m, v=1, backward_ticks=1):
    orders = rank_orders(kind, ranks=p, microbatches=m, stages_per_rank=v)
    return simulate(orders, ranks=p, stages=p * v, backward_ticks=backward_ticks)


def labels(table):
    return [" ".join(str(a) if a is not None else "." for a in row) for row in table]


def test_action_labels():
    assert str(Action("F", 0, 3)) == "F0"
    assert str(Action("B", 12, 0)) == "B12"
    assert str(Action("F", 1, 2, show_stage=True)) == "F1.s2"
    assert Action("F", 1, 2, show_stage=True) == Action("F", 1, 2)
    with pytest.raises(ValueError):
        Action("W", 0, 0)


def test_gpipe_two_ranks_two_microbatches():
    assert labels(table_of("gpipe", p=2, m=2)) == [
        "F0 F1 . . B0 B1",
        ". F0 F1 B0 B1 .",
    ]


def test_gpipe_three_ranks_two_microbatches():
    assert labels(table_of("gpipe", p=3, m=2)) == [
        "F0 F1 . . . . B0 B1",
        ". F0 F1 . . B0 B1 .",
        ". . F0 F1 B0 B1 . .",
    ]


def test_two_tick_backwards_fill_two_entries():
    assert labels(table_of("gpipe", p=2, m=2, backward_ticks=2)) == [
        "F0 F1 . . . B0 B0 B1 B1",
        ". F0 F1 B0 B0 B1 B1 . .",
    ]
    # rank 0 cannot start B1 in tick 6: rank 1's B1 ends in tick 6
    assert labels(table_of("1f1b", p=2, m=2, backward_ticks=2)) == [
        "F0 F1 . . B0 B0 . B1 B1",
        ". F0 B0 B0 F1 B1 B1 . .",
    ]


def test_1f1b_orders_warm_up_then_alternate():
    orders = rank_orders("1f1b", ranks=3, microbatches=4)
    assert [" ".join(map(str, order)) for order in orders] == [
        "F0 F1 F2 B0 F3 B1 B2 B3",  # 2 warm-up forwards
        "F0 F1 B0 F2 B1 F3 B2 B3",  # 1
        "F0 B0 F1 B1 F2 B2 F3 B3",  # 0
    ]
    assert [a.stage for a in orders[1]] == [1] * 8


def test_1f1b_two_ranks_four_microbatches():
    assert labels(table_of("1f1b", p=2, m=4)) == [
        "F0 F1 . B0 F2 B1 F3 B2 . B3",
        ". F0 B0 F1 B1 F2 B2 F3 B3 .",
    ]


def test_1f1b_three_ranks_four_microbatches():
    assert labels(table_of("1f1b", p=3, m=4)) == [
        "F0 F1 F2 . . B0 F3 B1 . B2 . B3",
        ". F0 F1 . B0 F2 B1 F3 B2 . B3 .",
        ". . F0 B0 F1 B1 F2 B2 F3 B3 . .",
    ]


def test_1f1b_with_fewer_microbatches_than_ranks():
    # warm-up is capped at m: rank 0 runs both forwards, then both backwards
    assert labels(table_of("1f1b", p=3, m=2)) == [
        "F0 F1 . . . B0 . B1",
        ". F0 F1 . B0 . B1 .",
        ". . F0 B0 F1 B1 . .",
    ]


def test_interleaved_orders_follow_megatron():
    orders = rank_orders("interleaved-1f1b", ranks=2, microbatches=4, stages_per_rank=2)
    assert [" ".join(map(str, order)) for order in orders] == [
        # warm-up (2-1)*2 + 2*(2-0-1) = 4
        "F0.s0 F1.s0 F0.s2 F1.s2 F2.s0 B0.s2 F3.s0 B1.s2 F2.s2 B0.s0 F3.s2 B1.s0 B2.s2 B3.s2 B2.s0 B3.s0",
        # warm-up (2-1)*2 + 2*(2-1-1) = 2
        "F0.s1 F1.s1 F0.s3 B0.s3 F1.s3 B1.s3 F2.s1 B0.s1 F3.s1 B1.s1 F2.s3 B2.s3 F3.s3 B3.s3 B2.s1 B3.s1",
    ]


@pytest.mark.parametrize(
    "p, v, m, before_first_backward",
    [
        # warm-up (v-1)*p + 2*(p-r-1) capped at m*v; the steady state then opens with one more forward
        (4, 2, 8, [10 + 1, 8 + 1, 6 + 1, 4 + 1]),
        (2, 2, 2, [4, 2 + 1]),  # rank 0: warm-up 4 is all m*v = 4 forwards
        (2, 3, 2, [6, 4 + 1]),  # rank 0: 4+2 = 6 = m*v
        (3, 2, 3, [6, 5 + 1, 3 + 1]),  # rank 0: 3+4 = 7, capped at 6
    ],
)
def test_interleaved_warm_up_counts(p, v, m, before_first_backward):
    orders = rank_orders("interleaved-1f1b", ranks=p, microbatches=m, stages_per_rank=v)
    counted = [next(i for i, a in enumerate(order) if a.kind == "B") for order in orders]
    assert counted == before_first_backward


def test_interleaved_two_ranks_two_chunks_two_microbatches():
    assert labels(table_of("interleaved-1f1b", p=2, m=2, v=2)) == [
        "F0.s0 F1.s0 F0.s2 F1.s2 . B0.s2 . B1.s2 B0.s0 B1.s0",
        ". F0.s1 F1.s1 F0.s3 B0.s3 F1.s3 B1.s3 B0.s1 B1.s1 .",
    ]


def test_interleaved_two_ranks_two_chunks_four_microbatches():
    assert labels(table_of("interleaved-1f1b", p=2, m=4, v=2)) == [
        "F0.s0 F1.s0 F0.s2 F1.s2 F2.s0 B0.s2 F3.s0 B1.s2 F2.s2 B0.s0 F3.s2 B1.s0 . B2.s2 . B3.s2 B2.s0 B3.s0",
        ". F0.s1 F1.s1 F0.s3 B0.s3 F1.s3 B1.s3 F2.s1 B0.s1 F3.s1 B1.s1 F2.s3 B2.s3 F3.s3 B3.s3 B2.s1 B3.s1 .",
    ]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_simulated_bubble_matches_the_formula(kind):
    for p in range(1, 5):
        for m in range(1, 9):
            table = table_of(kind, p=p, m=m)
            assert len(table) == p and {len(row) for row in table} == {2 * (m + p - 1)}
            assert bubble_fraction(table) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
            assert theoretical_bubble(p, m) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


def test_interleaving_shrinks_the_bubble():
    for p in range(2, 5):
        for m in range(p, 9, p):
            plain = bubble_fraction(table_of("1f1b", p=p, m=m))
            for v in (2, 3):
                assert bubble_fraction(table_of("interleaved-1f1b", p=p, m=m, v=v)) < plain, (p, m, v)


def test_bubble_fraction_counts_idle_entries():
    assert bubble_fraction([[Action("F", 0, 0), None], [None, None]]) == 0.75
    assert bubble_fraction([]) == 0.0
    assert theoretical_bubble(1, 5) == 0.0
    assert theoretical_bubble(4, 1) == 0.75


def test_a_bad_order_deadlocks():
    # rank 0 wants the backward of a microbatch whose forward it has not run yet
    orders = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(RuntimeError, match="deadlocks at tick 0"):
        simulate(orders, ranks=2, stages=2)
    # an odd order that is slow but not stuck: rank 1 waits for rank 0's F0, which comes second
    orders = [[Action("F", 1, 0), Action("F", 0, 0)], [Action("F", 0, 1), Action("F", 1, 1)]]
    assert labels(simulate(orders, ranks=2, stages=2)) == ["F1 F0 . .", ". . F0 F1"]
    # rank 0 wants B1 of a microbatch no one ever runs forward: it is stuck once rank 1 is done
    orders = [[Action("F", 0, 0), Action("B", 1, 0)], [Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(RuntimeError, match="deadlocks at tick 3"):
        simulate(orders, ranks=2, stages=2)


def test_actions_on_the_wrong_rank_are_refused():
    with pytest.raises(ValueError):
        simulate([[Action("F", 0, 1)], []], ranks=2, stages=2)


@pytest.mark.parametrize(
    "m, message",
    [
        (
            3,
            "--microbatches 3 must be a multiple of the 2 pipeline ranks for the interleaved-1f1b schedule: "
            "use --microbatches 2 or 4",
        ),
        (
            1,
            "--microbatches 1 must be a multiple of the 2 pipeline ranks for the interleaved-1f1b schedule: "
            "use --microbatches 2",
        ),
    ],
)
def test_interleaved_needs_microbatches_a_multiple_of_ranks(m, message):
    with pytest.raises(ConfigError) as e:
        rank_orders("interleaved-1f1b", ranks=2, microbatches=m, stages_per_rank=2)
    assert str(e.value) == message


def test_unknown_schedule_and_bad_counts():
    with pytest.raises(ConfigError) as e:
        rank_orders("zero-bubble", ranks=2, microbatches=2)
    assert (
        str(e.value) == "--pipeline-schedule must be one of gpipe, 1f1b, interleaved-1f1b; got 'zero-bubble'"
    )
    with pytest.raises(ValueError):
        rank_orders("1f1b", ranks=2, microbatches=2, stages_per_rank=2)
    with pytest.raises(ValueError):
        rank_orders("gpipe", ranks=0, microbatches=2)


def test_render():
    assert render(table_of("gpipe", p=2, m=2)) == "rank 0: F0 F1 .  .  B0 B1\nrank 1: .  F0 F1 B0 B1 ."
    assert render(table_of("interleaved-1f1b", p=2, m=2, v=2)).splitlines()[1] == (
        "rank 1: .     F0.s1 F1.s1 F0.s3 B0.s3 F1.s3 B1.s3 B0.s1 B1.s1 ."
    )
