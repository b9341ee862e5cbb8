"""Split a chain of layers into contiguous pipeline stages so that the slowest stage is as fast as possible.

Pure functions of per-layer costs (measured seconds, FLOPs, parameter counts: any non-negative numbers).
A split is written as its points: the index of the first layer of every stage after the first, so 10 layers
split at (4, 7) give stage 0 layers 0-3, stage 1 layers 4-6 and stage 2 layers 7-9.
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

from polytrain.errors import ConfigError


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def _check_costs(costs: Sequence[float]) -> List[float]:
    out = [float(c) for c in costs]
    for i, c in enumerate(out):
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"layer {i} has cost {c!r}: layer costs must be finite and non-negative")
    return out


def _check_points(points: Sequence[int], layers: int) -> Tuple[int, ...]:
    points = tuple(points)
    bounds = (0,) + points + (layers,)
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"split points {points} must increase strictly within 1..{layers - 1}")
    return points


def _spans(costs: List[float]) -> List[List[float]]:
    # spans[i][j] is the cost of layers i..j-1. fsum rounds each sum once, so two stages whose exact sums
    # are equal also compare equal, which prefix-sum differences do not promise (0.1 + 0.2 != 0.3)
    n = len(costs)
    return [[math.fsum(costs[i:j]) for j in range(n + 1)] for i in range(n + 1)]


def balance_by_time(costs: Sequence[float], *, stages: int) -> Tuple[int, ...]:
    """The split points of `costs` into `stages` contiguous, non-empty stages with the cheapest slowest stage.

    Exact, by dynamic programming over (stages used, layers covered): O(layers^3) to sum every span of
    layers, then O(layers^2 * stages^2) to search; 64 layers in 8 stages take milliseconds.
    Ties are broken deterministically: among splits with the same slowest stage, the one whose stage costs
    sorted slowest first are lexicographically smallest wins (then the second-slowest stage is as fast as
    it can be, and so on); among splits still tied, the one with the lexicographically smallest points
    (the earliest first cut, then the earliest second cut...).
    """
    costs = _check_costs(costs)
    layers = len(costs)
    if stages < 1:
        raise ValueError(f"a pipeline needs at least 1 stage, not {stages}")
    if stages > layers:
        raise ConfigError(
            f"cannot split {_plural(layers, 'layer')} into {_plural(stages, 'stage')}: use "
            f"--devices/--pipeline-stages of at most {layers}, or a model with more layers"
        )
    spans = _spans(costs)
    # best[j]: for the first j layers in k stages, (stage costs sorted slowest first, points). Adding the
    # same stage to two splits keeps their order in both keys, so extending only the best prefix is exact.
    best = {j: ((spans[0][j],), ()) for j in range(1, layers - stages + 2)}
    for k in range(2, stages + 1):
        nxt = {}
        # k stages cover at least k layers and leave one layer for each stage still to come
        for j in range(k, layers - (stages - k) + 1):
            candidates = []
            for i in range(k - 1, j):
                key, points = best[i]
                merged = tuple(sorted(key + (spans[i][j],), reverse=True))
                candidates.append((merged, points + (i,)))
            nxt[j] = min(candidates)
        best = nxt
    return best[layers][1]


def stage_costs(costs: Sequence[float], points: Sequence[int]) -> Tuple[float, ...]:
    """The cost of each stage of the split at `points`: the (exactly rounded) sum of its layers' costs."""
    costs = _check_costs(costs)
    bounds = (0,) + _check_points(points, len(costs)) + (len(costs),)
    return tuple(math.fsum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))


def stage_ranges(points: Sequence[int], *, layers: int) -> Tuple[range, ...]:
    """The layer indices of each stage of the split at `points`, for a model with `layers` layers."""
    bounds = (0,) + _check_points(points, layers) + (layers,)
    return tuple(range(a, b) for a, b in zip(bounds, bounds[1:]))


def parse_split(text: str, *, layers: int, stages: int) -> Tuple[int, ...]:
    """The split points written in `--split`, such as "4,7"; the caller handles "auto" before this.

    One stage needs no points, so an empty text is the only valid split for it.
    """
    items = [item.strip() for item in text.split(",")] if text.strip() else []
    try:
        points = tuple(int(item) for item in items)
    except ValueError:
        message = f"--split must be 'auto' or increasing layer indices like 4,7; got {text!r}"
        raise ConfigError(message) from None
    if len(points) != stages - 1:
        raise ConfigError(
            f"--split {text!r} gives {_plural(len(points), 'point')}; a pipeline of "
            f"{_plural(stages, 'stage')} needs {stages - 1}: "
            "the first layer of each stage after the first"
        )
    for p in points:
        if not 1 <= p <= layers - 1:
            raise ConfigError(
                f"--split point {p} is outside 1..{layers - 1}: the model has "
                f"{_plural(layers, 'layer')}, and every stage needs at least one"
            )
    for i, p in enumerate(points):
        if p in points[:i]:
            raise ConfigError(f"--split repeats layer {p}: give each point once, so every stage has a layer")
    for a, b in zip(points, points[1:]):
        if b < a:
            raise ConfigError(
                f"--split points must increase: {b} comes after {a}; write them in order, like "
                + ",".join(map(str, sorted(points)))
            )
    return points
