"""A degree beside the ranks holding the parameters is priced by its own module (planning/degree_cost.py
`DegreeCost`, listed in planning/beside.py `BESIDE`): the cost model, the memory check and the planner ask it and
nothing else. A stand-in for the context degree, dearer by known amounts in each place, changes each of them by
exactly those amounts."""

from dataclasses import replace

import pytest
from test_plan_context import LINK, WORK

import polytrain
from polytrain.parallel.layout import Layout
from polytrain.planning import beside
from polytrain.planning.context import ContextCost, context_parallel
from polytrain.planning.memory import memory_per_rank
from polytrain.planning.predict import predict
from polytrain.scaling.cluster_time import _link, _ring
from polytrain.scaling.gpus import GPUS

SPLIT = Layout(shard=2, context=2)  # four ranks of FSDP2, each sequence over two of them
EXTRA = ("all-reduce", 2, 8e6, 2, 3.0)  # three all-reduces of 8 MB over two neighbouring ranks, per step


class Dearer(ContextCost):
    """The context degree, with one second more per step, 1000 bytes more per rank and three collectives more
    on a cluster, under a name of its own."""

    name, ranks = "dearer", "dearer ranks"

    def priced(self, prediction, *args, **options):
        split = super().priced(prediction, *args, **options)
        return replace(split, communication=split.communication + 1.0)

    def states_saved(self, work, layout, *, per_weight, sharded):
        return -1000.0

    def collectives(self, *args, **options):
        return super().collectives(*args, **options) + [EXTRA]


def test_the_cost_model_prices_a_context_rank_s_messages_at_its_strategy_s_fitted_cost_per_message():
    alone = predict(WORK, "sharded", SPLIT, LINK)
    assert alone == context_parallel(WORK, 4, LINK, context=2)
    fitted = predict(WORK, "sharded", SPLIT, LINK, message_costs={"sharded": 0.01})
    assert fitted.messages == alone.messages
    assert fitted.communication == pytest.approx(alone.communication + 0.01 * alone.messages)


def test_a_degree_beside_is_asked_by_the_cost_model_the_memory_check_and_the_planner_alone(monkeypatch):
    asked = dict(
        devices=4, batch_size=8, layout="dp_shard=2,cp=2", activation_checkpointing="none", vocab_size=96,
        layers=2, heads=4, kv_heads=2, width=64, ffn_width=128, context=16,
    )  # fmt: skip

    def asking():
        return (
            predict(WORK, "sharded", SPLIT, LINK),
            memory_per_rank(WORK, SPLIT),
            polytrain.plan("llama", **asked)[0],
            (predict(WORK, "sharded", Layout(shard=4), LINK), memory_per_rank(WORK, Layout(shard=4))),
        )

    before = asking()
    monkeypatch.setattr(beside, "BESIDE", (Dearer(), *beside.BESIDE[1:]))
    after = asking()
    assert after[0].communication == pytest.approx(before[0].communication + 1.0)
    assert after[0].compute == before[0].compute
    assert after[1] == pytest.approx(before[1] + 1000.0)
    exposed = before[2]["exposed_communication_seconds"]
    request = type("Cluster", (), dict(gpus_per_node=8, gpu=GPUS["h100"]))
    extra = EXTRA[4] * _ring(*EXTRA[:3], *_link(request, EXTRA[3]))
    assert "context" in exposed and "dearer" not in exposed
    assert after[2]["exposed_communication_seconds"]["dearer"] == pytest.approx(exposed["context"] + extra)
    assert "context" not in after[2]["exposed_communication_seconds"]
    assert after[3] == before[3]  # (a layout without context ranks: as before)
