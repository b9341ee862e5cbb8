"""`polytrain train ... --dry-run [GPU]`: the run's own layout, from its flags, built at full size at its --devices
on torch's fake process group as `polytrain plan` builds each layout (plan_report.py), its memory per GPU and its
step predicted; nothing trained, no run folder, no worker."""

from __future__ import annotations

from ..errors import UserError
from ..scaling.cluster_plan import PlanRequest
from ..scaling.gpus import gpu_named
from .plan_report import amount_words, planned, table


def gpu_of_this_machine(name: str):
    """(the GPU `--dry-run NAME` names, or this machine's CUDA device where the table knows it, else the H100;
    words saying which and why)."""
    import torch

    from ..scaling.gpus import GPUS

    if name:
        try:
            return gpu_named(name), ""
        except UserError as error:
            raise UserError(str(error).replace("unknown --gpu", "--dry-run: unknown GPU")) from None
    if not torch.cuda.is_available():
        return GPUS["h100"], " (no GPU here: as on an H100; --dry-run NAME plans another)"
    here = torch.cuda.get_device_name()
    for key in sorted(GPUS, key=len, reverse=True):
        if all(part in here.lower() for part in key.split("-")):
            return GPUS[key], f" (this machine's {here})"
    return GPUS["h100"], f" (this machine's {here} is not in the table: as on an H100)"


def dry_run_plan(config, gpu_name: str = ""):
    """(the PlanRequest, its rows, words naming the GPU) of `polytrain train --dry-run [GPU]`: the run's own layout
    (its --strategy and flags) built at full size at its --devices on the fake process group, as `polytrain plan`
    builds each layout (every layout under `--strategy auto`)."""
    from ..strategies.optimizer_state import state_slots_of
    from .phases import prepare_data, prepare_model

    if config.strategy == "parameter-server":
        raise UserError(
            "--dry-run plans layouts of data, sharded, tensor, context and pipeline ranks; a parameter server "
            "is none of them: drop --dry-run"
        )
    dataset, objective = prepare_data(
        config, None, None, None, None, loss=None, metrics=None, step=None, eval_step=None, shout=False
    )
    if not objective.language:
        raise UserError(
            f"--dry-run plans language models (--model gpt or llama, or --init-from a Hugging Face checkpoint) "
            f"at full size; --model {config.model} is not one (the memory check runs before every run): drop "
            f"--dry-run"
        )

    def build():
        return prepare_model(config, None, dataset, objective, given_tensors=False, shout=False)[0]

    gpu, where = gpu_of_this_machine(gpu_name)
    chosen = config.strategy != "auto"
    request = PlanRequest(
        build,
        config.model,
        config.devices,
        gpu,
        config.batch_size,
        int(dataset.input_shape[0]),
        precision=config.precision,
        checkpointing=config.activation_checkpointing,
        optimizer=config.optimizer,
        schedule=config.pipeline_schedule or "1f1b",
        microbatches=config.microbatches,
        config=config if chosen else None,
        slots=state_slots_of(config),
    )
    rows = planned(request, config.layout if chosen else None)
    if chosen and rows[0].refused:  # the line the run itself would refuse with
        raise UserError(f"--dry-run at --devices {config.devices}: {rows[0].refused}")
    return request, rows, where


def dry_run(config, gpu_name: str = "") -> int:
    """`polytrain train --dry-run [GPU]` (`dry_run_plan`): its memory per GPU and its step predicted; nothing
    trained, no run folder, no worker. 0 where it fits, 1 where it does not."""
    if config.split or config.split_at:
        print(
            "--dry-run cuts the pipeline's stages where their parameters balance, not at --split/--split-at"
        )
    request, rows, where = dry_run_plan(config, gpu_name)
    chosen, best, gpu = request.config is not None, rows[0], request.gpu
    print(f"dry run{where}: nothing is trained")
    print("\n".join(table(request, rows, top=15, advise=not chosen)))
    if not chosen:
        print(
            "--strategy auto chooses among data, sharded and tensor layouts with its cost model as the run starts; "
            "give the layout above with its flags to run that one"
        )
    if best.fits:
        print(
            f"fits: {amount_words(best.memory)} of {gpu.memory_gib:.0f} GiB per GPU ({best.layout.describe()})"
        )
        return 0
    print(
        f"does not fit: {amount_words(best.memory)} per GPU needed, {gpu.memory_gib:.0f} GiB per {gpu.name}; "
        f"`polytrain plan` ranks the layouts that fit"
    )
    return 1
