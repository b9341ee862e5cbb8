"""`srun polytrain train` without SLURM: two tasks started by hand with the variables srun sets."""

import random
import sys

import pytest
import torch
from conftest import polytrain_here
from processes import finish, start

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


def srun(tmp_path, job_id: str):
    """Two tasks of one srun step on this machine; rank 0 hosts the rendezvous at the job's port."""
    tasks = [
        start(
            [sys.executable, "-m", "polytrain", *TRAIN, "--out", tmp_path / f"job{job_id}"],
            env={
                "SLURM_JOB_ID": job_id,
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank),
                "SLURM_NODEID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_TASKS_PER_NODE": "2",
                "SLURM_JOB_NODELIST": "localhost",
                "SLURM_JOB_NAME": "test",
            },
        )
        for rank in range(2)
    ]
    first = finish(tasks[0], timeout=240)
    if first.returncode != 0:
        tasks[1].kill()  # rank 0 could not host: rank 1 would wait for it
    return [first, finish(tasks[1], timeout=60)]


def test_two_srun_tasks_equal_a_two_process_run(tmp_path):
    # The port comes from the job id; if another program holds it, retry as a scheduler would give a new id.
    for attempt in range(5):
        job_id = str(random.Random(attempt).randrange(100000, 999999))
        results = srun(tmp_path, job_id)
        if not any("address already in use" in r.stderr.lower() for r in results):
            break
    assert all(r.returncode == 0 for r in results), "\n".join(r.stdout + r.stderr for r in results)
    assert sum("done: validation accuracy" in r.stdout for r in results) == 1  # only rank 0 reports
    # The reference runs inside a one-task allocation (salloc): there --devices 2 starts its own 2 workers.
    local = polytrain_here(
        None,
        *TRAIN,
        "--devices",
        "2",
        "--strategy",
        "data",
        "--out",
        tmp_path / "local",
        env={
            "SLURM_JOB_ID": "77",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
            "SLURM_JOB_NODELIST": "localhost",
        },
    )
    assert local.returncode == 0, local.stderr
    tasks = torch.load(tmp_path / f"job{job_id}" / "model.pt", weights_only=True)
    spawned = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    for key in spawned:
        torch.testing.assert_close(tasks[key], spawned[key], atol=1e-6, rtol=0)
