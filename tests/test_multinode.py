"""Two "machines" as two torchrun agents on 127.0.0.1 (c10d rendezvous), one worker each."""

import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import polytrain_here
from processes import finish, start

from polytrain.runtime.checkpoint import read_weights

pytestmark = pytest.mark.multiprocess

TRAIN = [
    "train",
    "--dataset",
    "synthetic",
    "--synthetic-size",
    "256",
    "--model",
    "lenet",
    "--epochs",
    "1",
    "--batch-size",
    "32",
    "--seed",
    "3",
]


@pytest.mark.parametrize(
    "strategy",
    [
        ["--strategy", "data"],
        ["--strategy", "pipeline", "--microbatches", "2"],
    ],
)
def test_two_torchrun_nodes_equal_a_two_process_run(tmp_path, strategy):
    # with a pipeline, each node times the layers for --split auto; both must follow rank 0's plan
    # The rendezvous store is hosted here, on a port the OS assigns, and both agents join it as clients
    # (is_host=false): no port is guessed, so nothing can take it between choosing and binding.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        timeout=timedelta(seconds=120),
    )
    agents = [
        start(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{store.port}",
                "--rdzv-conf",
                "is_host=false",
                "--rdzv-id",
                "polytrain-test",
                "--local-addr",
                "127.0.0.1",
                "--max-restarts",
                "0",
                "-m",
                "polytrain",
                *TRAIN,
                *strategy,
                "--out",
                tmp_path / "nodes",
            ]
        )
        for _ in range(2)
    ]
    results = [finish(agent, timeout=240) for agent in agents]
    assert all(r.returncode == 0 for r in results), "\n".join(r.stdout + r.stderr for r in results)
    assert sum("done: validation accuracy" in r.stdout for r in results) == 1  # only rank 0 reports
    local = polytrain_here(None, *TRAIN, *strategy, "--devices", "2", "--out", tmp_path / "local")
    assert local.returncode == 0, local.stderr
    nodes = read_weights(tmp_path / "nodes" / "model.pt")  # follows model.pt to a pipeline's shards
    single_node = read_weights(tmp_path / "local" / "model.pt")
    assert single_node.keys() == nodes.keys() and len(single_node) == 8
    for key in single_node:
        torch.testing.assert_close(nodes[key], single_node[key], atol=1e-5, rtol=0)
