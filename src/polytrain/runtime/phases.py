"""The phases of `api.train_run`, in the order it calls them: each checks or prepares one thing in the
launching process, before (and around) the workers that train."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from ..callbacks import check_monitor
from ..config import TrainConfig
from ..config.declare import flag_name
from ..data import ArrayDataset
from ..data.tokenizer import FILE as TOKENIZER
from ..data.tokenizer import companions
from ..errors import UserError
from ..models import build_model_on_meta, check_model_output, takes_channels_last, text_vocabulary
from ..models.lightning import is_lightning, plan_loop
from ..models.lora import adapters_of, add_adapters, describe_adapters
from ..models.own_loss import weighed_by_samples
from ..models.packing import check_packs
from ..optim import FROM_PYTHON, describe, recipe_line, recipe_notes
from ..optim.schedules import length_free
from ..parallel.global_batch import per_rank_dropout_line
from ..run_dir import (
    atomic_write_bytes,
    forget_unstarted_run,
    new_run_dir,
    read_config,
    refuse_if_training,
    training,
    write_config,
)
from ..sources import (
    as_dataset,
    check_objective,
    check_picklable,
    check_sizes,
    dataset_pair,
    item_form,
    make_objective,
    oversized_batch_note,
    refuse_for_strategy,
)
from ..strategies.gradients import check_fp16
from .inference import evaluate, load_run, predict, spread_indices, weights_file  # noqa: F401
from .launch import check_main_guard, run_job, spawns_workers
from .worker import resolved_device_type


def under_launcher(config: TrainConfig, launcher, resume_dir):
    """Under torchrun: its world size (the settings revalidated: the batch must divide), and a restarted
    attempt continues the run its predecessor started."""
    if launcher is None:
        return config, resume_dir
    config = replace(config, devices=launcher.world_size)
    if launcher.max_restarts > 0 and config.out is None and resume_dir is None:
        raise UserError(
            "under torchrun --max-restarts, pass --out DIR so restarted workers find the run's checkpoint"
        )
    if launcher.restart_count > 0 and resume_dir is None:
        resume_dir = config.out
    return config, resume_dir


# the settings that lay out a run's trajectory: a resume from Python must give them as the run had them (the
# command line reads them from the run's config.json)
TRAJECTORY = (
    "epochs", "batch_size", "optimizer", "lr", "lr_scale", "momentum", "weight_decay", "betas", "eps",
    "no_decay_norms_and_biases", "schedule", "schedule_args", "warmup_epochs", "label_smoothing", "clip_grad_norm",
    "clip_grad_value", "seed", "freeze", "dropout",
)  # fmt: skip


def check_resumed_settings(config: TrainConfig, run_dir) -> None:
    """fit(resume=RUN_DIR): one line where a setting of the trajectory differs from the run's (config.json),
    naming each with the run's value; the checkpoint's optimizer state and schedule would otherwise continue
    with the run's own and silently drop the new value, or lay the schedule out anew. --epochs may change where
    the schedule does not depend on it, as on the command line."""
    saved = read_config(run_dir)

    def plain(value):
        return tuple(value) if isinstance(value, list) else value

    differ = [
        name
        for name in TRAJECTORY
        if name in saved
        and plain(saved[name]) != plain(getattr(config, name, None))
        and not (name == "epochs" and length_free(str(saved.get("schedule") or "")))
    ]
    if differ:
        runs = ", ".join(f"{name}={plain(saved[name])!r}" for name in differ)
        given = ", ".join(f"{name}={plain(getattr(config, name, None))!r}" for name in differ)
        raise UserError(
            f"resume={str(run_dir)!r}: the run was trained with {runs}, this call gives {given}; a resumed run "
            f"continues with its own settings: pass the run's, or start a new run (out=) for new ones"
        )


def prepare_data(config, model, data, train, val, *, loss, metrics, step, eval_step, shout: bool):
    """(dataset, objective): the data as the run reads it, checked, and the objective that fits its kind."""
    objective = make_objective(config, loss, metrics, step=step, eval_step=eval_step)
    if config.num_workers is not None and train is None:
        raise UserError(
            "--num-workers applies to train= and val= Datasets; in-memory data is read on the device"
        )
    if config.augment and train is not None:
        raise UserError(
            "--augment applies to in-memory datasets; put augmentation in your Dataset's transforms"
        )
    if train is not None:
        # without val= (a run that never validates) the training set stands in for it, never read
        dataset = dataset_pair(
            train,
            train if val is None else val,
            model=model or config.model,
            objective=objective,
            config=config,
        )
    else:
        dataset = as_dataset(data if data is not None else config.dataset, config, verbose=shout)
    if getattr(dataset, "kind", "classification") != "classification":  # text: next-token cross-entropy
        objective = make_objective(
            config,
            loss,
            metrics,
            kind=dataset.kind,
            step=step,
            eval_step=eval_step,
            masks_labels=getattr(dataset, "masks_labels", True),
        )
    check_sizes(dataset, config)
    note = oversized_batch_note(dataset, config)
    if shout and note:
        print(note, flush=True)
    if shout and getattr(dataset, "skipped", None):
        print(
            f"--skip-bad: skipping {len(dataset.skipped)} unreadable image file(s), first {dataset.skipped[0]}"
        )
    return dataset, objective


def prepare_model(config, model, dataset, objective, *, given_tensors: bool, shout: bool):
    """(module, whether it is a registry model): a registry model is built without storage (each worker
    materialises what its rank holds); a module's outputs are checked against the data's classes, and a line
    names its layers that draw dropout masks on each rank."""
    torch.manual_seed(config.seed)
    registry_model = model is None or isinstance(model, str)
    module = (
        build_model_on_meta(
            model or config.model,
            dataset.input_shape,
            dataset.num_classes,
            config,
            vocabulary=text_vocabulary(dataset),
        )
        if registry_model
        else model
    )
    adapters = adapters_of(config)
    if adapters and not registry_model:  # (a registry model gets them as it is built)
        add_adapters(module, **adapters)
    if shout and adapters:
        print(describe_adapters(module), flush=True)
    if config.pack:
        check_packs(module)
    if isinstance(dataset, ArrayDataset) and objective.classification:
        # data given as tensors infers its classes from the labels: there the model may give more outputs
        note = check_model_output(module, dataset, exact=not given_tensors)
        if shout and note:
            print(note, flush=True)
    note = per_rank_dropout_line(module, config.devices)  # (verify refuses such a model)
    if shout and note:
        print(note, flush=True)
    return module, registry_model


def settle_augmentation(config, dataset, *, registry_model: bool, shout: bool):
    """The config with --augment as the run uses it. A dataset's own augmentation (cifar10's shifts and
    mirroring) is part of polytrain's recipe for its own models, said in one line; a module of the user's
    trains on the images as they are unless asked (never another training than the one written)."""
    if config.augment is not None or not getattr(dataset, "augment", False):
        return config
    if not registry_model:
        return replace(config, augment=False)
    if shout:
        print(
            f"augmentation: random 4-pixel shifts{' and mirroring' if dataset.flip else ''} of the training "
            f"images ({dataset.name}'s default with polytrain's models; --no-augment, or augment=False in "
            f"fit(), turns it off)",
            flush=True,
        )
    return config


def check_the_objective(
    config, module, objective, dataset, strategy: str, steps_per_epoch: int, *, shout=False, words=str
):
    """The objective the run trains with, checked on two samples, with what a LightningModule's self.trainer
    answers; refused in one line where the monitored figure or the strategy cannot go with it. Its note (how
    a model's own loss is weighed) is said where `shout`, in `words` (fit: its keywords)."""
    plan_loop(
        objective,
        epochs=config.epochs,
        steps_per_epoch=steps_per_epoch,
        max_steps=config.max_steps,
        world_size=config.devices,
    )
    objective = check_objective(module, objective, dataset)
    if config.staleness and objective.label_shift is not None:
        objective = weighed_by_samples(
            objective,
            why="asynchronous servers (--staleness) have no global step over which to count labels",
            remedy="Drop --staleness for the global token mean",
        )
    check_monitor(config.monitor, objective.names, logs_more=is_lightning(module))
    refuse_for_strategy(strategy, config, objective, dataset)
    if shout and objective.note:
        print(words(objective.note), flush=True)
    return objective


def check_precision(config: TrainConfig, device: torch.device, *, shout: bool) -> None:
    if config.precision != "fp16":
        return
    check_fp16(device.type)
    if device.type == "cpu" and shout:
        print(
            "note: --precision fp16 on a CPU computes in emulated half precision, about 3.5x slower than "
            "fp32 here, and saves no time; it is for GPUs (use it on a CPU only to test fp16)",
            flush=True,
        )


# the settings that name a run's layout with its strategy (parallel/layout.py `layout_of`)
LAYOUT_SETTINGS = ("devices", "pipeline_stages", "tensor_parallel", "data_parallel", "replicas")


def record_new_layout(run_dir: Path, config, strategy: str, plan, *, launched: bool) -> None:
    """A resumed run folder's config.json takes the strategy and layout it now trains on (with the settings
    that name it: those --strategy auto chose too)."""
    refuse_if_training(run_dir)  # before its config.json may be rewritten
    recorded = read_config(run_dir) if not launched and (run_dir / "config.json").is_file() else {}
    now = dict(
        strategy=strategy,
        strategy_plan=plan_record(plan, config.layout),
        **{name: getattr(config, name) for name in LAYOUT_SETTINGS},
    )
    if recorded and any(recorded.get(key) != value for key, value in now.items()):
        recorded.pop("versions", None)  # --strategy auto chose anew, or the layout changed
        write_config(run_dir, dict(recorded, **now))


def write_run_settings(
    run_dir: Path, config, *, strategy, plan, dataset, model, objective, custom_model: bool, custom_data: bool
) -> None:
    """config.json of a new run (every setting as resolved, and what the run trains on), and skipped.txt."""
    model_name = config.model if model is None else model if isinstance(model, str) else type(model).__name__
    settings = dict(
        config.to_dict(),
        strategy=strategy,
        dataset=dataset.name,
        model=model_name,
        device_type=resolved_device_type(config.device),
        custom_model=custom_model,
        custom_data=custom_data,
        loss=objective.describe_loss(),
        metrics=list(objective.names),
        strategy_plan=plan_record(plan, config.layout),
    )
    if callable(settings.get("tensor_plan")):  # a function from Python: recorded by its name
        settings["tensor_plan"] = describe(settings["tensor_plan"]) + FROM_PYTHON
    if getattr(dataset, "classes", None):
        settings["classes"] = list(dataset.classes)
    if getattr(dataset, "vocab", None):
        settings["vocab"] = "".join(dataset.vocab)  # `polytrain generate` decodes with it
    # a sequence classifier (a score head, its classes above): generate and export --format hf refuse it
    if getattr(dataset, "sequence_vocabulary", None):
        settings["classifies_texts"] = True
    kept_with = []
    if getattr(dataset, "tokenizer_file", None):  # token shards: their tokenizer, kept with the run
        kept_with = companions(dataset.tokenizer_file)
        settings["kept_tokenizer"] = dict(
            file=TOKENIZER,
            sha256=dataset.tokenizer_sha256,
            end_of_text_id=dataset.end_of_text_id,
            companions=[path.name for path in kept_with],
        )
    skipped = getattr(dataset, "skipped", None)
    if skipped:
        settings["skipped_files"] = len(skipped)
    write_config(run_dir, settings)
    if "kept_tokenizer" in settings:
        atomic_write_bytes(run_dir / TOKENIZER, Path(dataset.tokenizer_file).read_bytes())
        for path in kept_with:
            atomic_write_bytes(run_dir / path.name, path.read_bytes())
    if skipped:
        atomic_write_bytes(run_dir / "skipped.txt", "".join(f"{path}\n" for path in skipped).encode())


def auto_strategy(config, module, dataset, objective, *, device, channels_last: bool, launched: bool):
    """(the settings with --strategy auto on several devices decided, the line that says why). Under torchrun
    or srun every rank would measure for itself and might choose differently, so there only a --plan file
    chooses. A layout on a mesh (`sharded 2x2`) sets the flags that name it (--replicas 2)."""
    from ..scaling.auto import choose_strategy

    if objective.step is not None or item_form(dataset) != "pair":
        return config.with_strategy("data", plan=None), (
            "--strategy auto: data (a step= or batches without separate targets are measured only as data)"
        )
    if launched and not config.plan:
        return config.with_strategy("data", plan=None), (
            "--strategy auto: data (under torchrun/srun every rank would have to measure alike; pass "
            "--plan bench.json from polytrain bench to choose by measurement)"
        )
    strategy, settings, line = choose_strategy(
        config, module, dataset, objective, device=device, channels_last=channels_last
    )
    if settings:
        flags = " ".join(f"{flag_name(name)} {value}" for name, value in settings.items())
        line += f" (--strategy {strategy} {flags})"
    try:
        return config.with_strategy(strategy, plan=None, **settings), line
    except UserError as error:
        return config.with_strategy("data", plan=None), f"{line}; but {error}, so data"


def plan_record(plan, layout) -> Optional[dict]:
    """What config.json records of a strategy's plan for the run's `layout`: its one-line summary, and where the
    strategy says more (the pipeline: which layers each stage holds)."""
    if plan is None:
        return None
    return dict(summary=plan.describe(layout), **(plan.record() if hasattr(plan, "record") else {}))


def check_spawnable(strategy: str, config, module, recipe, *, registry_model: bool, **objects) -> None:
    """Where the run starts worker processes: the script guards its training (`if __name__ == "__main__"`)
    and everything they are handed pickles (a registry model is built in each worker instead)."""
    if not spawns_workers(config.devices):
        return
    check_main_guard(config.devices)
    check_picklable(
        model=None if registry_model else module,
        optimizer=recipe.optimizer,
        scheduler=recipe.schedule,
        **objects,
    )


def choose_channels_last(config, module, dataset, *, registry_model: bool) -> bool:
    """--channels-last as set, else: a model with convolutions, unless a user module cannot take it (one that
    flattens with .view(): probed on two samples)."""
    if config.channels_last is not None:
        return config.channels_last
    return any(isinstance(m, nn.Conv2d) for m in module.modules()) and (
        registry_model or takes_channels_last(module, dataset.sample_inputs(2))
    )


def settle_strategy(
    config, strategy: str, module, dataset, objective, *, device, channels_last, launcher, shout
):
    """(config, strategy) with --strategy auto on several devices decided (measured, or from --plan)."""
    if config.strategy != "auto" or config.devices == 1:
        return config, strategy
    config, line = auto_strategy(
        config,
        module,  # measuring materialises a copy, where it fits (scaling/whole_model.py)
        dataset,
        objective,
        device=device,
        channels_last=channels_last,
        launched=launcher is not None,
    )
    strategy = config.strategy
    refuse_for_strategy(strategy, config, objective, dataset)
    if shout:
        print(line, flush=True)
    return config, strategy


def announce_recipe(recipe, *, steps_per_epoch: int, epochs, words=str) -> None:
    """What trains, beside torch's defaults: never a silent change (its notes in `words`: fit's keywords)."""
    print(recipe_line(recipe), flush=True)
    for line in recipe_notes(recipe, steps_per_epoch=steps_per_epoch, epochs=epochs):
        print(words(line), flush=True)


def prepare_run_dir(config, resume_dir, launcher, *, keep_files: bool, strategy, plan, run_settings: dict):
    """(run folder or None, whether this run made it): a resumed folder records the layout it now trains on;
    a new one (rank 0's, with files kept) gets config.json."""
    if resume_dir is not None:
        record_new_layout(Path(resume_dir), config, strategy, plan, launched=launcher is not None)
        return Path(resume_dir), False
    if keep_files and (launcher is None or launcher.rank == 0):
        run_dir = new_run_dir(config.out)
        fresh = not run_dir.exists()
        write_run_settings(run_dir, config, strategy=strategy, plan=plan, **run_settings)
        return run_dir, fresh
    return None, False


def train_in_folder(job, run_dir, *, fresh: bool, resumed: bool, launched: bool):
    """The job's result, trained with its run folder held (one process trains a folder at a time); a new
    folder that never started is removed again (torchrun's restarts keep theirs)."""
    try:
        with training(run_dir):
            return run_job(job)
    except BaseException:
        if not resumed and run_dir is not None and not launched:
            forget_unstarted_run(run_dir, whole_folder=fresh)
        raise
