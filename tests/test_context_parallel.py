"""Context parallelism (parallel/context.py): the head-tail split of a sequence, and causal attention,
the GPT and the Llama over a sequence split across 2 and 4 gloo processes, against one device in float64.

One launch of 4 processes runs every multi-process check: C = 2 on the context dimension of a 2 x 2 DeviceMesh
(two context groups side by side, ranks 0-1 and 2-3) and C = 4 on the whole world as a process group."""

import copy

import pytest
import torch
import torch.nn.functional as F

from polytrain.errors import ConfigError
from polytrain.models.gpt import GPT
from polytrain.models.llama import Llama
from polytrain.models.mlp import MLP
from polytrain.objective import IGNORE_INDEX, Objective
from polytrain.parallel.context import (
    ContextGroup,
    apply_context_parallel,
    head_tail_positions,
    join_sequence,
    split_sequence,
)

EXACT = 1e-12  # float64: one device's result up to rounding
VOCAB, LENGTH, BATCH = 11, 16, 2
ATTENTIONS = {"multi-head": (4, 4), "grouped-query": (4, 2)}  # (query heads, key/value heads)
MODELS = {
    "gpt": lambda: GPT(VOCAB, context=LENGTH, layers=2, heads=4, width=32),
    "llama": lambda: Llama(VOCAB, context=LENGTH, layers=2, heads=4, kv_heads=2, width=32),
}


def test_head_tail_positions_are_a_head_and_a_tail_chunk_per_rank():
    assert [head_tail_positions(8, r, 2).tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [head_tail_positions(16, r, 4).tolist() for r in range(4)] == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]
    assert head_tail_positions(4, 0, 1).tolist() == [0, 1, 2, 3]
    assert ContextGroup(None, 1, 2).positions(4).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_split_and_join_round_trip(size):
    length = 2 * size * 3
    tokens = torch.arange(BATCH * length).view(BATCH, length)
    parts = [split_sequence(tokens, r, size) for r in range(size)]
    assert all(part.shape == (BATCH, length // size) for part, _ in parts)
    for part, positions in parts:  # each token's global position is where it was
        assert torch.equal(part, tokens[:, positions])
    assert torch.equal(join_sequence([part for part, _ in parts]), tokens)
    heads = torch.randn(BATCH, 3, length, 4)
    assert torch.equal(
        join_sequence([split_sequence(heads, r, size, dim=2)[0] for r in range(size)], dim=2), heads
    )


def test_a_context_that_does_not_cut_into_head_and_tail_chunks_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        split_sequence(torch.zeros(BATCH, 10, dtype=torch.long), 0, 4)
    message = str(error.value)
    assert "\n" not in message
    assert "--context 10" in message and "--context-parallel 4" in message and "multiple of 8" in message


def test_a_model_is_switched_into_context_parallel_mode_and_back():
    model = GPT(VOCAB, context=LENGTH, layers=2, heads=4, width=32)
    context = ContextGroup(None, 0, 2)
    apply_context_parallel(model, context)
    switched = [
        name for name, module in model.named_modules() if getattr(module, "context_parallel", None) is context
    ]
    assert switched == ["0", "1.attention", "2.attention"]
    assert copy.deepcopy(model)[1].attention.context_parallel is context
    apply_context_parallel(model, None)
    assert all(getattr(module, "context_parallel", None) is None for module in model.modules())
    with pytest.raises(ConfigError, match="MLP has no attention"):
        apply_context_parallel(MLP((1, 4, 4), 3), context)


def _attention_errors(context: ContextGroup, heads: int, kv_heads: int) -> dict:
    """Largest differences of this rank's causal attention output and q, k, v gradients from its tokens of one
    device's on the whole sequence."""
    generator = torch.Generator().manual_seed(10 * heads + kv_heads)
    like = dict(generator=generator, dtype=torch.float64)
    q = torch.randn(BATCH, heads, LENGTH, 8, **like, requires_grad=True)
    k, v = (torch.randn(BATCH, kv_heads, LENGTH, 8, **like, requires_grad=True) for _ in range(2))
    upstream = torch.randn(BATCH, heads, LENGTH, 8, **like)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    whole.backward(upstream)

    def mine(tensor):
        return split_sequence(tensor.detach(), context.rank, context.size, dim=2)[0]

    parts = [mine(t).requires_grad_() for t in (q, k, v)]
    out = context.attention(*parts)
    out.backward(mine(upstream))
    found = dict(zip(("output", "q", "k", "v"), (out, *(part.grad for part in parts))))
    expected = dict(zip(("output", "q", "k", "v"), (whole, q.grad, k.grad, v.grad)))
    return {name: (found[name] - mine(expected[name])).abs().max().item() for name in found}


def context_sum(value: torch.Tensor, context: ContextGroup) -> torch.Tensor:
    """`value` summed over the context group."""
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(value.detach(), "sum", context.group))


def _model_errors(context: ContextGroup, build) -> dict:
    """Largest differences of a model switched into context-parallel mode from one device's on one batch: this
    rank's logits, every parameter's gradient summed over the context group, the loss and token count summed."""
    torch.manual_seed(0)
    whole = build().double()
    model = apply_context_parallel(copy.deepcopy(whole), context)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    labels[0, 3] = labels[1, 12] = IGNORE_INDEX
    logits = whole(ids)
    loss, count = Objective(kind="language").token_loss(logits, labels)
    loss.backward()

    def mine(tensor):
        return split_sequence(tensor, context.rank, context.size)[0]

    part_logits = model(mine(ids))
    objective = Objective(kind="language")
    objective.sequence_parts = context.size  # as a strategy sets it (parallel/context.py)
    part_loss, part_count = objective.token_loss(part_logits, mine(labels))
    part_loss.backward()
    grads = dict(whole.named_parameters())
    return {
        "logits": (part_logits - mine(logits)).abs().max().item(),
        "gradients": max(
            (context_sum(parameter.grad, context) - grads[name].grad).abs().max().item()
            for name, parameter in model.named_parameters()
        ),
        "loss": abs(context_sum(part_loss, context).item() - loss.item()),
        "count": abs(context_sum(part_count, context).item() - count.item()),
        "smallest gradient norm": min(parameter.grad.norm().item() for parameter in whole.parameters()),
    }


def _on_rank(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    found = {}
    for size, group in ((2, mesh["cp"]), (4, dist.group.WORLD)):
        context = ContextGroup.of(group)
        found[size] = {
            "rank": context.rank,
            "attention": {name: _attention_errors(context, *heads) for name, heads in ATTENTIONS.items()},
            "models": {name: _model_errors(context, build) for name, build in MODELS.items()},
        }
    return found


@pytest.fixture(scope="module")
def on_four_ranks():
    from distributed import run_on_ranks

    from polytrain.runtime.forkserver import start_method

    return run_on_ranks(_on_rank, world_size=4, timeout=200, method=start_method())


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 4])
def test_attention_over_the_split_sequence_equals_one_device(on_four_ranks, size):
    assert [found[size]["rank"] for found in on_four_ranks] == ([0, 1, 0, 1] if size == 2 else [0, 1, 2, 3])
    for rank, found in enumerate(on_four_ranks):
        for name, errors in found[size]["attention"].items():
            assert max(errors.values()) < EXACT, (rank, name, errors)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_model_over_the_split_sequence_equals_one_device(on_four_ranks, size, model):
    for rank, found in enumerate(on_four_ranks):
        errors = dict(found[size]["models"][model])
        assert errors.pop("smallest gradient norm") > 0, (rank, model)
        assert max(errors.values()) < EXACT, (rank, model, errors)


# `polytrain verify --context-parallel C`: every strategy that splits sequences (data, sharded, tensor, pipeline) on
# each model, C = 2 inside 2 sharded or replicated data slices (4 ranks), C = 4 over every rank, C = 2 beside 2
# tensor ranks, and C = 2 on each of 2 pipeline stages, with each activation checkpointing mode and accumulation,
# against one device in float64 (on CPU processes each chunk attends block by block: parallel/block_attention.py)
SMALL = ["--dataset", "shakespeare", "--layers", "2", "--heads", "4", "--width", "32", "--context", "32"]
VERIFIES = {
    "llama sharded 2 x cp 2, full checkpointing, 2 passes": [
        "--model", "llama", "--kv-heads", "2", "--strategy", "sharded", "--devices", "4",
        "--context-parallel", "2", "--activation-checkpointing", "full", "--accumulate", "2",
    ],
    "gpt data, cp 4, selective checkpointing": [
        "--model", "gpt", "--strategy", "data", "--devices", "4", "--context-parallel", "4",
        "--activation-checkpointing", "selective",
    ],
    "llama cp 2 x tp 2, selective checkpointing, 2 passes": [
        "--model", "llama", "--kv-heads", "2", "--strategy", "tensor", "--devices", "4", "--tensor-parallel", "2",
        "--context-parallel", "2", "--activation-checkpointing", "selective", "--accumulate", "2",
    ],
    "llama 2 pipeline stages x cp 2, selective checkpointing, 2 passes": [
        "--model", "llama", "--kv-heads", "2", "--strategy", "pipeline", "--devices", "4", "--context-parallel", "2",
        "--activation-checkpointing", "selective", "--accumulate", "2",
    ],
    "gpt cp 2 x tp 2 (norms whole: no sequence parallelism), full checkpointing": [
        "--model", "gpt", "--strategy", "tensor", "--devices", "4", "--tensor-parallel", "2",
        "--context-parallel", "2", "--activation-checkpointing", "full",
    ],
    "gpt sharded 2 x cp 2": [
        "--model", "gpt", "--strategy", "sharded", "--devices", "4", "--context-parallel", "2",
    ],
    "gpt 2 pipeline stages x cp 2, full checkpointing, 2 passes": [
        "--model", "gpt", "--strategy", "pipeline", "--devices", "4", "--context-parallel", "2",
        "--activation-checkpointing", "full", "--accumulate", "2",
    ],
    "llama data 2 x cp 2": [
        "--model", "llama", "--kv-heads", "2", "--strategy", "data", "--devices", "4", "--context-parallel", "2",
    ],
}  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(VERIFIES))
def test_verify_passes_with_sequences_split_over_a_context_group(capfd, case):
    from conftest import polytrain_here

    done = polytrain_here(capfd, "verify", *SMALL, *VERIFIES[case], "--steps", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout and "(each sequence split over" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 3 and all(float(row[3]) < 1e-12 for row in rows), done.stdout


REFUSALS = {
    "a strategy that does not split sequences": (
        ["--model", "gpt", "--strategy", "parameter-server", "--devices", "2", "--context-parallel", "2"],
        ["--context-parallel applies to --strategy data or sharded or tensor or pipeline"],
    ),
    "pipeline stages and context groups that do not fit the devices": (
        ["--model", "gpt", "--strategy", "pipeline", "--devices", "6", "--pipeline-stages", "2", "--context-parallel", "2"],
        ["--pipeline-stages 2 x --context-parallel 2 = 4 ranks per pipeline do not divide --devices 6"],
    ),
    "traced pipeline stages": (
        ["--model", "gpt", "--strategy", "pipeline", "--devices", "4", "--context-parallel", "2", "--split-at", "blocks.1"],
        ["--split-at (traced stages) does not combine with --context-parallel"],
    ),
    "context groups that do not divide the tensor groups": (
        ["--model", "gpt", "--strategy", "tensor", "--devices", "2", "--tensor-parallel", "2", "--context-parallel", "2"],
        ["--context-parallel 2 must divide the 1 tensor groups"],
    ),
    "a model without attention": (
        ["--model", "mlp", "--dataset", "synthetic", "--strategy", "data", "--devices", "2", "--context-parallel", "2"],
        ["--context-parallel splits the sequences of --model gpt and llama", "MLP has no attention"],
    ),
    "a context that does not cut into head-tail chunks": (
        ["--model", "llama", "--context", "36", "--strategy", "data", "--devices", "4", "--context-parallel", "4"],
        ["--context 36", "multiple of 8"],
    ),
    "dropout": (
        ["--model", "gpt", "--dropout", "0.1", "--strategy", "sharded", "--devices", "2", "--context-parallel", "2"],
        ["does not split dropout masks", "--dropout 0"],
    ),
    "a group size that does not divide the devices": (
        ["--model", "gpt", "--strategy", "data", "--devices", "3", "--context-parallel", "2"],
        ["--context-parallel 2 must divide --devices 3"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_context_parallelism_cannot_split_is_one_line_before_any_worker(capsys, tmp_path, case):
    from polytrain.cli import main

    argv, words = REFUSALS[case]
    dataset = [] if "--dataset" in argv else ["--dataset", "shakespeare"]
    code = main(["train", *argv, *dataset, "--max-steps", "1", "--out", str(tmp_path / "run")])
    captured = capsys.readouterr()
    assert code == 2, captured.out + captured.err
    assert captured.err.startswith("polytrain: error:") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err and captured.out.count("\n") <= 1  # (at most the defaults line)
    assert all(word in captured.err for word in words), captured.err
    assert not (tmp_path / "run").exists()


def test_the_memory_check_counts_a_context_rank_s_part_of_the_activations():
    from polytrain.parallel.presets import layout_of
    from polytrain.planning.costmodel import Workload
    from polytrain.planning.memory import memory_per_rank

    work = Workload(parameter_bytes=1000.0, compute_seconds=0.0, activation_bytes=100.0, batch_size=8)
    data = memory_per_rank(work, layout_of("data", 4))
    split = memory_per_rank(work, layout_of("data", 4, context_parallel=2))
    assert data - split == pytest.approx(100.0 * 8 / 4 - 100.0 * 8 / (2 * 2))  # 2 slices of 4, each half kept
    sharded = memory_per_rank(work, layout_of("sharded", 4, context_parallel=2))
    assert sharded < split  # FSDP2 shards over the context groups' ranks too
    # a pipeline's stages: each context rank keeps half of its micro-batches' activations, whole copies of the
    # stage's weights (DDP), or, on sharding pipelines, shards over the pipelines and the context ranks (FSDP2)
    staged = memory_per_rank(work, layout_of("pipeline", 2))
    split = memory_per_rank(work, layout_of("pipeline", 4, context_parallel=2))
    assert staged - split == pytest.approx(100.0 * 8 / 2 - 100.0 * 8 / (2 * 2))
    shards = dict(pipeline_stages=2, data_parallel="shard")
    staged = memory_per_rank(work, layout_of("pipeline", 4, **shards))
    split = memory_per_rank(work, layout_of("pipeline", 8, context_parallel=2, **shards))
    states = 1000.0 * (1 + 2)  # weights, gradients and one optimizer slot, over shards x 2 stages
    assert staged - split == pytest.approx(states / (2 * 2) - states / (4 * 2) + 100.0 * 8 / (2 * 2) / 2)


RESUMED = [
    *("--model", "llama", "--dataset", "shakespeare", "--layers", "2", "--heads", "4", "--kv-heads", "2"),
    *("--width", "32", "--context", "32", "--batch-size", "8", "--optimizer", "adamw", "--lr", "0.01"),
    *("--seed", "5", "--device", "cpu"),
]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_context_parallel_run_resumes_on_another_layout_as_the_straight_run(tmp_path, capfd):
    """2 steps on 2 sharded slices x 2 context ranks, 2 more on 2 pipeline stages x 2 context ranks, then 2 more on
    2 data-parallel ranks without context parallelism: the weights of 6 steps on one device (the checkpoint holds
    the one-device names and state)."""
    from conftest import load_weights, polytrain_here

    straight, out = tmp_path / "straight", tmp_path / "run"
    done = polytrain_here(capfd, "train", *RESUMED, "--max-steps", "6", "--out", straight)
    assert done.returncode == 0, done.stderr
    theirs = load_weights(straight / "model.pt")
    split = ["--strategy", "sharded", "--devices", "4", "--context-parallel", "2"]
    done = polytrain_here(capfd, "train", *RESUMED, *split, "--max-steps", "2", "--out", out)
    assert done.returncode == 0 and "context parallel: each sequence" in done.stdout, (
        done.stdout + done.stderr
    )
    assert difference(load_weights(out / "model.pt"), theirs) > 1e-3  # (sharded: its shards) 4 steps short
    staged = ["--strategy", "pipeline", "--devices", "4", "--context-parallel", "2"]
    done = polytrain_here(capfd, "train", "--resume", out, *staged, "--max-steps", "4")
    assert done.returncode == 0 and "each sequence split over 2 context ranks" in done.stdout, (
        done.stdout + done.stderr
    )
    moved = ["--strategy", "data", "--devices", "2", "--context-parallel", "1"]
    done = polytrain_here(capfd, "train", "--resume", out, *moved, "--max-steps", "6")
    assert done.returncode == 0 and "context parallel" not in done.stdout, done.stdout + done.stderr
    ours = load_weights(out / "model.pt")
    assert list(ours) == list(theirs)
    assert difference(ours, theirs) < 1e-5  # float32 sums in another order on each layout


def difference(ours: dict, theirs: dict) -> float:
    """The largest difference of two state dicts' tensors, each on its tensor's scale."""
    return max(
        float((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max().clamp_min(1e-12)) for k in theirs
    )
