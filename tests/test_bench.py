"""`polytrain bench` as users run it, and `--strategy auto` choosing from what it wrote."""

import json

import pytest
from processes import polytrain

from polytrain.parallel.presets import plain_layout
from polytrain.scaling.auto import simplest_first, steady_name

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # batch 30: 2 devices divide it, 4 do not (a row that says why, before any process starts); no GPU here
    result = polytrain(
        "bench",
        "--model",
        "mlp",
        "--devices",
        "1,2,4",
        "--strategies",
        "data,pipeline",
        "--batch-sizes",
        "30",
        "--device",
        "cpu,cuda",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--predict",
        "3",
        "--out",
        out,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, json.loads((out / "bench.json").read_text()), out


def test_every_combination_gets_a_progress_line_and_a_row(bench_run):
    stdout, document, _ = bench_run
    rows = {(r["device"], r["strategy"], r["devices"]): r for r in document["rows"]}
    assert len(rows) == 10 and stdout.count("bench ") >= 10
    ran = [rows[("cpu", "single", 1)], rows[("cpu", "data", 2)], rows[("cpu", "pipeline", 2)]]
    for row in ran:
        assert row["skipped"] == "" and row["samples_per_second"] == pytest.approx(30 / row["step_seconds"])
        assert sum(row["phases"].values()) == pytest.approx(row["step_seconds"])
        assert all(value >= 0 for value in row["phases"].values())
        assert len(row["ranks"]) == row["devices"] and row["held_bytes"] > 0
    assert rows[("cpu", "single", 1)]["speedup"] == 1.0
    assert rows[("cpu", "data", 2)]["phases"]["communication"] > 0
    assert rows[("cpu", "data", 2)]["ranks"][0]["reference"] > 0  # compute timed on a plain replica
    assert rows[("cpu", "pipeline", 2)]["phases"]["idle"] > 0  # the bubble, reported by the strategy
    assert "does not divide evenly" in rows[("cpu", "data", 4)]["skipped"]
    assert rows[("cuda", "data", 2)]["skipped"] == "no CUDA GPU here"
    # mlp's weights, gradients and momentum: 3 x (784*128 + 128 + 128*64 + 64 + 64*10 + 10) x 4 bytes
    assert rows[("cpu", "data", 2)]["held_bytes"] == 3 * 109_386 * 4


def test_the_table_the_prediction_and_the_files(bench_run):
    stdout, document, out = bench_run
    assert "samples/s" in stdout and "speedup" in stdout and "predicted" in stdout
    assert (
        "cpu    data              4    30 skipped: --batch-size 30 (the global batch) does not divide"
        in stdout
    )
    assert "3 cpu (processes sharing this machine's cores), batch 30: would pick" in stdout
    assert document["links"]["cpu"]["how"].startswith("measured: all-reduces between the 2 cpu processes")
    work = document["workloads"][0]
    assert work["parameter_bytes"] == 109_386 * 4 and set(work["replica_seconds"]) == {"2", "3"}
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_auto_takes_the_fastest_strategy_the_bench_measured(bench_run, tmp_path):
    _, document, out = bench_run
    rows = [r for r in document["rows"] if r["device"] == "cpu" and r["devices"] == 2 and not r["skipped"]]
    measured = {r["strategy"]: r["step_seconds"] for r in rows}
    places = {r["strategy"]: simplest_first(r["strategy"], plain_layout(r["strategy"], 2)) for r in rows}
    fastest = steady_name(measured, places)  # or the simpler of two within 10% of each other
    result = polytrain(
        "train",
        "--model",
        "mlp",
        "--devices",
        "2",
        "--batch-size",
        "30",
        "--epochs",
        "1",
        "--max-steps",
        "2",
        "--device",
        "cpu",
        "--plan",
        out / "bench.json",
        "--out",
        tmp_path / "run",
    )
    assert result.returncode == 0, result.stderr
    assert f"--strategy auto: {fastest} on 2 cpu device(s), measured " in result.stdout
    assert json.loads((tmp_path / "run" / "config.json").read_text())["strategy"] == fastest


def test_auto_trains_the_hybrid_layout_a_bench_file_measured_fastest(bench_run, tmp_path):
    """A `sharded 2x2` row measured fastest: the run is hybrid sharding (--strategy sharded --replicas 2), said
    so, and recorded so. The rows as files written before rows carried their layout have them: the settings
    beside --strategy."""
    _, document, _ = bench_run
    old = {key: value for key, value in document["rows"][0].items() if key != "layout"}
    rows = [
        dict(old, strategy=strategy, devices=4, batch_size=32, step_seconds=ms * 1e-3, skipped="",
             replicas=replicas, tensor_parallel=0)
        for strategy, ms, replicas in (("data", 10.0, 0), ("sharded", 12.0, 0), ("sharded", 5.0, 2))
    ]  # fmt: skip
    plan = tmp_path / "bench.json"
    plan.write_text(json.dumps(dict(document, rows=document["rows"] + rows)))
    result = polytrain(
        "train", "--model", "mlp", "--devices", "4", "--batch-size", "32", "--epochs", "1", "--max-steps", "2",
        "--device", "cpu", "--plan", plan, "--out", tmp_path / "run",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (
        f"--strategy auto: sharded 2x2 on 4 cpu device(s), measured fastest at 5.0 ms/step in {plan} "
        "(--strategy sharded --replicas 2)"
    ) in result.stdout
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (recorded["strategy"], recorded["replicas"]) == ("sharded", 2)
    assert recorded["strategy_plan"]["summary"] == "shards on each device"  # the replicas: recorded above


def test_bench_takes_every_model_setting_the_command_line_has():
    """`polytrain bench` hands every model setting to BenchOptions: one added to the models and not here would
    make every bench fail before it starts (a TypeError)."""
    import dataclasses

    from polytrain.config.model_defaults import MODEL_SETTINGS
    from polytrain.runtime.bench import BenchOptions

    fields = {field.name for field in dataclasses.fields(BenchOptions)}
    assert set(MODEL_SETTINGS) <= fields, sorted(set(MODEL_SETTINGS) - fields)
