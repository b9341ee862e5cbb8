"""What a sharded run's workers are told, checked in the launching process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from ..parallel.layout import Layout


@dataclass(frozen=True)
class ShardedPlan:
    cpu_offload: bool = False

    def describe(self, layout: Layout) -> str:
        """Where the shards live (how many copies of them `layout` says, not said here)."""
        return "shards in host memory (--cpu-offload)" if self.cpu_offload else "shards on each device"


def sharded_plan(layout: Layout, *, cpu_offload: bool, device_type: Optional[str]) -> Optional[ShardedPlan]:
    """Where FSDP2's shards live, for a layout whose data ranks shard a model no tensor plan splits (None for
    another); one line where --cpu-offload asks for what the run cannot do."""
    shards = layout.data_parallel == "shard" and layout.tensor == 1
    if cpu_offload and device_type != "cuda":
        raise ConfigError(
            "--cpu-offload moves each GPU's shards to host memory; CPU processes keep them there "
            "already: drop --cpu-offload, or train on GPUs"
        )
    if cpu_offload and not shards:
        raise ConfigError(
            f"--cpu-offload keeps FSDP2's shards in host memory, but {layout.describe()} holds no shards of "
            f"a whole model; use --strategy sharded on --devices 2 or more, or drop --cpu-offload"
        )
    return ShardedPlan(cpu_offload=cpu_offload) if shards else None
