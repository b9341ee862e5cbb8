"""`--strategy auto` on several devices: every synchronous strategy trains the same model, so the choice
is only about speed and memory. The cost model predicts each one's step from a few seconds of measurement in
this process (or from a `polytrain bench` file given with `--plan`), and the fastest that fits is used, unless
a simpler one is predicted within 10% of it (data parallelism first): the same machine chooses the same way.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from ..errors import ConfigError, first_line
from ..parallel.layout import Layout
from ..parallel.presets import LAYOUT_SETTINGS, flags_of, label, layout_of, mesh_of
from ..pipeline.plan import default_microbatches
from ..planning import costmodel, memory
from ..planning.beside import sizes_beside
from .fits import available_per_rank

SLOTS = {"sgd": 1, "adam": 2, "adamw": 2, "rmsprop": 1}  # optimizer state tensors per weight (sgd: momentum)
# A strategy replaces a simpler one only when predicted at least this much faster: measurements move by
# several percent from run to run, and the same settings should choose the same strategy.
PREFER_DATA = 1.10
# Each quantity auto needs is timed in at least this many rounds, interleaved, over at least this many seconds,
# and keeps its fastest (timing.py): the longer the rounds span, the likelier each meets a quiet moment. On a
# loaded 2-core machine 2 s chose data parallelism for LeNet in 19 of 20 runs (the median of 3 steps in a row:
# 8 of 12), at the cost of 2 s before the workers start.
AUTO_REPEATS, AUTO_SECONDS = 3, 2.0
# Tensor parallelism is last: `auto` takes it only where it is predicted clearly faster, or alone fits. Each
# strategy's layouts on a mesh come right after its plain one (`sharded 2x2` after `sharded`, `tensor 2x2` after
# `tensor`): a mesh is taken only where it is predicted clearly faster than its plain layout too.
SIMPLEST_FIRST = ("data", "sharded", "parameter-server", "pipeline", "tensor")  # ties go to the earlier


def candidates(model, work: costmodel.Workload, devices: int, *, device_type: str) -> Dict[str, str]:
    """The strategies that cannot run this model on `devices` ranks here, with the reason."""
    from ..errors import UserError
    from ..pipeline.layers import flatten_layers
    from ..pipeline.plan import check_torch
    from ..pipeline.planning import torch_version

    refused = {}
    try:
        flatten_layers(model)
        check_torch(
            torch_version(),
            device_type=device_type,
            ranks=devices,
            fewest_microbatches=default_microbatches(work.batch_size, devices),
        )
        if len(work.boundary_bytes) < devices - 1:
            refused["pipeline"] = (
                f"{devices} stages need {devices - 1} cuts, the model has {len(work.boundary_bytes)}"
            )
    except UserError as error:
        refused["pipeline"] = str(error)
    return refused


def pick(
    work: costmodel.Workload,
    link: costmodel.Link,
    *,
    devices: int,
    device_type: str,
    refused: dict,
    available: float,
    optimizer: str = "sgd",
    message_costs: Optional[dict] = None,
    checkpointing: str = "none",
) -> Tuple[Optional[costmodel.Prediction], dict, dict]:
    """(the prediction `steady_choice` takes among those that can run and fit, every prediction, which fit) —
    pure numbers. Predictions are by label: a strategy (`sharded`) or its layout on a mesh (`sharded 2x2`, hybrid
    sharding; `tensor 2x2`, groups of tensor ranks). Tensor parallelism is among them where the workload has a
    tensor plan for `devices` ranks; being last in `SIMPLEST_FIRST`, it is taken only when predicted
    `PREFER_DATA` faster than every other that fits, or when no other fits."""
    from .workload import predictions_for

    predictions = predictions_for(work, link, devices=devices, kind=device_type, message_costs=message_costs)
    fits = {
        name: p.strategy not in refused
        and memory.memory_per_rank(
            work,
            p.layout,
            optimizer_slots=SLOTS.get(optimizer, 1),
            checkpointing=checkpointing,
            servers=int(p.strategy == "parameter-server"),
        )
        <= available
        for name, p in predictions.items()
    }
    # tensor parallelism's host work around each collective (DTensor's) is most of its step on small models and
    # only a bench measures it (its cost per message, one for all its layouts): unpriced, a layout with tensor
    # ranks is taken only where nothing else fits
    priced = {
        name: p
        for name, p in predictions.items()
        if p.layout is None or p.layout.tensor == 1 or p.strategy in (message_costs or {})
    }
    best = steady_choice(priced, fits=fits) or steady_choice(predictions, fits=fits)
    return best, predictions, fits


def steady_choice(
    predictions: Dict[str, costmodel.Prediction],
    *,
    fits: Optional[Dict[str, bool]] = None,
    margin: float = PREFER_DATA,
) -> Optional[costmodel.Prediction]:
    """The simplest strategy (data parallelism first, `SIMPLEST_FIRST`) that fits and that no fitting strategy
    is predicted to beat by `margin`: a near tie goes to the common choice, and the same one run after run."""
    name = steady_name(
        {name: p.step_seconds for name, p in predictions.items() if fits is None or fits.get(name, False)},
        {name: simplest_first(p.strategy, p.layout) for name, p in predictions.items()},
        margin=margin,
    )
    return predictions[name] if name is not None else None


def steady_name(
    seconds: Dict[str, float], places: Dict[str, tuple], *, margin: float = PREFER_DATA
) -> Optional[str]:
    """Of layouts (by label) and their step times, the first in `SIMPLEST_FIRST` order (each one's `places`,
    `simplest_first`) that none is `margin` faster than (None for none)."""
    finite = {name: value for name, value in seconds.items() if not math.isnan(value)}
    if not finite:
        return None
    fastest = min(finite.values())
    order = sorted(finite, key=lambda name: (places[name], name))
    return next((name for name in order if finite[name] < fastest * margin), min(finite, key=finite.get))


def simplest_first(strategy: str, layout: Optional[Layout]) -> tuple:
    """The place of `strategy` on `layout` in the order of `SIMPLEST_FIRST`, each strategy's plain layout before
    its meshes, and of those the one nearest the plain layout first: fewest copies of the shards (`sharded 2x4`
    before `sharded 4x2`), fewest groups of tensor ranks."""
    rank = SIMPLEST_FIRST.index(strategy) if strategy in SIMPLEST_FIRST else len(SIMPLEST_FIRST)
    # (then the degrees beside them whole first: the experts on every rank before experts split)
    return rank, mesh_of(strategy, layout) if layout is not None else (), sizes_beside(layout)


def describe(best, predictions: dict, one_device: float, *, devices: int, kind: str, source: str) -> str:
    others = ", ".join(
        f"{name} {p.step_seconds * 1e3:.1f}"
        for name, p in predictions.items()
        if name != best.label and math.isfinite(p.step_seconds)
    )
    line = (
        f"--strategy auto: {best.label} on {devices} {kind} device(s), predicted {best.step_seconds * 1e3:.1f} "
        f"ms/step (others, ms: {others}; one device {one_device * 1e3:.1f}), from {source}"
    )
    if best.step_seconds > one_device:
        line += f"; one device would be faster: {devices} are predicted at {one_device / best.step_seconds:.2f}x its speed"
    return line


def choose_strategy(
    config, model, dataset, objective, *, device: torch.device, channels_last: bool
) -> Tuple[str, dict, str]:
    """(the strategy chosen, the settings beside it that give its layout, the line that says why) for `--strategy
    auto` with several devices: a strategy (`data`, {}), or one on a mesh (`sharded`, {"replicas": 2})."""
    from .whole_model import measurable_copy
    from .workload import measure

    n = config.devices
    costs = None
    if config.plan:
        work, link, source = read_plan(config.plan, device_type=device.type, batch_size=config.batch_size)
        costs = read_message_costs(config.plan, device_type=device.type)
        measured = measured_choice(
            config.plan, device_type=device.type, devices=n, batch_size=config.batch_size
        )
        if measured:
            return measured
    else:
        measured_model = measurable_copy(
            model,
            copies=n + 3,  # itself, one device's, n replicas side by side, one more for the sizes
            device=device,
            seed=config.seed,
            what="--strategy auto times whole steps of the model and",
            instead="name the strategy (--strategy sharded), or pass --plan bench.json from polytrain bench",
        )
        try:
            work, (link, _) = measure(
                measured_model,
                dataset,
                objective,
                batch_size=config.batch_size,
                device=device,
                devices=[n],
                repeats=AUTO_REPEATS,
                channels_last=channels_last,
                plain=channels_last,
                link=True,
                min_seconds=AUTO_SECONDS,
                tensor_plan=getattr(config, "tensor_plan", None),
                tensor_devices=[n],
            )
            source = "a few seconds of measurement"
        except Exception as error:  # a model the probe cannot drive: train as before, say why
            return (
                "data",
                {},
                (
                    f"--strategy auto: data (measuring the model failed: {first_line(error)}; pass "
                    f"--strategy to choose)"
                ),
            )
    refused = candidates(model, work, n, device_type=device.type)
    best, predictions, _ = pick(
        work,
        link,
        devices=n,
        device_type=device.type,
        refused=refused,
        available=available_per_rank(device, n),
        optimizer=config.optimizer,
        message_costs=costs,
        checkpointing=config.activation_checkpointing,
    )
    if best is None:
        return "data", {}, "--strategy auto: no strategy is predicted to fit in memory; trying data"
    return (
        best.strategy,
        flags_of(best.strategy, best.layout),
        describe(
            best,
            {k: v for k, v in predictions.items() if k not in refused},
            work.compute_seconds,
            devices=n,
            kind=device.type,
            source=source,
        ),
    )


def _load(path: str) -> dict:
    try:
        document = json.loads(Path(path).expanduser().read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"--plan {path}: no such file; give the bench.json that polytrain bench wrote"
        ) from None
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"--plan {path} is not a bench.json written by polytrain bench ({type(error).__name__}); "
            f"run polytrain bench --out DIR and pass DIR/bench.json"
        ) from None
    if (
        not isinstance(document, dict)
        or not isinstance(document.get("rows"), list)
        or not isinstance(document.get("workloads"), list)
        or not isinstance(document.get("links"), dict)
    ):
        raise ConfigError(
            f"--plan {path} is not a bench.json written by polytrain bench (no rows, workloads or "
            f"links); run polytrain bench --out DIR and pass DIR/bench.json"
        )
    return document


def row_layout(row: dict) -> Layout:
    """The layout a bench file's row ran: its `layout` as written, or in files written before rows carried it,
    the settings beside --strategy that gave it (none in files written before meshes)."""
    if isinstance(row.get("layout"), dict):
        return Layout(**row["layout"])
    # (those files wrote the settings they were given, 0 for those not given)
    settings = {name: row[name] for name in LAYOUT_SETTINGS if row.get(name) not in (None, 0)}
    return layout_of(str(row["strategy"]), int(row["devices"]), **settings)


def measured_choice(
    path: str, *, device_type: str, devices: int, batch_size: int
) -> Optional[Tuple[str, dict, str]]:
    """(strategy, the settings beside it, the line that says why) of the layout the bench file measured fastest
    at exactly this device kind, count and batch (a simpler one within `PREFER_DATA` of it, as `steady_choice`
    takes): ("sharded", {"replicas": 2}) for a row of hybrid sharding."""
    rows = [
        r
        for r in _load(path)["rows"]
        if isinstance(r, dict)
        and r.get("device") == device_type
        and r.get("devices") == devices
        and r.get("batch_size") == batch_size
        and not r.get("skipped")
        and r.get("devices", 1) > 1
    ]
    measured = {}  # label -> (seconds, strategy, layout)
    try:
        for r in rows:
            strategy, layout = str(r["strategy"]), row_layout(r)
            measured[label(strategy, layout)] = float(r["step_seconds"]), strategy, layout
    except (KeyError, TypeError, ValueError, ConfigError):
        raise ConfigError(
            f"--plan {path}: a row lacks its step_seconds or its layout; write the file again with polytrain bench"
        ) from None
    seconds = {name: row[0] for name, row in measured.items()}
    name = steady_name(seconds, {name: simplest_first(*row[1:]) for name, row in measured.items()})
    if name is None:
        return None
    _, strategy, layout = measured[name]
    fastest = min(seconds, key=seconds.get)
    line = f"--strategy auto: {name} on {devices} {device_type} device(s), measured "
    if name == fastest:
        return (
            strategy,
            flags_of(strategy, layout),
            line + f"fastest at {seconds[name] * 1e3:.1f} ms/step in {path}",
        )
    return (
        strategy,
        flags_of(strategy, layout),
        line
        + (
            f"at {seconds[name] * 1e3:.1f} ms/step in {path}, within {PREFER_DATA - 1:.0%} of "
            f"{fastest} ({seconds[fastest] * 1e3:.1f}), the simpler kept"
        ),
    )


def read_plan(
    path: str, *, device_type: str, batch_size: int
) -> Tuple[costmodel.Workload, costmodel.Link, str]:
    """The workload measured nearest this batch size, and the link, on this device kind, from a bench file."""
    document = _load(path)
    try:
        works = [w for w in document["workloads"] if w["device"] == device_type]
        link = document["links"][device_type]
        link = costmodel.Link(alpha=float(link["alpha"]), beta=float(link["beta"]))
        if not works:
            raise KeyError(device_type)
        nearest = min(works, key=lambda w: abs(math.log(int(w["batch_size"]) / batch_size)))
        work = _scaled_workload(nearest, batch_size)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise ConfigError(
            f"--plan {path} holds no measurement on {device_type}; run polytrain bench --device "
            f"{device_type} and pass its bench.json"
        ) from None
    return work, link, f"{path} (batch {nearest['batch_size']}, scaled to {batch_size})"


def read_message_costs(path: str, *, device_type: str) -> Dict[str, float]:
    """Each strategy's cost per message that the bench file fitted on this device kind (none in older files)."""
    document = _load(path)
    try:
        costs = document["links"][device_type].get("message_costs") or {}
        return {str(name): float(seconds) for name, seconds in costs.items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        raise ConfigError(
            f"--plan {path}: its message_costs are not numbers by strategy; write the file again "
            f"with polytrain bench"
        ) from None


def _scaled_workload(measured: dict, batch_size: int) -> costmodel.Workload:
    """A bench file's workload, its compute scaled from the batch it was measured at to `batch_size` (compute
    grows with the batch; sizes and the update do not)."""
    scale = batch_size / int(measured["batch_size"])
    pass_seconds = float(measured["compute_seconds"]) - float(measured["update_seconds"])
    plain = measured.get("plain")  # absent in files written before it was measured
    return costmodel.Workload(
        compute_seconds=pass_seconds * scale + float(measured["update_seconds"]),
        parameter_bytes=float(measured["parameter_bytes"]),
        batch_size=batch_size,
        update_seconds=float(measured["update_seconds"]),
        layers=int(measured["layers"]),
        boundary_bytes=tuple(float(b) for b in measured["boundary_bytes"]),
        activation_bytes=float(measured.get("activation_bytes", 0.0)),  # absent in older files
        blocks=int(measured.get("blocks", 0)),  # the checkpointing figures: absent in older files
        block_bytes=float(measured.get("block_bytes", 0.0)),
        block_input_bytes=float(measured.get("block_input_bytes", 0.0)),
        block_matmul_bytes=float(measured.get("block_matmul_bytes", 0.0)),
        backward_bytes=float(measured.get("backward_bytes", 0.0)),  # absent in older files
        replica_seconds={int(k): float(v) * scale for k, v in measured["replica_seconds"].items()},
        microbatch_seconds={int(k): float(v) * scale for k, v in measured["microbatch_seconds"].items()},
        plain=_scaled_workload(dict(plain, batch_size=measured["batch_size"]), batch_size) if plain else None,
        **_tensor_fields(measured, scale),
        # a mixture of experts (absent in older files, and for a dense model): routed bytes per sample
        mixtures=int(measured.get("mixtures", 0)),
        experts=int(measured.get("experts", 0)),
        expert_bytes=float(measured.get("expert_bytes", 0.0)),
        routed_bytes=float(measured.get("routed_bytes", 0.0)),
        routed_counts=tuple(float(c) for c in measured.get("routed_counts", ())),
    )


def _tensor_fields(measured: dict, scale: float) -> dict:
    """A bench file's tensor-parallel measurements (absent in files written before them), compute scaled; the
    ranks' shares are keyed "n/T"."""
    return dict(
        tensor_splits=tuple(int(t) for t in measured.get("tensor_splits", ())),
        split_bytes=float(measured.get("split_bytes", 0.0)),
        split_share=float(measured.get("split_share", 0.0)),
        tensor_reductions=tuple(float(b) for b in measured.get("tensor_reductions", ())),
        tensor_gathers=tuple(float(b) for b in measured.get("tensor_gathers", ())),
        sequence_splits=tuple(int(t) for t in measured.get("sequence_splits", ())),
        sequence_parameters=int(measured.get("sequence_parameters", 0)),
        sequence_gathers=int(measured.get("sequence_gathers", 0)),
        tensor_seconds={
            tuple(int(part) for part in key.split("/")): float(value) * scale
            for key, value in measured.get("tensor_seconds", {}).items()
        },
    )
