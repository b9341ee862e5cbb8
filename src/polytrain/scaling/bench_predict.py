"""The cost model beside `polytrain bench`'s measured rows (runtime/bench.py): each strategy's cost per message fitted
to its row on the fewest devices, the predicted step of every row, and projections to the `--predict` counts
(the strategy `--strategy auto` would pick there)."""

from __future__ import annotations

from typing import Dict, Optional

from ..parallel.presets import mesh_of
from ..planning import costmodel
from ..planning.beside import fitted_beside
from .auto import steady_choice
from .workload import predictions_for


def fit_message_costs(rows: list, workloads: dict, links: dict) -> Dict[str, Dict[str, float]]:
    """Per device kind, each strategy's cost per message, fitted to its row on the fewest devices (then the
    smallest batch), which is marked `fitted`; the strategy's other rows are then predictions. Then the cost per
    call of each degree beside them that fits one (`DegreeCost.fitted`: the experts' all-to-all), on the first row
    that splits it."""
    costs: Dict[str, Dict[str, float]] = {}
    first = {}
    fitted = fitted_beside()
    for row in sorted(rows, key=lambda r: (r.devices, r.batch_size)):
        if row.devices > 1 and not row.skipped and row.key in workloads:
            if all(degree.size(row.layout) == 1 for degree in fitted):
                first.setdefault((row.device, row.strategy), row)
    for (kind, strategy), row in first.items():
        prediction = predictions_for(workloads[row.key], links[kind], devices=row.devices, kind=kind).get(
            row.label
        )
        if prediction is not None and prediction.messages:
            costs.setdefault(kind, {})[strategy] = cost = costmodel.fit_message_cost(
                row.step_seconds, prediction
            )
            row.fitted = cost > 0  # a model already slower than the row fits nothing: its error shows
    # then, where a degree was split that fits a cost per call, that cost on the first such row, its strategy's
    # cost per message given
    for degree in fitted:
        split = {}
        for row in sorted(rows, key=lambda r: (r.devices, r.batch_size)):
            if degree.size(row.layout) > 1 and not row.skipped and row.key in workloads and row.devices > 1:
                split.setdefault(row.device, row)
        for kind, row in split.items():
            prediction = predictions_for(
                workloads[row.key], links[kind], devices=row.devices, kind=kind, message_costs=costs.get(kind)
            ).get(row.label)
            cost = degree.fit(row.step_seconds, prediction) if prediction is not None else None
            if cost is not None:
                costs.setdefault(kind, {})[degree.fitted] = cost
                row.fitted = cost > 0
    return costs


def predict_rows(rows: list, workloads: dict, links: dict, message_costs: Optional[dict] = None) -> None:
    """The cost model's step time beside each measured row."""
    for row in rows:
        if row.key not in workloads or row.skipped:
            continue
        work, link = workloads[row.key], links[row.device]
        if row.devices == 1:
            row.predicted_seconds = work.compute_seconds
            continue
        predictions = predictions_for(
            work,
            link,
            devices=row.devices,
            kind=row.device,
            message_costs=(message_costs or {}).get(row.device),
        )
        if row.label in predictions:
            row.predicted_seconds = predictions[row.label].step_seconds


def project(options, workloads: dict, links: dict, message_costs: Optional[dict] = None) -> list:
    """For each `--predict` count: every strategy's predicted step, and the fastest."""
    projections = []
    for (kind, batch), work in workloads.items():
        for n in options.predict:
            if n == 1:
                continue
            if batch % n:  # no slice was timed, and no strategy here would run it
                projections.append((kind, batch, n, {}, None))
                continue
            predictions = predictions_for(
                work, links[kind], devices=n, kind=kind, message_costs=(message_costs or {}).get(kind)
            )
            # as --strategy auto would: without the meshes (`tensor RxT`, `sharded RxG`), which it does not choose
            plain = {
                name: p
                for name, p in predictions.items()
                if p.layout is None or not mesh_of(p.strategy, p.layout)
            }
            best = steady_choice(plain)
            projections.append((kind, batch, n, predictions, best.label if best else None))
    return projections
