"""The built-in GPT's and Llama's tensor plans run their norms sequence-parallel where the context splits evenly
(`polytrain verify` of the GPT on 2 ranks and on a 2 x 2 mesh is in test_tensor.py, of the Llama in
test_llama.py and the matrix)."""

from polytrain.config import TrainConfig
from polytrain.models import build_model
from polytrain.models.gpt import GPT
from polytrain.models.llama import Llama
from polytrain.parallel.layout import Layout
from polytrain.strategies.tensor import plan_for


def test_the_gpt_plan_cuts_the_sequence_where_the_context_splits_evenly():
    config = TrainConfig(strategy="tensor", devices=2)
    plan = plan_for(config, GPT(11, context=8, layers=1, width=16, heads=2), devices=2)
    assert plan.sequence_parallel and "norms sequence-parallel" in plan.describe(Layout(tensor=2))
    uneven = plan_for(config, GPT(11, context=7, layers=1, width=16, heads=2), devices=2)
    assert not uneven.sequence_parallel and "sequence" not in uneven.describe(Layout(tensor=2))
    assert not plan_for(config, build_model("mlp", (1, 4, 4), 3), devices=2).sequence_parallel


def test_the_llama_plan_cuts_the_sequence_unless_a_router_would_see_parts_of_it():
    config = TrainConfig(strategy="tensor", devices=2, model="llama")
    llama = dict(layers=2, width=32, heads=4, kv_heads=2, ffn_width=64)
    plan = plan_for(config, Llama(11, context=8, **llama), devices=2)
    assert plan.sequence_parallel and "norms sequence-parallel" in plan.describe(Layout(tensor=2))
    assert not plan_for(config, Llama(11, context=7, **llama), devices=2).sequence_parallel
    mixture = Llama(11, context=8, experts=4, **llama)  # its load-balancing loss is not a sum over tokens
    assert not plan_for(config, mixture, devices=2).sequence_parallel
