"""Two "machines" as two torchrun agents on 127.0.0.1 (c10d rendezvous), one worker each."""
import os
import socket
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.multiprocess

TRAIN = ["train", "--dataset", "synthetic", "--synthetic-size", "256", "--model", "lenet", "--epochs", "1",
         "--batch-size", "32", "--seed", "3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_equal_a_two_process_run(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    port = free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "polytrain-test",
         "--local-addr", "127.0.0.1", "--max-restarts", "0", "-m", "polytrain", *TRAIN,
         "--out", str(tmp_path / "nodes")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert all(agent.returncode == 0 for agent in agents), "\n".join(outputs)
    assert sum("done: validation accuracy" in out for out in outputs) == 1      # only rank 0 reports
    local = subprocess.run([sys.executable, "-m", "polytrain", *TRAIN, "--devices", "2",
                            "--out", str(tmp_path / "local")], env=env, capture_output=True, text=True,
                           timeout=240)
    assert local.returncode == 0, local.stderr
    nodes = torch.load(tmp_path / "nodes" / "model.pt", weights_only=True)
    single_node = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    for key in single_node:
        torch.testing.assert_close(nodes[key], single_node[key], atol=1e-6, rtol=0)
