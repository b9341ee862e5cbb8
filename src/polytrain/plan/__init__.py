"""Pure planning: stage balancing, schedule tables, device mesh layout. No torch.distributed here."""

from __future__ import annotations

from polytrain.plan.balance import balance_by_time, parse_split, stage_costs, stage_ranges
from polytrain.plan.schedule import Action, bubble_fraction, rank_orders, render, simulate, theoretical_bubble

__all__ = [
    "Action",
    "balance_by_time",
    "bubble_fraction",
    "parse_split",
    "rank_orders",
    "render",
    "simulate",
    "stage_costs",
    "stage_ranges",
    "theoretical_bubble",
]
