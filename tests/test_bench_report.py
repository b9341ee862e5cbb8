"""The bench's arithmetic on rows and timings made by hand: the split of a step, the link fit, speedups,
explanations, the pick of --strategy auto, and the files it writes and reads back."""

import json
import math

import pytest

from polytrain.cli import main
from polytrain.errors import ConfigError
from polytrain.parallel.layout import Layout
from polytrain.parallel.presets import plain_layout
from polytrain.planning.costmodel import Link, Prediction, Workload
from polytrain.planning.memory import memory_per_rank
from polytrain.runtime.bench import (
    BenchOptions,
    BenchResult,
    Row,
    combinations,
    fill_speedups,
    link_of,
    summarize,
)
from polytrain.runtime.bench_report import draw, explain, report, table, write_json
from polytrain.scaling.auto import describe, measured_choice, pick, read_plan
from polytrain.scaling.workload import link_for
from polytrain.strategies.parameter_server import ParameterServer

MS = 1e-3
WORK = Workload(
    compute_seconds=10 * MS,
    parameter_bytes=1.76e6,
    batch_size=64,
    update_seconds=1 * MS,
    layers=4,
    boundary_bytes=(1000.0, 500.0),
    replica_seconds={2: 8 * MS},
    microbatch_seconds={2: 2 * MS},
)


def rank(number, steps, *, window, reference=None, held=100, link=None):
    return {
        "rank": number,
        "device": "cpu",
        "steps": steps,
        "window": window,
        "reference": reference,
        "held_bytes": held,
        "peak_bytes": None,
        "threads": 1,
        "link": link,
    }


def test_a_strategy_that_reports_nothing_is_split_by_the_replica_reference():
    # two steps of 20 ms train_step + 1 ms data; the replica alone takes 12 ms; 2 ms between steps
    steps = [{"step": 20 * MS, "data": 1 * MS}, {"step": 20 * MS, "data": 1 * MS}]
    row = Row("cpu", "data", 2, 64)
    summarize(
        row,
        [
            rank(0, steps, window=46 * MS, reference=12 * MS),
            rank(1, steps, window=46 * MS, reference=12 * MS),
        ],
    )
    assert row.step_seconds == pytest.approx(23 * MS)
    assert row.samples_per_second == pytest.approx(64 / 0.023)
    assert row.phases == pytest.approx(
        {"compute": 12 * MS, "communication": 8 * MS, "all-to-all": 0.0, "data": 1 * MS, "idle": 2 * MS}
    )


def test_phases_a_strategy_reports_are_taken_as_they_are_and_the_rest_is_compute():
    steps = [{"step": 30 * MS, "data": 0.0, "idle": 10 * MS, "communication": 5 * MS}]
    row = Row("cpu", "pipeline", 2, 64)
    summarize(row, [rank(0, steps, window=30 * MS, held=300), rank(1, steps, window=30 * MS, held=500)])
    assert row.phases == pytest.approx(
        {"compute": 15 * MS, "communication": 5 * MS, "all-to-all": 0.0, "data": 0.0, "idle": 10 * MS}
    )
    assert row.held_bytes == 500


def test_a_workers_pull_waits_while_the_server_updates_which_is_idle_time():
    server = [{"step": 20 * MS, "data": 0.0, "communication": 4 * MS, "server_update": 3 * MS}]
    worker = [{"step": 20 * MS, "data": 0.0, "communication": 5 * MS}]
    settled = ParameterServer.settle_phases([server, worker])
    assert settled[0][0]["communication"] == pytest.approx(4 * MS) and "idle" not in server[0]
    assert settled[1][0]["communication"] == pytest.approx(2 * MS)
    assert settled[1][0]["idle"] == pytest.approx(3 * MS)
    row = Row("cpu", "parameter-server", 2, 64)
    summarize(row, [rank(0, server, window=20 * MS), rank(1, worker, window=20 * MS)])
    # rank 0: 16 compute + 4 comm; rank 1: 15 compute + 2 comm + 3 idle
    assert row.phases == pytest.approx(
        {"compute": 15.5 * MS, "communication": 3 * MS, "all-to-all": 0.0, "data": 0.0, "idle": 1.5 * MS}
    )


def test_the_link_is_fitted_to_a_ring_all_reduce_over_the_ranks_that_timed_it():
    alpha, beta, n = 100e-6, 1e9, 4
    timings = {
        size: 2 * (n - 1) / n * size / beta + 2 * (n - 1) * alpha for size in (4096, 65536, 1 << 20, 8 << 20)
    }
    rows = [Row("cpu", "data", n, 64, link=timings), Row("cpu", "data", 8, 64, link={1: 1.0, 2: 5.0})]
    link, how = link_of(rows, "cpu", cores=4)
    assert link.alpha == pytest.approx(alpha) and link.beta == pytest.approx(beta)
    assert "4 cpu processes of the data run" in how
    assert link_of(rows, "cuda") is None
    # 4 processes on 2 cores took turns while they timed it: the link is what one rank per core sees, and
    # the cost model adds the turns back for 4 processes, not twice
    shared, _ = link_of(rows, "cpu", cores=2)
    assert shared.alpha == pytest.approx(alpha / 2) and shared.beta == pytest.approx(beta)
    assert link_for(shared, 4, device_type="cpu", cores=2).alpha == pytest.approx(alpha)


def test_one_device_is_the_baseline_of_every_kind_and_batch_and_speedups_are_against_it():
    rows = combinations(
        BenchOptions(
            devices=(1, 2, 4),
            strategies=("data", "single", "pipeline"),
            batch_sizes=(64, 512),
            device_kinds=("cpu",),
        )
    )
    assert [(r.strategy, r.devices, r.batch_size) for r in rows[:5]] == [
        ("single", 1, 64),
        ("data", 2, 64),
        ("data", 4, 64),
        ("pipeline", 2, 64),
        ("pipeline", 4, 64),
    ]
    assert len(rows) == 10
    base, two, lost = (
        Row("cpu", "single", 1, 64, step_seconds=0.010),
        Row("cpu", "data", 2, 64, step_seconds=0.004),
        Row("cpu", "data", 4, 64, skipped="why"),
    )
    fill_speedups([base, two, lost])
    assert two.speedup == pytest.approx(2.5) and two.efficiency == pytest.approx(1.25)
    assert math.isnan(lost.speedup)


def test_a_combination_that_cannot_run_is_a_row_that_says_why():
    lines = table([Row("cuda", "data", 2, 64, skipped="no CUDA GPU here")])
    assert lines[-1].split() == ["cuda", "data", "2", "64", "skipped:", "no", "CUDA", "GPU", "here"]


def phases(compute, communication=0.0, data=0.0, idle=0.0):
    return {"compute": compute, "communication": communication, "data": data, "idle": idle}


def test_communication_that_makes_more_devices_lose_is_explained_with_the_batch_that_fixes_it():
    base = Row("cpu", "single", 1, 64, step_seconds=10 * MS, phases=phases(10 * MS))
    # 20 ms: 8 compute, 12 communication (60%); 8x the batch: 12 / (12 + 64) = 16% <= 20%
    slow = Row("cpu", "data", 2, 64, step_seconds=20 * MS, phases=phases(8 * MS, 12 * MS))
    lines = explain([base, slow], {("cpu", 64): WORK}, cores=2)
    assert lines == [
        "  data on 2 cpu, batch 64 is slower (20.0 ms/step against 10.0 ms on 1 device): communication "
        "is 60% of each step: 1.8 MB of gradients per 32-sample slice; a global batch of 512 would make "
        "it 16%"
    ]
    fast = Row("cpu", "data", 2, 64, step_seconds=6 * MS, phases=phases(4 * MS, 2 * MS))
    assert explain([base, fast], {("cpu", 64): WORK}) == []


def test_a_pipeline_bubble_and_compute_that_does_not_split_are_explained():
    base = Row("cpu", "single", 1, 64, step_seconds=10 * MS, phases=phases(10 * MS))
    pipe = Row("cpu", "pipeline", 2, 64, step_seconds=20 * MS, phases=phases(10 * MS, 0, 0, 10 * MS))
    shared = Row("cpu", "data", 4, 64, step_seconds=12 * MS, phases=phases(11 * MS, 1 * MS))
    gpu_base = Row("cuda", "single", 1, 64, step_seconds=1 * MS, phases=phases(1 * MS))
    gpu = Row("cuda", "data", 2, 64, step_seconds=1.2 * MS, phases=phases(1.1 * MS, 0.1 * MS))
    # the bubble with 8 micro-batches is 1/9 = 0.11: idle at 20% of a step is the bubble, at 50% mostly waits
    bubbly = Row("cpu", "pipeline", 2, 64, step_seconds=20 * MS, phases=phases(16 * MS, 0, 0, 4 * MS))
    pipe_line, shared_line, gpu_line = explain([base, pipe, shared, gpu_base, gpu], {}, cores=2)
    assert (
        "idle is 50% of each step against a pipeline bubble (p-1)/(m+p-1) of 0.11 with 8 micro-batches: the rest "
        "is stages waiting for each other's activations" in pipe_line
    )
    assert "fewer (--microbatches 2) remove some" in pipe_line
    [bubble_line] = explain([base, bubbly], {}, cores=2)
    assert (
        "idle is 20% of each step: the pipeline bubble (p-1)/(m+p-1) is 0.11 with 8 micro-batches; "
        "--microbatches 32 would make it 0.03"
    ) in bubble_line
    assert (
        "compute is 11.0 ms per step against 10.0 ms on one device: 4 processes share 2 cores" in shared_line
    )
    assert "a 32-sample slice keeps a GPU busy no shorter than the whole batch" in gpu_line


def test_auto_picks_the_fastest_that_can_run_and_fits_in_memory():
    link = Link(alpha=1e-4, beta=1e9)
    best, predictions, fits = pick(WORK, link, devices=2, device_type="cuda", refused={}, available=1e12)
    assert best.strategy == min(predictions.values(), key=lambda p: p.step_seconds).strategy
    # memory too small for a whole replica: only the sharded strategy fits
    need = {
        name: memory_per_rank(WORK, p.layout, servers=int(p.strategy == "parameter-server"))
        for name, p in predictions.items()
    }
    assert need["sharded"] < min(need["data"], need["parameter-server"])
    best, _, fits = pick(
        WORK, link, devices=2, device_type="cuda", refused={"pipeline": "no"}, available=need["sharded"]
    )
    assert best.strategy == "sharded" and not fits["data"] and not fits["pipeline"]


def test_memory_per_rank_by_hand():
    # S = 1.76e6 bytes, SGD with momentum: weights + gradients + 1 slot; activations 1500 bytes per sample
    assert memory_per_rank(WORK, plain_layout("data", 2)) == pytest.approx(3 * 1.76e6 + 1500 * 32)
    assert memory_per_rank(WORK, plain_layout("parameter-server", 2), servers=1) == pytest.approx(
        2 * 1.76e6 + 2 * 1.76e6 + 1500 * 32
    )
    assert memory_per_rank(WORK, plain_layout("sharded", 2)) == pytest.approx(
        1.5 * 1.76e6 + 1.76e6 + 1500 * 32
    )
    assert memory_per_rank(WORK, plain_layout("pipeline", 2), optimizer_slots=2) == pytest.approx(
        2 * 1.76e6 + 750 * 64
    )


def test_auto_says_when_one_device_would_be_faster():
    predictions = {
        "data": Prediction("data", 2, 9 * MS, 3 * MS),
        "sharded": Prediction("sharded", 2, 9 * MS, 9 * MS),
    }
    line = describe(predictions["data"], predictions, 10 * MS, devices=2, kind="cpu", source="a test")
    assert line == (
        "--strategy auto: data on 2 cpu device(s), predicted 12.0 ms/step (others, ms: sharded 18.0; one "
        "device 10.0), from a test; one device would be faster: 2 are predicted at 0.83x its speed"
    )


def result_with(rows):
    options = BenchOptions(devices=(1, 2), strategies=("data",), batch_sizes=(64,), predict=(4,))
    return BenchResult(
        options,
        rows,
        {("cpu", 64): WORK},
        {"cpu": (Link(2e-4, 1e9), "measured: a test")},
        [("cpu", 64, 4, {"data": Prediction("data", 4, 4 * MS, 1 * MS)}, "data")],
    )


def test_bench_json_round_trips_into_the_plan_that_auto_reads(tmp_path):
    rows = [
        Row("cpu", "single", 1, 64, step_seconds=10 * MS, samples_per_second=6400, phases=phases(10 * MS)),
        Row(
            "cpu", "data", 2, 64, step_seconds=8 * MS, samples_per_second=8000, phases=phases(6 * MS, 2 * MS)
        ),
        Row(
            "cpu",
            "sharded",
            2,
            64,
            step_seconds=7 * MS,
            samples_per_second=9000,
            phases=phases(5 * MS, 2 * MS),
        ),
        Row("cpu", "pipeline", 2, 64, skipped="why"),
    ]
    fill_speedups(rows)
    result = result_with(rows)
    write_json(result, tmp_path / "bench.json")
    draw(result, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads((tmp_path / "bench.json").read_text())
    assert [r["strategy"] for r in document["rows"]] == ["single", "data", "sharded", "pipeline"]
    assert document["projections"][0]["chosen"] == "data"
    name, settings, line = measured_choice(
        str(tmp_path / "bench.json"), device_type="cpu", devices=2, batch_size=64
    )
    assert (name, settings) == ("sharded", {}) and "measured fastest at 7.0 ms/step" in line
    assert measured_choice(str(tmp_path / "bench.json"), device_type="cpu", devices=4, batch_size=64) is None
    work, link, source = read_plan(str(tmp_path / "bench.json"), device_type="cpu", batch_size=128)
    assert work.batch_size == 128 and work.pass_seconds == pytest.approx(2 * WORK.pass_seconds)
    assert work.replica_seconds == {2: pytest.approx(16 * MS)} and link == Link(2e-4, 1e9)
    assert "batch 64, scaled to 128" in source
    text = "\n".join(report(result))
    assert "4 cpu (processes sharing this machine's cores), batch 64: would pick data" in text
    assert "link (cpu): 200 us per message, 1.00 GB/s; measured: a test" in text


def test_a_plan_keeps_the_default_format_measurement_and_reads_files_without_it(tmp_path):
    from dataclasses import replace

    plain = replace(
        WORK, compute_seconds=15 * MS, replica_seconds={2: 12 * MS}, microbatch_seconds={2: 3 * MS}
    )
    result = result_with([Row("cpu", "single", 1, 64, step_seconds=10 * MS, phases=phases(10 * MS))])
    result.workloads[("cpu", 64)] = replace(WORK, plain=plain)
    write_json(result, tmp_path / "bench.json")
    work, _, _ = read_plan(str(tmp_path / "bench.json"), device_type="cpu", batch_size=128)
    assert work.plain.pass_seconds == pytest.approx(2 * plain.pass_seconds)
    assert work.plain.replica_seconds == {2: pytest.approx(24 * MS)} and work.plain.batch_size == 128
    assert work.in_format(True) is work.plain and work.in_format(False) is work
    document = json.loads((tmp_path / "bench.json").read_text())
    del document["workloads"][0]["plain"]  # a file from before the plain measurement
    (tmp_path / "old.json").write_text(json.dumps(document))
    old, _, _ = read_plan(str(tmp_path / "old.json"), device_type="cpu", batch_size=64)
    assert old.plain is None and old.in_format(True) is old


def test_strategies_that_cannot_train_channels_last_say_so_and_do_not():
    import torch

    from polytrain.strategy_registry import STRATEGIES, contiguous_strategies

    assert set(contiguous_strategies()) == {"pipeline", "sharded", "tensor"}
    for name in ("single", "data", "parameter-server"):
        assert STRATEGIES[name].keeps_channels_last
    asked = STRATEGIES["single"](device=torch.device("cpu"), channels_last=True)
    assert asked.channels_last

    sharded = STRATEGIES["sharded"](
        device=torch.device("cpu"), world_size=2, layout=Layout(shard=2), channels_last=True
    )
    assert not sharded.channels_last


@pytest.mark.parametrize(
    "content, words",
    [
        ("not json", "is not a bench.json written by polytrain bench (JSONDecodeError)"),
        ('{"rows": 3}', "no rows, workloads or links"),
        ('{"rows": [], "workloads": [], "links": {}}', "holds no measurement on cpu"),
    ],
)
def test_a_malformed_plan_is_one_line(tmp_path, content, words):
    path = tmp_path / "bench.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as refused:
        read_plan(str(path), device_type="cpu", batch_size=64)
    assert words in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--strategies", "data,nope"], "--strategies: unknown strategy 'nope'"),
        (["--model", "vgg"], "--model: unknown model 'vgg'"),
        (["--devices", "0,2"], "--devices takes positive whole numbers"),
        (["--batch-sizes", "sixty"], "--batch-sizes takes positive whole numbers"),
        (["--device", "tpu"], "--device: unknown device kind 'tpu'"),
        (["--devices", "1,500"], "CPU processes would only take turns"),
    ],
)
def test_bench_mistakes_are_one_line(capsys, tmp_path, argv, words):
    code = main(["bench", "--device", "cpu", *argv, "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("polytrain: error:") and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "b").exists()


def test_auto_keeps_data_parallelism_unless_another_is_clearly_faster():
    link = Link(alpha=1e-4, beta=1e9)
    _, predictions, _ = pick(WORK, link, devices=2, device_type="cuda", refused={}, available=1e12)
    data = predictions["data"].step_seconds
    close = Workload(**{**WORK.__dict__, "update_seconds": 0.0})  # no update to split: sharded only pays more
    assert pick(close, link, devices=2, device_type="cuda", refused={}, available=1e12)[0].strategy == "data"
    # a large update that sharding splits 2 ways makes sharded clearly faster
    heavy = Workload(**{**WORK.__dict__, "compute_seconds": 0.1, "update_seconds": 0.09})
    best, predictions, _ = pick(
        heavy, link, devices=2, device_type="cuda", refused={"pipeline": "no"}, available=1e12
    )
    assert best.strategy == "sharded" and best.step_seconds * 1.1 < predictions["data"].step_seconds
    assert data > 0


def test_the_median_round_is_kept():
    from polytrain.runtime.bench import median_row

    runs = [Row("cpu", "data", 2, 64, step_seconds=s) for s in (0.03, 0.01, 0.02)]
    assert median_row(runs).step_seconds == 0.02
    assert median_row(runs[:2]).step_seconds == 0.01
    assert median_row([Row("cpu", "data", 2, 64, skipped="why")]).skipped == "why"


def test_a_relative_fit_lets_small_messages_set_the_latency():
    # 8 MB messages 3% faster than the line: an unweighted fit moves alpha by 10%
    sizes = [4096, 65536, 1 << 20, 8 << 20]
    seconds = [1e-4 + s / 1e9 for s in sizes]
    seconds[-1] *= 0.97
    assert Link.fit(sizes, seconds, relative=True).alpha == pytest.approx(1e-4, rel=0.01)
    assert Link.fit(sizes, seconds).alpha > 1.05e-4


def test_measured_slices_replace_the_even_split():
    from polytrain.planning.costmodel import data_parallel, pipeline

    link = Link(alpha=1e-4, beta=1e9)
    even = Workload(
        compute_seconds=WORK.compute_seconds,
        parameter_bytes=WORK.parameter_bytes,
        batch_size=64,
        update_seconds=WORK.update_seconds,
        boundary_bytes=WORK.boundary_bytes,
    )
    assert data_parallel(even, 2, link).compute == pytest.approx(9 * MS / 2 + 1 * MS)
    assert data_parallel(WORK, 2, link).compute == pytest.approx(8 * MS + 1 * MS)  # replica_seconds[2]
    # a pipeline slot is one micro-batch's pass over one stage: 2 ms / 2 stages
    assert pipeline(WORK, 2, link, microbatches=8).idle == pytest.approx(1 * MS)


def test_auto_measures_in_this_process_and_names_its_pick():
    import torch
    from conftest import tiny_digits

    from polytrain.config import TrainConfig
    from polytrain.objective import Objective
    from polytrain.scaling.auto import choose_strategy

    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(784, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
    )
    config = TrainConfig(devices=2, batch_size=32, device="cpu")
    name, settings, line = choose_strategy(
        config, model, tiny_digits(), Objective(), device=torch.device("cpu"), channels_last=False
    )
    assert name in ("data", "parameter-server", "sharded", "pipeline") and settings == {}  # (no mesh of 2)
    assert (
        line.startswith(f"--strategy auto: {name} on 2 cpu device(s), predicted ") and "a few seconds" in line
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--devices", "2", "--strategy", "data", "--plan", "x.json"], "--plan chooses for --strategy auto"),
        (["--plan", "x.json"], "--plan chooses a strategy for several devices"),
        (["--devices", "2", "--plan", "missing.json"], "--plan missing.json: no such file"),
    ],
)
def test_plan_mistakes_are_one_line(capsys, tmp_path, argv, words):
    from conftest import assert_refused_in_one_line

    assert_refused_in_one_line(
        capsys,
        tmp_path / "run",
        [*argv, "--device", "cpu", "--dataset", "synthetic", "--synthetic-size", "64"],
        [words],
    )


def test_a_convolutional_workload_is_measured_in_both_memory_formats():
    import torch
    from conftest import tiny_digits

    from polytrain.objective import Objective
    from polytrain.scaling.workload import measure_workload

    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 26 * 26, 10)
    )
    common = dict(batch_size=16, device=torch.device("cpu"), devices=[2], repeats=1)
    work = measure_workload(model, tiny_digits(), Objective(), channels_last=True, plain=True, **common)
    assert work.plain is not None and work.plain.plain is None
    assert set(work.plain.replica_seconds) == {2} and work.plain.compute_seconds > 0
    assert (
        work.plain.parameter_bytes == work.parameter_bytes
        and work.plain.boundary_bytes == work.boundary_bytes
    )
    assert (
        measure_workload(model, tiny_digits(), Objective(), channels_last=False, plain=True, **common).plain
        is None
    )


def test_fewer_micro_batches_are_advised_only_as_a_count_that_divides_the_batch_and_every_torch_runs():
    base = Row("cpu", "single", 1, 100, step_seconds=10 * MS, phases=phases(10 * MS))
    # 3 stages, batch 100: 10 micro-batches by default; 3 does not divide 100, 4 does
    pipe = Row("cpu", "pipeline", 3, 100, step_seconds=50 * MS, phases=phases(20 * MS, 0, 0, 30 * MS))
    [line] = explain([base, pipe], {}, cores=2)
    assert (
        "idle is 60% of each step against a pipeline bubble (p-1)/(m+p-1) of 0.17 with 10 micro-batches"
        in line
    )
    assert "fewer (--microbatches 4) remove some" in line


def test_a_count_the_batch_does_not_split_into_is_a_line_that_says_so():
    result = result_with([Row("cpu", "single", 1, 64, step_seconds=10 * MS, phases=phases(10 * MS))])
    result.projections.append(("cpu", 64, 3, {}, None))
    text = "\n".join(report(result))
    assert (
        "  3 cpu, batch 64: not projected: a global batch of 64 does not split into 3 equal slices; give "
        "--batch-sizes a multiple of 3"
    ) in text
    assert "4 cpu (processes sharing this machine's cores), batch 64: would pick data" in text


def test_projections_cover_every_count_asked_for():
    from polytrain.runtime.bench import project

    options = BenchOptions(devices=(1, 2), strategies=("data",), batch_sizes=(64,), predict=(1, 3, 4))
    projected = project(options, {("cpu", 64): WORK}, {"cpu": Link(2e-4, 1e9)})
    assert [(n, chosen) for _, _, n, _, chosen in projected] == [(3, None), (4, "data")]
    assert projected[0][3] == {} and set(projected[1][3]) == {
        "data",
        "parameter-server",
        "sharded",
        "sharded 2x2",  # hybrid sharding: projected, but not what --strategy auto picks from
        "pipeline",
    }


def test_experts_exchanges_are_a_phase_of_their_own_and_the_busiest_expert_rank_is_named():
    # 20 ms steps, the replica alone 12 ms: 8 ms outside compute, of which 5 ms the expert groups timed in their
    # all-to-alls; rank 1's experts computed 300 (token, choice) pairs to rank 0's 100
    steps = [{"step": 20 * MS, "data": 0.0, "all-to-all": 5 * MS, "routed": 50}] * 2
    busy = [{"step": 20 * MS, "data": 0.0, "all-to-all": 5 * MS, "routed": 150}] * 2
    row = Row("cpu", "data", 2, 64, layout=Layout(replicate=2, expert=2))
    summarize(
        row,
        [rank(0, steps, window=40 * MS, reference=12 * MS), rank(1, busy, window=40 * MS, reference=12 * MS)],
    )
    assert row.phases == pytest.approx(
        {"compute": 12 * MS, "communication": 3 * MS, "all-to-all": 5 * MS, "data": 0.0, "idle": 0.0}
    )
    assert row.imbalance == pytest.approx(1.5)  # 300 against a mean of 200
    assert row.label == "data ep2" and row.layout.expert == 2
    rows = [Row("cpu", "single", 1, 64, step_seconds=30 * MS, phases={}), row]
    fill_speedups(rows)
    assert any(
        "data ep2 on 2 cpu, batch 64: all-to-all 5.0 ms per step; the busiest expert rank computed 1.50x"
        in line
        for line in table(rows)
    )


def test_a_mixture_of_experts_is_benched_with_its_experts_split_over_each_count_that_divides_them():
    options = BenchOptions(
        model="llama", devices=(1, 2, 4), strategies=("single", "data", "sharded", "pipeline"), experts=4,
        device_kinds=("cpu",),
    )  # fmt: skip
    split = {(r.label, r.devices) for r in combinations(options) if r.layout.expert > 1}
    assert split == {
        ("data ep2", 2), ("data ep2", 4), ("data ep4", 4), ("sharded ep2", 2), ("sharded ep2", 4),
        ("sharded ep4", 4),
    }  # fmt: skip
    dense = BenchOptions(model="llama", devices=(1, 2), strategies=("data",), device_kinds=("cpu",))
    assert not any(r.layout.expert > 1 for r in combinations(dense))
