"""`parallelize` (parallel/parallelize.py) on the run's one mesh, at full size in one process: a `fake` process
group of 64 ranks, the model built on the meta device, one rank's view. Each parameter must be the DTensor that
rank holds (sharded over the right ranks, split over the right ones), the context group the ranks the layout
names, and every step applied. The multi-process proofs that these layouts train one device's model are
`polytrain verify`'s (test_context_parallel.py, test_tensor.py, test_sharded.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from polytrain.models import build_model_on_meta
from polytrain.objective import Objective
from polytrain.parallel.context import sequence_modules
from polytrain.parallel.layout import Layout
from polytrain.parallel.parallelize import Preparation, parallelize

WORLD, RANK = 64, 45
LLAMA = dict(layers=2, heads=4, kv_heads=2, width=32, context=32)


@pytest.fixture
def fake_world():
    """A fake process group of WORLD ranks in this process, this process being RANK."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from polytrain.parallel.mesh import forget_earlier_meshes

    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_earlier_meshes()


def ranks_where(layout: Layout, **same) -> list:
    """The ranks whose coordinates equal RANK's along the degrees named in `same` (True)."""
    mine = layout.coordinates(RANK)
    return [
        rank
        for rank in range(layout.world_size)
        if all(layout.coordinates(rank)[name] == mine[name] for name in same)
    ]


def held_rows(full: int, parts: int, index: int) -> int:
    """torch.chunk's rows for part `index` of `parts` (ceil-sized chunks, the last ones smaller or empty)."""
    size = math.ceil(full / parts)
    return max(0, min(size, full - index * size))


def split_dim(module, style, bias: bool):
    """The dimension torch's parallel styles split a parameter of `module` along (None: replicated): colwise
    splits a Linear's outputs (weight rows and bias), rowwise its inputs (weight columns; the bias whole); on an
    Embedding, rowwise splits the vocabulary and colwise the width."""
    if style is None:
        return None
    if isinstance(module, torch.nn.Embedding):
        return 0 if style == "rowwise" else 1
    if style == "rowwise":
        return None if bias else 1
    return 0


def assert_tensor_and_data_split(model, name, parameter, styles, whole, *, tensor_index, shards, shard_index):
    """`parameter` (called `name` in `model`) is split over 4 tensor ranks as the plan's `styles` say (Replicate
    where it names none) and FSDP2's rows of this rank's slice over `shards`: its local shape is the one-device
    `whole` cut by torch.chunk's shares, at `tensor_index` and `shard_index`; the DTensor keeps `whole`."""
    from torch.distributed.tensor import Replicate, Shard

    assert parameter.shape == whole, name
    tensor = parameter.placements[-1]
    module = name.rsplit(".", 1)[0]
    dim = split_dim(model.get_submodule(module), styles.get(module), name.endswith("bias"))
    expected = list(whole)
    if dim is None:
        assert tensor == Replicate(), name
    else:
        assert tensor == Shard(dim), name
        expected[dim] = held_rows(expected[dim], 4, tensor_index)
    expected[0] = held_rows(expected[0], shards, shard_index)
    assert list(parameter.to_local().shape) == expected, name


def test_fsdp_over_shards_and_context_ranks_within_copies(fake_world):
    """llama on 2 copies x 8 shards x 4 context ranks, full checkpointing: FSDP2 shards each copy over its 32
    (dp_shard, cp) ranks (torchtitan's dp_shard_cp), the 4 ranks of RANK's context group split its sequences."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    layout = Layout(replicate=2, shard=8, context=4)
    model = build_model_on_meta("llama", (LLAMA["context"],), 64, dict(LLAMA))
    wholes = {name: p.shape for name, p in model.named_parameters()}
    objective = Objective()
    options = Preparation(device=torch.device("cpu"), data_parallel="shard", activation_checkpointing="full")
    done = parallelize(model, layout, options, objective=objective)

    where = layout.coordinates(RANK)
    copy_ranks = ranks_where(layout, replicate=True)  # the 32 ranks of RANK's copy
    index = copy_ranks.index(RANK)
    for name, parameter in model.named_parameters():
        assert isinstance(parameter, DTensor), name
        assert parameter.placements == (Replicate(), Shard(0)), name
        shard_mesh = parameter.device_mesh
        assert shard_mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp"), name
        assert shard_mesh.mesh[where["replicate"]].tolist() == copy_ranks
        assert parameter.to_local().shape[0] == held_rows(wholes[name][0], 32, index), name
    assert done.context.rank == where["context"] and done.context.size == 4
    assert objective.sequence_parts == 4
    assert done.context.group.mesh.tolist() == ranks_where(layout, replicate=True, shard=True)
    switched = sequence_modules(model)
    assert switched and all(module.context_parallel is done.context for module in switched)
    recomputed = [m for m in model.modules() if "forward" in m.__dict__]
    assert len(recomputed) == LLAMA["layers"]  # the blocks, wrapped for recomputation
    assert done.runner is model and done.global_rows is None


def test_tensor_plan_then_fsdp_over_the_data_dimension(fake_world):
    """gpt on 16 shards x 4 tensor ranks: the built-in plan splits the attention and MLP layers over RANK's 4
    consecutive tensor ranks, and FSDP2 shards over the 16 ranks at RANK's tensor index (a 2-D DTensor)."""
    from torch.distributed.tensor import DTensor

    from polytrain.strategies.tensor import plan_for

    layout = Layout(shard=16, tensor=4)
    options = dict(layers=2, heads=4, width=64, context=32)
    model = build_model_on_meta("gpt", (32,), 64, options)
    wholes = {name: p.shape for name, p in model.named_parameters()}
    plan = plan_for(SimpleNamespace(tensor_plan=None), model, devices=4)
    preparation = Preparation(device=torch.device("cpu"), data_parallel="shard", tensor_plan=plan)
    parallelize(model, layout, preparation, objective=Objective())

    where = layout.coordinates(RANK)
    styles = {name: style for name, style, _ in plan.styles}
    assert len(styles) >= 4, "the built-in plan splits the attention and MLP layers"
    for name, parameter in model.named_parameters():
        assert isinstance(parameter, DTensor), name
        assert parameter.device_mesh.mesh_dim_names == ("dp_shard", "tp"), name
        assert parameter.device_mesh.mesh[:, where["tensor"]].tolist() == ranks_where(layout, tensor=True)
        data = parameter.placements[0]
        assert getattr(data, "dim", None) == 0, name  # FSDP2 over dp_shard (strided over a tp split of rows)
        assert_tensor_and_data_split(
            model, name, parameter, styles, wholes[name], tensor_index=where["tensor"], shards=16,
            shard_index=where["shard"],
        )  # fmt: skip


def test_every_degree_but_the_pipeline_on_one_mesh(fake_world):
    """llama on 2 copies x 4 shards x 2 context ranks x 4 tensor ranks (64): the tensor plan splits over RANK's 4
    tensor ranks, the context group is its 2 neighbouring tensor groups, and FSDP2 shards each copy's tensor slices
    over the 8 (dp_shard, cp) ranks at RANK's tensor index, hybrid over the copies."""
    from torch.distributed.tensor import DTensor, Replicate

    from polytrain.strategies.tensor import plan_for

    layout = Layout(replicate=2, shard=4, context=2, tensor=4)
    model = build_model_on_meta("llama", (32,), 64, dict(LLAMA, heads=8, kv_heads=4))
    wholes = {name: p.shape for name, p in model.named_parameters()}
    plan = plan_for(SimpleNamespace(tensor_plan=None), model, devices=4)
    objective = Objective()
    options = Preparation(device=torch.device("cpu"), data_parallel="shard", tensor_plan=plan)
    done = parallelize(model, layout, options, objective=objective)

    where = layout.coordinates(RANK)
    assert done.context.group.mesh.tolist() == ranks_where(layout, replicate=True, shard=True, tensor=True)
    assert objective.sequence_parts == 2
    # RANK's copy, at its tensor index: 8 ranks
    shard_ranks = ranks_where(layout, replicate=True, tensor=True)
    index = shard_ranks.index(RANK)
    styles = {name: style for name, style, _ in plan.styles}
    for name, parameter in model.named_parameters():
        assert isinstance(parameter, DTensor), name
        assert parameter.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp", "tp"), name
        ranks = parameter.device_mesh.mesh[where["replicate"], :, where["tensor"]].tolist()
        assert ranks == shard_ranks, name
        copies, data, _ = parameter.placements
        assert copies == Replicate() and getattr(data, "dim", None) == 0, name
        assert_tensor_and_data_split(
            model,
            name,
            parameter,
            styles,
            wholes[name],
            tensor_index=where["tensor"],
            shards=8,
            shard_index=index,
        )


def test_compile_compiles_each_block_in_place_and_a_model_without_blocks_whole():
    """--compile (step 5): each block of a GPT compiled in place, with its recomputation inside, and the same
    gradients as the eager model's; LeNet, which has no blocks, is left for the caller to compile whole."""
    import copy

    from polytrain.models import build_model

    torch.manual_seed(0)
    small = dict(layers=1, width=16, heads=2, context=8)
    eager = build_model("gpt", (8,), 65, small)
    compiled = copy.deepcopy(eager)
    options = Preparation(device=torch.device("cpu"), compile=True, activation_checkpointing="full")
    done = parallelize(compiled, Layout(), options, objective=Objective())
    assert not done.compile_whole and compiled._compiled_call_impl is None
    assert [name for name, m in compiled.named_modules() if m._compiled_call_impl is not None] == ["1"]
    x = torch.randint(0, 65, (2, 8))
    for model in (eager, compiled):
        model(x).square().mean().backward()
    assert [name for name, _ in eager.named_parameters()] == [name for name, _ in compiled.named_parameters()]
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
    lenet = build_model("lenet", (1, 28, 28), 10, {})
    options = Preparation(device=torch.device("cpu"), compile=True)
    done = parallelize(lenet, Layout(), options, objective=Objective())
    assert done.compile_whole and not any(m._compiled_call_impl is not None for m in lenet.modules())
    # a pipeline rank's part: LeNet's stages each compiled in place (what the schedule calls); a GPT's blocks
    from polytrain.pipeline.layers import Stage, flatten_layers, named_subset

    for name, held in (("lenet", [0, 1, 2]), ("gpt", [0, 1])):
        model = (
            build_model("gpt", (8,), 65, small)
            if name == "gpt"
            else build_model("lenet", (1, 28, 28), 10, {})
        )
        layers = flatten_layers(model)
        stage = Stage([layers[i][1] for i in held])
        part = named_subset([layers[i] for i in held])
        options = Preparation(device=torch.device("cpu"), compile=True, stages=(stage,), whole=model)
        done = parallelize(part, Layout(), options, objective=Objective())
        compiled = [m for m in part.modules() if m._compiled_call_impl is not None]
        assert not done.compile_whole and (stage._compiled_call_impl is not None) == (name == "lenet"), name
        assert len(compiled) == (0 if name == "lenet" else 1), name  # (the GPT's first stage holds one block)


def test_a_strategy_takes_the_run_s_layout_and_refuses_one_of_another_world_size():
    """The layout is the one description of a run's degrees: a strategy reads its batch slices and gradient ranks
    from the layout it is given (no degree of its own), and one whose product is not the world size is refused."""
    from polytrain.strategies import Strategy

    sharded = Strategy(device=torch.device("cpu"), rank=3, world_size=4, layout=Layout(replicate=2, shard=2))
    assert (sharded.data_rank, sharded.data_world, sharded.replicas) == (3, 4, 4)
    tensor = Strategy(device=torch.device("cpu"), rank=3, world_size=4, layout=Layout(shard=2, tensor=2))
    assert (tensor.data_rank, tensor.data_world, tensor.replicas) == (1, 2, 2)
    assert Strategy(device=torch.device("cpu"), world_size=2).layout == Layout(replicate=2)
    with pytest.raises(ValueError, match="a layout of 4 ranks"):
        Strategy(device=torch.device("cpu"), world_size=2, layout=Layout(shard=4))
