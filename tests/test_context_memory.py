"""What a rank of a context group holds (planning/context.py `context_part`, `--context-parallel C`): 1/C of one
device's activations, and what its way of attending adds, counted from the attention's shape: block by block
(parallel/block_attention.py, CPUs) nothing kept beyond 1/C but each block's output under selective
checkpointing, and one layer's gathered keys and values for a while in the backward; over the gathered keys
(GPUs) the keys and values gathered whole and its chunks' zero rows. Against hand-worked figures and against
what a context rank's forward keeps, measured on fake tensors in this process (a fake process group of C ranks:
the gather runs without peers), and beside tensor ranks against the real tensor plan on a fake process group of
the layout's ranks; and the memory check's figure for a context-parallel layout."""

import dataclasses
import types

import pytest
import torch
import torch.distributed as dist

from polytrain.models.gpt import GPT
from polytrain.models.llama import Llama
from polytrain.objective import Objective
from polytrain.parallel.layout import Layout
from polytrain.parallel.presets import layout_of
from polytrain.planning.activations import AttentionShape, peak_bytes
from polytrain.planning.context import blockwise_transient, context_bytes, context_part
from polytrain.planning.costmodel import Workload
from polytrain.planning.memory import memory_per_rank
from polytrain.scaling.activation_memory import activation_profile

VOCAB, BATCH = 65, 2
MODELS = {
    "gpt": lambda context: GPT(VOCAB, context=context, layers=3, heads=4, width=64),
    "llama": lambda context: Llama(VOCAB, context=context, layers=2, heads=4, kv_heads=2, width=64),
}
FIGURES = ("activation_bytes", "block_bytes", "block_input_bytes", "block_matmul_bytes")
# a 2-layer llama of 4 heads over 2 key/value heads of width 32, T = 64, float32
SHAPE = AttentionShape(layers=2, heads=4, kv_heads=2, head_dim=32, context=64, element_bytes=4)


def test_what_a_context_rank_s_attention_keeps_beyond_one_c_worked_by_hand():
    # C = 2: a rank's 32 tokens are 2 chunks of 16, from 0 and 48 (rank 0): 16 and 64 rows with the zero
    # rows, 80
    kept, outputs = context_bytes(SHAPE, 2)
    gathered = 2 * 2 * 64 * 32 * 4 - 2 * 2 * 32 * 32 * 4  # keys and values of all 64 tokens, not its own 32
    padded = 2 * 4 * 80 * 32 * 4 - 4 * 32 * 32 * 4  # queries and outputs of 80 rows, not its own 32 queries
    log_sum_exp = 4 * 80 * 4 - 4 * 32 * 4
    assert kept == gathered + padded + log_sum_exp == 82688
    assert outputs == 4 * 80 * 32 * 4 + 4 * 80 * 4 - (4 * 32 * 32 * 4 + 4 * 32 * 4) == 25344
    # C = 4: 16 tokens, chunks of 8 ending at 8 and 64 (rank 0): 72 rows
    kept, _ = context_bytes(SHAPE, 4)
    assert kept == (2 * 2 * (64 - 16) * 32 + 4 * (2 * 72 - 16) * 32) * 4 + 4 * 4 * (72 - 16)
    assert context_bytes(SHAPE, 1) == (0.0, 0.0)
    # float64 keeps its log-sum-exp in float64; bf16 in float32
    wide, _ = context_bytes(dataclasses.replace(SHAPE, element_bytes=8), 2)
    assert wide == 2 * (gathered + padded) + 2 * log_sum_exp
    narrow, _ = context_bytes(dataclasses.replace(SHAPE, element_bytes=2), 2)
    assert narrow == (gathered + padded) / 2 + log_sum_exp
    assert blockwise_transient(SHAPE, 2) == 0.0  # (over the gathered keys nothing is counted once)


def test_what_a_context_rank_attending_block_by_block_keeps_and_holds_worked_by_hand():
    blocks = dataclasses.replace(SHAPE, blockwise=True)
    # nothing kept beyond 1/C; selective checkpointing keeps each block's output and log-sum-exp: the busiest rank
    # attends in 2C + 1 blocks of c = T/2C rows where its share of one device's would be 2: (2C - 1) c rows more
    # of 4 heads (C = 2: 3 x 16 rows; C = 4: 7 x 8)
    assert context_bytes(blocks, 2) == (0.0, (32 * 4 + 4) * 4 * 48)
    assert context_bytes(blocks, 4) == (0.0, (32 * 4 + 4) * 4 * 56)
    # one layer's backward around the ring (C = 2: parts of 32 tokens, chunks of 16): another rank's keys and
    # values and the next ones in flight, the gradients travelling with them and those arriving (8 parts of 2
    # key/value heads), one block's key and value gradients, a chunk's query gradients (4 heads), and a diagonal
    # block's keys and values repeated for the 4 query heads with their gradients
    assert blockwise_transient(blocks, 2) == (8 * 2 * 32 + 2 * 2 * 16 + 4 * 16 + 4 * 4 * 16) * 32 * 4
    alike = dataclasses.replace(blocks, kv_heads=4)  # (no heads shared: nothing repeated)
    assert blockwise_transient(alike, 2) == (8 * 4 * 32 + 2 * 4 * 16 + 4 * 16) * 32 * 4
    work = Workload(
        compute_seconds=0.0, parameter_bytes=0.0, batch_size=8, activation_bytes=1000e3, blocks=2,
        block_bytes=400e3, block_input_bytes=20e3, block_matmul_bytes=100e3, attention=blocks,
    )  # fmt: skip
    part = context_part(work, Layout(context=2))
    transient = blockwise_transient(blocks, 2)
    assert part.activation_bytes == 500e3 + transient and part.block_bytes == 200e3
    assert part.block_matmul_bytes == 50e3 + (32 * 4 + 4) * 4 * 48
    # the transient once in every mode's peak
    outside = (1000e3 - 2 * 400e3) / 2
    assert peak_bytes(part, "none") == 500e3 + transient
    assert peak_bytes(part, "full") == outside + transient + 2 * 10e3 + 200e3


def test_each_checkpointing_mode_keeps_one_c_and_the_attention_s_extra_where_its_blocks_are_kept():
    work = Workload(
        compute_seconds=0.0, parameter_bytes=0.0, batch_size=8, activation_bytes=1000e3, blocks=2,
        block_bytes=400e3, block_input_bytes=20e3, block_matmul_bytes=100e3, attention=SHAPE,
    )  # fmt: skip
    kept, outputs = 82688, 25344
    part = context_part(work, Layout(context=2))
    assert part.activation_bytes == 500e3 + 2 * kept and part.block_bytes == 200e3 + kept
    assert part.block_input_bytes == 10e3 and part.block_matmul_bytes == 50e3 + outputs
    outside = (1000e3 - 2 * 400e3) / 2  # embeddings, head and loss: 1/C
    assert peak_bytes(part, "none") == 500e3 + 2 * kept
    # full: each block's input, and one recomputed block with its gathered keys and values and zero rows
    assert peak_bytes(part, "full") == outside + 2 * 10e3 + 200e3 + kept
    assert peak_bytes(part, "selective") == outside + 2 * (10e3 + 50e3 + outputs) + 200e3 + kept
    # per rank: a slice of 4 sequences (2 context groups of 2 split the batch of 8), a part of each
    data = layout_of("data", 4, context_parallel=2)
    weights = memory_per_rank(dataclasses.replace(work, activation_bytes=0.0), data)
    for mode in ("none", "full"):
        held = memory_per_rank(work, data, checkpointing=mode) - weights
        assert held == pytest.approx(4 * peak_bytes(part, mode))
    assert context_part(work, Layout()) is work
    # beside 2 tensor ranks: each runs 2 of the 4 query heads and 1 of the 2 key/value heads
    halved = context_bytes(dataclasses.replace(SHAPE, heads=2, kv_heads=1), 2)[0]
    assert halved < kept and context_part(work, Layout(context=2, tensor=2)).block_bytes == 200e3 + halved
    # a workload whose attention was not seen: 1/C alone (the cuts' too, where nothing else is known)
    unseen = context_part(
        dataclasses.replace(work, attention=None, boundary_bytes=(10.0, 30.0)), Layout(context=2)
    )
    assert unseen.activation_bytes == 500e3 and unseen.boundary_bytes == (5.0, 15.0)


@pytest.fixture
def fake_group():
    """A fake process group of `size` ranks in this process: collectives return tensors of their shapes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(size: int):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
        return dist.group.WORLD

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("blockwise", [True, False], ids=["block-by-block", "gathered"])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_count_is_what_a_context_rank_s_forward_keeps(fake_group, monkeypatch, name, size, blockwise):
    """One device's figures, split by `context_part`, against a context rank's forward on fake tensors: every
    rank, every figure checkpointing uses; attending block by block (this CPU's way) and over the gathered keys
    with zero rows (a GPU's way, taken here by telling the CPU it has no blockwise kernel)."""
    from polytrain.parallel import context as context_module
    from polytrain.parallel.context import ContextGroup, apply_context_parallel

    if not blockwise:  # (the name context.py asks)
        monkeypatch.setattr(context_module, "blockwise", lambda device_type: False)
    group, context = fake_group(size), 64
    ids = torch.zeros(BATCH, context, dtype=torch.long)
    for rank in range(size):
        model, objective = MODELS[name](context), Objective(kind="language")
        one = activation_profile(model, objective, ids, ids)
        assert one["attention"].context == context and one["attention"].layers == len(model) - 3
        assert one["attention"].blockwise  # (measured on this CPU)
        one["attention"] = dataclasses.replace(one["attention"], blockwise=blockwise)
        counted = context_part(
            Workload(compute_seconds=0.0, parameter_bytes=0.0, batch_size=BATCH, **one), Layout(context=size)
        )
        transient = blockwise_transient(one["attention"], size)  # (held for a while, not kept)
        apply_context_parallel(model, ContextGroup(group, rank, size))
        objective.sequence_parts = size
        kept = activation_profile(model, objective, ids[:, : context // size], ids[:, : context // size])
        for figure in FIGURES:  # (the token ids' bool mask, 1 byte a sample, is not split: 2 bytes at most)
            expected = getattr(counted, figure) - (transient if figure == "activation_bytes" else 0.0)
            if blockwise and figure == "block_matmul_bytes":
                # rank r attends in r + C + 2 blocks, C - 1 - r fewer than the busiest rank (the count's), whose
                # 2C + 1 keep 2C - 1 blocks' outputs beyond its share
                block = context_bytes(one["attention"], size)[1] / (2 * size - 1)
                expected -= block * (size - 1 - rank) * (len(model) - 3) / one["blocks"]
            assert expected == pytest.approx(kept[figure], abs=2), (rank, figure)
        if blockwise:  # nothing kept beyond 1/C; one layer's transient, below what every layer kept gathered
            assert kept["activation_bytes"] == pytest.approx(one["activation_bytes"] / size, abs=2)
            gathered = dataclasses.replace(one["attention"], blockwise=False)
            assert 0 < transient < (len(model) - 3) * context_bytes(gathered, size)[0]
        else:
            assert kept["activation_bytes"] > one["activation_bytes"] / size + 20e3  # far from 1/C alone


def test_the_memory_check_refuses_a_context_split_whose_gathered_keys_do_not_fit(monkeypatch):
    """benchmarks/context_parallel.py's T = 16384 batch 1 case, where 1/C alone passed 4 ranks that then held
    2.3x its figure (attending over the gathered keys with zero rows): with a limit between 1/C and the count
    (on this CPU, block by block: 1/C and one layer's keys and values in flight around the ring in its backward),
    4 context ranks are refused, the count named."""
    from polytrain.config import TrainConfig
    from polytrain.data import load_dataset
    from polytrain.errors import UserError
    from polytrain.models import build_model_on_meta
    from polytrain.scaling import fits

    shape = dict(layers=2, width=128, heads=4, kv_heads=2, context=16384)
    data = load_dataset("shakespeare", context=16384)
    model = build_model_on_meta("llama", data.input_shape, data.num_classes, shape)
    config = TrainConfig(model="llama", strategy="sharded", devices=4, context_parallel=4, batch_size=1)
    layout = fits.layout_for(config, "sharded")
    activations = fits.measured_activations(model, data, torch.device("cpu"))
    work = fits.model_workload(model, batch_size=1, **activations)
    counted = memory_per_rank(work, layout, optimizer_slots=2)
    alone = memory_per_rank(
        dataclasses.replace(work, attention=None, backward_bytes=0.0), layout, optimizer_slots=2
    )
    # one layer's keys and values in flight around the ring with their gradients, a block's gradients and a
    # diagonal block repeated for the query heads, one sequence: 14 MiB beside 1/C's 95 (gathered whole: 27)
    assert work.attention.blockwise and context_bytes(work.attention, 4)[0] == 0
    assert counted - alone == pytest.approx(blockwise_transient(work.attention, 4)) == 14 * 2**20
    parameters = sum(p.numel() for p in model.parameters())
    assert work.attention == AttentionShape(2, 4, 2, 32, 16384, 4, parameters, blockwise=True)
    monkeypatch.setattr(fits, "available_per_rank", lambda device, devices: (counted + alone) / 2)
    with pytest.raises(UserError, match=f"at least {counted / 2**30:,.1f} GiB"):
        fits.check_fits(
            config, model, "sharded", name="llama", device=torch.device("cpu"), slots=2, dataset=data
        )


def test_fsdp_beside_tensor_ranks_shards_the_state_over_the_context_ranks_too():
    """--strategy tensor --context-parallel C: FSDP2 shards each tensor rank's weights, gradients and optimizer
    state over the data and context ranks (parallel/mesh.py fsdp_submesh), so C context ranks hold 1/C of a
    tensor rank's state each; without activations, the rest of the count is that state and the gathered unit."""
    from polytrain.parallel.layout import Layout
    from polytrain.planning.costmodel import Workload
    from polytrain.planning.memory import memory_per_rank

    work = Workload(
        compute_seconds=1.0, parameter_bytes=8e6, split_bytes=6e6, batch_size=4, gathered_bytes=1e6
    )
    held = 6e6 / 2 + 2e6  # a tensor rank's weights: the split layers' half and the rest whole
    for context in (1, 2, 4):
        layout = Layout(shard=2, context=context, tensor=2)
        memory = memory_per_rank(work, layout, optimizer_slots=2)
        assert memory == pytest.approx(held * (1 + 1 + 2) / (2 * context) + 1e6), context


def kept_by_a_rank(name: str, layout, rank: int) -> float:
    """Bytes per sample that `rank` of `layout` keeps for backward in a training forward and loss of `name` at
    T = 64, prepared by `parallelize` (the built-in tensor plan, context parallelism) on a fake process group
    of the layout's ranks in this process: the local part of every tensor autograd saves, weights left out."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from polytrain.parallel.mesh import forget_earlier_meshes
    from polytrain.parallel.parallelize import Preparation, parallelize
    from polytrain.strategies.tensor import plan_for

    def local(tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    def key(tensor):
        return local(tensor).untyped_storage()._cdata

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        model, objective, context = MODELS[name](64), Objective(kind="language"), 64
        plan = None
        if layout.tensor > 1:
            config = types.SimpleNamespace(tensor_plan=None, context=context)
            plan = plan_for(config, model, devices=layout.tensor)
        options = Preparation(device=torch.device("cpu"), tensor_plan=plan)
        parallelize(model, layout, options, objective=objective)
        weights, saved = {key(p) for p in model.parameters()}, {}

        def pack(tensor):
            if key(tensor) not in weights:
                saved.setdefault(key(tensor), local(tensor).untyped_storage().nbytes())
            return tensor

        ids = torch.zeros(BATCH, context // layout.context, dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            objective.loss_sum(model(ids), ids)
        return sum(saved.values()) / BATCH
    finally:
        dist.destroy_process_group()
        forget_earlier_meshes()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_context_rank_beside_tensor_ranks_keeps_the_count_for_its_heads(name):
    """--context-parallel 2 beside 2 tensor ranks: every rank of the 4 keeps half of what a rank of the tensor
    group alone keeps, and holds for a while the gathered keys and values of the heads it runs (half the query
    and key/value heads: `context_part(work, Layout(context=C, tensor=T))`), measured against the real tensor
    plan on a fake process group. With all the heads counted, the figure would be 30 KiB (llama) high."""
    from polytrain.parallel.layout import Layout

    one = activation_profile(
        MODELS[name](64), Objective(kind="language"), *[torch.zeros(BATCH, 64).long()] * 2
    )
    tensor = kept_by_a_rank(name, Layout(tensor=2), 0)
    work = Workload(
        compute_seconds=0.0, parameter_bytes=0.0, batch_size=BATCH, activation_bytes=tensor,
        attention=one["attention"],
    )  # fmt: skip
    counted = context_part(work, Layout(context=2, tensor=2)).activation_bytes
    shape = one["attention"]  # (block by block on this CPU: one layer's gathered keys held, not kept)
    halved = dataclasses.replace(shape, heads=shape.heads // 2, kv_heads=shape.kv_heads // 2)
    fewer = blockwise_transient(shape, 2) - blockwise_transient(halved, 2)  # fewer heads: less gathered
    assert fewer > 0 and counted == context_part(work, Layout(context=2)).activation_bytes - fewer
    kept = counted - blockwise_transient(halved, 2)
    for rank in range(4):
        assert kept_by_a_rank(name, Layout(context=2, tensor=2), rank) == pytest.approx(kept, abs=2), rank
