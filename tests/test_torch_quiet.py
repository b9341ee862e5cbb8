"""Nothing of torch's internals reaches the user: no built-in model under any strategy or mesh prints a warning.

Every run is two steps of a tiny model; all of them share one launch of four processes (tests/quiet_runs.py),
since starting processes costs more than the runs themselves.
"""

import json
import re
import sys
from pathlib import Path

import pytest
from processes import finish, start

pytestmark = pytest.mark.multiprocess

SYNTHETIC = ["--dataset", "synthetic", "--synthetic-size", "64"]
DATA = {
    "gpt": ["--dataset", "shakespeare", "--layers", "2", "--width", "32", "--heads", "2", "--context", "16"],
    "cifar-cnn": [*SYNTHETIC, "--synthetic-shape", "3,32,32"],
    "resnet": [*SYNTHETIC, "--synthetic-shape", "3,32,32"],
}
MODELS = ["lenet", "lenet5", "mlp", "cifar-cnn", "resnet", "gpt"]
PLANNED = ["mlp", "gpt"]  # the models with a built-in tensor plan
EVERY_MODEL = ["single", "data", "sharded", "pipeline", "parameter-server"]
MESHES = [
    "pipeline --pipeline-stages 2",  # 2 replicas x 2 stages
    "pipeline --pipeline-stages 2 --tensor-parallel 2",  # 2 stages x 2 tensor ranks
    "tensor --tensor-parallel 2",  # 2 replicas (FSDP2) x 2 tensor ranks
    "pipeline --pipeline-stages 2 --data-parallel shard",  # 2 FSDP2 shards x 2 stages
]
SPLIT = {("mlp", MESHES[1]): " --split 4"}  # (its Linears 1 and 3 split the hidden units between them)
CASES = (
    [(model, strategy, 1 if strategy == "single" else 2) for strategy in EVERY_MODEL for model in MODELS]
    + [(model, "tensor", 2) for model in PLANNED]
    + [(model, mesh + SPLIT.get((model, mesh), ""), 4) for mesh in MESHES for model in PLANNED]
)
WARNING = re.compile(r"Warning\b|\bWARN")


def argv(model: str, strategy: str, devices: int) -> list:
    return [
        "--model",
        model,
        *DATA.get(model, SYNTHETIC),
        "--batch-size",
        "16",
        "--max-steps",
        "2",
        "--strategy",
        *strategy.split(),
        "--devices",
        str(devices),
        "--device",
        "cpu",
    ]


def plan(folder: Path) -> dict:
    """Groups for four processes: single runs one per process, two-device runs on processes {0, 1} and {2, 3}
    in turn, then the four-device meshes."""
    groups = [{"processes": [p], "runs": []} for p in range(4)] + [
        {"processes": [0, 1], "runs": []},
        {"processes": [2, 3], "runs": []},
        {"processes": [0, 1, 2, 3], "runs": []},
    ]
    singles = pairs = 0
    for case in CASES:
        devices = case[2]
        if devices == 1:
            groups[singles % 4]["runs"].append(case)
            singles += 1
        elif devices == 2:
            groups[4 + pairs % 2]["runs"].append(case)
            pairs += 1
        else:
            groups[6]["runs"].append(case)
    return {"folder": str(folder), "groups": groups}


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict:
    """What each case printed on stderr, all processes together, and its exit codes: case -> (codes, text)."""
    folder = tmp_path_factory.mktemp("quiet")
    layout = plan(folder)
    cases = [case for group in layout["groups"] for case in group["runs"]]
    for group in layout["groups"]:
        group["runs"] = [argv(*case) for case in group["runs"]]
    (folder / "plan.json").write_text(json.dumps(layout))
    helper = Path(__file__).with_name("quiet_runs.py")
    processes = [start([sys.executable, helper, folder / "plan.json", p]) for p in range(4)]
    finished = [finish(process, timeout=240) for process in processes]
    found = {case: ([], []) for case in cases}
    for process, done in enumerate(finished):
        case = None
        for line in done.stderr.splitlines():
            opened = re.match(r"quiet-run (\d+): ", line)
            closed = re.match(r"quiet-exit (\d+): (-?\d+)", line)
            if opened:
                case = cases[int(opened.group(1)) - 1]
            elif closed:
                found[cases[int(closed.group(1)) - 1]][0].append(int(closed.group(2)))
                case = None
            if case is not None:
                found[case][1].append(line)
        if case is not None:
            found[case][1].append(f"(process {process} ended in this run, with exit code {done.returncode})")
    return found


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]}-{case[1].replace(' ', '')}-{case[2]}")
def test_no_torch_warning(printed, case):
    codes, lines = printed[case]
    devices = case[2]
    assert codes == [0] * devices, "\n".join(lines)
    assert not [line for line in lines if WARNING.search(line)], "\n".join(lines)
