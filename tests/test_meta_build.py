"""Models built on the meta device (parallel/meta.py, parallel/materialise.py): each rank gives storage only to
what it holds (its FSDP2 shards, tensor slices or pipeline stage) and fills it with its part of the one-device
initial values, and no rank holds the whole model while setting up (its peak resident memory, measured by the
operating system, grows by its part and one parameter, not by the model)."""

import ctypes
import resource

import pytest
import torch
import torch.nn as nn

from polytrain.models import build_model, build_model_on_meta
from polytrain.parallel.meta import give_values, module_seed

# a Llama of 55M parameters (220 MB in float32): large enough that a whole copy shows in a process's memory
SIZES = dict(layers=4, heads=8, width=1024, ffn_width=2816, vocab_size=4096)
SHAPE, CLASSES = (16,), 256
M_MMAP_THRESHOLD = -3  # glibc mallopt


def _build(meta: bool, sizes=SIZES) -> nn.Module:
    return (build_model_on_meta if meta else build_model)("llama", SHAPE, CLASSES, sizes)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM). Not getrusage's ru_maxrss: Linux carries that over an exec
    from the process that forked it, so a worker spawned by a large pytest process would report its parent's."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _strategy(kind: str, model: nn.Module, rank: int, world: int):
    from polytrain.config import TrainConfig
    from polytrain.parallel.layout import Layout
    from polytrain.parallel.presets import layout_of
    from polytrain.pipeline.layers import flatten_layers
    from polytrain.pipeline.plan import PipelinePlan
    from polytrain.pipeline.strategy import Pipeline
    from polytrain.planning.sharded import ShardedPlan
    from polytrain.strategies import Strategy
    from polytrain.strategies.tensor import plan_for

    common = dict(device=torch.device("cpu"), rank=rank, world_size=world, seed=0)
    if kind == "sharded":
        return Strategy(plan=ShardedPlan(cpu_offload=False), layout=Layout(shard=world), **common)
    if kind == "tensor":
        return Strategy(
            plan=plan_for(TrainConfig(strategy="tensor", devices=2), model, devices=2),
            layout=Layout(shard=world // 2, tensor=2),
            **common,
        )
    names = tuple(name for name, _ in flatten_layers(model))  # stage 0: embedding and 3 blocks
    plan = PipelinePlan("gpipe", 2, (4,), names, SHAPE, input_dtype="int64")
    return Pipeline(plan=plan, layout=layout_of("pipeline", 2, pipeline_stages=2), **common)


def _expected_bytes(kind: str, whole: nn.Module, rank: int) -> int:
    """This rank's share, worked out from the one-device shapes: FSDP2 cuts dimension 0 as torch.chunk does;
    the Llama's tensor plan halves the blocks' matrices and keeps the rest whole; stage 0 holds layers 0-3."""
    total = 0
    for name, p in whole.named_parameters():
        if kind == "sharded":
            per_rank = -(-p.shape[0] // 2)
            rows = max(0, min(p.shape[0], (rank + 1) * per_rank) - rank * per_rank)
            total += rows * p[0].numel() * 4
        elif kind == "tensor":
            total += p.numel() * 4 // (2 if ".attention." in name or ".feed_forward." in name else 1)
        elif (int(name.split(".")[0]) < 4) == (rank == 0):
            total += p.numel() * 4
    return total


def _set_up_on_rank(rank: int, world: int, kind: str, meta: bool) -> dict:
    from polytrain.strategies.holdings import local_bytes

    # blocks over 1 MB mapped on their own and unmapped when freed: resident memory is what is alive
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 2**20)

    def set_up(model):
        strategy = _strategy(kind, model, rank, world)
        strategy.setup(
            model,
            lambda named: torch.optim.SGD([p for _, p in named], lr=0.1),
            lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        )
        return strategy

    set_up(_build(True, dict(SIZES, width=64, ffn_width=128)))  # first uses import what they need
    before = _rss_bytes()
    model = _build(meta)
    built_on_meta = all(p.is_meta for p in model.parameters())
    strategy = set_up(model)
    grown = _peak_rss_bytes() - before
    held = local_bytes(strategy.model.parameters())
    reference = give_values(_build(meta=True), device="cpu", seed=0)
    whole = sum(p.numel() * 4 for p in reference.parameters())
    largest = max(p.numel() * 4 for p in reference.parameters())
    expected = _expected_bytes(kind, reference, rank)
    # every parameter this rank holds equals its part of the one-device value
    mine = dict(strategy.model.named_parameters())
    for name, p in mine.items() if meta else ():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        assert torch.equal(value.detach(), reference.get_parameter(name).detach()), name
    # the one-device value itself: the embedding (module "0") drawn from its own seed, independently
    torch.manual_seed(module_seed(0, "0"))
    embedding = torch.empty(SIZES["vocab_size"], SIZES["width"]).normal_(0.0, 0.02)
    assert torch.equal(reference.get_parameter("0.weight").detach(), embedding)
    return dict(meta=built_on_meta, held=held, expected=expected, grown=grown, whole=whole, largest=largest)


CASES = [("sharded", True), ("tensor", True), ("pipeline", True), ("sharded", False)]


def _set_up_each_on_rank(rank: int, world: int, cases) -> list:
    """`_set_up_on_rank` for each case in turn, in one launch: the operating system's peak (VmHWM) is set back
    to the resident memory before each (/proc/self/clear_refs), so each measures its own set-up alone."""
    import gc

    results = []
    for kind, meta in cases:
        gc.collect()  # (what the case before left)
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        results.append(_set_up_on_rank(rank, world, kind, meta))
    return results


@pytest.fixture(scope="module")
def set_up() -> dict:
    """(kind, built on meta) -> each rank's result, all cases in one launch of two processes."""
    from distributed import run_on_ranks

    by_rank = run_on_ranks(_set_up_each_on_rank, CASES, timeout=300)
    return {case: [results[number] for results in by_rank] for number, case in enumerate(CASES)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["sharded", "tensor", "pipeline"])
def test_each_rank_materialises_only_what_it_holds(set_up, kind):
    for rank, result in enumerate(set_up[kind, True]):
        assert result["meta"], "the model must reach the strategy without storage"
        assert result["held"] == result["expected"], (rank, result)
        # its part, one whole parameter at a time and some slack: far from the whole model
        assert result["grown"] < result["expected"] + 2 * result["largest"] + 0.1 * result["whole"], result
        assert result["grown"] < 0.8 * result["whole"], result


@pytest.mark.multiprocess
def test_the_memory_check_fails_when_the_whole_model_is_built_first(set_up):
    for result in set_up["sharded", False]:
        assert not result["meta"] and result["held"] == result["expected"]
        assert result["grown"] >= 0.8 * result["whole"], result  # what the test above refuses


def test_a_user_module_built_on_meta_without_reset_parameters_is_refused():
    from polytrain.errors import UserError

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.factor = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(
        UserError, match=r"1 \(Scale\) was built on the meta device and has no reset_parameters"
    ):
        give_values(model, device="cpu", seed=0)


def test_a_user_module_whose_reset_parameters_leaves_a_tensor_without_values_is_refused():
    """Built on the meta device, a module's tensors get storage that holds whatever memory held, and its
    reset_parameters() gives them values; one it leaves out (here a buffer made in __init__) would train as
    garbage, so it is refused in one line naming it. Torch's layers fill all of theirs."""
    from polytrain.errors import UserError

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)

        def reset_parameters(self):
            nn.init.ones_(self.weight)

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), Masked())
    with pytest.raises(UserError, match=r"2 \(Masked\) .* gives its buffer 'mask' no value"):
        give_values(model, device="cpu", seed=0)

    Masked.reset_parameters = lambda self: (nn.init.ones_(self.weight), self.mask.copy_(torch.eye(4)))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), Masked())
    give_values(model, device="cpu", seed=0)
    assert torch.equal(model[2].mask, torch.eye(4)) and torch.equal(model[2].weight, torch.ones(4))
    assert not any(t.isnan().any() for t in [*model.parameters(), *model.buffers()])
