"""Which parameter server holds which parameter: partitioned by size, as MXNet's kvstore and the OSDI'14
parameter server do, so that no server carries most of the traffic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

from ..errors import ConfigError

SERVER_DEVICES = ("cpu", "same")


def partition_by_size(sizes: Sequence[int], *, servers: int) -> Tuple[int, ...]:
    """The server of each parameter: largest first, each to the server holding the fewest elements so far
    (ties: the parameter earlier in the model first, the lower server first)."""
    load = [0] * servers
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        server = min(range(servers), key=lambda k: (load[k], k))
        owner[index] = server
        load[server] += sizes[index]
    return tuple(owner)


@dataclass(frozen=True)
class ServerPlan:
    servers: int  # server roles, hosted by ranks 0..servers-1
    server_device: str  # "cpu": master weights in host memory; "same": on the rank's device
    owner: Tuple[int, ...]  # server of each parameter, in model.parameters() order
    staleness: int = 0  # 0: synchronous; S: a worker runs at most S updates ahead of the slowest

    def __post_init__(self) -> None:
        if self.server_device not in SERVER_DEVICES:
            raise ConfigError(
                f"unknown --server-device {self.server_device!r}; choose one of {', '.join(SERVER_DEVICES)}"
            )

    def owned(self, server: int) -> Tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.owner) if k == server)

    def describe(self, layout) -> str:
        """Where the servers are and what they keep (the plan alone says it, whatever `layout`)."""
        ranks = "rank 0" if self.servers == 1 else f"ranks 0-{self.servers - 1}"
        mode = f"asynchronous, staleness at most {self.staleness}" if self.staleness else "synchronous"
        return (
            f"{self.servers} server{'s' if self.servers > 1 else ''} on {ranks}, master weights and optimizer "
            f"state in {'host memory' if self.server_device == 'cpu' else 'device memory'}, {mode}"
        )


def check_servers(servers: int, *, devices: int) -> None:
    if not isinstance(servers, int) or not 1 <= servers < devices:
        top = f"between 1 and {devices - 1}" if devices > 1 else "1, with --devices 2 or more"
        raise ConfigError(
            f"--servers {servers} needs a worker besides the servers' ranks: use a number "
            f"{top} (servers run on ranks 0..K-1, which also compute), or more --devices"
        )
