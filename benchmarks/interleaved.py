"""Ways of training timed side by side (A, B, A, B, ...) and their table: shared by the step benchmarks
(`single_device.py`, `gpt_step.py`). Each way is a function that trains a fresh copy of the model and returns
[(seconds, training loss)] per epoch."""

from __future__ import annotations

import copy
import json
import statistics


def interleave(ways: dict, base, *, repeats: int, warmup: int, epochs: int, **common) -> tuple:
    """({way: every timed epoch's seconds}, {way: the last run's losses by epoch}), after `warmup` untimed
    epochs of each way; every run starts from a deepcopy of `base`."""
    if warmup:
        for train in ways.values():
            train(copy.deepcopy(base), epochs=warmup, **common)
    seconds = {name: [] for name in ways}
    losses = {name: [] for name in ways}
    for repeat in range(repeats):
        for name, train in ways.items():
            results = train(copy.deepcopy(base), epochs=epochs, **common)
            seconds[name] += [time for time, _ in results]
            losses[name] = [loss for _, loss in results]
            print(
                f"  repeat {repeat + 1}/{repeats}  {name:<9}  "
                + "  ".join(f"{time:.3f}s" for time, _ in results),
                flush=True,
            )
    return seconds, losses


def report(seconds: dict, losses: dict, *, per_epoch: int, unit: str, targets: dict) -> tuple:
    """Print each way's median, fastest and slowest epoch, `unit`s per second (`per_epoch` of them in an
    epoch) and losses, then polytrain's ratio to each way in `targets` (way -> the most it may be); return
    (medians, {way: ratio of medians}, {way: ratio of the fastest epochs})."""
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    width = max(9, len(unit) + 2)
    print(
        f"\n{'way':<10} {'median s':>9} {'min s':>8} {'max s':>8} {unit + '/s':>{width}}  train loss by epoch"
    )
    for name, times in seconds.items():
        print(
            f"{name:<10} {medians[name]:9.3f} {min(times):8.3f} {max(times):8.3f} "
            f"{per_epoch / medians[name]:{width},.0f}  " + " ".join(f"{loss:.4f}" for loss in losses[name])
        )
    if any(max(times) > 1.5 * medians[name] for name, times in seconds.items()):
        print(
            "some epochs took over 1.5x the median: other processes competed for the cores; if the medians "
            "disagree with the minima, rerun"
        )
    print()
    ratios, of_minima = {}, {}
    for other, target in targets.items():
        ratios[other] = medians["polytrain"] / medians[other]
        of_minima[other] = min(seconds["polytrain"]) / min(seconds[other])
        print(
            f"polytrain / {other:<8} = {ratios[other]:.3f}   (target <= {target:.2f}: "
            f"{'met' if ratios[other] <= target else 'MISSED'}; ratio of the fastest epochs {of_minima[other]:.3f})"
        )
    return medians, ratios, of_minima


def save(result: dict, path) -> dict:
    """`result` written as JSON to `path` where one is given (--json); returned as it is."""
    if path:
        with open(path, "w") as handle:
            json.dump(result, handle, indent=1)
    return result
