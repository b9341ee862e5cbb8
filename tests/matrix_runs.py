"""Many short training runs in a few processes that stand in for torchrun's workers, so that one launch shows
everything the runs print, torch's warnings included (tests/test_matrix.py).

    python tests/matrix_runs.py PLAN.json PROCESS

PLAN.json: {"folder": DIR, "groups": [{"processes": [0, 1], "runs": [[MODEL, ARG, ...], ...]}, ...]}. Process
PROCESS takes the groups that name it, in order: a group of one runs as a plain process does (its --devices N
starts workers of its own), a larger one as torchrun's workers with ranks in the order named (one process group
per run, met through a file). A MODEL of polytrain's registry trains as `polytrain train --model MODEL ARG ...`;
one of tests/matrix_models.py's is given to `polytrain.fit` with the ARGs as its keywords (`--pipeline-stages 2`
as `pipeline_stages=2`), the command line's way of printing a refusal (`polytrain: error: ...`, exit code 2); with
torchrun's variables set, fit joins the process group made here, as `polytrain train` does, and starts no workers.
Before each run every process writes `matrix-run N: ARGS` to stderr and to stdout, and after it
`matrix-exit N: CODE` to stderr.
"""

import datetime
import json
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

LAUNCHER = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def fit_keywords(args: list) -> dict:
    """`--flag value ...` as fit's keywords: {"flag": value}, a whole number as an int."""
    flags, values = args[0::2], args[1::2]
    return {
        flag[2:].replace("-", "_"): int(value) if value.isdigit() else value
        for flag, value in zip(flags, values)
    }


def train(model: str, args: list, out: str) -> int:
    import matrix_models

    from polytrain.cli import run_command  # (`main` would end a torchrun worker after its run)

    if model not in matrix_models.MODELS:
        return run_command(["train", "--model", model, *args, "--out", out])
    import polytrain
    from polytrain.errors import UserError

    try:
        settings = fit_keywords(args)
        polytrain.fit(**matrix_models.keywords(model, strategy=settings["strategy"]), **settings, out=out)
    except UserError as error:  # as the command line prints one
        print(f"polytrain: error: {error}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def run(number: int, model: str, args: list, folder: str, *, rank: int, world: int, store) -> int:
    for name in LAUNCHER:
        os.environ.pop(name, None)
    if world > 1:
        os.environ.update(
            TORCHELASTIC_RUN_ID=f"matrix-{number}",
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
    print(f"matrix-run {number}: {model} {' '.join(args)}", file=sys.stderr, flush=True)
    print(f"matrix-run {number}: {model} {' '.join(args)}", flush=True)  # what it prints on stdout follows
    try:
        code = train(model, args, os.path.join(folder, f"run-{number}"))
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stderr.flush()
    print(f"matrix-exit {number}: {code}", file=sys.stderr, flush=True)
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
        for model, *args in group["runs"]:
            number += 1
            if process in ranks:
                code = run(
                    number,
                    model,
                    args,
                    plan["folder"],
                    rank=ranks.index(process),
                    world=len(ranks),
                    store=store,
                )
                failed += code != 0
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
