"""`--strategy auto` and `polytrain bench` with tensor parallelism, on workloads and rows made by hand: auto
takes tensor only where it is predicted clearly faster or alone fits; the bench runs tensor rows (and data x
tensor meshes) only for a model with a plan, fits tensor's cost per message once for all its layouts, explains
its collectives, and writes what --plan reads back."""

import json
from dataclasses import replace

import pytest

from polytrain.models import build_model
from polytrain.parallel.layout import Layout
from polytrain.parallel.presets import flags_of, label, layout_of
from polytrain.planning.costmodel import Link, Prediction, Workload, tensor_parallel
from polytrain.planning.memory import memory_per_rank
from polytrain.planning.predict import predict_all
from polytrain.runtime.bench import (
    BenchOptions,
    BenchResult,
    Row,
    combinations,
    fit_message_costs,
    has_tensor_plan,
    predict_rows,
    row_config,
)
from polytrain.runtime.bench_report import report, table, write_json
from polytrain.scaling.auto import measured_choice, pick, read_plan, steady_choice

MS = 1e-3
LINK = Link(alpha=1e-4, beta=1e9)
# 40 MB of weights, all but 1 MB in the layers the plan splits; a slow link makes replicas' gradient exchanges
# (40 MB each) cost far more than tensor parallelism's activations (8 all-reduces of 64 x 1 KB)
HEAVY = Workload(
    compute_seconds=0.1,
    parameter_bytes=4e7,
    batch_size=64,
    update_seconds=0.01,
    layers=4,
    activation_bytes=1000.0,
    tensor_splits=(2, 4),
    split_bytes=3.9e7,
    split_share=0.9,
    tensor_reductions=(1024.0,) * 8,
)


def test_auto_takes_tensor_where_it_is_predicted_clearly_faster_than_every_other():
    # unpriced (no bench file measured tensor's cost per message), tensor is not taken for speed
    best, _, _ = pick(HEAVY, LINK, devices=2, device_type="cuda", refused={}, available=1e12)
    assert best.strategy == "data"
    best, predictions, fits = pick(
        HEAVY, LINK, devices=2, device_type="cuda", refused={}, available=1e12, message_costs={"tensor": 0.0}
    )
    # data: 45 ms + 10 ms + 2 x 1/2 x 40 ms + 0.2 ms = 95.2 ms; tensor: 90 x 0.55 + 10 x 20.5/40 + 8 x 0.47 ms
    # (each all-reduce's 2 ring messages cost alpha twice: latency and their rank's CPU time)
    assert predictions["data"].step_seconds == pytest.approx(0.0952)
    assert predictions["tensor"].step_seconds == pytest.approx(0.0495 + 0.005125 + 8 * (65536e-9 + 4e-4))
    assert best.strategy == "tensor" and all(fits.values())


def test_auto_keeps_data_parallelism_when_tensor_is_faster_by_less_than_the_margin_or_slower():
    predictions = {
        "data": Prediction("data", 2, 10 * MS, 0.0),
        "tensor": Prediction("tensor", 2, 9.5 * MS, 0.0),
    }
    assert steady_choice(predictions).strategy == "data"  # 5% faster: not enough
    predictions["tensor"] = Prediction("tensor", 2, 8.5 * MS, 0.0)
    assert steady_choice(predictions).strategy == "tensor"  # 15% faster
    # a light model on a fast link: its activations' all-reduces cost more than its gradients'
    light = replace(HEAVY, parameter_bytes=4e5, split_bytes=3.9e5, tensor_reductions=(1e5,) * 8)
    best, predictions, _ = pick(light, LINK, devices=2, device_type="cuda", refused={}, available=1e12)
    assert predictions["tensor"].step_seconds > predictions["data"].step_seconds and best.strategy == "data"


def test_auto_takes_tensor_when_nothing_else_fits_in_memory():
    light = replace(HEAVY, parameter_bytes=4e5, split_bytes=3.9e5, tensor_reductions=(1e5,) * 8)
    need = {
        name: memory_per_rank(
            light, p.layout, optimizer_slots=2, servers=int(p.strategy == "parameter-server")
        )
        for name, p in predict_all(light, 2, LINK).items()
    }
    # AdamW, T = 2: (195 KB + 10 KB) x 4 and 64 samples' activations, against sharded's 400 KB x 4 / 2 + 400 KB
    # and 32 samples' (the model has no cuts: no pipeline, as `candidates` says)
    assert need["tensor"] == pytest.approx(4 * 2.05e5 + 64 * 1000)
    assert need["sharded"] == pytest.approx(4 * 4e5 / 2 + 4e5 + 32 * 1000)
    assert need["tensor"] < min(need["data"], need["sharded"], need["parameter-server"])
    best, predictions, fits = pick(
        light,
        LINK,
        devices=2,
        device_type="cuda",
        refused={"pipeline": "no cuts"},
        available=need["tensor"],
        optimizer="adamw",
    )
    assert best.strategy == "tensor" and [name for name, ok in fits.items() if ok] == ["tensor"]
    assert predictions["tensor"].step_seconds > predictions["data"].step_seconds  # slower, but it fits


def test_auto_considers_tensor_only_with_a_plan_and_its_meshes_priced_as_tensor_is():
    _, predictions, _ = pick(
        replace(HEAVY, tensor_splits=()), LINK, devices=2, device_type="cuda", refused={}, available=1e12
    )
    assert "tensor" not in predictions
    best, predictions, _ = pick(HEAVY, LINK, devices=4, device_type="cuda", refused={}, available=1e12)
    assert {"tensor", "tensor 2x2", "sharded 2x2"} <= set(predictions)
    # unpriced, no layout with tensor ranks is taken for speed: a (data, tensor) mesh no more than `tensor`
    assert predictions["tensor 2x2"].step_seconds < predictions["data"].step_seconds / 1.1
    assert best.strategy == "data"
    best, predictions, _ = pick(
        HEAVY, LINK, devices=4, device_type="cuda", refused={}, available=1e12, message_costs={"tensor": 0.0}
    )
    assert best.strategy == "tensor"  # 42.3 ms against tensor 2x2's 62.7 and data's 93.1


# 40 MB of weights and no tensor plan, over 8 ranks whose messages cost 1 ms each: FSDP2 over all 8 sends 7 x 3
# messages per layer, each copy of a hybrid layout fewer
SHARDABLE = replace(HEAVY, tensor_splits=(), split_bytes=0.0, split_share=0.0, tensor_reductions=())


def test_auto_takes_hybrid_sharding_where_predicted_clearly_faster_and_says_which_flags_it_means():
    need = {
        name: memory_per_rank(SHARDABLE, p.layout, servers=int(p.strategy == "parameter-server"))
        for name, p in pick(SHARDABLE, LINK, devices=8, device_type="cuda", refused={}, available=1e12)[
            1
        ].items()
    }
    room = max(need["sharded 4x2"], need["sharded 2x4"], need["sharded"]) + 1  # a replica does not fit
    assert need["data"] > room and need["parameter-server"] > room
    slow = Link(alpha=1e-3, beta=1e9)
    no_cuts = {"pipeline": "8 stages need 7 cuts, the model has 0"}  # as `candidates` says
    best, predictions, fits = pick(
        SHARDABLE, slow, devices=8, device_type="cuda", refused=no_cuts, available=room
    )
    assert [name for name, ok in fits.items() if ok] == ["sharded", "sharded 4x2", "sharded 2x4"]
    # 4 copies of 2 shards: 142.3 ms, clearly faster than 2 copies of 4 (157.8) and FSDP2 over all 8 (201.5)
    assert best.label == "sharded 4x2" and best.layout == Layout(replicate=4, shard=2)
    assert predictions["sharded 2x4"].step_seconds > best.step_seconds * 1.1
    # the flags that give a layout: the inverse of layout_of (made from the layout, no label read back)
    assert flags_of(best.strategy, best.layout) == {"replicas": 4}
    assert layout_of("sharded", 8, **flags_of(best.strategy, best.layout)) == best.layout
    assert flags_of("tensor", Layout(shard=2, tensor=4)) == {"tensor_parallel": 4}
    assert flags_of("data", Layout(replicate=8)) == {}
    assert flags_of("sharded", Layout(shard=4, context=2)) == {"context_parallel": 2}
    assert label("sharded", Layout(shard=4, context=2)) == "sharded cp2"
    # within 10% of each other, the layout nearest plain sharding is kept: fewer copies
    best, predictions, _ = pick(SHARDABLE, LINK, devices=8, device_type="cuda", refused={}, available=room)
    assert (
        predictions["sharded 4x2"].step_seconds
        < predictions["sharded 2x4"].step_seconds
        < (predictions["sharded 4x2"].step_seconds * 1.1)
    )
    assert best.label == "sharded 2x4"


def test_the_bench_runs_tensor_rows_and_meshes_only_for_a_model_with_a_plan():
    options = BenchOptions(
        model="gpt", dataset="shakespeare", devices=(1, 2, 4), strategies=("data", "tensor")
    )
    rows = combinations(options)
    assert [(r.strategy, r.devices, r.label) for r in rows] == [
        ("single", 1, "single"),
        ("data", 2, "data"),
        ("data", 4, "data"),
        ("tensor", 2, "tensor"),
        ("tensor", 4, "tensor"),
        ("tensor", 4, "tensor 2x2"),
    ]
    assert [r.strategy for r in combinations(options, tensor=False)] == ["single", "data", "data"]


def test_the_bench_runs_sharding_also_as_copies_of_shard_groups_of_two_four_and_eight():
    options = BenchOptions(model="mlp", devices=(1, 2, 4, 8), strategies=("sharded",))
    rows = combinations(options)
    assert [(r.devices, r.label, r.layout) for r in rows[1:]] == [
        (2, "sharded", Layout(shard=2)),
        (4, "sharded", Layout(shard=4)),
        (4, "sharded 2x2", Layout(replicate=2, shard=2)),
        (8, "sharded", Layout(shard=8)),
        (8, "sharded 4x2", Layout(replicate=4, shard=2)),
        (8, "sharded 2x4", Layout(replicate=2, shard=4)),
    ]
    hybrid = row_config(options, rows[3], epochs=1, max_steps=2)
    assert hybrid.replicas == 2 and hybrid.layout == Layout(replicate=2, shard=2)
    assert row_config(options, rows[2], epochs=1, max_steps=2).replicas is None
    assert has_tensor_plan(build_model("mlp", (1, 28, 28), 10))
    assert not has_tensor_plan(build_model("lenet", (1, 28, 28), 10))


def phases(step):
    return {"compute": step * 0.6, "communication": step * 0.4, "data": 0.0, "idle": 0.0}


def tensor_rows():
    return [
        Row("cpu", "single", 1, 64, step_seconds=100 * MS, phases=phases(100 * MS)),
        Row("cpu", "tensor", 2, 64, step_seconds=80 * MS, phases=phases(80 * MS)),
        Row("cpu", "tensor", 4, 64, step_seconds=120 * MS, phases=phases(120 * MS)),
        Row(
            "cpu",
            "tensor",
            4,
            64,
            step_seconds=90 * MS,
            phases=phases(90 * MS),
            layout=layout_of("tensor", 4, tensor_parallel=2),
        ),
    ]


def test_tensors_cost_per_message_is_fitted_on_its_fewest_devices_and_predicts_its_meshes(tmp_path):
    work = replace(HEAVY, sequence_splits=(2, 4), sequence_parameters=10, sequence_gathers=2)
    rows = tensor_rows()
    costs = fit_message_costs(rows, {("cpu", 64): work}, {"cpu": LINK})
    two = tensor_parallel(work, 2, LINK, scatter_by_allreduce=True)
    assert costs["cpu"]["tensor"] == pytest.approx(
        (80 * MS - two.step_seconds) / two.collectives
    )  # per collective
    assert [r.fitted for r in rows] == [False, True, False, False]
    predict_rows(rows, {("cpu", 64): work}, {"cpu": LINK}, costs)
    # 4 processes on 2 cores take turns: each message waits twice as long (the link's alpha doubles), and each
    # collective's host work takes twice as long; FSDP2's messages on the mesh at tensor's cost (no sharded row)
    turned = Link(alpha=2e-4, beta=1e9)
    for row, tensor in ((rows[2], 4), (rows[3], 2)):
        p = tensor_parallel(work, 4, turned, tensor=tensor, scatter_by_allreduce=True, turns=2)
        assert row.predicted_seconds == pytest.approx(
            p.step_seconds + (2 * p.collectives + p.shard_messages) * costs["cpu"]["tensor"]
        )
    lines = table(rows)
    assert lines[5].startswith("cpu    tensor 2x2        4    64")
    result = BenchResult(
        BenchOptions(devices=(1, 2, 4), strategies=("tensor",)),
        rows,
        {("cpu", 64): work},
        {"cpu": (LINK, "measured: a test")},
        [],
        costs,
    )
    text = "\n".join(report(result))
    assert (
        "tensor on 2 cpu, batch 64: 8 reduce-scatters (all-reduces on gloo) of up to 64 KiB, 10 all-gathers of "
        "up to 64 KiB, 30 small all-reduces of the norms' gradients per step over each group of 2 "
        "(sequence-parallel)"
    ) in text
    # each rank of a 2 x 2 mesh: 19.5 MB + 1 MB = 20.5 MB (19.6 MiB) of weights, sharded over the 2 groups
    assert (
        "tensor 2x2 on 4 cpu, batch 64: 8 reduce-scatters (all-reduces on gloo) of up to 32 KiB, 10 all-gathers "
        "of up to 32 KiB, 10 small all-reduces of the norms' gradients per step over each group of 2 "
        "(sequence-parallel); FSDP2 over 2 data shards: 2 all-gathers and a reduce-scatter per layer (4) of "
        "each rank's 19.6 MiB of weights"
    ) in text
    # tensor on 4 is slower than on 2 processes: its explanation names the collectives
    assert (
        "tensor on 4 cpu, batch 64 is slower (120.0 ms/step against 80.0 ms on 2 devices): communication is 40%"
        in text
    )
    # bench.json keeps the tensor measurements, which --plan reads back; a mesh row is a choice for auto
    write_json(result, tmp_path / "bench.json")
    work_back, _, _ = read_plan(str(tmp_path / "bench.json"), device_type="cpu", batch_size=64)
    assert work_back == work
    timed = replace(work, tensor_seconds={(2, 2): 0.05, (4, 2): 0.03})
    write_json(replace(result, workloads={("cpu", 64): timed}), tmp_path / "timed.json")
    assert read_plan(str(tmp_path / "timed.json"), device_type="cpu", batch_size=32)[
        0
    ].tensor_seconds == pytest.approx({(2, 2): 0.025, (4, 2): 0.015})  # compute scaled with the batch
    document = json.loads((tmp_path / "bench.json").read_text())
    assert [Layout(**r["layout"]) for r in document["rows"]] == [
        Layout(),
        Layout(tensor=2),
        Layout(tensor=4),
        layout_of("tensor", 4, tensor_parallel=2),
    ]
    assert (
        measured_choice(str(tmp_path / "bench.json"), device_type="cpu", devices=4, batch_size=64)[:2]
        == ("tensor", {"tensor_parallel": 2})  # tensor 2x2: 90 ms, against one group of 4's 120
    )


@pytest.mark.multiprocess
def test_bench_runs_a_tensor_row_of_the_mlp_beside_its_prediction(tmp_path):
    from processes import polytrain

    result = polytrain(
        "bench",
        "--model",
        "mlp",
        "--devices",
        "1,2",
        "--strategies",
        "tensor",
        "--batch-sizes",
        "16",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads((tmp_path / "bench.json").read_text())
    (row,) = [r for r in document["rows"] if r["strategy"] == "tensor"]
    assert (
        row["skipped"] == ""
        and row["fitted"]
        and row["predicted_seconds"] == pytest.approx(row["step_seconds"])
    )
    (work,) = document["workloads"]
    # the mlp's plan: 784 -> 128 by columns, 128 -> 64 by rows, one all-reduce of 64 floats per sample in forward
    assert (
        work["tensor_splits"] == [2]
        and work["tensor_reductions"] == [256.0]
        and "2/2" in work["tensor_seconds"]
    )
    assert (
        "tensor on 2 cpu, batch 16: 1 all-reduce of up to 4 KiB per step over each group of 2 (all-reduces "
        "after each row-wise layer in forward and before each column-wise one in backward)"
    ) in result.stdout


def test_auto_takes_a_measured_hybrid_row_as_its_layout_not_as_its_strategy(tmp_path):
    """bench.json's `sharded 2x2` row is its own layout: chosen, it is hybrid sharding (--replicas 2), and its
    (fast) time never stands for plain `sharded`'s."""
    options = BenchOptions(devices=(1, 4), strategies=("data", "sharded"), batch_sizes=(64,))
    rows = combinations(options)
    for row, ms in zip(rows, (40.0, 10.0, 12.0, 5.0)):  # single, data, sharded, sharded 2x2
        row.step_seconds = ms * MS
    assert [r.label for r in rows] == ["single", "data", "sharded", "sharded 2x2"]
    result = BenchResult(options, rows, {("cpu", 64): HEAVY}, {"cpu": (LINK, "a test")}, [], {})
    write_json(result, tmp_path / "bench.json")
    written = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["layout"]["replicate"] for r in written] == [1, 4, 1, 2]
    chosen = measured_choice(str(tmp_path / "bench.json"), device_type="cpu", devices=4, batch_size=64)
    assert chosen[:2] == ("sharded", {"replicas": 2}) and "sharded 2x2 on 4 cpu device(s)" in chosen[2]
    assert "fastest at 5.0 ms/step" in chosen[2]
    rows[3].step_seconds = 11.5 * MS  # within 10% of plain sharding, 15% slower than data
    write_json(replace(result, rows=rows), tmp_path / "bench.json")
    chosen = measured_choice(str(tmp_path / "bench.json"), device_type="cpu", devices=4, batch_size=64)
    assert chosen[:2] == ("data", {}) and "10.0 ms/step" in chosen[2]


def test_auto_takes_a_measured_row_with_its_experts_split_as_its_layout(tmp_path):
    """bench.json's `data ep2` row is its own layout (the row carries its `Layout`): chosen, it trains with
    --expert-parallel 2, and its time never stands for plain `data`'s, nor plain `data`'s for it."""
    options = BenchOptions(
        model="llama",
        devices=(1, 2),
        strategies=("data",),
        batch_sizes=(64,),
        experts=4,
        device_kinds=("cpu",),
    )
    rows = combinations(options)
    assert [r.label for r in rows] == ["single", "data", "data ep2"]
    for row, ms in zip(rows, (40.0, 10.0, 6.0)):
        row.step_seconds = ms * MS
    result = BenchResult(options, rows, {("cpu", 64): HEAVY}, {"cpu": (LINK, "a test")}, [], {})
    write_json(result, tmp_path / "bench.json")
    chosen = measured_choice(str(tmp_path / "bench.json"), device_type="cpu", devices=2, batch_size=64)
    assert chosen[:2] == ("data", {"expert_parallel": 2}) and "data ep2 on 2 cpu device(s)" in chosen[2]
    assert "fastest at 6.0 ms/step" in chosen[2]
    rows[2].step_seconds = 12.0 * MS
    write_json(replace(result, rows=rows), tmp_path / "bench.json")
    chosen = measured_choice(str(tmp_path / "bench.json"), device_type="cpu", devices=2, batch_size=64)
    assert chosen[:2] == ("data", {}) and "fastest at 10.0 ms/step" in chosen[2]
    # a file written before rows carried their layout names the degree beside --strategy
    document = json.loads((tmp_path / "bench.json").read_text())
    for row in document["rows"]:
        layout = row.pop("layout")
        row["expert_parallel"] = layout["expert"] if layout["expert"] > 1 else 0
    document["rows"][2]["step_seconds"] = 6.0 * MS
    (tmp_path / "old.json").write_text(json.dumps(document))
    chosen = measured_choice(str(tmp_path / "old.json"), device_type="cpu", devices=2, batch_size=64)
    assert chosen[:2] == ("data", {"expert_parallel": 2}) and "fastest at 6.0 ms/step" in chosen[2]
