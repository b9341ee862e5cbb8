"""What each rank spent a few steps on: `--timeline` records when every rank ran each micro-batch's
forward and backward, draws `pipeline.png` (one lane per rank, idle time left blank) and prints the
measured bubble next to the theoretical one.

An event is (rank, step, kind, microbatch, stage, start, end): kind "F" or "B", times in seconds from
the step's start, which all ranks of a pipeline take together after a barrier.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Iterable, List, Tuple

from ..callbacks import Callback
from ..pipeline.plan import stages_per_rank
from ..pipeline.schedule import bubble_fraction, rank_orders, simulate, theoretical_bubble
from ..report import save_figure

Event = Tuple[int, int, str, int, int, float, float]


def measured_bubble(events: Iterable[Event], *, ranks_per_pipeline: int) -> float:
    """Idle share of the ranks' time in the recorded steps: for each step and pipeline, 1 - busy / (ranks x
    span), span running from the first forward to the last backward; averaged over them."""
    groups = defaultdict(list)
    for event in events:
        groups[(event[1], event[0] // ranks_per_pipeline)].append(event)
    fractions = []
    for group in groups.values():
        span = max(e[6] for e in group) - min(e[5] for e in group)
        busy = sum(e[6] - e[5] for e in group)
        if span > 0:
            fractions.append(1.0 - busy / (ranks_per_pipeline * span))
    return sum(fractions) / len(fractions) if fractions else float("nan")


def expected_bubble(schedule: str, *, ranks: int, microbatches: int) -> float:
    """The bubble of the schedule's table with equal forward and backward times: (p-1)/(m+p-1) for GPipe
    and 1F1B, smaller for interleaved 1F1B."""
    chunks = stages_per_rank(schedule)
    if chunks == 1 or microbatches % ranks:
        return theoretical_bubble(ranks, microbatches)
    orders = rank_orders(schedule, ranks=ranks, microbatches=microbatches, stages_per_rank=chunks)
    return bubble_fraction(simulate(orders, ranks=ranks, stages=ranks * chunks))


def draw_timeline(events: List[Event], path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = min(e[1] for e in events)  # one step, the first recorded
    shown = [e for e in events if e[1] == step]
    ranks = sorted({e[0] for e in shown})
    origin = min(e[5] for e in shown)
    figure, axes = plt.subplots(figsize=(10, 0.6 * len(ranks) + 1.4))
    colours = {"F": "#4c72b0", "B": "#dd8452"}
    for rank, kind, micro, stage, start, end in ((e[0], e[2], e[3], e[4], e[5], e[6]) for e in shown):
        lane = ranks.index(rank)
        width = (end - start) * 1e3
        axes.barh(
            lane, width, left=(start - origin) * 1e3, color=colours[kind], edgecolor="white", height=0.8
        )
        label = f"{kind}{micro}" + (f"/s{stage}" if len({e[4] for e in shown if e[0] == rank}) > 1 else "")
        axes.text(
            (start - origin) * 1e3 + width / 2,
            lane,
            label,
            ha="center",
            va="center",
            fontsize=7,
            color="white",
            clip_on=True,
        )
    axes.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    axes.invert_yaxis()
    axes.set_xlabel(
        "milliseconds from the step's first forward (blue: forward, orange: backward, blank: idle)"
    )
    axes.set_title(title, fontsize=9)
    figure.tight_layout()
    save_figure(figure, path)


class Timeline(Callback):
    """Records steps `first` .. `first + count - 1` (after the first, which pays for shape inference), then
    gathers every rank's events; rank 0 draws them and prints the bubble. Runs on every rank."""

    def __init__(self, path, *, first: int = 2, count: int = 3):
        self.path, self.first, self.count = Path(path), first, count
        self.steps = 0
        self.done = False

    def on_step_end(self, trainer, step):
        self.steps += 1
        strategy = trainer.strategy
        if self.done:
            return
        if self.steps == self.first - 1:
            strategy.start_trace()
        elif self.steps == self.first - 1 + self.count:
            self.finish(trainer)

    def on_epoch_end(self, trainer, record):
        if not self.done and self.steps >= self.first:  # an epoch shorter than the recording
            self.finish(trainer)

    def finish(self, trainer):
        self.done = True
        strategy = trainer.strategy
        events = strategy.stop_trace()
        gathered = strategy.gather_object(events)
        if not strategy.is_main:
            return
        events = [event for part in gathered for event in part]
        if not events:
            return
        schedule, ranks, microbatches = strategy.trace_layout()
        measured = measured_bubble(events, ranks_per_pipeline=ranks)
        expected = expected_bubble(schedule, ranks=ranks, microbatches=microbatches)
        title = (
            f"{schedule}, {ranks} stages x {microbatches} micro-batches: bubble measured {measured:.2f}, "
            f"theoretical {expected:.2f}"
        )
        draw_timeline(events, self.path, title=title)
        formula = "(p-1)/(m+p-1)" if stages_per_rank(schedule) == 1 else "of the interleaved table"
        print(
            f"timeline: {len({e[1] for e in events})} steps recorded; bubble measured {measured:.3f}, theoretical "
            f"{formula} = {expected:.3f} (p={ranks}, m={microbatches}); wrote {self.path}",
            flush=True,
        )
