"""--precision bf16 under FSDP2: a MixedPrecisionPolicy (bfloat16 parameters for compute and the all-gathers,
float32 gradient reduction into float32 shards, which the optimizer steps), and `polytrain verify` passes it
against one device within the measured noise floor."""

import pytest
import torch
from processes import polytrain

pytestmark = pytest.mark.multiprocess


def _dtypes_on_rank(rank: int, world: int, precision: str) -> dict:
    from polytrain.data.order import Batch
    from polytrain.models.gpt import GPT
    from polytrain.objective import Objective
    from polytrain.parallel.layout import Layout
    from polytrain.planning.sharded import ShardedPlan
    from polytrain.strategies import Strategy

    torch.manual_seed(0)
    model = GPT(65, context=8, layers=1, heads=2, width=16)
    strategy = Strategy(
        device=torch.device("cpu"),
        rank=rank,
        world_size=world,
        precision=precision,
        plan=ShardedPlan(cpu_offload=False),
        layout=Layout(shard=world),
        objective=Objective(kind="language"),
    )
    strategy.setup(
        model,
        lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-3),
        lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    )
    seen = []
    layer = strategy.model[1].mlp[0]
    layer.register_forward_pre_hook(lambda module, inputs: seen.append(module.weight.dtype))
    x, y = torch.randint(0, 65, (4, 8)), torch.randint(0, 65, (4, 8))
    stats = strategy.train_step(Batch(x, y, 4, 0))
    shards = list(strategy.model.parameters())
    return dict(
        compute=str(seen[0]),
        shards={str(p.to_local().dtype) for p in shards},
        grads={str(p.grad.to_local().dtype) for p in shards if p.grad is not None},
        finite=bool(torch.isfinite(stats.loss_sum)),
        line=strategy.placement[0] if strategy.placement else "",
    )


@pytest.mark.parametrize("precision, compute", [("bf16", "torch.bfloat16"), ("fp32", "torch.float32")])
def test_bf16_computes_and_gathers_in_bfloat16_and_steps_float32_shards(precision, compute):
    from distributed import run_on_ranks

    for rank, result in enumerate(run_on_ranks(_dtypes_on_rank, precision)):
        assert result["compute"] == compute  # the weight a layer computes with, gathered
        assert result["shards"] == {"torch.float32"} and result["grads"] == {"torch.float32"}
        assert result["finite"]
        if rank == 0:
            assert ("gathered in bf16" in result["line"]) == (precision == "bf16")


def test_verify_passes_bf16_sharded_as_trained():
    result = polytrain(
        "verify",
        *("--model", "gpt", "--dataset", "shakespeare", "--layers", "1", "--width", "32"),
        *("--strategy", "sharded", "--devices", "2", "--precision", "bf16", "--steps", "6"),
        timeout=400,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "both as trained (bf16)" in result.stdout and "PASS" in result.stdout
    assert "noise floor" in result.stdout


def test_the_policy_is_not_asked_for_without_bf16():
    from polytrain.parallel.fsdp import mixed_precision

    assert mixed_precision("fp32") == {} and mixed_precision("fp16") == {}
    policy = mixed_precision("bf16")["mp_policy"]  # sharded's, tensor's, and that of pipelines of shards
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
