"""What a sharded run's workers are told, checked in the launching process."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardedPlan:
    cpu_offload: bool = False
    replicas: int = 1  # copies of the sharded model (--replicas; hybrid sharding where above 1)

    def describe(self) -> str:
        where = "shards in host memory (--cpu-offload)" if self.cpu_offload else "shards on each device"
        return where if self.replicas == 1 else f"{where}, {self.replicas} replicas"
