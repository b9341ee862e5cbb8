"""Accumulation, clipping by the global norm and fp16 loss scaling give the one-device training on every
strategy: `polytrain verify` against one device that takes each step in one pass, and the all-reduces that
make a norm global and an overflow common, on real gloo processes."""

import pytest
import torch
import torch.distributed as dist
from conftest import polytrain_here
from distributed import run_on_ranks

from polytrain.strategies.gradients import Gradients

pytestmark = pytest.mark.multiprocess

# LeNet's gradient norm on these digits is 1.1 to 1.4 in its first steps (a 10-step fit clipped all 10 at 0.05).
KNOBS = ("--accumulate", "4", "--clip-grad-norm", "0.05")


@pytest.mark.parametrize(
    "strategy",
    [
        ["--strategy", "data"],
        ["--strategy", "sharded"],
        ["--strategy", "pipeline", "--microbatches", "2"],
        ["--strategy", "parameter-server", "--devices", "3", "--servers", "2"],
        ["--strategy", "pipeline", "--devices", "4", "--pipeline-stages", "2"],
    ],
    ids=["data", "sharded", "pipeline", "parameter-server", "pipeline-2x2"],
)
def test_verify_with_accumulation_and_clipping_passes_on_every_strategy(strategy, capfd):
    devices = [] if "--devices" in strategy else ["--devices", "2"]
    result = polytrain_here(
        capfd, "verify", *devices, "--steps", "4", "--batch-size", "96", *KNOBS, *strategy, "--device", "cpu"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4 and all(float(diff) <= 1e-5 for *_, diff in rows)


def some_gradients():
    torch.manual_seed(0)
    return [torch.randn(4, 3), torch.randn(5), torch.randn(3, 3) * 5, torch.randn(2)]


def _clip_halves(rank, world_size, group_wide):
    """Each rank holds half of a model's gradients (as two pipeline stages do) and clips them to 1.0."""
    mine = some_gradients()[rank::world_size]
    params = []
    for grad in mine:
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad
        params.append(p)
    optimizer = torch.optim.SGD(params, lr=1.0)
    gradients = Gradients(device=torch.device("cpu"), clip_norm=1.0)
    gradients.step(optimizer, params, norm_group=dist.group.WORLD if group_wide else None)
    return [p.grad.tolist() for p in params], float(gradients.last_norm)


def _overflow_on_rank_one(rank, world_size):
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    gradients = Gradients(device=torch.device("cpu"), fp16=True)
    scale = gradients.scaler.get_scale()
    weight.grad = torch.tensor([float("inf") if rank == 1 else 1.0, 1.0]) * scale
    gradients.step(optimizer, [weight], overflow_group=dist.group.WORLD)
    return (
        weight.detach().tolist(),
        gradients.scaler.get_scale() / scale,
        gradients.epoch_figures()["skipped_steps"],
    )


def _each_check(rank, world_size):
    """The checks below, one after the other in the same pair of processes (a spawn each would cost seconds)."""
    return {
        "group-wide": _clip_halves(rank, world_size, True),
        "stage-local": _clip_halves(rank, world_size, False),
        "overflow": _overflow_on_rank_one(rank, world_size),
    }


@pytest.fixture(scope="module")
def on_two_ranks():
    """What each of 2 gloo processes returned from `_each_check`, by rank."""
    return run_on_ranks(_each_check)


def test_the_norm_summed_over_stages_clips_as_one_device_and_a_stage_local_norm_does_not(on_two_ranks):
    grads = some_gradients()
    whole = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(whole, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(whole, 1.0)
    expected = [p.grad for p in whole]
    for group_wide in (True, False):
        ranks = [found["group-wide" if group_wide else "stage-local"] for found in on_two_ranks]
        clipped = [None] * len(grads)
        for rank, (parts, _) in enumerate(ranks):
            clipped[rank::2] = [torch.tensor(part) for part in parts]
        same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(clipped, expected))
        assert same == group_wide
        if group_wide:
            assert all(abs(seen - float(norm)) < 1e-4 for _, seen in ranks)


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(on_two_ranks):
    assert len(on_two_ranks) == 2
    for weights, scale_change, skipped in (found["overflow"] for found in on_two_ranks):
        assert weights == [1.0, 1.0] and scale_change == 0.5 and skipped == 1


@pytest.mark.parametrize("strategy", ["sharded", "pipeline"])
def test_fp16_trains_every_strategy_within_its_noise_floor_of_one_device(strategy, capfd):
    # float64 cannot run under fp16 autocast: verify compares as trained, against one device repeated in
    # another summation order
    result = polytrain_here(
        capfd,
        "verify",
        "--devices",
        "2",
        "--steps",
        "4",
        "--precision",
        "fp16",
        "--strategy",
        strategy,
        "--device",
        "cpu",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "both as trained (fp16)" in result.stdout
        and "PASS" in result.stdout
        and "noise floor" in result.stdout
    )
    floors = [float(line.split()[4]) for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(floors) == 4 and max(floors) > 0  # the two summation orders do round apart
