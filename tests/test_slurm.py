"""Reading what SLURM tells an srun task: host lists, tasks per node, the port rule, and slurm_task."""

import dataclasses

import pytest

from polytrain.config.slurm import SlurmTask, expand_nodelist, port_for_job, slurm_task, tasks_per_node


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("gpu5", ["gpu5"]),
        ("  gpu5 \n", ["gpu5"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3,c[08-10]", ["a1", "a2", "b3", "c08", "c09", "c10"]),
        ("rack[1-2]-node[1-2]", ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"]),
        ("node[8-10]", ["node8", "node9", "node10"]),  # width of the first number: no padding
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("n[007]", ["n007"]),
        ("n[3-3]", ["n3"]),
        ("n[1-2]x", ["n1x", "n2x"]),
        ("[1-2]", ["1", "2"]),
        ("a, b", ["a", "b"]),
        ("n[1, 3]", ["n1", "n3"]),
        ("x[1-2],y[5,7],z", ["x1", "x2", "y5", "y7", "z"]),
        ("r[1,3]n[0-1]", ["r1n0", "r1n1", "r3n0", "r3n1"]),
    ],
)
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    "text, what",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("node[1-2", "bracket"),
        ("node1-2]", "bracket"),
        ("node[[1-2]]", "bracket"),
        ("n[1-2]],a", "bracket"),
        ("node[5-3]", "ends below its start"),
        ("node[a-b]", "not a number"),
        ("node[1-]", "not a number"),
        ("node[-2]", "not a number"),
        ("node[1-2-3]", "not a number"),
        ("node[]", "not a number"),
        ("node[1,,2]", "not a number"),
        ("node[\u0661-\u0662]", "not a number"),  # Arabic-Indic digits: \d would take them
        ("a,,b", "empty host"),
        ("a,", "empty host"),
    ],
)
def test_expand_nodelist_malformed(text, what):
    with pytest.raises(ValueError) as info:
        expand_nodelist(text)
    message = str(info.value)
    assert what in message and repr(text) in message and "\n" not in message


@pytest.mark.parametrize(
    "text, counts",
    [
        ("2", [2]),
        ("4(x2),3", [4, 4, 3]),
        ("1(x3)", [1, 1, 1]),
        ("2,3,1(x2)", [2, 3, 1, 1]),
        (" 8 ", [8]),
    ],
)
def test_tasks_per_node(text, counts):
    assert tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "x", "4(2)", "4(x)", "4(x2", "4x2", "4,,3", "-1", "4(x2),"])
def test_tasks_per_node_malformed(text):
    with pytest.raises(ValueError, match="tasks per node") as info:
        tasks_per_node(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(
    "job_id, port",
    [
        ("1234", 16234),  # Lightning: 15000 + int("1234")
        ("7", 15007),
        ("987654321", 19321),  # last four digits: 4321
        ("120000", 15000),  # last four digits: 0000
        ("1234_5", 16239),  # array task 5 added
        ("1234_0", 16234),
        ("9999_40536", 65535),  # 9999 + 40536 = 50535: the top of the range
        ("9999_40537", 15000),  # 50536 wraps to the bottom
        ("5_100000", 64469),  # 100005 % 50536 = 49469
        (" 1234 ", 16234),
    ],
)
def test_port_for_job(job_id, port):
    assert port_for_job(job_id) == port


@pytest.mark.parametrize("job_id", ["", "abc", "12a4", "1234_", "_5", "1234_5_6", "1234_[1-3]", "-1234"])
def test_port_for_job_malformed(job_id):
    with pytest.raises(ValueError, match="job id") as info:
        port_for_job(job_id)
    assert repr(job_id) in str(info.value)


def srun_env(**overrides):
    """A task's environment from `srun -N 2 --ntasks-per-node=4` (rank 5: second node, local rank 1)."""
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "4242",
        "SLURM_RESTART_COUNT": "0",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


def test_slurm_task_full():
    assert slurm_task(srun_env()) == SlurmTask(
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        node_rank=1,
        master_addr="gpu07",
        master_port=19242,
        restart_count=0,
    )


def test_slurm_task_is_frozen():
    task = slurm_task(srun_env())
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.rank = 0


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"HOME": "/root", "PATH": "/bin"},
        # salloc: an allocation but no srun task
        {
            "SLURM_JOB_ID": "4242",
            "SLURM_NTASKS": "8",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_NNODES": "2",
        },
        # a batch script's single step, or srun -n 1
        srun_env(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1"),
        srun_env(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS=None, SLURM_NTASKS="1"),
        # a batch script of an 8-task job that runs polytrain without srun: one process, not rank 0 of 8
        srun_env(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS=None, SLURM_NTASKS="8", SLURM_STEP_NODELIST=None),
        # srun -n 1 inside an 8-task allocation: the step's count wins
        srun_env(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="8"),
        # no task count at all
        srun_env(SLURM_STEP_NUM_TASKS=None, SLURM_NTASKS=None),
    ],
)
def test_slurm_task_none(env):
    assert slurm_task(env) is None


def test_step_num_tasks_takes_precedence():
    assert slurm_task(srun_env(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="8")).world_size == 2


def test_minimal_env_uses_defaults():
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODELIST": "n[3-4]", "SLURM_JOB_ID": "77"}
    assert slurm_task(env) == SlurmTask(
        rank=1,
        world_size=2,
        local_rank=0,
        local_world_size=2,
        node_rank=0,
        master_addr="n3",
        master_port=15077,
        restart_count=0,
    )


def test_master_addr_and_port_overrides():
    task = slurm_task(srun_env(MASTER_ADDR="10.0.0.9", MASTER_PORT="29500"))
    assert (task.master_addr, task.master_port) == ("10.0.0.9", 29500)
    # with both set, neither the node list nor the job id is needed
    task = slurm_task(
        srun_env(
            MASTER_ADDR="head",
            MASTER_PORT="1234",
            SLURM_STEP_NODELIST=None,
            SLURM_JOB_NODELIST=None,
            SLURM_NODELIST=None,
            SLURM_JOB_ID=None,
        )
    )
    assert (task.master_addr, task.master_port) == ("head", 1234)


@pytest.mark.parametrize(
    "overrides, addr",
    [
        ({}, "gpu07"),
        ({"SLURM_STEP_NODELIST": "step[3-4]"}, "step3"),
        ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": "job[05,09]"}, "job05"),
        ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None, "SLURM_NODELIST": "old1,old2"}, "old1"),
        ({"SLURM_STEP_NODELIST": "rack[2-3]-n[9-10]"}, "rack2-n9"),
    ],
)
def test_master_addr_from_node_lists(overrides, addr):
    assert slurm_task(srun_env(**overrides)).master_addr == addr


def test_master_port_from_array_job():
    assert slurm_task(srun_env(SLURM_JOB_ID="31234_2")).master_port == 16236


@pytest.mark.parametrize(
    "overrides, size",
    [
        ({}, 4),  # SLURM_NTASKS_PER_NODE
        ({"SLURM_NTASKS_PER_NODE": None, "SLURM_STEP_TASKS_PER_NODE": "5,3"}, 3),  # node 1 of the step
        (
            {"SLURM_NTASKS_PER_NODE": None, "SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": "6,2"},
            2,
        ),
        ({"SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "5,3"}, 3),  # not a plain integer
        (
            {
                "SLURM_NTASKS_PER_NODE": None,
                "SLURM_STEP_TASKS_PER_NODE": "3(x2)",
                "SLURM_TASKS_PER_NODE": "9",
            },
            3,
        ),
        ({"SLURM_NTASKS_PER_NODE": None, "SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": None}, 8),
    ],
)
def test_local_world_size_sources(overrides, size):
    assert slurm_task(srun_env(**overrides)).local_world_size == size


def test_local_world_size_on_first_node():
    env = srun_env(
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURM_NTASKS_PER_NODE=None,
        SLURM_STEP_TASKS_PER_NODE="5,3",
    )
    assert (slurm_task(env).node_rank, slurm_task(env).local_world_size) == (0, 5)


def test_restart_count():
    assert slurm_task(srun_env(SLURM_RESTART_COUNT="3")).restart_count == 3
    assert slurm_task(srun_env(SLURM_RESTART_COUNT=None)).restart_count == 0


def test_env_is_not_modified():
    env = srun_env()
    before = dict(env)
    slurm_task(env)
    assert env == before


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            {"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None, "SLURM_NODELIST": None},
            ["NODELIST", "MASTER_ADDR"],
        ),
        ({"SLURM_STEP_NODELIST": "gpu[07-"}, ["SLURM_STEP_NODELIST", "gpu[07-", "MASTER_ADDR"]),
        ({"SLURM_JOB_ID": None}, ["SLURM_JOB_ID", "MASTER_PORT"]),
        ({"SLURM_JOB_ID": "abc"}, ["SLURM_JOB_ID", "'abc'", "MASTER_PORT"]),
        ({"MASTER_PORT": "http"}, ["MASTER_PORT", "'http'"]),
        ({"MASTER_PORT": "70000"}, ["MASTER_PORT", "70000"]),
        ({"MASTER_PORT": "0"}, ["MASTER_PORT"]),
        ({"SLURM_PROCID": "x"}, ["SLURM_PROCID", "'x'"]),
        ({"SLURM_PROCID": "-1"}, ["SLURM_PROCID", "'-1'"]),
        ({"SLURM_PROCID": "8"}, ["SLURM_PROCID", "SLURM_STEP_NUM_TASKS"]),
        ({"SLURM_STEP_NUM_TASKS": "eight"}, ["SLURM_STEP_NUM_TASKS", "'eight'"]),
        ({"SLURM_LOCALID": "one"}, ["SLURM_LOCALID"]),
        ({"SLURM_NODEID": ""}, ["SLURM_NODEID"]),
        ({"SLURM_RESTART_COUNT": "1.5"}, ["SLURM_RESTART_COUNT"]),
        (
            {"SLURM_NTASKS_PER_NODE": None, "SLURM_STEP_TASKS_PER_NODE": "4(x"},
            ["SLURM_STEP_TASKS_PER_NODE", "'4(x'"],
        ),
        (
            {"SLURM_NTASKS_PER_NODE": None, "SLURM_STEP_TASKS_PER_NODE": "8"},
            ["SLURM_STEP_TASKS_PER_NODE", "1 nodes"],
        ),
    ],
)
def test_slurm_task_errors(overrides, words):
    with pytest.raises(ValueError) as info:
        slurm_task(srun_env(**overrides))
    message = str(info.value)
    assert all(word in message for word in words), message
    assert "\n" not in message
