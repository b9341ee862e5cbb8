"""Splitting layers into pipeline stages: exact balance, the tie rule, and reading --split."""

import pytest

from polytrain.errors import ConfigError
from polytrain.pipeline.balance import balance_by_time, parse_split, stage_costs, stage_ranges


@pytest.mark.parametrize(
    "costs, stages, points",
    [
        ([1, 1, 1, 1], 2, (2,)),  # (1,): 1,3  (2,): 2,2  (3,): 3,1
        ([3, 1, 1, 1], 2, (1,)),  # (1,): 3,3  (2,): 4,2  (3,): 5,1
        # the last stage holds 9; alone it leaves 36 for two stages (max >= 18), so it is 8+9 = 17, and the
        # only split of 1..7 with both halves <= 17 is 1..5 = 15 | 6+7 = 13
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, (5, 7)),
        # greedy "close a stage before it passes the average 5" cuts 1+2 | 3+4 = 3,7; best is 1+2+3 | 4 = 6,4
        ([1, 2, 3, 4], 2, (3,)),
        ([4, 1, 1, 1, 1, 4], 3, (1, 5)),  # 4 | 1+1+1+1 | 4: every stage 4
        ([7], 1, ()),
        ([1, 5, 2], 1, ()),
        ([1, 5, 2], 3, (1, 2)),
        ([0, 0, 0], 3, (1, 2)),
        ([0.5, 0.25, 0.25], 2, (1,)),  # 0.5 | 0.5
    ],
)
def test_balance_by_time_minimises_the_slowest_stage(costs, stages, points):
    assert balance_by_time(costs, stages=stages) == points


@pytest.mark.parametrize(
    "costs, stages, points",
    [
        # max 5 three ways: (1,2) 5,1,3  (1,3) 5,2,2  (1,4) 5,3,1; sorted slowest first (5,2,2) is smallest
        ([5, 1, 1, 1, 1], 3, (1, 3)),
        # (1,3) 1,2,2  (2,3) 2,1,2  (2,4) 2,2,1 all sort to (2,2,1): the earliest points win
        ([1, 1, 1, 1, 1], 3, (1, 3)),
        ([1, 1, 1], 2, (1,)),  # (1,) 1,2 and (2,) 2,1
        ([0, 0, 0, 0], 2, (1,)),  # every split costs 0,0
        # (1,4) 2,4,4  (2,4) 4,2,4  (2,5) 4,4,2 tie on (4,4,2); (1,4) is earliest
        ([2, 2, 1, 1, 2, 2], 3, (1, 4)),
    ],
)
def test_ties_go_to_the_smallest_sorted_costs_then_the_earliest_points(costs, stages, points):
    assert balance_by_time(costs, stages=stages) == points


def test_sixty_four_layers_in_eight_stages_is_exact():
    """(An exhaustive search of the 64-choose-7 splits would not finish: no timing is needed to see one.)"""
    assert balance_by_time([1.0] * 64, stages=8) == (8, 16, 24, 32, 40, 48, 56)
    # the 57 stands alone (any stage holding it costs >= 57); the 63 ones then split 9 per stage, since any
    # other split of them has a stage above 9 and so a larger second-slowest cost
    assert balance_by_time([1.0] * 63 + [57.0], stages=8) == (9, 18, 27, 36, 45, 54, 63)


def test_more_stages_than_layers_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        balance_by_time([1, 2, 3, 4, 5], stages=6)
    assert str(e.value) == (
        "cannot split 5 layers into 6 stages: use --devices/--pipeline-stages of at most 5, "
        "or a model with more layers"
    )


@pytest.mark.parametrize(
    "costs, stages", [([1, -1], 2), ([1, float("nan")], 1), ([float("inf")], 1), ([1, 2], 0)]
)
def test_bad_costs_and_stage_counts_are_internal_errors(costs, stages):
    with pytest.raises(ValueError):
        balance_by_time(costs, stages=stages)


def test_stage_costs_and_ranges():
    assert stage_costs([1, 2, 3, 4, 5, 6, 7, 8, 9], (5, 7)) == (15.0, 13.0, 17.0)
    assert stage_costs([0.1, 0.2, 0.3], ()) == (0.6,)
    assert stage_ranges((4, 7), layers=10) == (range(0, 4), range(4, 7), range(7, 10))
    assert stage_ranges((), layers=3) == (range(0, 3),)
    for points in [(0,), (4, 4), (7, 4), (10,)]:
        with pytest.raises(ValueError):
            stage_ranges(points, layers=10)


@pytest.mark.parametrize(
    "text, layers, stages, points",
    [
        ("4,7", 10, 3, (4, 7)),
        (" 4 , 7 ", 10, 3, (4, 7)),
        ("1,9", 10, 3, (1, 9)),
        ("5", 6, 2, (5,)),
        ("", 10, 1, ()),
    ],
)
def test_parse_split(text, layers, stages, points):
    assert parse_split(text, layers=layers, stages=stages) == points


@pytest.mark.parametrize(
    "text, stages, message",
    [
        ("a,b", 3, "--split must be 'auto' or increasing layer indices like 4,7; got 'a,b'"),
        ("4,,7", 3, "--split must be 'auto' or increasing layer indices like 4,7; got '4,,7'"),
        ("auto", 3, "--split must be 'auto' or increasing layer indices like 4,7; got 'auto'"),
        ("4.5,7", 3, "--split must be 'auto' or increasing layer indices like 4,7; got '4.5,7'"),
        (
            "4",
            3,
            "--split '4' gives 1 point; a pipeline of 3 stages needs 2: the first layer of each stage after "
            "the first",
        ),
        (
            "4,7",
            1,
            "--split '4,7' gives 2 points; a pipeline of 1 stage needs 0: the first layer of each stage "
            "after the first",
        ),
        (
            "",
            2,
            "--split '' gives 0 points; a pipeline of 2 stages needs 1: the first layer of each stage after "
            "the first",
        ),
        (
            "0,7",
            3,
            "--split point 0 is outside 1..9: the model has 10 layers, and every stage needs at least one",
        ),
        (
            "4,10",
            3,
            "--split point 10 is outside 1..9: the model has 10 layers, and every stage needs at least one",
        ),
        (
            "-1,7",
            3,
            "--split point -1 is outside 1..9: the model has 10 layers, and every stage needs at least one",
        ),
        ("4,4", 3, "--split repeats layer 4: give each point once, so every stage has a layer"),
        ("4,7,4", 4, "--split repeats layer 4: give each point once, so every stage has a layer"),
        ("7,4", 3, "--split points must increase: 4 comes after 7; write them in order, like 4,7"),
    ],
)
def test_parse_split_errors_name_the_flag_and_the_fix_in_one_line(text, stages, message):
    with pytest.raises(ConfigError) as e:
        parse_split(text, layers=10, stages=stages)
    assert str(e.value) == message
