"""Pipeline schedules as clock-tick tables: which rank runs which forward or backward, and when.

Pure functions of counts, for tests, planning and printing. A forward takes one tick, a backward
`backward_ticks`, and sending activations or gradients between ranks is free. With `ranks` ranks and
`stages_per_rank` model chunks on each, stage s lives on rank s % ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from polytrain.errors import ConfigError

KINDS = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class Action:
    """One forward ("F") or backward ("B") of one microbatch through one stage."""

    kind: str
    microbatch: int
    stage: int
    # "F0" names an action only while each rank holds one stage; interleaved schedules print "F0.s2"
    show_stage: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in ("F", "B"):
            raise ValueError(f"action kind must be 'F' or 'B', not {self.kind!r}")

    def __str__(self) -> str:
        label = f"{self.kind}{self.microbatch}"
        return f"{label}.s{self.stage}" if self.show_stage else label


def _one_f_one_b(warmup: int, forwards: List[Action], backwards: List[Action]) -> List[Action]:
    # warm-up forwards, then steady state (forward warmup+k, backward k), then the backwards left over
    order = forwards[:warmup]
    for k in range(len(forwards) - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[len(forwards) - warmup :]


def _interleaved(rank: int, ranks: int, microbatches: int, chunks: int) -> List[Action]:
    # Megatron's virtual microbatch k: groups of ranks*chunks; inside a group, `ranks` microbatches go
    # through chunk 0, then the same ones through chunk 1...; backwards visit the chunks last first
    def action(kind: str, k: int) -> Action:
        group, within = divmod(k, ranks * chunks)
        chunk = within // ranks if kind == "F" else chunks - 1 - within // ranks
        return Action(kind, group * ranks + within % ranks, chunk * ranks + rank, show_stage=chunks > 1)

    total = microbatches * chunks
    warmup = min(total, (chunks - 1) * ranks + 2 * (ranks - rank - 1))
    return _one_f_one_b(
        warmup, [action("F", k) for k in range(total)], [action("B", k) for k in range(total)]
    )


def rank_orders(kind: str, *, ranks: int, microbatches: int, stages_per_rank: int = 1) -> List[List[Action]]:
    """For each rank, the order in which it runs its forwards and backwards under schedule `kind`.

    gpipe: every forward 0..m-1, then every backward 0..m-1 (torch.distributed.pipelining's ScheduleGPipe).
    1f1b (PipeDream-flush, Megatron without interleaving): rank r of p runs min(m, p-r-1) warm-up
    forwards, then alternates one forward and one backward, then runs the backwards left over.
    interleaved-1f1b (Megatron, Narayanan et al. 2021): v = `stages_per_rank` chunks per rank, chunk c of
    rank r being stage c*p + r; rank r runs min(m*v, (v-1)*p + 2*(p-r-1)) warm-up forwards, then one
    forward and one backward at a time, in Megatron's virtual-microbatch order. m must be a multiple of p.
    """
    if kind not in KINDS:
        raise ConfigError(f"--pipeline-schedule must be one of {', '.join(KINDS)}; got {kind!r}")
    if ranks < 1 or microbatches < 1 or stages_per_rank < 1:
        raise ValueError(
            f"ranks ({ranks}), microbatches ({microbatches}) and stages per rank "
            f"({stages_per_rank}) must all be at least 1"
        )
    if kind == "interleaved-1f1b":
        if microbatches % ranks:
            low, high = microbatches // ranks * ranks, (microbatches // ranks + 1) * ranks
            fix = f"{low} or {high}" if low else str(high)
            raise ConfigError(
                f"--microbatches {microbatches} must be a multiple of the {ranks} pipeline ranks "
                f"for the interleaved-1f1b schedule: use --microbatches {fix}"
            )
        return [_interleaved(r, ranks, microbatches, stages_per_rank) for r in range(ranks)]
    if stages_per_rank != 1:
        raise ValueError(f"the {kind} schedule runs one stage per rank, not {stages_per_rank}")
    orders = []
    for r in range(ranks):
        forwards = [Action("F", i, r) for i in range(microbatches)]
        backwards = [Action("B", i, r) for i in range(microbatches)]
        warmup = microbatches if kind == "gpipe" else min(microbatches, ranks - r - 1)
        orders.append(_one_f_one_b(warmup, forwards, backwards))
    return orders


def _ready(action: Action, finished: dict, tick: int, stages: int) -> bool:
    def done(kind: str, stage: int) -> bool:
        return finished.get((kind, action.microbatch, stage), tick) < tick

    if action.kind == "F":
        return action.stage == 0 or done("F", action.stage - 1)
    return done("F", action.stage) and (action.stage == stages - 1 or done("B", action.stage + 1))


def simulate(
    orders: Sequence[Sequence[Action]], *, ranks: int, stages: int, backward_ticks: int = 1
) -> List[List[Optional[Action]]]:
    """The clock-tick table of `orders`: table[rank][tick] is the action running then, or None (idle).

    Each rank runs its actions strictly in its order, one at a time, each as soon as its inputs exist:
    F(s, i) after F(s-1, i); B(s, i) after F(s, i) and B(s+1, i). A backward fills `backward_ticks`
    consecutive entries. Raises RuntimeError when no rank can ever move again (a deadlocked order).
    """
    if len(orders) != ranks:
        raise ValueError(f"{len(orders)} orders for {ranks} ranks")
    if backward_ticks < 1:
        raise ValueError(f"a backward takes at least 1 tick, not {backward_ticks}")
    for r, order in enumerate(orders):
        for a in order:
            if not 0 <= a.stage < stages or a.stage % ranks != r:
                raise ValueError(
                    f"rank {r} cannot run {a!r}: it holds the stages s < {stages} with s % {ranks} == {r}"
                )
    finished = {}  # (kind, microbatch, stage) -> the last tick it occupies
    table: List[List[Optional[Action]]] = [[] for _ in range(ranks)]
    position, running, busy_until = [0] * ranks, [None] * ranks, [-1] * ranks
    tick = 0
    while any(position[r] < len(orders[r]) or busy_until[r] >= tick for r in range(ranks)):
        moved = False
        for r in range(ranks):
            if (
                busy_until[r] < tick
                and position[r] < len(orders[r])
                and _ready(orders[r][position[r]], finished, tick, stages)
            ):
                running[r] = action = orders[r][position[r]]
                position[r] += 1
                busy_until[r] = tick + (backward_ticks if action.kind == "B" else 1) - 1
                # recorded now but ends at busy_until >= tick, so no rank can use it within this tick
                finished[(action.kind, action.microbatch, action.stage)] = busy_until[r]
            busy = busy_until[r] >= tick
            moved |= busy
            table[r].append(running[r] if busy else None)
        if not moved:
            stuck = ", ".join(
                f"rank {r} at {orders[r][position[r]]!r}"
                for r in range(ranks)
                if position[r] < len(orders[r])
            )
            raise RuntimeError(f"pipeline schedule deadlocks at tick {tick}: {stuck}")
        tick += 1
    return table


def bubble_fraction(table: Sequence[Sequence[Optional[Action]]]) -> float:
    """The share of rank-ticks in `table` spent idle."""
    slots = sum(len(row) for row in table)
    return sum(a is None for row in table for a in row) / slots if slots else 0.0


def theoretical_bubble(stages: int, microbatches: int) -> float:
    """GPipe's and 1F1B's idle share with backward as long as forward: (p-1)/(m+p-1)."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages ({stages}) and microbatches ({microbatches}) must be at least 1")
    return (stages - 1) / (microbatches + stages - 1)


def render(table: Sequence[Sequence[Optional[Action]]]) -> str:
    """The table as text, one line per rank and one column per tick; "." marks an idle tick."""
    cells = [[str(a) if a is not None else "." for a in row] for row in table]
    width = max((len(c) for row in cells for c in row), default=1)
    return "\n".join(
        f"rank {r}: " + " ".join(c.ljust(width) for c in row).rstrip() for r, row in enumerate(cells)
    )
