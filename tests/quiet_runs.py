"""Many short `polytrain train` runs in a few processes that stand in for torchrun's workers, so that one launch
shows everything the runs print, torch's warnings included (tests/test_torch_quiet.py).

    python tests/quiet_runs.py PLAN.json PROCESS

PLAN.json: {"folder": DIR, "groups": [{"processes": [0, 1], "runs": [[ARG, ...], ...]}, ...]}. Process PROCESS
takes the groups that name it, in order: a group of one trains as a plain `polytrain train` does, a larger one as
torchrun's workers with ranks in the order named (one process group per run, met through a file). Before each run
every process writes `quiet-run N: ARGS` to stderr, and after it `quiet-exit N: CODE`.
"""

import datetime
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

LAUNCHER = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def run(number: int, args: list, folder: str, *, rank: int, world: int, store) -> int:
    from polytrain.cli import run_command  # (`main` would end a torchrun worker after its run)

    for name in LAUNCHER:
        os.environ.pop(name, None)
    if world > 1:
        os.environ.update(
            TORCHELASTIC_RUN_ID=f"quiet-{number}",
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
        )
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"run-{number}", store),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
    # a warning shows once per place in a process: forget those shown, so each run shows its own (re-adding a
    # default filter changes nothing else)
    warnings.filterwarnings("ignore", category=ImportWarning)
    print(f"quiet-run {number}: {' '.join(args)}", file=sys.stderr, flush=True)
    try:
        code = run_command(["train", *args, "--out", os.path.join(folder, f"run-{number}")])
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"quiet-exit {number}: {code}", file=sys.stderr, flush=True)
    return code


def main(plan_file: str, process: int) -> int:
    with open(plan_file) as handle:
        plan = json.load(handle)
    torch.set_num_threads(1)
    failed, number = 0, 0
    for index, group in enumerate(plan["groups"]):
        ranks = group["processes"]
        store = None
        if process in ranks and len(ranks) > 1:
            store = dist.FileStore(os.path.join(plan["folder"], f"group-{index}"), len(ranks))
        for args in group["runs"]:
            number += 1
            if process in ranks:
                code = run(
                    number, args, plan["folder"], rank=ranks.index(process), world=len(ranks), store=store
                )
                failed += code != 0
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
