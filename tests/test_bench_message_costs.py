"""Each strategy's cost per message inside a step: fitted to its row on the fewest devices, used for its other
rows, written into bench.json and read back by --plan; on rows and workloads made by hand."""

import json

import pytest
from test_bench_report import MS, WORK, phases

from polytrain.errors import ConfigError
from polytrain.parallel.layout import Layout
from polytrain.planning.costmodel import Link, Workload
from polytrain.runtime.bench import BenchOptions, BenchResult, Row, fit_message_costs, predict_rows
from polytrain.runtime.bench_report import report, table, write_json
from polytrain.scaling.auto import read_message_costs
from polytrain.scaling.workload import predictions_for


def test_each_strategy_is_fitted_on_its_fewest_devices_and_predicted_elsewhere(tmp_path):
    link = Link(2e-4, 1e9)
    big = Workload(
        compute_seconds=50 * MS,
        parameter_bytes=1.76e6,
        batch_size=512,
        update_seconds=1 * MS,
        layers=4,
        boundary_bytes=(1000.0, 500.0),
        replica_seconds={2: 30 * MS, 4: 20 * MS},
    )
    works = {("cpu", 64): WORK, ("cpu", 512): big}
    rows = [
        Row("cpu", strategy, n, batch, step_seconds=ms * MS, phases=phases(ms * MS))
        for strategy, n, batch, ms in [
            ("single", 1, 64, 10),
            ("single", 1, 512, 50),
            ("sharded", 4, 512, 90),
            ("sharded", 2, 512, 60),
            ("sharded", 2, 64, 40),
            ("data", 4, 512, 70),
        ]
    ]
    rows.insert(5, Row("cpu", "data", 2, 64, skipped="why"))
    costs = fit_message_costs(rows, works, {"cpu": link})
    fitted = [(r.strategy, r.devices, r.batch_size) for r in rows if r.fitted]
    assert costs["cpu"]["data"] > 0 and costs["cpu"]["sharded"] > 0
    assert fitted == [("sharded", 2, 64), ("data", 4, 512)]  # fewest devices, then the smallest batch; ran
    alone = predictions_for(WORK, link, devices=2, kind="cpu")["sharded"]  # gloo: 16 messages
    assert alone.messages == 16
    assert costs["cpu"]["sharded"] == pytest.approx((40 * MS - alone.step_seconds) / 16)
    predict_rows(rows, works, {"cpu": link}, costs)
    by = {(r.strategy, r.devices, r.batch_size): r for r in rows}
    assert by["sharded", 2, 64].predicted_seconds == pytest.approx(40 * MS)  # fitted to it
    four = predictions_for(big, link, devices=4, kind="cpu")["sharded"]
    assert by["sharded", 4, 512].predicted_seconds == pytest.approx(
        four.step_seconds + four.messages * costs["cpu"]["sharded"]
    )
    assert by["single", 1, 64].predicted_seconds == WORK.compute_seconds and not by["single", 1, 64].fitted
    line = {(r.strategy, r.devices, r.batch_size): text for r, text in zip(rows, table(rows)[2:])}
    assert line["sharded", 2, 64].endswith(f"{40:.1f} (fitted)")
    error = by["sharded", 4, 512].predicted_seconds / (90 * MS) - 1
    assert line["sharded", 4, 512].endswith(f"({error:+.0%})") and "fitted" not in line["sharded", 4, 512]
    # written into bench.json and read back by --plan
    result = BenchResult(BenchOptions(), rows, works, {"cpu": (link, "measured: a test")}, [], costs)
    write_json(result, tmp_path / "bench.json")
    assert read_message_costs(str(tmp_path / "bench.json"), device_type="cpu") == pytest.approx(costs["cpu"])
    cost = costs["cpu"]["sharded"] * 1e3
    assert (
        f"per message inside a step (cpu), fitted to each strategy's row marked 'fitted': sharded {cost:.2f} ms"
        in "\n".join(report(result))
    )


def test_plans_without_message_costs_read_as_none_and_malformed_ones_are_one_line(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": [], "workloads": [], "links": {"cpu": {"alpha": 1e-4, "beta": 1e9}}}))
    assert read_message_costs(str(path), device_type="cpu") == {}
    path.write_text(
        json.dumps(
            {
                "rows": [],
                "workloads": [],
                "links": {"cpu": {"alpha": 1e-4, "beta": 1e9, "message_costs": {"data": "fast"}}},
            }
        )
    )
    with pytest.raises(ConfigError) as refused:
        read_message_costs(str(path), device_type="cpu")
    assert "its message_costs are not numbers by strategy" in str(refused.value) and "\n" not in str(
        refused.value
    )


def test_a_row_the_model_already_predicts_too_slow_fits_no_cost_and_shows_its_error():
    link = Link(2e-4, 1e9)
    slow = Row(
        "cpu", "sharded", 2, 64, step_seconds=1 * MS, phases=phases(1 * MS)
    )  # faster than the link allows
    costs = fit_message_costs([slow], {("cpu", 64): WORK}, {"cpu": link})
    assert costs == {"cpu": {"sharded": 0.0}} and not slow.fitted
    predict_rows([slow], {("cpu", 64): WORK}, {"cpu": link}, costs)
    assert table([slow])[2].endswith("%)") and "fitted" not in table([slow])[2]


def test_an_all_to_all_s_cost_is_fitted_to_the_first_row_with_experts_split_and_read_back(tmp_path):
    from polytrain.planning.experts import ALL_TO_ALL
    from polytrain.scaling.auto import read_plan

    link = Link(2e-4, 1e9)
    moe = Workload(
        compute_seconds=50 * MS, parameter_bytes=4e6, batch_size=64, update_seconds=2 * MS, layers=4,
        boundary_bytes=(1000.0, 500.0), replica_seconds={2: 30 * MS}, mixtures=2, experts=4, expert_bytes=3e6,
        routed_bytes=4000.0,
    )  # fmt: skip
    works = {("cpu", 64): moe}
    rows = [
        Row("cpu", "single", 1, 64, step_seconds=50 * MS, phases=phases(50 * MS)),
        Row("cpu", "data", 2, 64, step_seconds=40 * MS, phases=phases(40 * MS)),
        Row(
            "cpu",
            "data",
            2,
            64,
            step_seconds=48 * MS,
            phases=phases(48 * MS),
            layout=Layout(replicate=2, expert=2),
        ),
    ]
    costs = fit_message_costs(rows, works, {"cpu": link})
    assert [r.fitted for r in rows] == [
        False,
        True,
        True,
    ]  # data on its plain row, the all-to-all on data ep2
    split = predictions_for(moe, link, devices=2, kind="cpu", message_costs={"data": costs["cpu"]["data"]})
    assert costs["cpu"][ALL_TO_ALL] == pytest.approx((48 * MS - split["data ep2"].step_seconds) / 8)
    predict_rows(rows, works, {"cpu": link}, costs)
    assert rows[2].predicted_seconds == pytest.approx(48 * MS)
    result = BenchResult(BenchOptions(), rows, works, {"cpu": (link, "measured: a test")}, [], costs)
    write_json(result, tmp_path / "bench.json")
    assert read_message_costs(str(tmp_path / "bench.json"), device_type="cpu") == pytest.approx(costs["cpu"])
    work = read_plan(str(tmp_path / "bench.json"), device_type="cpu", batch_size=64)[0]
    assert (work.mixtures, work.experts, work.expert_bytes, work.routed_bytes) == (2, 4, 3e6, 4000.0)
    assert "all-to-all" in "\n".join(report(result)) and " per call" in "\n".join(report(result))
