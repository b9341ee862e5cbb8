"""Tensor parallelism in the cost model, each term against arithmetic written out by hand; and what the model
reads from a real model and its plan (sizes counted by hand)."""

from dataclasses import replace

import pytest
import torch

from polytrain.models import build_model
from polytrain.models.gpt import GPT
from polytrain.objective import Objective
from polytrain.parallel.layout import Layout
from polytrain.parallel.presets import plain_layout
from polytrain.planning.costmodel import (
    Link,
    Workload,
    fit_message_cost,
    tensor_collectives,
    tensor_parallel,
)
from polytrain.planning.memory import memory_per_rank
from polytrain.planning.predict import predict_all
from polytrain.scaling.tensor_inputs import narrowed, split_share, tensor_fields, tensor_plans

LINK = Link(alpha=1e-4, beta=1e9)  # 0.1 ms per message, 1 GB/s
# 4 MB of weights, 3 MB of them in the split layers, which take 80% of the 90 ms pass; 8 activation all-reduces
# (2 blocks: 2 forward, 2 backward each) of 1024 bytes per sample (a context of 8 x width 32 floats)
WORK = Workload(
    compute_seconds=0.1,
    parameter_bytes=4e6,
    batch_size=64,
    update_seconds=0.01,
    layers=4,
    activation_bytes=1000.0,
    tensor_splits=(2, 4),
    split_bytes=3e6,
    split_share=0.8,
    tensor_reductions=(1024.0,) * 8,
    sequence_parameters=10,
)


def test_compute_splits_the_split_layers_share_and_runs_the_rest_whole():
    # T = 2: 90 ms x (0.2 + 0.8 / 2) = 54 ms; the update over 1.5 MB + 1 MB of the 4 MB: 10 ms x 0.625
    assert tensor_parallel(WORK, 2, LINK).compute == pytest.approx(0.054 + 0.00625)
    # T = 4: 90 ms x (0.2 + 0.2) = 36 ms; update over 0.75 MB + 1 MB: 4.375 ms
    assert tensor_parallel(WORK, 4, LINK).compute == pytest.approx(0.036 + 0.004375)
    # measured shares replace the formula, as the replicas' slices do for data parallelism
    timed = replace(WORK, tensor_seconds={(2, 2): 0.07})
    assert tensor_parallel(timed, 2, LINK).compute == pytest.approx(0.07 + 0.00625)


def test_megatrons_all_reduces_each_of_the_groups_batch_times_the_activation():
    # T = 2: 8 all-reduces of 64 x 1024 = 65,536 bytes: 2 x 1/2 x 65,536 / 1e9 s + 2 x 1 ring messages, each
    # 0.1 ms of latency and 0.1 ms of its rank's CPU time
    two = tensor_parallel(WORK, 2, LINK)
    assert two.communication == pytest.approx(8 * (65536e-9 + 4e-4)) == pytest.approx(3.724288e-3)
    assert two.messages == 16 and two.collectives == 8 and two.turns == 1.0
    # T = 4: 2 x 3/4 x 65,536 / 1e9 s + 6 ring messages of 2 x 0.1 ms each; still 8 collectives
    four = tensor_parallel(WORK, 4, LINK)
    assert four.communication == pytest.approx(8 * (98.304e-6 + 1.2e-3)) and four.messages == 48
    assert four.collectives == 8
    assert tensor_collectives(WORK, 2, 2) == {"all-reduce": [65536.0] * 8, "all-gather": []}


def test_a_head_split_by_the_vocabulary_gathers_its_scores():
    # 65 scores per position, 8 positions, floats: 2,080 bytes per sample; 64 samples gathered: 133,120 bytes,
    # an all-gather over 2 ranks: 1/2 x 133,120 / 1e9 s + 1 ring message of 2 x 0.1 ms
    work = replace(WORK, tensor_gathers=(2080.0,))
    p = tensor_parallel(work, 2, LINK)
    assert p.communication == pytest.approx(3.724288e-3 + 66.56e-6 + 2e-4) and p.messages == 16 + 1
    assert p.collectives == 8 + 1


def test_sequence_parallel_reduce_scatters_and_all_gathers_instead():
    # the built-in GPT with a whole head and embeddings: 2 more gathers of the sequence
    work = replace(WORK, sequence_splits=(2,), sequence_gathers=2)
    sent = tensor_collectives(work, 2, 2)
    # each all-reduce is a reduce-scatter and an all-gather; 2 more all-gathers (into the head, out of the
    # embeddings); 3 small all-reduces for each of the norms' 10 parameters on a 1-D mesh
    assert sent == {
        "reduce-scatter": [65536.0] * 8,
        "all-gather": [65536.0] * 10,
        "small all-reduce": [0.0] * 30,
    }
    # a reduce-scatter or an all-gather: 1/2 x 65,536 / 1e9 s + 1 ring message of 2 x 0.1 ms; a small all-reduce
    # 2 ring messages
    p = tensor_parallel(work, 2, LINK)
    assert (
        p.communication
        == pytest.approx(8 * 232.768e-6 + 10 * 232.768e-6 + 30 * 4e-4)
        == pytest.approx(16.189824e-3)
    )
    assert p.messages == 8 + 10 + 60 and p.collectives == 8 + 10 + 30
    # the 8 pairs move what the 8 all-reduces moved, in twice as many collectives
    pairs = 8 * 2 * (0.5 * 65536e-9 + 2e-4)
    assert pairs == pytest.approx(tensor_parallel(WORK, 2, LINK).communication)
    # gloo reduce-scatters by all-reducing: a whole all-reduce each, 2 x 1/2 x 65,536 / 1e9 + 2 x 2 x 0.1 ms
    gloo = tensor_parallel(work, 2, LINK, scatter_by_allreduce=True)
    assert (
        gloo.communication
        == pytest.approx(8 * 465.536e-6 + 10 * 232.768e-6 + 30 * 4e-4)
        == pytest.approx(18.051968e-3)
    )
    assert gloo.messages == 16 + 10 + 60 and gloo.collectives == 8 + 10 + 30


def test_a_data_by_tensor_mesh_adds_fsdp2_over_the_data_dimension_on_each_ranks_slice():
    # 2 groups of 2: each group 32 samples; each rank holds 1.5 MB + 1 MB = 2.5 MB
    p = tensor_parallel(WORK, 4, LINK, tensor=2, scatter_by_allreduce=True)
    assert (p.strategy, p.layout, p.label) == ("tensor", Layout(shard=2, tensor=2), "tensor 2x2")
    # compute: 90 ms / 2 x (0.2 + 0.4) = 27 ms; the update over 2.5 of 4 MB, split over the 2 data shards
    assert p.compute == pytest.approx(0.027 + 0.01 * 0.625 / 2)
    activations = 8 * (2 * 0.5 * 32768e-9 + 2 * 2e-4)  # 8 all-reduces of 32 x 1024 bytes
    # gloo FSDP2 over 2 ranks: 2 all-gathers and a reduce-scatter run as an all-reduce: 4 x 1/2 x 2.5 MB / 1 GB/s,
    # 4 x 1 messages for each of 4 layers (their alpha once: FSDP2's per-message cost is sharded's)
    fsdp = 4 * 0.5 * 2.5e6 / 1e9 + 4 * 4 * 1e-4
    assert p.communication == pytest.approx(activations + fsdp) == pytest.approx(10.062144e-3)
    assert p.messages == 16 + 16 and p.shard_messages == 16 and p.collectives == 8
    nccl = tensor_parallel(WORK, 4, LINK, tensor=2)
    assert nccl.communication == pytest.approx(activations + 3 * 0.5 * 2.5e-3 + 12 * 1e-4)
    # sequence-parallel on the mesh: one small all-reduce per norm parameter
    assert len(tensor_collectives(replace(WORK, sequence_splits=(2,)), 4, 2)["small all-reduce"]) == 10
    # split by the vocabulary, the embeddings and head reduce-scatter and gather like the blocks: no 2 more
    assert len(tensor_collectives(replace(WORK, sequence_splits=(2,)), 2, 2)["all-gather"]) == 8


def test_every_layout_the_plan_splits_is_predicted_and_a_cost_per_collective_applies_to_all():
    assert "tensor" in predict_all(WORK, 2, LINK)
    four = predict_all(WORK, 4, LINK)
    assert {"tensor", "tensor 2x2"} <= set(four)
    assert "tensor 2x2" not in predict_all(WORK, 4, LINK, meshes=False)
    assert not any(name.startswith("tensor") for name in predict_all(WORK, 3, LINK))  # T = 3: no plan
    assert not any(
        name.startswith("tensor") for name in predict_all(replace(WORK, tensor_splits=()), 2, LINK)
    )
    # tensor's cost is per collective (8 here, whatever the ring's length); without sharded's, FSDP2's 3 x 1 x 4
    # messages on the mesh are priced at it too
    costly = predict_all(WORK, 4, LINK, message_costs={"tensor": 1e-3})
    assert costly["tensor"].communication == pytest.approx(four["tensor"].communication + 8e-3)
    assert costly["tensor 2x2"].communication == pytest.approx(
        four["tensor 2x2"].communication + 8e-3 + 12e-3
    )
    assert costly["data"] == four["data"]
    # with sharded's cost known, FSDP2's messages on the mesh are priced at it: 8 tensor collectives at 1 ms, 3 x 1 x 4
    # layers of FSDP2's messages at 3 ms (FSDP2 copies each layer in and out around its collectives)
    both = predict_all(WORK, 4, LINK, message_costs={"tensor": 1e-3, "sharded": 3e-3})
    assert four["tensor 2x2"].messages == 16 + 12 and four["tensor 2x2"].shard_messages == 12
    assert both["tensor 2x2"].communication == pytest.approx(four["tensor 2x2"].communication + 8e-3 + 36e-3)
    assert both["tensor"] == costly["tensor"]
    # 4 processes on 2 cores: each collective's host work takes 2 turns; FSDP2's messages are priced as sharded's
    # (per message, not stretched); the other strategies are unchanged
    shared = predict_all(WORK, 4, LINK, message_costs={"tensor": 1e-3, "sharded": 3e-3}, turns=2.0)
    assert shared["tensor"].communication == pytest.approx(four["tensor"].communication + 2 * 8e-3)
    assert shared["tensor 2x2"].communication == pytest.approx(
        four["tensor 2x2"].communication + 2 * 8e-3 + 36e-3
    )
    assert all(shared[name] == both[name] for name in ("data", "parameter-server", "sharded", "pipeline"))
    impossible = tensor_parallel(WORK, 3, LINK)
    assert impossible.step_seconds == float("inf") and "does not split over 3 ranks" in impossible.note


def test_the_cost_per_collective_fitted_at_2_processes_stretches_with_the_processes_per_core():
    # gloo, sequence-parallel, T = 2 on 2 cores (1 turn): compute 54 + 6.25 ms; 18.051968 ms of link (above);
    # 48 collectives (8 reduce-scatters, 10 all-gathers, 30 small all-reduces)
    work = replace(WORK, sequence_splits=(2, 4), sequence_gathers=2)
    two = tensor_parallel(work, 2, LINK, scatter_by_allreduce=True)
    assert two.step_seconds == pytest.approx(0.06025 + 18.051968e-3) and two.collectives == 48
    # measured 150 ms: (150 - 78.301968) / 48 = 1.493709 ms per collective
    cost = fit_message_cost(0.150, two)
    assert cost == pytest.approx(71.698032e-3 / 48) == pytest.approx(1.493709e-3)
    # T = 4 on the same 2 cores: 2 turns, so the link's alpha is 0.2 ms (as `link_for` gives it) and each
    # collective's host work 2 x 1.493709 ms. Compute: 90 ms x (0.2 + 0.2) + 10 ms x 1.75 / 4 = 40.375 ms.
    # Link: 8 reduce-scatters run as all-reduces, 2 x 3/4 x 65,536 / 1e9 s + 6 ring messages x 2 x 0.2 ms each;
    # 10 all-gathers, 3/4 x 65,536 / 1e9 s + 3 x 2 x 0.2 ms; 30 small all-reduces, 6 x 2 x 0.2 ms
    link = 8 * (98.304e-6 + 2.4e-3) + 10 * (49.152e-6 + 1.2e-3) + 30 * 2.4e-3
    four = tensor_parallel(work, 4, Link(alpha=2e-4, beta=1e9), scatter_by_allreduce=True, turns=2.0)
    assert four.communication == pytest.approx(link) == pytest.approx(104.477952e-3)
    priced = predict_all(
        work,
        4,
        Link(alpha=2e-4, beta=1e9),
        scatter_by_allreduce=True,
        turns=2.0,
        message_costs={"tensor": cost},
    )["tensor"]
    assert priced.step_seconds == pytest.approx(40.375e-3 + 104.477952e-3 + 48 * 2 * 1.493709e-3)
    # the fit divides by the turns where the fitted row itself shared the cores (2 processes on 1 core)
    crowded = tensor_parallel(work, 2, Link(alpha=2e-4, beta=1e9), scatter_by_allreduce=True, turns=2.0)
    assert fit_message_cost(crowded.step_seconds + 0.096, crowded) == pytest.approx(0.096 / 96)
    assert fit_message_cost(two.step_seconds / 2, two) == 0.0  # never negative


def test_memory_per_rank_holds_the_split_layers_share_and_the_replicated_whole():
    # SGD with momentum: weights, gradients, 1 slot; T = 2: 1.5 MB + 1 MB; activations for all 64 samples
    assert memory_per_rank(WORK, plain_layout("tensor", 2)) == pytest.approx(3 * 2.5e6 + 64 * 1000)
    # AdamW, T = 4: 0.75 MB + 1 MB, 4 tensors each
    assert memory_per_rank(WORK, plain_layout("tensor", 4), optimizer_slots=2) == pytest.approx(
        4 * 1.75e6 + 64 * 1000
    )
    # 2 x 2: each rank's 2.5 MB sharded over 2 data shards, plus a layer gathered (the whole 2.5 MB, an upper
    # bound, as for sharded); activations of its group's 32 samples
    assert memory_per_rank(WORK, Layout(shard=2, tensor=2)) == pytest.approx(
        3 * 2.5e6 / 2 + 2.5e6 + 32 * 1000
    )


def test_the_split_layers_share_from_the_pass_with_them_narrowed():
    # pass 10 ms; narrowed to 1/2 it takes 6 ms: the split layers took 4 / (10 x 1/2) = 80% of it
    assert split_share(0.010, 0.006, tensor=2, fallback=0.5) == pytest.approx(0.8)
    assert split_share(0.010, 0.011, tensor=2, fallback=0.5) == 0.0  # noise: never negative
    assert split_share(0.010, None, tensor=2, fallback=0.5) == 0.5


def gpt_split_floats(width: int, layers: int) -> int:
    """By hand: qkv (W x 3W + 3W), projection (W x W + W), MLP (W x 4W + 4W, 4W x W + W) in each block."""
    return layers * (
        3 * width * width
        + 3 * width
        + width * width
        + width
        + 4 * width * width
        + 4 * width
        + 4 * width * width
        + width
    )


def test_what_the_model_and_its_plan_tell_the_cost_model():
    torch.manual_seed(0)
    context, layers, width = 8, 2, 32
    model = GPT(65, context=context, layers=layers, heads=4, width=width)
    x, y = torch.randint(0, 65, (4, context)), torch.randint(0, 65, (4, context))
    plans = tensor_plans(model, [2, 4])
    assert sorted(plans) == [2, 4]
    fields = tensor_fields(model, plans, Objective(kind="language"), x, y)
    # 2 per block in forward (the rowwise outputs), 2 in backward (the colwise inputs): context x width floats
    activation = 4.0 * context * width
    if plans[2].vocabulary:  # the token embedding (tied to the head) split by its 65 entries as well
        assert fields["split_bytes"] == 4 * (gpt_split_floats(width, layers) + 65 * width)
        # and its output summed in forward, the head's input gradient in backward; the head's scores gathered
        assert fields["tensor_reductions"] == (activation,) * (4 * layers + 2)
        assert fields["tensor_gathers"] == (4.0 * context * 65,) and fields["sequence_gathers"] == 0
    else:
        assert fields["split_bytes"] == 4 * gpt_split_floats(width, layers)
        assert fields["tensor_reductions"] == (activation,) * (4 * layers)
        assert fields["tensor_gathers"] == () and fields["sequence_gathers"] == 2
    assert fields["sequence_splits"] == (2, 4)  # 2 and 4 divide the context of 8
    assert fields["sequence_parameters"] == 2 * (2 * layers + 1)  # each norm's weight and bias
    # 2 heads: 4 ranks cannot split them
    assert sorted(tensor_plans(GPT(65, context=6, layers=1, heads=2, width=32), [2, 4])) == [2]
    # the mlp: one all-reduce after its rowwise layer; its first layer's input is the data (no gradient)
    mlp = build_model("mlp", (1, 28, 28), 10)
    mlp_fields = tensor_fields(
        mlp, tensor_plans(mlp, [2]), Objective(), torch.rand(4, 1, 28, 28), torch.randint(0, 10, (4,))
    )
    assert mlp_fields["tensor_reductions"] == (4.0 * 64,) and mlp_fields["sequence_splits"] == ()
    assert mlp_fields["split_bytes"] == 4 * (784 * 128 + 128 + 128 * 64 + 64)
    # a model without a plan: nothing
    assert tensor_plans(build_model("lenet", (1, 28, 28), 10), [2, 4]) == {}


def test_the_stand_in_for_a_rank_runs_its_share_of_each_split_layer():
    torch.manual_seed(0)
    model = GPT(65, context=8, layers=1, heads=4, width=32)
    share = narrowed(model, tensor_plans(model, [2])[2], 2)
    assert share[1].attention.qkv.weight.shape == (48, 32)  # 2 of 4 heads: q, k, v of 16 each
    assert share[1].attention.proj.weight.shape == (32, 16)
    assert share[1].mlp[0].weight.shape == (64, 32) and share[1].mlp[2].weight.shape == (32, 64)
    assert share(torch.randint(0, 65, (2, 8))).shape == (2, 8, 65)  # the scores whole, as gathered
    if tensor_plans(model, [2])[2].vocabulary:
        assert share[-1].share.weight.shape == (33, 32)  # 65 entries over 2 ranks: 33 and 32
    assert model[1].attention.qkv.weight.shape == (96, 32)  # the model itself is untouched
