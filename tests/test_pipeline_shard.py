"""Pipeline x sharded (`--strategy pipeline --pipeline-stages S --data-parallel shard`): the pipelines side by side
are FSDP2 shard groups of their stages. The layout and its one-line refusals in this process; on 4 processes
(2 pipelines x 2 stages): each rank holds half its stage's parameters, gradients and optimizer state, materialised
from a meta-device model with the one-device values; `polytrain verify` of a small GPT against one device; and a
run stopped twice (one device -> 2 replicas of 2 sharding pipelines on 8 processes -> 2 sharding pipelines) that
ends where one straight run ends."""

import pytest
import torch
import torch.nn as nn
from conftest import RESUME_TRAIN, assert_refused_in_one_line, assert_same_weights, polytrain_here
from conftest import load_weights as load

from polytrain.config.train import TrainConfig
from polytrain.errors import ConfigError
from polytrain.parallel.layout import Layout
from polytrain.parallel.presets import layout_of
from polytrain.pipeline.plan import data_words, pipelines_words
from polytrain.pipeline.strategy import Pipeline

# float32 Adam: the pipelines' sums of shards round apart from one device's sums (see test_shards.py)
ADAM_ROUNDING = 2e-5
SHARDED = ["--strategy", "pipeline", "--devices", "4", "--pipeline-stages", "2", "--data-parallel", "shard"]
# hybrid sharding: 8 ranks, 2 replicas of 2 pipelines that shard their 2 stages
HYBRID_SETTINGS = dict(strategy="pipeline", devices=8, pipeline_stages=2, data_parallel="shard", replicas=2)
HYBRID = [*SHARDED[:3], "8", *SHARDED[4:], "--replicas", "2"]

# ---- the layout, in this process ----


def test_the_pipelines_side_by_side_are_a_shard_degree_on_the_mesh():
    config = TrainConfig(strategy="pipeline", devices=8, pipeline_stages=2, data_parallel="shard")
    assert config.layout == Layout(shard=4, pipeline=2)
    assert config.layout.mesh_names == ("dp_shard", "pp") and config.data_parallel_size == 4
    assert config.layout.describe() == "4 shards x 2 stages"
    replicated = TrainConfig(strategy="pipeline", devices=8, pipeline_stages=2)  # as before: replicas
    assert replicated.layout == Layout(replicate=4, pipeline=2)
    assert TrainConfig(**dict(replicated.to_dict(), data_parallel="replicate")).layout == replicated.layout
    layout = layout_of(
        "pipeline", 4, pipeline_stages=2, data_parallel="shard"
    )  # as the replicated pipeline's
    assert [(layout.data_rank(r), layout.coordinates(r)["pipeline"]) for r in range(4)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert layout.degrees() == {"shard": 2, "pipeline": 2} and pipelines_words(layout) == "2 shards (FSDP2)"
    with_tensor = TrainConfig(
        strategy="pipeline", devices=8, pipeline_stages=2, tensor_parallel=2, data_parallel="shard"
    )  # the shard degree combines with the tensor degree: a (dp_shard, pp, tp) mesh
    assert with_tensor.layout == Layout(shard=2, pipeline=2, tensor=2) and with_tensor.data_parallel_size == 2
    assert with_tensor.layout.mesh_names == ("dp_shard", "pp", "tp")


def test_replicas_of_sharding_pipelines_are_a_replicate_degree_beside_the_shard_degree():
    """--replicas R (hybrid sharding): the pipelines as R copies of shard groups; each rank keeps its place."""
    config = TrainConfig(**HYBRID_SETTINGS)
    assert config.layout == Layout(replicate=2, shard=2, pipeline=2) and config.data_parallel_size == 4
    assert config.layout.mesh_names == ("dp_replicate", "dp_shard", "pp")
    assert config.layout.describe() == "2 replicas x 2 shards x 2 stages"
    layout = config.layout
    assert [(layout.data_rank(r), layout.coordinates(r)["pipeline"]) for r in range(8)] == [
        (d, s) for d in range(4) for s in range(2)
    ]
    assert pipelines_words(layout) == "2 replicas of 2 shards (hybrid sharding, FSDP2)"
    assert [data_words(layout, d) for d in (0, 3)] == ["replica 1/2, shard 1/2", "replica 2/2, shard 2/2"]
    with_tensor = TrainConfig(**dict(HYBRID_SETTINGS, devices=16, tensor_parallel=2))
    assert with_tensor.layout == Layout(replicate=2, shard=2, pipeline=2, tensor=2)
    assert TrainConfig(**dict(HYBRID_SETTINGS, replicas=1)).layout == Layout(shard=4, pipeline=2)


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(devices=4), ["make one pipeline", "--pipeline-stages 2"]),
        (dict(devices=2), ["make one pipeline", "--devices 4 --pipeline-stages 2"]),
        (
            dict(devices=4, pipeline_stages=2, tensor_parallel=2),
            ["2 stages of 2 tensor ranks make one pipeline", "--devices 8 --pipeline-stages 2"],
        ),
        (dict(devices=4, pipeline_stages=2, split_at="2"), ["--split-at", "--data-parallel shard"]),
        (dict(strategy="data", devices=4), ["--data-parallel applies to --strategy pipeline only"]),
        (dict(devices=8, pipeline_stages=2, replicas=3), ["--replicas 3 must divide the 4 pipelines"]),
        (dict(devices=8, pipeline_stages=2, replicas=4), ["--replicas 4", "a divisor of 4 below 4"]),
        (
            dict(devices=8, pipeline_stages=2, replicas=2, data_parallel="replicate"),
            ["without --data-parallel shard every pipeline is a replica", "add --data-parallel shard"],
        ),
    ],
)
def test_a_sharded_pipeline_that_cannot_work_is_one_line(settings, words):
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**{"strategy": "pipeline", "data_parallel": "shard", **settings})
    assert "\n" not in str(caught.value) and all(word in str(caught.value) for word in words), str(
        caught.value
    )


def test_the_cli_refuses_one_sharded_pipeline_before_any_worker(tmp_path, capsys):
    argv = ["--strategy", "pipeline", "--devices", "2", "--data-parallel", "shard"]
    assert_refused_in_one_line(capsys, tmp_path / "run", argv, ["--data-parallel shard", "one pipeline"])


# ---- on 4 processes: 2 pipelines x 2 stages, each stage sharded over the 2 pipelines ----


def _mlp() -> nn.Module:
    """Built on the meta device: 2 stages of Linear layers whose rows split evenly in two."""
    with torch.device("meta"):
        return nn.Sequential(
            nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)
        )


def _hold_on_rank(rank: int, world: int, shard: bool) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from polytrain.data.order import Batch
    from polytrain.parallel.meta import give_values
    from polytrain.pipeline.layers import flatten_layers
    from polytrain.pipeline.plan import PipelinePlan
    from polytrain.strategies.holdings import local_bytes, local_part, whole

    model = _mlp()
    built_on_meta = all(p.is_meta for p in model.parameters())
    names = tuple(name for name, _ in flatten_layers(model))
    layout = layout_of("pipeline", world, pipeline_stages=2, data_parallel="shard" if shard else None)
    plan = PipelinePlan("1f1b", 2, (3,), names, (1, 8, 8))
    strategy = Pipeline(
        plan=plan,
        layout=layout,
        device=torch.device("cpu"),
        rank=rank,
        world_size=world,
        seed=0,
        precision="bf16",
    )
    strategy.setup(
        model,
        lambda named: torch.optim.Adam([p for _, p in named], lr=0.01),
        lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    )
    params = list(strategy.model.parameters())
    reference = give_values(_mlp(), device="cpu", seed=0)  # one device's initial values
    same = all(
        torch.equal(whole(p), reference.get_parameter(name)) for name, p in strategy.model.named_parameters()
    )
    generator = torch.Generator().manual_seed(strategy.data_rank)
    x, y = torch.randn(8, 1, 8, 8, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    strategy.train_step(Batch(x, y, 16, 0))
    slots = [v for p in params for v in strategy.optimizer.state[p].values() if v.dim() > 0]
    return dict(
        stage=sum(p.numel() * p.element_size() for p in params),
        held=local_bytes(params),
        grads=local_bytes(p.grad for p in params),
        slots=local_bytes(slots),
        meta=built_on_meta and not any(local_part(p).is_meta for p in params),
        same=same,
        sharded=all(isinstance(stage, FSDPModule) for stage in strategy.stage_modules),
        copies=all(isinstance(stage, DistributedDataParallel) for stage in strategy.stage_modules),
        mesh=strategy.mesh.world.mesh_dim_names,
        summed_by_hand=strategy.dp_group is not None,
        # --precision bf16: sharded's MixedPrecisionPolicy on every unit (float32 master shards, stepped above)
        policies={
            (
                str(unit._get_fsdp_state()._mp_policy.param_dtype),
                str(unit._get_fsdp_state()._mp_policy.reduce_dtype),
            )
            for stage in strategy.stage_modules
            for unit in stage.modules()
            if isinstance(unit, FSDPModule)
        },
        dtypes={str(local_part(p).dtype) for p in params} | {str(local_part(p.grad).dtype) for p in params},
        line="\n".join(strategy.placement),
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("shard", [True, False], ids=["shards", "replicas"])
def test_each_rank_holds_half_its_stages_parameters_gradients_and_optimizer_state(shard):
    """In --precision bf16, which gathers and computes in bfloat16 as --strategy sharded does: the shards, their
    gradients and the optimizer state stay float32. Whole replicas (no --data-parallel shard) are DDP modules, each
    holding its whole stage in float32, and no gradient is summed by hand."""
    from distributed import run_on_ranks

    results = run_on_ranks(_hold_on_rank, shard, world_size=4, timeout=300)
    # ranks 0 and 2 hold stage 0 (one Linear(64, 32)), ranks 1 and 3 stage 1 (Linear(32, 32), Linear(32, 10))
    assert [r["stage"] for r in results] == [(64 * 32 + 32) * 4, (32 * 32 + 32 + 32 * 10 + 10) * 4] * 2
    mesh = ("dp_shard", "pp") if shard else ("dp_replicate", "pp")
    for rank, result in enumerate(results):
        assert result["sharded" if shard else "copies"] and not result["summed_by_hand"], (rank, result)
        assert result["meta"], (rank, result)
        assert result["mesh"] == mesh, (rank, result)
        assert result["same"], f"rank {rank} does not start from the one-device weights"
        parts = 2 if shard else 1
        assert result["held"] * parts == result["stage"] and result["grads"] == result["held"], (rank, result)
        assert result["slots"] == 2 * result["held"], (rank, result)  # Adam's two moments, of its shard only
        # whole replicas keep float32 weights under autocast, as one pipeline does
        policies = {("torch.bfloat16", "torch.float32")} if shard else set()
        assert result["policies"] == policies and result["dtypes"] == {"torch.float32"}, (rank, result)
    assert ("gathered in bf16 for compute (float32 master shards)" in results[0]["line"]) == shard


GPT_TINY = ["--model", "gpt", "--dataset", "shakespeare", "--layers", "2", "--width", "32", "--heads", "2"]


# 8 processes: 2 shards x 2 stages x 2 tensor ranks, each stage's tensor slices sharded over the pipelines
THREE_D = [*SHARDED[:3], "8", *SHARDED[4:], "--tensor-parallel", "2"]


# docs/strategies/pipeline.md shows, and test_readme_commands.py runs to PASS, the verify of LeNet on SHARDED and
# of this GPT on HYBRID (2 replicas of 2 sharding pipelines, 8 processes); they are not repeated here
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "model, layout",
    [
        ([*GPT_TINY, "--context", "16", "--batch-size", "8", "--steps", "2", "--accumulate", "2"], SHARDED),
        ([*GPT_TINY, "--context", "16", "--batch-size", "8", "--steps", "3", "--accumulate", "2"], THREE_D),
    ],
    ids=["gpt", "gpt-with-tensor-ranks"],
)
def test_verify_two_sharded_pipelines_of_two_stages(capfd, model, layout):
    """The GPT ties its embedding and head across the stages (each a shard of the tied weight); accumulation and
    the global-norm clip over the stages' sharded gradients. With tensor ranks: a (dp_shard, pp, tp) mesh, FSDP2
    shards each stage's tensor slices (2-D DTensors over dp_shard and tp)."""
    result = polytrain_here(capfd, "verify", *model, *layout, "--clip-grad-norm", "0.5", "--device", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert rows and all(float(diff) <= 1e-10 for *_, diff in rows) and "PASS" in result.stdout, result.stdout
    assert "pipeline of 2 stages x 2 shards (FSDP2)" in result.stdout
    assert ("each stage split over 2 tensor ranks" in result.stdout) == (layout is THREE_D)


@pytest.mark.multiprocess
def test_a_run_stopped_twice_on_sharded_pipelines_ends_where_one_straight_run_ends(
    straight_resume_run, tmp_path, capfd
):
    """One device writes a whole checkpoint, which hybrid-sharded pipelines (2 replicas of 2 shards) cut into
    their shards; they write theirs as DCP shards (nothing gathered), which 2 sharded pipelines on half the ranks
    read back."""
    out = tmp_path / "run"
    first = polytrain_here(capfd, "train", *RESUME_TRAIN, "--devices", "1", "--max-steps", 3, "--out", out)
    assert first.returncode == 0, first.stderr
    second = polytrain_here(capfd, "train", "--resume", out, *HYBRID, "--max-steps", 8)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "rank 7: replica 2/2, shard 2/2 of stage 1" in second.stdout
    progress = torch.load(out / "checkpoint.pt", weights_only=True)
    assert "model" not in progress and "optimizer" not in progress  # nothing was gathered to rank 0
    names = sorted(p.name for p in (out / progress["shards"]).iterdir())
    assert names == [".metadata"] + [f"__{r}_0.distcp" for r in range(8)]
    third = polytrain_here(capfd, "train", "--resume", out, *SHARDED)
    assert third.returncode == 0, third.stdout + third.stderr
    assert_same_weights(load(out / "model.pt"), straight_resume_run, atol=ADAM_ROUNDING)
