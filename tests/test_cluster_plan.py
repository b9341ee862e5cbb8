"""`polytrain plan` (scaling/cluster_plan.py, scaling/full_size.py): layouts built at full size on torch's fake
process group by the code a run uses. What a rank holds is checked against the math of torch's chunks and against
real runs on CPU processes; what the code refuses is refused with its line; the command writes its table, JSON and
picture."""

import json
import math
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch
from conftest import polytrain_here

from polytrain.models import build_model, build_model_on_meta
from polytrain.parallel.layout import Layout, parse_layout
from polytrain.parallel.presets import layout_of, settings_of
from polytrain.scaling.cluster_plan import PlanRequest, candidate_layouts, make_plan_table, plan_layout
from polytrain.scaling.full_size import holdings_at_full_size
from polytrain.scaling.gpus import GPUS, gpu_named

SMALL = dict(layers=2, heads=4, kv_heads=2, width=64, ffn_width=128, context=16)
VOCAB = 96


def _small(meta: bool = True):
    return (build_model_on_meta if meta else build_model)("llama", (16,), VOCAB, dict(SMALL))


def _tensor_plan(layout: Layout, model):
    from polytrain.config.train import TrainConfig
    from polytrain.strategy_registry import make_plan

    settings = settings_of(layout)
    config = TrainConfig(devices=layout.world_size, batch_size=8 * layout.data_degree, **settings)
    assert config.layout == layout
    return make_plan(settings["strategy"], config, model, None, device=None)


def _chunk(size: int, parts: int) -> int:
    """Rank 0's share of `size` rows cut by torch.chunk into `parts`."""
    return -(-size // parts)


def test_a_512_rank_4d_layout_of_the_70b_shape_builds_here_with_each_parameter_cut_as_torch_cuts_it():
    """dp_replicate 2 x dp_shard 16 x cp 2 x tp 8 of Llama 3 70B: the tensor plan's slices (colwise: rows / 8,
    rowwise: columns / 8), then FSDP2's shards of rank 0 over the 32 ranks of dp_shard and cp; against the
    one-device shapes."""
    from polytrain.config.model_defaults import PRESETS

    sizes = dict(PRESETS["llama"]["70b"])
    vocab = sizes.pop("vocab_size")

    def build():
        return build_model_on_meta("llama", (sizes["context"],), vocab, sizes)

    layout = Layout(replicate=2, shard=16, context=2, tensor=8)
    assert layout.world_size == 512
    plan = _tensor_plan(layout, build())
    held = holdings_at_full_size(build, layout, tensor_plan=plan)
    styles = {name: style for name, style, _ in plan.styles}
    expected = 0
    for name, p in build().named_parameters():
        rows, rest = p.shape[0], math.prod(p.shape[1:])
        style = styles.get(name.rsplit(".", 1)[0])
        if style == "colwise":
            rows = rows // 8
        elif style == "rowwise" and p.dim() == 2:
            rest = rest // 8
        expected += _chunk(rows, 32) * rest * 4
    assert held.parameter_bytes == held.trained_bytes == expected
    assert expected > 70e9 * 4 / 512  # (the vocabulary's tables stay whole on the tensor ranks)
    assert held.units == 80 + 3  # the blocks, the embedding, the head, the root


def _holdings_on_rank(rank, world_size, layout):
    from polytrain.strategies import Strategy
    from polytrain.strategies.holdings import local_bytes

    torch.manual_seed(0)
    model = _small(meta=False)
    strategy = Strategy(
        device=torch.device("cpu"),
        rank=rank,
        world_size=world_size,
        layout=layout,
        plan=_tensor_plan(layout, model),
    )
    strategy.setup(model, lambda named: torch.optim.AdamW([p for _, p in named]), lambda optimizer: None)
    return local_bytes(strategy.model.parameters())


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [Layout(shard=2), Layout(tensor=2), Layout(context=2), Layout(shard=2, tensor=2)],
    ids=["dp_shard=2", "tp=2", "cp=2", "dp_shard=2,tp=2"],
)
def test_what_the_plan_counts_is_what_rank_0_of_a_real_run_holds_to_the_byte(layout):
    from distributed import run_on_ranks

    real = run_on_ranks(_holdings_on_rank, layout, world_size=layout.world_size)
    planned = holdings_at_full_size(_small, layout, tensor_plan=_tensor_plan(layout, _small()))
    assert planned.parameter_bytes == real[0]
    assert real[0] == max(real)  # rank 0 holds the most


def _pipeline_plan(layout: Layout):
    from polytrain.config.train import TrainConfig
    from polytrain.scaling.cluster_plan import pipeline_plan

    settings = settings_of(layout)
    config = TrainConfig(devices=layout.world_size, batch_size=8 * layout.data_degree, **settings)
    assert config.layout == layout
    request = PlanRequest(_small, "llama", layout.world_size, gpu_named("h100"), 8 * layout.data_degree, 16)
    return pipeline_plan(request, config, _small())


def _pipeline_holdings_on_rank(rank, world_size, layout):
    from polytrain.pipeline.strategy import Pipeline
    from polytrain.strategies.holdings import local_bytes

    torch.manual_seed(0)
    plan = _pipeline_plan(layout)
    strategy = Pipeline(
        device=torch.device("cpu"), rank=rank, world_size=world_size, layout=layout, plan=plan
    )
    strategy.setup(_small(meta=False), lambda named: torch.optim.AdamW([p for _, p in named]), lambda o: None)
    return local_bytes(strategy.model.parameters())


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [Layout(pipeline=2), Layout(shard=2, pipeline=2), Layout(pipeline=2, tensor=2, context_in="replicate")],
    ids=["pp=2", "dp_shard=2,pp=2", "pp=2,tp=2"],
)
def test_a_pipeline_s_stages_as_planned_are_what_its_ranks_hold_to_the_byte(layout):
    """The pipeline's own set-up on the fake process group, its model left on the meta device, against a real run
    of the same plan: rank 0 (the embedding's stage) and the last stage's first rank (the head's)."""
    from distributed import run_on_ranks

    real = run_on_ranks(_pipeline_holdings_on_rank, layout, world_size=layout.world_size)
    plan = _pipeline_plan(layout)
    last = layout.rank_with(0, pipeline=1)
    for rank in (0, last):
        planned = holdings_at_full_size(_small, layout, pipeline_plan=plan, rank=rank)
        assert planned.parameter_bytes == real[rank], rank


def test_a_layout_the_code_refuses_at_full_size_is_refused_with_its_line():
    """A tensor degree above the model's key/value heads, as at run time."""
    request = PlanRequest(_small, "llama", 8, gpu_named("h100"), 8, 16)
    row = plan_layout(request, Layout(shard=2, tensor=4), None)
    assert row.limit == "refused" and "key/value heads" in row.refused
    assert not row.fits


def test_a_borrowed_degree_is_named_and_set_from_the_layout_s_table_alone(monkeypatch):
    """The layout's words, `--layout`, the labels and the presets' flags read the degrees borrowed from the others'
    ranks from layout.py `BORROWED`: renamed there, each follows; taken out, none shows it."""
    from polytrain.parallel import layout as layouts
    from polytrain.parallel.presets import LAYOUT_SETTINGS, flags_of, label

    experts = Layout(shard=4, expert=2)
    assert "expert_parallel" in LAYOUT_SETTINGS and flags_of("sharded", experts) == {"expert_parallel": 2}
    monkeypatch.setitem(layouts.BORROWED, "expert", "xp")
    monkeypatch.setitem(layouts.BORROWED_WORDS, "expert", "{} expert ranks")
    assert experts.words() == "dp_shard=4,xp=2" and parse_layout("dp_shard=4,xp=2", 4) == experts
    assert label("sharded", experts) == "sharded xp2" and experts.describe() == "4 shards, 2 expert ranks"
    monkeypatch.delitem(layouts.BORROWED, "expert")
    assert experts.named() == {"shard": 4} and label("sharded", experts) == "sharded"
    assert settings_of(experts) == {"strategy": "sharded"}


def test_layouts_and_gpus_are_read_in_one_line_each():
    assert parse_layout("dp_shard=8,tp=8", 64) == Layout(shard=8, tensor=8)
    # the expert degree borrows its ranks from the shards (and their context ranks): no factor of the world
    experts = Layout(shard=4, context=2, expert=4)
    assert parse_layout(experts.words(), 8) == experts and experts.words() == "dp_shard=4,cp=2,ep=4"
    settings = settings_of(experts)
    assert layout_of(settings.pop("strategy"), 8, **settings) == experts
    with pytest.raises(Exception, match="must divide them"):
        Layout(shard=4, expert=3)
    assert Layout(replicate=4, expert=2).expert_holders == 4  # DDP's copies lend theirs (--strategy data)
    with pytest.raises(Exception, match="none to borrow from"):
        Layout(replicate=2, pipeline=2, expert=2)  # a pipeline's replicas
    with pytest.raises(Exception, match="--strategy sharded"):
        Layout(replicate=2, context=2, context_in="replicate", expert=2)  # copies beside context ranks
    with pytest.raises(Exception, match="product is 64"):
        parse_layout("dp_shard=8,tp=4", 64)
    with pytest.raises(Exception, match="NAME=SIZE"):
        parse_layout("fsdp=8", 8)
    with pytest.raises(Exception, match="h100, h100-pcie, h200"):
        gpu_named("h900")
    assert gpu_named("H100-SXM") is GPUS["h100"]
    request = PlanRequest(_small, "llama", 8, gpu_named("h100"), 8, 16)
    found = candidate_layouts(request)
    assert all(layout.world_size == 8 and 8 % layout.data_degree == 0 for layout in found)
    assert Layout(shard=8) in found and Layout(shard=2, context=2, tensor=2) in found
    assert len({layout.words() + str(layout.data_parallel) for layout in found}) == len(found)
    # each is a layout the presets make, and the flags that make it make it back (its words too)
    for layout in found:
        settings = settings_of(layout)
        assert layout_of(settings.pop("strategy"), 8, **settings) == layout, layout
        if layout.context == layout.world_size:  # `cp=8` says not how its ranks hold: FSDP2, as sharded
            assert parse_layout(layout.words(), 8) == Layout(context=layout.context)
        else:
            assert parse_layout(layout.words(), 8) == layout, layout


def test_bf16_activations_are_measured_in_bf16():
    """The memory check counted activations in float32 whatever the precision (1.75x too much in bf16 on a GPU):
    under autocast the saved matrix products are half the bytes."""
    from polytrain.objective import Objective
    from polytrain.scaling.activation_memory import activation_profile

    model, x = _small(), torch.zeros(1, 16, dtype=torch.long)
    fp32 = activation_profile(model, Objective(kind="language"), x, x)
    bf16 = activation_profile(model, Objective(kind="language"), x, x, precision="bf16")
    assert bf16["block_matmul_bytes"] == pytest.approx(fp32["block_matmul_bytes"] / 2, rel=0.02)
    assert bf16["activation_bytes"] < 0.75 * fp32["activation_bytes"]
    assert bf16["attention"].element_bytes == 2


def test_the_plan_ranks_fitting_layouts_by_speed_and_tells_more_gpus_from_less_memory():
    big = PlanRequest(_small, "llama", 4, gpu_named("h100"), 8, 16)
    told = []  # the progress of each layout as it is built (the command's line on a terminal)
    built = make_plan_table(big, progress=lambda row, done, layouts: told.append((row.layout, done, layouts)))
    assert [done for _, done, _ in told] == list(range(1, len(built) + 1))
    assert {layouts for *_, layouts in told} == {len(built)} and {row.layout for row in built} == {
        layout for layout, *_ in told
    }
    rows = [row for row in built if not row.refused]  # (tp=4: the 2 key/value heads refuse it)
    assert rows and all(row.fits for row in rows)
    speeds = [row.tokens_per_second_per_device for row in rows]
    assert speeds == sorted(speeds, reverse=True)
    sharded = next(row for row in rows if row.layout == Layout(shard=4))
    copies = next(row for row in rows if row.layout == Layout(replicate=4))
    assert sharded.parameters * 4 == pytest.approx(copies.parameters, rel=0.05)  # (uneven chunks round up)
    assert copies.optimizer == 2 * copies.gradients == 2 * copies.parameters  # AdamW's two slots
    # FSDP2 gathers units whole in bf16; DDP under autocast keeps a bf16 copy of every weight for the backward
    assert copies.buffers == copies.parameters / 2 and sharded.buffers > 0


def test_layouts_planned_by_forked_planners_are_those_one_process_plans_even_where_a_planner_dies(
    monkeypatch,
):
    """`polytrain plan` spreads the layouts over forks of its process (one per CPU): the table is the one this
    process alone makes, row for row; a planner that dies mid-way leaves its layouts to this process."""
    import dataclasses
    import sys
    import threading

    from polytrain.scaling import cluster_plan, forked

    request = PlanRequest(_small, "llama", 8, gpu_named("h100"), 16, 16)
    alone = make_plan_table(request, workers=1)
    assert len(alone) > 8 and any(row.refused for row in alone) and any(row.fits for row in alone)
    in_forks = make_plan_table(request, workers=2)
    assert [dataclasses.asdict(row) for row in in_forks] == [dataclasses.asdict(row) for row in alone]

    here, plan_layout_ = os.getpid(), cluster_plan.plan_layout

    def dies_in_a_fork(request, layout, work):
        if os.getpid() != here and layout.tensor > 1:
            os._exit(3)  # a planner killed (out of memory, a signal) in the middle of its layouts
        return plan_layout_(request, layout, work)

    monkeypatch.setattr(cluster_plan, "plan_layout", dies_in_a_fork)
    told = []
    survived = make_plan_table(request, workers=2, progress=lambda row, done, layouts: told.append(done))
    assert [dataclasses.asdict(row) for row in survived] == [dataclasses.asdict(row) for row in alone]
    assert sorted(told) == list(range(1, len(alone) + 1))
    assert forked.fork_count(3) == 1  # (a few layouts: this process alone)
    with monkeypatch.context() as alone_here:  # this process's only thread of Python: a fork per CPU
        alone_here.setattr(threading, "active_count", lambda: 1)
        assert forked.fork_count(400) == (len(os.sched_getaffinity(0)) if sys.platform == "linux" else 1)
    waiting = threading.Event()  # another thread of Python, as a notebook's kernel runs: no forks
    other = threading.Thread(target=waiting.wait)
    other.start()
    try:
        assert forked.fork_count(400) == 1
    finally:
        waiting.set()
        other.join()


def test_forked_map_gives_results_in_order_with_what_lived_before_kept_out_of_the_collector_s_scans():
    """scaling/forked.py: results in the items' order from forks (a closure, not pickled) and here; while 4 pieces
    or more run, what lived before is frozen (out of the collector's scans) and unfrozen after, and what a caller
    froze itself stays frozen."""
    import gc

    from polytrain.scaling.forked import forked_map

    offset = 7  # (read by the closure in each fork)
    assert forked_map(lambda x: x * x + offset, list(range(9)), workers=2) == [x * x + 7 for x in range(9)]
    seen = forked_map(lambda x: gc.get_freeze_count(), [1, 2, 3, 4], workers=1)
    assert min(seen) > 0 and gc.get_freeze_count() == 0
    assert forked_map(lambda x: gc.get_freeze_count(), [1, 2], workers=1) == [0, 0]  # (a few: nothing frozen)
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        forked_map(lambda x: x, [1, 2, 3, 4], workers=1)
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


@pytest.mark.multiprocess
def test_ctrl_c_stops_a_plan_and_its_forks_at_once():
    """SIGINT to the command alone (a terminal's Ctrl-C reaches its forks too, which only makes it quicker) while
    the forks build the 179 layouts of Llama 3 8B on 64 GPUs: the command says it was interrupted and exits 130
    within seconds, its forks gone with it, instead of building the layouts already queued first."""
    import signal
    import sys
    import time

    from processes import ENV, children

    argv = [sys.executable, "-m", "polytrain", "plan", "--model", "llama", "--size", "8b", "--devices", "64"]
    argv += ["--batch-size", "256", "--context", "8192"]
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, **ENV)
    )
    try:
        deadline, wanted = time.monotonic() + 120, 2 if len(os.sched_getaffinity(0)) >= 2 else 0
        while len(children(process.pid)) < wanted and time.monotonic() < deadline:  # its forks at work
            time.sleep(0.2)
        forks = children(process.pid)
        assert len(forks) >= wanted, "the plan never forked"
        time.sleep(2)
        process.send_signal(signal.SIGINT)
        began = time.monotonic()
        out, _ = process.communicate(timeout=60)
        assert time.monotonic() - began < 10, out[-2000:]
        assert process.returncode == 130 and "polytrain: interrupted" in out, out[-2000:]
        time.sleep(1)
        assert not [pid for pid in forks if os.path.exists(f"/proc/{pid}")], "a fork outlived the command"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_plan_command_prints_its_table_and_writes_json_and_a_picture(capfd, tmp_path):
    out = tmp_path / "plan.json"
    done = polytrain_here(
        capfd, "plan", "--model", "llama", "--layers", 2, "--width", 64, "--heads", 4, "--kv-heads", 2,
        "--ffn-width", 128, "--vocab-size", VOCAB, "--context", 16, "--devices", 4, "--batch-size", 8,
        "--json", out, "--png", tmp_path / "plan.png",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "tok/s/GPU" in done.stdout and "dp_shard=4" in done.stdout
    objects = json.loads(out.read_text())
    assert {"layout", "memory_gib", "tokens_per_second_per_device", "fits"} <= set(objects[0])
    assert (tmp_path / "plan.png").stat().st_size > 0
    # the train command's flags name one layout, as --layout does; the plan gives the flags of its first
    model = ["--layers", 2, "--width", 64, "--heads", 4, "--kv-heads", 2, "--ffn-width", 128, "--context", 16]
    one = polytrain_here(
        capfd, "plan", *model, "--devices", 8, "--batch-size", 8, "--strategy", "tensor", "--tensor-parallel", 2,
        "--context-parallel", 2,
    )  # fmt: skip
    assert one.returncode == 0 and "(1 layout built" in one.stdout, one.stdout + one.stderr
    assert "dp_shard=2,cp=2,tp=2 " in one.stdout
    assert "train the first with: --strategy tensor --context-parallel 2 --tensor-parallel 2 --devices 8" in (
        one.stdout
    )
    for argv, words in (
        (["--tensor-parallel", 2], "add --strategy"),
        (["--strategy", "sharded", "--layout", "dp_shard=8"], "drop --strategy"),
        (["--strategy", "tensor", "--tensor-parallel", 3], "divide --devices 8"),
    ):
        refused = polytrain_here(capfd, "plan", *model, "--devices", 8, "--batch-size", 8, *argv)
        assert refused.returncode == 2 and words in refused.stderr, refused.stderr
        assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    wrong = polytrain_here(capfd, "plan", "--devices", 4, "--batch-size", 8, "--gpu", "h900")
    assert wrong.returncode != 0 and wrong.stderr.strip().splitlines()[-1].endswith(", ".join(GPUS)), (
        wrong.stderr
    )


def test_no_layout_that_fits_says_the_smallest_need(capfd):
    done = polytrain_here(
        capfd, "plan", "--size", "8b", "--context", 1024, "--devices", 2, "--batch-size", 2, "--gpu", "l40s",
        "--layout", "dp_shard=2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "dp_shard=2 does not fit 2 x 45 GiB" in done.stdout and "over" in done.stdout
    assert "the fewest GPUs that fit are 4 (" in done.stdout


def test_a_hugging_face_config_is_planned_without_its_weights(capfd, tmp_path):
    config = dict(
        architectures=["LlamaForCausalLM"], num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=16,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "plan.json"
    done = polytrain_here(
        capfd, "plan", "--hf-config", tmp_path, "--devices", 2, "--batch-size", 4, "--layout", "dp_shard=2",
        "--json", out,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    ours = holdings_at_full_size(_small, Layout(shard=2))
    assert json.loads(out.read_text())[0]["memory_split_gib"]["parameters"] * 2**30 == ours.parameter_bytes
    config["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(config))
    wrong = polytrain_here(capfd, "plan", "--hf-config", tmp_path, "--devices", 2, "--batch-size", 4)
    assert wrong.returncode != 0 and "--hf-config: " in wrong.stderr and "silu" in wrong.stderr


class _TinyLM(torch.nn.Module):
    """A language model of the user's own: (batch, context) token ids in, logits out."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 30)
        self.mix = torch.nn.Linear(30, 30)
        self.head = torch.nn.Linear(30, VOCAB)

    def forward(self, ids):
        return self.head(torch.relu(self.mix(self.embedding(ids))))


def test_plan_from_python_takes_a_name_or_a_function_that_builds_the_model():
    import polytrain
    from polytrain.errors import UserError

    rows = polytrain.plan("llama", devices=8, batch_size=16, vocab_size=VOCAB, **SMALL)
    assert len(rows) == len(candidate_layouts(PlanRequest(_small, "x", 8, GPUS["h100"], 16, 16, layers=4)))
    speeds = [row["tokens_per_second_per_device"] for row in rows if row["fits"] and "refused" not in row]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) > 10
    # a row's layout, as a dict of degrees or in its words, plans that layout again
    for given in (rows[0]["layout"], rows[0]["layout_words"]):
        (again,) = polytrain.plan("llama", devices=8, batch_size=16, vocab_size=VOCAB, layout=given, **SMALL)
        assert (
            again["layout_words"] == rows[0]["layout_words"] and again["memory_gib"] == rows[0]["memory_gib"]
        )
    # a model of the user's, built on the meta device by its class: rank 0's shard is torch.chunk's of each
    # parameter (31 rows cut over 4 ranks: 8 each, the last 7)
    mine = dict(context=16, activation_checkpointing="none")  # (it has no blocks to recompute)
    (row,) = polytrain.plan(_TinyLM, devices=4, batch_size=8, layout="dp_shard=4", **mine)
    expected = sum(4 * math.ceil(p.shape[0] / 4) * p[0].numel() for p in _TinyLM().parameters())
    assert row["memory_split_gib"]["parameters"] * 2**30 == pytest.approx(expected, rel=1e-12)
    assert row["fits"] and row["memory_split_gib"]["activations"] > 0
    (refused,) = polytrain.plan(_TinyLM, devices=2, batch_size=8, layout="tp=2", **mine)
    assert "tensor_plan" in refused["refused"] and not refused["fits"]
    with pytest.raises(UserError, match="context=T"):
        polytrain.plan(_TinyLM, devices=2, batch_size=8)
    with pytest.raises(UserError, match="layers=, width="):
        polytrain.plan("llama", devices=2, batch_size=8, depth=3)


def test_a_mixture_of_experts_is_planned_with_the_parameters_a_token_uses():
    from polytrain.models.moe import GroupedExperts
    from polytrain.scaling.cluster_plan import model_work

    def build():
        return build_model_on_meta("llama", (16,), VOCAB, dict(SMALL, experts=4, experts_per_token=1))

    model = build()
    experts = sum(p.numel() for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
    embedding = model[0].weight.numel()
    total = sum(p.numel() for p in model.parameters())
    work = model_work(PlanRequest(build, "moe", 2, GPUS["h100"], 4, 16))
    assert experts > 0 and work.dense_parameters == total - embedding - experts * 3 / 4  # 1 expert of 4 used
    import polytrain

    rows = polytrain.plan(
        "llama", devices=2, batch_size=4, vocab_size=VOCAB, experts=4, experts_per_token=1, **SMALL
    )
    assert rows[0]["fits"] and rows[0]["tokens_per_second_per_device"] > 0


def test_expert_parallelism_is_planned_with_its_all_to_alls_and_its_smaller_gathers():
    """A plan of a mixture of experts lists each FSDP2 layout (beside tensor ranks and pipeline stages too) with its
    experts over P of the shards too; a row with them counts 4 all-to-alls per mixture (a rank's tokens to their K
    experts and back, forward and backward), over its stage's mixtures only in a pipeline; its degrees come back as
    the same layout."""
    import polytrain
    from polytrain.scaling.cluster_time import _link, _ring

    moe = dict(SMALL, vocab_size=VOCAB, experts=4, experts_per_token=2)
    planned = {row["layout_words"]: row for row in polytrain.plan("llama", devices=4, batch_size=8, **moe)}
    split = {
        "dp_shard=4,ep=2",
        "dp_shard=4,ep=4",
        "dp_shard=2,cp=2,ep=2",
        "dp_shard=2,tp=2,ep=2",
        "dp_shard=2,pp=2,ep=2",
    }
    assert split <= set(planned)
    assert all(planned[words]["fits"] for words in split)  # (built at full size, not refused)
    assert not any(
        "ep=" in w and "dp_shard" not in w and "cp=" not in w for w in planned
    )  # (nothing to borrow)
    # a pipeline's rank exchanges its 4 sequences for its stage's 1 mixture, its ranks 2 apart (the stages between)
    staged = planned["dp_shard=2,pp=2,ep=2"]["exposed_communication_seconds"]["experts"]
    request = SimpleNamespace(gpus_per_node=8, gpu=GPUS["h100"])
    nbytes = 4 * 16 * 2 * 64 * 2
    assert staged == pytest.approx(4 * 1 * _ring("all-to-all", 2, nbytes, *_link(request, 4)), rel=1e-9)
    rows = {
        layout: polytrain.plan(
            "llama", devices=4, batch_size=8, layout=layout, activation_checkpointing="none", **moe
        )[0]
        for layout in ("dp_shard=4", "dp_shard=4,ep=2")
    }
    # 2 sequences of 16 tokens a rank, each token to 2 experts of width 64 in bf16, in each of the 2 blocks
    expected = 4 * 2 * _ring("all-to-all", 2, 2 * 16 * 2 * 64 * 2, *_link(request, 2))
    ep = rows["dp_shard=4,ep=2"]
    assert ep["exposed_communication_seconds"]["experts"] == pytest.approx(expected, rel=1e-9)
    assert "experts" not in rows["dp_shard=4"]["exposed_communication_seconds"]
    assert ep["layout"] == {"shard": 4, "expert": 2}
    again = polytrain.plan(
        "llama", devices=4, batch_size=8, layout=ep["layout"], activation_checkpointing="none", **moe
    )
    assert again[0]["layout_words"] == "dp_shard=4,ep=2" and again[0]["step_seconds"] == ep["step_seconds"]


def test_auto_checkpointing_takes_the_least_recomputation_that_fits_each_layout():
    import polytrain

    shape = dict(layers=2, heads=4, kv_heads=2, width=64, ffn_width=128, vocab_size=VOCAB, context=2048)
    for batch, expected in ((1024, "none"), (4096, "full"), (16384, "full")):
        asked = dict(devices=1, batch_size=batch, gpu="l40s", layout="single", **shape)
        rows = {
            mode: polytrain.plan("llama", activation_checkpointing=mode, **asked)[0]
            for mode in ("none", "selective", "full", "auto")
        }
        chosen = rows["auto"]
        assert chosen["activation_checkpointing"] == expected
        # the auto row is the explicit mode's row: its bytes and its step
        for key in ("memory_gib", "step_seconds", "fits"):
            assert chosen[key] == rows[expected][key], key
        fitting = [mode for mode in ("none", "selective", "full") if rows[mode]["fits"]]
        assert expected == (fitting[0] if fitting else "full")
    assert rows["auto"]["fits"] is False  # (the last batch fits no mode: the most saving one shown)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--devices", 0, "--batch-size", 8], "--devices must be a positive whole number, got 0"),
        (["--devices", 2, "--batch-size", -1], "--batch-size must be a positive whole number, got -1"),
        (["--devices", 2, "--batch-size", 8, "--context", 0], "--context must be a positive whole number"),
        (["--devices", 2, "--batch-size", 8, "--activation-checkpointing", "bogus"], "give auto, or one of"),
        (["--devices", 2, "--batch-size", 8, "--model", "gpt", "--size", "8b"], "--size names a shape of"),
        (["--devices", 2, "--batch-size", 8, "--experts", 4, "--moe-every", 0], "--moe-every must be"),
        (["--devices", 2, "--batch-size", 8, "--layers", 2, "--experts", 4, "--moe-every", 3], "at most --moe-every 2"),
        (["--devices", 8, "--batch-size", 8, "--strategy", "sharded", "--tensor-parallel", 4], "--strategy tensor"),
        (["--devices", 2, "--batch-size", 8, "--json", "/nonexistent/dir/x.json"], "does not exist"),
        (["--devices", 2, "--batch-size", 8, "--png", "plan.txt"], "ending in .png"),
    ],
    ids=["devices", "batch", "context", "checkpointing", "size", "moe-every", "moe-every-layers", "strategy-flag",
         "json-folder", "png-name"],
)  # fmt: skip
def test_what_a_plan_cannot_take_is_refused_in_one_line_before_planning(capfd, argv, words):
    done = polytrain_here(capfd, "plan", *argv)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and words in done.stderr, done.stderr


def test_plan_from_python_refuses_what_is_not_a_model_in_one_line():
    import polytrain
    from polytrain.errors import UserError

    for model, words in ((_TinyLM(), "not a built model"), (lambda: 5, "returned int, not an nn.Module")):
        with pytest.raises(UserError, match=words):
            polytrain.plan(model, devices=2, batch_size=8, context=16, activation_checkpointing="none")
    with pytest.raises(UserError, match="--batch-size must be a positive whole number, got '64'"):
        polytrain.plan("llama", devices=2, batch_size="64")


def test_tensor_ranks_of_the_llama_keep_half_its_blocks_activations_sequence_parallel(monkeypatch):
    """The built-in Llama's tensor plan runs its norms on parts of the sequence (a Llama with mixtures does not:
    its router sees whole sequences), so a rank of 2 keeps 1/2 of one device's block activations, not
    (10 + 24/2) / 34 (Korthikanti et al., Table 2): one device's less a rank's is 17/12 as much as without."""
    import polytrain
    import polytrain.strategies.tensor as tensor

    assert _tensor_plan(Layout(tensor=2), _small()).sequence_parallel
    mixture = build_model_on_meta("llama", (16,), VOCAB, dict(SMALL, experts=4))
    assert not _tensor_plan(Layout(tensor=2), mixture).sequence_parallel
    shape = dict(layers=2, heads=4, kv_heads=2, width=64, ffn_width=128, vocab_size=VOCAB, context=2048)

    def activations(layout):
        asked = dict(devices=layout.world_size, batch_size=8, gpu="h100", layout=layout.words() or "single")
        (row,) = polytrain.plan("llama", activation_checkpointing="none", **asked, **shape)
        return row["memory_split_gib"]["activations"], row.get("sequence_parallel")

    (one, _), (split, sequence) = activations(Layout()), activations(Layout(tensor=2))
    monkeypatch.setattr(tensor, "_cuts_sequence", lambda *args: False)
    whole, without = activations(Layout(tensor=2))
    assert sequence is True and without is False
    assert (one - split) / (one - whole) == pytest.approx(17 / 12)
