"""The Python API: `fit` (and `evaluate`, `predict` from runtime/inference.py), the same code the command
line runs.

import polytrain
history = polytrain.fit("lenet", "mnist-sample", epochs=3)            # names from the registries
history = polytrain.fit(my_module, my_dataset, devices=2, strategy="data")   # or objects
"""

from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch.nn as nn

from .config import TrainConfig
from .config.flags import refuse_ignored
from .config.keywords import check_keywords, keyword_words
from .config.model_defaults import apply_model_defaults, defaults_words
from .config.pretrained import apply_checkpoint
from .config.train import apply_inputs
from .data import ArrayDataset, unused_dataset_options
from .data.token_shards import check_same_tokenizer
from .errors import ConfigError, UserError
from .loggers import split_logger_argument
from .models.classifier import SequenceClassifier
from .models.lightning import is_lightning, lightning_parts
from .optim import make_recipe, take_objects, unscheduled_objects
from .optim.freeze import freeze
from .parallel.meta import from_factory, give_values
from .runtime.base_apart import check_base, make_record, read_record, write_record
from .runtime.checkpoint import has_checkpoint
from .runtime.hostenv import allocator_is_ours, launcher_env
from .runtime.inference import evaluate, load_run, predict, spread_indices, weights_file  # noqa: F401
from .runtime.launch import check_devices, spawns_workers
from .runtime.own_module import attributes_kept, left_as_given, trains_in_place, workers_note
from .runtime.phases import (
    announce_recipe,
    check_precision,
    check_resumed_settings,
    check_spawnable,
    check_the_objective,
    choose_channels_last,
    prepare_data,
    prepare_model,
    prepare_run_dir,
    settle_augmentation,
    settle_strategy,
    train_in_folder,
    under_launcher,
)
from .runtime.pretrained import Pretrained, check_vocabulary, initial_weights
from .runtime.worker import Job, choose_device
from .scaling.fits import check_fits
from .sources import (
    split_data,
)
from .strategies.optimizer_state import state_slots_of
from .strategy_registry import make_plan, resolve_strategy_name
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
    words=str,
):
    """Validate everything, prepare the run folder, then train on `config.devices` devices: the phases below,
    in order, each a function of its own. Returns (history, model with the trained weights, run folder or None);
    `return_weights=False` (the command line, whose run folder holds them) leaves the model as it was given.
    `words` says the notes written for the command line in the caller's words (fit: its keywords).
    A module of the caller's that trains on one device in this process is trained itself, from the object as
    it was given: the checks that run it on samples leave its attributes as they were (runtime/own_module.py).
    """
    launcher = launcher_env()
    config, resume_dir = under_launcher(config, launcher, resume_dir)
    shout = verbose and (launcher is None or launcher.rank == 0)  # one process prints the notes
    own = isinstance(model, nn.Module)  # the caller's object (not a name, not a function that builds one)
    model = from_factory(model)  # a function that builds the model: built on the meta device
    strategy = resolve_strategy_name(config.strategy, config.devices)
    # under srun each task may see only the GPU it is bound to
    check_devices(
        config.devices if launcher is None else 1 if launcher.rendezvous else launcher.local_world_size,
        config.device,
    )
    with attributes_kept(model if own else None):  # the checks run the caller's module on samples
        data, train, val = split_data(
            data, train, val, validates=eval_step is not None or getattr(step, "validates", True)
        )
        dataset, objective = prepare_data(
            config, model, data, train, val, loss=loss, metrics=metrics, step=step, eval_step=eval_step, shout=shout
        )  # fmt: skip
        # --init-from's weights, unless the run continues from a checkpoint of its own (a resumed or restarted
        # run that stopped before its first checkpoint starts from them again)
        pretrained = config.init_from is not None and (resume_dir is None or not has_checkpoint(resume_dir))
        # a LoRA fine-tune's checkpoints hold no base (runtime/base_apart.py): it is read again from the folder
        # its record names (resolved as it started: the one folder checked and read, from wherever this runs)
        base = read_record(resume_dir) if resume_dir is not None else None
        if base is not None and not pretrained:
            check_base(base, resume_dir)
        if pretrained:
            check_vocabulary(config, dataset)
        check_same_tokenizer(
            dataset,
            config.init_from if pretrained else resume_dir,
            "--init-from" if pretrained else "the run",
        )
        module, registry_model = prepare_model(
            config, model, dataset, objective, given_tensors=isinstance(data, (tuple, list)), shout=shout
        )
        if pretrained or base:  # the checkpoint's tensors against the model's shapes, from the files' headers
            weights = initial_weights(base["init_from"] if base else config.init_from, module)
            weights.check(module)
            if shout and isinstance(module, SequenceClassifier):  # which head it starts from
                print(module.start_line(weights), flush=True)
        config = settle_augmentation(config, dataset, registry_model=registry_model, shout=shout)
        steps_per_epoch = -(-dataset.num_train // config.batch_size)
        objective = check_the_objective(
            config, module, objective, dataset, strategy, steps_per_epoch, shout=shout, words=words
        )
        # frozen before the optimizer's groups are planned (a group only they would fill is none) and the memory
        # check, which counts no gradient or state for them
        if config.freeze:
            note = freeze(module, config.freeze)
            if shout:
                print(note, flush=True)
        if resume_dir is None and pretrained and config.lora and isinstance(weights, Pretrained):
            base = make_record(weights, module)
        recipe = make_recipe(
            config, optimizer=optimizer, scheduler=scheduler, param_groups=param_groups
        ).checked(module, staleness=config.staleness or 0)
        check_spawnable(
            strategy, config, module, recipe, registry_model=registry_model, loss=loss, metrics=metrics,
            train=train, val=val, logger=tuple(loggers) or None, callbacks=tuple(callbacks) or None, step=step,
            eval_step=eval_step,
        )  # fmt: skip
        device = choose_device(config.device, launcher.local_rank if launcher else 0)
        check_precision(config, device, shout=shout)
        channels_last = choose_channels_last(config, module, dataset, registry_model=registry_model)
        config, strategy = settle_strategy(
            config, strategy, module, dataset, objective, device=device, channels_last=channels_last,
            launcher=launcher, shout=shout,
        )  # fmt: skip
        name = model if isinstance(model, str) else config.model if registry_model else type(module).__name__
        fit = check_fits(
            config, module, strategy, name=name, device=device, slots=state_slots_of(config), dataset=dataset,
            on_this_host=launcher.local_world_size if launcher else None,
        )  # fmt: skip
        # (only a process of polytrain's own has its C allocator set: never the caller's)
        ours = launcher is not None or allocator_is_ours() or spawns_workers(config.devices)
        give_back = ours and device.type == "cpu" and fit.gives_back_memory()
        if shout and give_back:
            print(fit.line(), flush=True)
        plan = make_plan(strategy, config, module, dataset, device=device)
    in_place = trains_in_place(module if own else None, devices=config.devices, launched=launcher is not None)
    if shout:
        announce_recipe(recipe, steps_per_epoch=steps_per_epoch, epochs=config.epochs, words=words)
        if own and return_weights and spawns_workers(config.devices):
            print(workers_note(module, config.devices), flush=True)
    run_dir, fresh = prepare_run_dir(
        config, resume_dir, launcher, keep_files=keep_files, strategy=strategy, plan=plan,
        run_settings=dict(
            dataset=dataset, model=model, objective=objective, custom_model=not registry_model,
            custom_data=not (train is None and (data is None or isinstance(data, str))),
        ),
    )  # fmt: skip
    if base is not None and run_dir is not None and resume_dir is None:
        write_record(run_dir, base)
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
        pretrained=weights if pretrained or base else None,
        base=base,
        give_back_memory=give_back,
        return_weights=return_weights and not in_place,  # trained in place: the weights are in it
        in_place=in_place,
    )
    with left_as_given(module) if in_place else contextlib.nullcontext():
        result = train_in_folder(
            job, run_dir, fresh=fresh, resumed=resume_dir is not None, launched=bool(launcher)
        )
    if result is None:  # (a rank other than 0 under a launcher)
        return None, module, run_dir
    if return_weights and not in_place:
        give_values(module, device="cpu", seed=config.seed).load_state_dict(result.weights)
    if verbose and result.history.stopped:  # early stopping, or a callback
        print(result.history.stopped + (f"; run folder {run_dir}" if run_dir else ""), flush=True)
    return result.history, module, run_dir


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
    `param_groups=fn(name, parameter) -> dict` of group options (equal dicts share a group); an optimizer
    object with neither `scheduler=` nor `schedule=` trains at a constant learning rate, without warm-up.
    On one device the module itself is trained, as a hand-written loop trains it (what `forward` or a
    LightningModule sets on it stays); with `devices > 1` the module, data and loss are pickled to the worker
    processes, each trains a copy, and only the weights and buffers come back into the module (a start line
    says so): define them in an importable module (not a notebook cell, not a lambda) so the workers can
    unpickle them.
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
        unscheduled_objects(settings, optimizer, scheduler)  # your optimizer, no schedule: a constant rate
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
        if settings.get("init_from") is not None and not (model is None or isinstance(model, str)):
            raise ConfigError(
                f"init_from= loads a checkpoint into polytrain's own model, not a {type(model).__name__}; "
                f"pass model=None (or the model's name), or load the weights into your module yourself"
            )
        named, given = apply_checkpoint(settings, given, model)  # init_from=: its model and sizes
        model = named if settings.get("init_from") is not None else model
        applied = apply_model_defaults(settings, given, model if isinstance(model, str) else None)
        if verbose and applied and not resume and (launcher_env() is None or launcher_env().rank == 0):
            print(
                defaults_words(model, applied, pretrained=settings.get("init_from") is not None), flush=True
            )
        config = TrainConfig(devices=devices, strategy=strategy, out=out or resume, **settings)
        refuse_ignored(config, given)
        if resume is not None:
            check_resumed_settings(config, resume)
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
            words=keyword_words,
        )
    except UserError as error:
        raise (
            type(error)(keyword_words(str(error))) if type(error).__init__ is UserError.__init__ else error
        ) from None
    return history
