"""The Python API: `fit` (and `evaluate`, `predict` from runtime/inference.py), the same code the command
line runs.

import polytrain
history = polytrain.fit("lenet", "mnist-sample", epochs=3)            # names from the registries
history = polytrain.fit(my_module, my_dataset, devices=2, strategy="data")   # or objects
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn

from .callbacks import check_monitor
from .checkpoint import atomic_write_bytes
from .config import TrainConfig
from .config.flags import refuse_ignored
from .config.keywords import check_keywords, keyword_words
from .config.model_defaults import apply_model_defaults, defaults_words
from .config.train import apply_inputs
from .data import ArrayDataset, unused_dataset_options
from .errors import ConfigError, UserError
from .loggers import split_logger_argument
from .models import build_model_on_meta, check_model_output, takes_channels_last
from .models.lightning import is_lightning, lightning_parts, plan_loop
from .models.meta import from_factory, give_values
from .optim import FROM_PYTHON, describe, make_recipe, recipe_line, recipe_notes, take_objects
from .run_dir import (
    forget_unstarted_run,
    new_run_dir,
    read_config,
    refuse_if_training,
    training,
    write_config,
)
from .runtime.hostenv import launcher_env
from .runtime.inference import evaluate, load_run, predict, spread_indices, weights_file  # noqa: F401
from .runtime.launch import check_devices, check_main_guard, run_job, spawns_workers
from .runtime.worker import Job, choose_device, resolved_device_type
from .scaling.fits import check_fits
from .sources import (
    as_dataset,
    check_objective,
    check_picklable,
    check_sizes,
    dataset_pair,
    item_form,
    make_objective,
    oversized_batch_note,
    refuse_for_strategy,
    split_data,
)
from .strategies import make_plan, resolve_strategy_name
from .strategies.gradients import check_fp16
from .strategies.optimizer_state import state_slots_of
from .trainer import History
from .user_callbacks import check_callbacks


def train_run(
    config: TrainConfig,
    *,
    model: Union[str, nn.Module, None] = None,
    data=None,
    train=None,
    val=None,
    loss=None,
    metrics=None,
    loggers=(),
    resume_dir: Optional[str] = None,
    keep_files: bool = True,
    verbose: bool = True,
    callbacks=(),
    optimizer=None,
    scheduler=None,
    param_groups=None,
    step=None,
    eval_step=None,
    return_weights: bool = True,
):
    """Validate everything, prepare the run folder, then train on `config.devices` devices: the phases below,
    in order, each a function of its own. Returns (history, model with the trained weights, run folder or None);
    `return_weights=False` (the command line, whose run folder holds them) leaves the model as it was given.
    """
    launcher = launcher_env()
    config, resume_dir = under_launcher(config, launcher, resume_dir)
    shout = verbose and (launcher is None or launcher.rank == 0)  # one process prints the notes
    model = from_factory(model)  # a function that builds the model: built on the meta device
    strategy = resolve_strategy_name(config.strategy, config.devices)
    # under srun each task may see only the GPU it is bound to
    check_devices(
        config.devices if launcher is None else 1 if launcher.rendezvous else launcher.local_world_size,
        config.device,
    )
    data, train, val = split_data(data, train, val)
    dataset, objective = prepare_data(
        config,
        model,
        data,
        train,
        val,
        loss=loss,
        metrics=metrics,
        step=step,
        eval_step=eval_step,
        shout=shout,
    )
    module, registry_model = prepare_model(
        config, model, dataset, objective, given_tensors=isinstance(data, (tuple, list)), shout=shout
    )
    steps_per_epoch = -(-dataset.num_train // config.batch_size)
    objective = check_the_objective(config, module, objective, dataset, strategy, steps_per_epoch)
    recipe = make_recipe(config, optimizer=optimizer, scheduler=scheduler, param_groups=param_groups).checked(
        module, staleness=config.staleness or 0
    )
    if spawns_workers(strategy, config.devices):
        check_main_guard(config.devices)
        check_picklable(
            model=None if registry_model else module,
            loss=loss,
            metrics=metrics,
            train=train,
            val=val,
            logger=tuple(loggers) or None,
            callbacks=tuple(callbacks) or None,
            optimizer=recipe.optimizer,
            scheduler=recipe.schedule,
            step=step,
            eval_step=eval_step,
        )
    device = choose_device(config.device, launcher.local_rank if launcher else 0)
    check_precision(config, device, shout=shout)
    channels_last = config.channels_last
    if channels_last is None:  # a user module that flattens with .view() cannot take it: probed
        channels_last = any(isinstance(m, nn.Conv2d) for m in module.modules()) and (
            registry_model or takes_channels_last(module, dataset.sample_inputs(2))
        )
    if config.strategy == "auto" and config.devices > 1:
        strategy, line = auto_strategy(
            config,
            module,  # measuring materialises a copy, where it fits (scaling/whole_model.py)
            dataset,
            objective,
            device=device,
            channels_last=channels_last,
            launched=launcher is not None,
        )
        config = config.with_strategy(strategy, plan=None)
        refuse_for_strategy(strategy, config, objective, dataset)
        if shout:
            print(line, flush=True)
    name = model if isinstance(model, str) else config.model if registry_model else type(module).__name__
    check_fits(
        config, module, strategy, name=name, device=device, slots=state_slots_of(config), dataset=dataset
    )
    plan = make_plan(strategy, config, module, dataset, device=device)
    if shout:
        print(recipe_line(recipe), flush=True)  # what trains, beside torch's defaults: never a silent change
        for line in recipe_notes(recipe, steps_per_epoch=steps_per_epoch, epochs=config.epochs):
            print(line, flush=True)
    if resume_dir is not None:
        run_dir, fresh = Path(resume_dir), False
        record_new_layout(run_dir, strategy, plan, launched=launcher is not None)
    elif keep_files and (launcher is None or launcher.rank == 0):
        run_dir = new_run_dir(config.out)
        fresh = not run_dir.exists()
        write_run_settings(
            run_dir, config, strategy=strategy, plan=plan, dataset=dataset, model=model, objective=objective,
            custom_model=not registry_model,
            custom_data=not (train is None and (data is None or isinstance(data, str))),
        )  # fmt: skip
    else:
        run_dir, fresh = None, False
    job = Job(
        config,
        strategy,
        dataset,
        module,
        str(run_dir) if run_dir else None,
        resume=resume_dir is not None,
        verbose=verbose,
        channels_last=channels_last,
        plan=plan,
        objective=objective,
        loggers=tuple(loggers),
        callbacks=tuple(callbacks),
        optim=recipe,
        return_weights=return_weights,
    )
    try:
        with training(run_dir):  # one process trains a run folder at a time
            result = run_job(job)
    except BaseException:
        if resume_dir is None and run_dir is not None and launcher is None:  # torchrun restarts keep it
            forget_unstarted_run(run_dir, whole_folder=fresh)
        raise
    if result is None:  # (a rank other than 0 under a launcher)
        return None, module, run_dir
    if return_weights:
        give_values(module, device="cpu", seed=config.seed).load_state_dict(result.weights)
    if verbose and result.history.stopped:  # early stopping, or a callback
        print(result.history.stopped + (f"; run folder {run_dir}" if run_dir else ""), flush=True)
    return result.history, module, run_dir


# -- the phases of train_run ---------------------------------------------------------------------------------


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
        dataset = dataset_pair(train, val, model=model or config.model, objective=objective, config=config)
    else:
        dataset = as_dataset(data if data is not None else config.dataset, config)
    if getattr(dataset, "kind", "classification") != "classification":  # text: next-token cross-entropy
        objective = make_objective(config, loss, metrics, kind=dataset.kind, step=step, eval_step=eval_step)
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
    materialises what its rank holds); a module's outputs are checked against the data's classes."""
    torch.manual_seed(config.seed)
    registry_model = model is None or isinstance(model, str)
    module = (
        build_model_on_meta(model or config.model, dataset.input_shape, dataset.num_classes, config)
        if registry_model
        else model
    )
    if isinstance(dataset, ArrayDataset) and objective.classification:
        # data given as tensors infers its classes from the labels: there the model may give more outputs
        note = check_model_output(module, dataset, exact=not given_tensors)
        if shout and note:
            print(note, flush=True)
    return module, registry_model


def check_the_objective(config, module, objective, dataset, strategy: str, steps_per_epoch: int):
    """The objective the run trains with, checked on two samples, with what a LightningModule's self.trainer
    answers; refused in one line where the monitored figure or the strategy cannot go with it."""
    plan_loop(
        objective,
        epochs=config.epochs,
        steps_per_epoch=steps_per_epoch,
        max_steps=config.max_steps,
        world_size=config.devices,
    )
    objective = check_objective(module, objective, dataset)
    check_monitor(config.monitor, objective.names, logs_more=is_lightning(module))
    refuse_for_strategy(strategy, config, objective, dataset)
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


def record_new_layout(run_dir: Path, strategy: str, plan, *, launched: bool) -> None:
    """A resumed run folder's config.json takes the strategy and layout it now trains on."""
    refuse_if_training(run_dir)  # before its config.json may be rewritten
    recorded = read_config(run_dir) if not launched and (run_dir / "config.json").is_file() else {}
    now = dict(strategy=strategy, strategy_plan=plan_record(plan))
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
        strategy_plan=plan_record(plan),
    )
    if callable(settings.get("tensor_plan")):  # a function from Python: recorded by its name
        settings["tensor_plan"] = describe(settings["tensor_plan"]) + FROM_PYTHON
    if getattr(dataset, "classes", None):
        settings["classes"] = list(dataset.classes)
    if getattr(dataset, "vocab", None):
        settings["vocab"] = "".join(dataset.vocab)  # `polytrain generate` decodes with it
    skipped = getattr(dataset, "skipped", None)
    if skipped:
        settings["skipped_files"] = len(skipped)
    write_config(run_dir, settings)
    if skipped:
        atomic_write_bytes(run_dir / "skipped.txt", "".join(f"{path}\n" for path in skipped).encode())


def auto_strategy(config, module, dataset, objective, *, device, channels_last: bool, launched: bool):
    """(strategy, the line that says why) for --strategy auto on several devices. Under torchrun or srun every
    rank would measure for itself and might choose differently, so there only a --plan file chooses."""
    from .scaling.auto import choose_strategy

    if objective.step is not None or item_form(dataset) != "pair":
        return (
            "data",
            "--strategy auto: data (a step= or batches without separate targets are measured only as data)",
        )
    if launched and not config.plan:
        return "data", (
            "--strategy auto: data (under torchrun/srun every rank would have to measure alike; pass "
            "--plan bench.json from polytrain bench to choose by measurement)"
        )
    strategy, line = choose_strategy(
        config, module, dataset, objective, device=device, channels_last=channels_last
    )
    try:
        config.with_strategy(strategy, plan=None)
    except UserError as error:
        return "data", f"{line}; but {error}, so data"
    return strategy, line


def plan_record(plan) -> Optional[dict]:
    """What config.json records of a strategy's plan: its one-line summary, and where the strategy says more
    (the pipeline: which layers each stage holds)."""
    if plan is None:
        return None
    return dict(summary=plan.describe(), **(plan.record() if hasattr(plan, "record") else {}))


def fit(
    model: Union[str, nn.Module],
    data: Union[str, ArrayDataset, tuple, None] = None,
    *,
    train=None,
    val=None,
    loss=None,
    metrics=None,
    logger=None,
    callbacks=None,
    optimizer=None,
    scheduler=None,
    param_groups=None,
    step=None,
    eval_step=None,
    epochs: Optional[float] = None,
    devices: int = 1,
    strategy: str = "auto",
    out: Optional[str] = None,
    resume: Optional[str] = None,
    verbose: bool = True,
    **settings,
) -> History:
    """Train `model` (a registry name or any `nn.Module`) on `data`; return the per-epoch history.

    `model` may also be a function that returns the module (called under `torch.device("meta")`: built
    without storage, each rank materialises only what it holds; see docs/several-devices.md).
    `data` is a dataset name (default "mnist-sample"; "shakespeare" or "text" for a language model such as
    "gpt"), an `ArrayDataset` or (train_x, train_y, val_x, val_y) uint8 tensors, all kept on the device;
    or pass `train=` and `val=` `torch.utils.data.Dataset`s of (input, target) pairs, read by `num_workers=`
    loader processes in the same global sample order.
    `loss=fn(outputs, targets)` returns the batch *mean* (as PyTorch's losses do by default) for any
    objective; without it the objective is classification (cross-entropy, with accuracy).
    `metrics={"name": fn(outputs, targets)}` returns per-sample values or the batch mean.
    Dataset items may also be tuples or dicts of tensors (a dict batch is passed as `model(**batch)`); a model
    whose output carries its loss (`.loss`, or a dict's "loss") trains on it; `step=fn(model, batch)` returns
    the loss of a batch as it comes ((inputs, targets), a tuple or a dict) for anything else, and runs under
    no_grad for validation unless `eval_step=` is given. A loss or step may return the batch mean, or a pair
    (sum of per-element losses, elements counted): the step then minimises the global sum over the global
    count, exactly, on any device count and accumulation (e.g. tokens that are not padding).
    `logger="tensorboard"`, `"csv"` (or a list, or objects with `log_metrics(metrics, step)`) add loggers.
    Every `polytrain train` flag is a keyword (`batch_size=`, `lr=`, `optimizer=`, ...); a registry model may
    bring its own defaults for those not given (`"gpt"`: AdamW, cosine, ...; printed; `epochs=` is 5 otherwise).
    `optimizer=` also takes a torch.optim class or fn(params_or_groups) -> Optimizer, `scheduler=` an
    lr_scheduler class or fn(optimizer) -> scheduler (or {"scheduler": s, "interval": "step"|"epoch"}),
    `param_groups=fn(name, parameter) -> dict` of group options (equal dicts share a group). The module is
    trained in place. With `devices > 1` the module, data and loss are pickled to the worker processes:
    define them in an importable module (not a notebook cell, not a lambda) so the workers can unpickle them.
    `callbacks=[obj, ...]`: objects with any of `on_fit_start`, `on_epoch_start`, `on_step_end`,
    `on_validation_end`, `on_epoch_end`, `on_fit_end`, each called as `hook(trainer)` on the main rank (a
    Keras-style `on_epoch_end(self, epoch, logs=None)` gets the epoch index and the epoch's figures, a
    Lightning-style `on_train_epoch_end(self, trainer, pl_module)` the trainer and the module);
    `trainer.epoch` (from 1), `trainer.step` (optimizer steps done), `trainer.metrics` (the latest validation's
    figures, and after a step `step_loss`), `trainer.model`, `trainer.history`; setting `trainer.should_stop =
    True` ends training on every rank at the same step with a checkpoint (on several devices, the step the
    ranks agree on, within about 0.2 s plus a step, as for Ctrl-C; at once at a validation or an epoch end).
    With `devices > 1` the callbacks run on a pickled copy in the rank-0 worker process: what they change on
    themselves is not seen by the caller (write what you need to a file).
    Files (config, metrics, checkpoints, curves) are written only when `out` is given. `resume=RUN_DIR`
    continues such a run from its checkpoint (give the same model, data and settings); a run that has
    finished returns its history and weights without training.
    """
    try:
        check_keywords(settings)
        if is_lightning(model):  # its training_step, validation_step and configure_optimizers
            step, eval_step, optimizer, scheduler = lightning_parts(
                model, step=step, eval_step=eval_step, optimizer=optimizer, scheduler=scheduler
            )
        optimizer, scheduler = take_objects(settings, optimizer, scheduler)  # objects out, names in
        if "per_device_batch_size" in settings and "batch_size" in settings:
            raise ConfigError("give either batch_size= (global) or per_device_batch_size=, not both")
        values = dict(settings, devices=devices, strategy=strategy)
        apply_inputs(values)
        settings = {key: value for key, value in values.items() if key not in ("devices", "strategy")}
        names, loggers = split_logger_argument(logger)
        if names:
            settings["logger"] = names
        if epochs is not None:
            settings["epochs"] = epochs
        given = set(settings)
        applied = apply_model_defaults(settings, given, model if isinstance(model, str) else None)
        if verbose and applied and not resume and (launcher_env() is None or launcher_env().rank == 0):
            print(defaults_words(model, applied), flush=True)
        config = TrainConfig(devices=devices, strategy=strategy, out=out or resume, **settings)
        refuse_ignored(config, given)
        named = data if isinstance(data, str) else config.dataset if data is None and train is None else None
        unused = unused_dataset_options(named, settings)
        if unused:
            raise UserError(
                f"{', '.join(name + '=' for name in unused)} "
                f"{'is' if len(unused) == 1 else 'are'} not used with "
                f"{'dataset ' + repr(named) if named else 'data given as objects'}; "
                f"drop {'it' if len(unused) == 1 else 'them'}"
            )
        history, _, _ = train_run(
            config,
            model=model,
            data=data,
            train=train,
            val=val,
            loss=loss,
            metrics=metrics,
            loggers=loggers,
            resume_dir=resume,
            callbacks=check_callbacks(callbacks),
            keep_files=out is not None,
            verbose=verbose,
            optimizer=optimizer,
            scheduler=scheduler,
            param_groups=param_groups,
            step=step,
            eval_step=eval_step,
        )
    except UserError as error:
        raise (
            type(error)(keyword_words(str(error))) if type(error).__init__ is UserError.__init__ else error
        ) from None
    return history
