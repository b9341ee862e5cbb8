"""What a sharded run's workers are told, checked in the launching process."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardedPlan:
    cpu_offload: bool = False

    def describe(self) -> str:
        """Where the shards live (how many copies of them the run's layout says)."""
        return "shards in host memory (--cpu-offload)" if self.cpu_offload else "shards on each device"
