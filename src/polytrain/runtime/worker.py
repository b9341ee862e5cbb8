"""What one training process does: join the group, build the strategy and loaders, run the trainer."""

from __future__ import annotations

import copy
import gc
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..callbacks import Curves, MetricsLog, Monitor, ProgressBar, StepRecorder
from ..config import TrainConfig
from ..config.registry_names import parse_loggers
from ..data import ArrayDataset
from ..data.loader import make_loaders
from ..errors import UserError
from ..loggers import StepsFile, make_loggers
from ..models.lightning import plan_loop
from ..objective import Objective
from ..optim import make_recipe
from ..optim.steps import describe_position
from ..scaling.flops import flops_per_sample
from ..scaling.stepclock import StepClock
from ..scaling.timeline import Timeline
from ..strategy_registry import STRATEGIES
from ..trainer import History, Trainer
from ..user_callbacks import UserCallbacks
from .checkpoint import Checkpointer
from .hostenv import (
    LauncherEnv,
    allocator_is_ours,
    keep_freed_memory,
    launcher_env,
    share_cores,
    usable_cores,
)
from .pretrained import initial_weights
from .stopping import StopSignal, TrainingInterrupted, interrupted_message
from .watchdog import Allowance, Watchdog, first_step_work, predicted_step_seconds


@dataclass
class Job:
    """Everything a worker needs; pickled to each spawned process."""

    config: TrainConfig
    strategy: str
    dataset: ArrayDataset
    model: nn.Module
    run_dir: Optional[str] = None  # None: keep nothing on disk (Python API without out=)
    resume: bool = False
    verbose: bool = True
    record_steps: bool = False  # per-step global loss and parameters, for `polytrain verify`
    channels_last: bool = False  # resolved by the caller: on for registry models with convolutions
    plan: object = None  # the strategy's plan, computed by the caller (Strategy.make_plan)
    objective: Objective = None  # the loss and metrics; None: classification with --label-smoothing
    loggers: tuple = ()  # logger objects given to fit(logger=...), called on the main rank
    callbacks: tuple = ()  # the user's callback objects (fit(callbacks=...)), called on the main rank
    bench: Optional[tuple] = None  # (warm-up steps, measured steps): time each step (`polytrain bench`)
    optim: object = None  # optim.Recipe checked by the caller; None: made from the config
    # --init-from's weights (runtime/pretrained.py initial_weights) where the caller has them (checked against
    # the model); None: found from the config where it names a folder (a resumed run reads its own checkpoint)
    pretrained: object = None
    # a LoRA fine-tune's base record (runtime/base_apart.py): its tensors are in no checkpoint of the run
    base: Optional[dict] = None
    # a CPU process gives freed blocks back to the system at once, where the memory check found that a heap
    # keeping them would outgrow what it has (scaling/fits.py `Fit.gives_back_memory`)
    give_back_memory: bool = False
    # False: the caller does not take the trained weights back (the command line: they are in the run folder),
    # so a split model is never gathered whole onto one rank
    return_weights: bool = True
    # True: train `model` itself, the caller's object (one device in the caller's process), as a hand-written
    # loop does; False: a copy (a spawned worker's own, or one that leaves the caller's model as it was)
    in_place: bool = False

    def __post_init__(self):
        # decided once, where the job is made, not on every rank
        if self.objective is None:
            self.objective = Objective(label_smoothing=self.config.label_smoothing)
        if self.pretrained is None and self.config.init_from is not None and not self.resume:
            self.pretrained = initial_weights(self.config.init_from, self.model)


@dataclass
class WorkerResult:
    history: History
    weights: dict  # the trained state dict, on the CPU
    steps: list = None  # with Job.record_steps: (global loss, flat parameters) after each step
    timings: list = None  # with Job.bench: every rank's measured steps and memory (stepclock.StepClock)


def choose_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        # a scheduler that binds each task to its own GPU leaves it fewer visible GPUs than local ranks
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def resolved_device_type(kind: str) -> str:
    """What `--device auto|cpu|cuda` means on this machine: "cuda" or "cpu"."""
    return choose_device(kind, 0).type


def join_process_group(backend: str, launcher: LauncherEnv) -> None:
    """Join the group: at srun's address, or through torchrun's environment; after a restart by the elastic
    agent, under a fresh key prefix.

    The agent's store outlives worker restarts, so a restarted worker would otherwise read the addresses
    its dead predecessors published and fail to connect.
    """
    env = os.environ
    if launcher.rendezvous is not None:
        try:
            dist.init_process_group(
                backend, init_method=launcher.rendezvous, rank=launcher.rank, world_size=launcher.world_size
            )
        except dist.DistNetworkError as error:
            reason = str(error).strip().splitlines()[0][:160]
            raise UserError(
                f"cannot meet the other tasks at {launcher.rendezvous[6:]} ({reason}); if the port "
                f"is taken, set MASTER_PORT to a free one for every task"
            ) from None
        return
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), launcher.world_size, is_master=False)
    prefixed = dist.PrefixStore(f"polytrain/attempt-{launcher.restart_count}", store)
    dist.init_process_group(backend, store=prefixed, rank=launcher.rank, world_size=launcher.world_size)


def train_worker(job: Job) -> Optional[WorkerResult]:
    config = job.config
    launcher = launcher_env()  # None: one process of its own (the caller's)
    rank, world, local_rank, local_world = (
        (launcher.rank, launcher.world_size, launcher.local_rank, launcher.local_world_size)
        if launcher
        else (0, 1, 0, 1)
    )
    device = choose_device(config.device, local_rank)
    distributed = (
        world > 1
    )  # (every strategy on several devices; one device is the run every other reproduces)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if launcher is not None or allocator_is_ours():  # a process started for training, or the command line's
        model_bytes = sum(p.numel() * p.element_size() for p in job.model.parameters())
        keep_freed_memory(model_bytes=model_bytes, give_back=job.give_back_memory)
    if launcher is not None and device.type == "cpu":  # (never the caller's)
        share_cores(local_world)
    if distributed and not dist.is_initialized():
        join_process_group("nccl" if device.type == "cuda" else "gloo", launcher)
    stop = StopSignal(exit_on_repeat=launcher is not None).install()
    try:
        stop.connect(world)
        if distributed:  # under torchrun every rank planned and named a run folder: follow rank 0's
            box = [(job.plan, job.run_dir)]
            dist.broadcast_object_list(box, src=0)
            job.plan, job.run_dir = box[0]
        return _train(job, device, rank, world, launcher, stop)
    finally:
        stop.close()
        if distributed and dist.is_initialized():
            failure = sys.exc_info()[1]
            if launcher is not None and isinstance(failure, Exception):
                _record_first(failure)
            _leave_process_groups(failure)


def _record_first(error: Exception) -> None:
    """Write this rank's error to its launcher's error file before it leaves the process groups: leaving closes
    its connections, a peer's collective then fails, and that peer's death could reach the launcher, which stops
    every worker, before this rank's own error did (the launcher then named the peer's "connection closed" as
    the cause: runtime/launch.py `root_failure` prefers a rank's own error, where one is recorded). The elastic
    wrapper writes the same record again when the error leaves the worker."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    try:
        ErrorHandler().record_exception(error)
    except OSError:  # (no error file to write: the wrapper's record is the only one)
        pass


def _leave_process_groups(error: Optional[BaseException]) -> None:
    """Destroy the process groups once nothing of the run holds them but their Python objects, which release the
    GIL as they go. DDP's reducer holds its group in C++: where it went last, the gloo group's destructor waited
    for gloo's threads with the GIL held while one of them needed it (torch's deadlock, pytorch#56297; a worker
    stopped by Ctrl-C hung at its exit in about 1 of 20 runs with torch._dynamo preloaded). A run that ended
    released its reducers (`Strategy.close`); a failed one is freed here first, its traceback's frames and the
    reference cycles that keep its objects (a full collection: about 1 s in a process that has trained many runs,
    so not on every run)."""
    if error is not None:
        traceback.clear_frames(error.__traceback__)
        gc.collect()
    dist.destroy_process_group()


def _train(
    job: Job, device, rank: int, world: int, launcher: Optional[LauncherEnv], stop: StopSignal
) -> Optional[WorkerResult]:
    """One rank's run: the phases below, in order, each a function of its own."""
    config = job.config
    torch.manual_seed(config.seed)
    strategy = _make_strategy(job, device, rank, world)
    train_loader, val_loader = _make_loaders(job, strategy, device)
    steps = len(train_loader)
    module_loop = _set_up_model(job, strategy, steps_per_epoch=steps, rank=rank, world=world)
    run_dir = job.run_dir
    checkpointer = (
        Checkpointer(
            Path(run_dir), is_main=strategy.is_main, asynchronous=config.async_checkpoint, base=job.base
        )
        if run_dir
        else None
    )
    # --resume, or a restart by the elastic agent, continues from the run's checkpoint where it has one
    restarted = launcher is not None and launcher.restart_count > 0
    resumed = (
        checkpointer.resume(
            strategy,
            batch_size=config.batch_size,
            steps_per_epoch=steps,
            train_samples=train_loader.num_samples,
        )
        if checkpointer is not None and (job.resume or restarted)
        else None
    )
    callbacks, recorder, clock = _make_callbacks(job, strategy, launcher, module_loop=module_loop, rank=rank)
    trainer = Trainer(
        strategy,
        train_loader,
        val_loader,
        epochs=config.epochs,
        callbacks=callbacks,
        resumed=resumed,
        checkpointer=checkpointer,
        checkpoint_every=config.checkpoint_every,
        max_steps=config.max_steps,
        stop_vote=stop.should_stop,
        val_every=config.val_every,
        monitor=Monitor(config.monitor, config.monitor_mode, config.patience),
    )
    history = trainer.fit()
    _finish(strategy, trainer, history, checkpointer, stop, run_dir=run_dir, steps_per_epoch=steps)
    return _result(job, strategy, history, recorder, clock)


def _make_strategy(job: Job, device, rank: int, world: int):
    config = job.config
    return STRATEGIES[job.strategy](
        device=device,
        rank=rank,
        world_size=world,
        precision=config.precision,
        compile=config.compile,
        cuda_graphs=config.cuda_graphs,
        channels_last=job.channels_last,
        plan=job.plan,
        accumulate=config.accumulate,
        clip_grad_norm=config.clip_grad_norm,
        clip_grad_value=config.clip_grad_value,
        activation_checkpointing=config.activation_checkpointing,
        seed=config.seed,
        layout=config.layout,
        objective=job.objective,
    )


def _make_loaders(job: Job, strategy, device):
    """The training and validation loaders of this rank's slice of each global batch."""
    config = job.config
    return make_loaders(
        job.dataset,
        batch_size=config.batch_size,
        device=device,
        rank=strategy.data_rank,
        world_size=strategy.data_world,
        seed=config.seed,
        augment=config.augment,
        channels_last=strategy.channels_last,
        eval_batch_size=config.eval_batch_size,
        accumulate=config.accumulate,
    )


def _set_up_model(job: Job, strategy, *, steps_per_epoch: int, rank: int, world: int):
    """The strategy places its copy of the model with the optimizer and schedule; returns a LightningModule's
    loop (None for other models)."""
    config = job.config
    # Spawned workers receive the model's tensors in memory shared between processes: each worker must
    # train its own copy, or every rank's optimizer would step the same storage. One device in the caller's
    # process trains the caller's object itself where asked (runtime/own_module.py).
    recipe = (job.optim or make_recipe(config)).grouped(job.model)  # groups laid out over the whole model
    # the mixtures' balance loss joins the objective (where the caller's check of it did not); the copy made
    # below carries the routing counts this clears
    strategy.objective.watch_balance(job.model)
    # a LightningModule's self.trainer answers in configure_optimizers; its loop runs on every rank
    module_loop = plan_loop(
        strategy.objective,
        epochs=config.epochs,
        steps_per_epoch=steps_per_epoch,
        max_steps=config.max_steps,
        rank=rank,
        world_size=world,
    )
    strategy.schedule_per_step = recipe.per_step
    model = job.model if job.in_place else copy.deepcopy(job.model)
    strategy.pretrained = job.pretrained
    strategy.setup(model, recipe.optimizer_factory(), recipe.scheduler_factory(steps_per_epoch))
    if job.verbose and strategy.placement:
        print("\n".join(strategy.placement), flush=True)
    return module_loop


def _make_callbacks(job: Job, strategy, launcher, *, module_loop, rank: int) -> tuple:
    """(callbacks, step recorder or None, step clock or None): what watches the steps, in the order it runs."""
    config, run_dir = job.config, job.run_dir
    callbacks = [module_loop] if module_loop is not None else []
    if strategy.is_main and job.verbose:
        callbacks.append(ProgressBar())
    if strategy.is_main and run_dir:
        callbacks += [MetricsLog(Path(run_dir) / "metrics.jsonl"), Curves(Path(run_dir) / "curves.png")]
        callbacks.append(StepsFile(Path(run_dir) / "steps.jsonl"))
    if strategy.is_main:  # the loggers, then the user's own callbacks
        users = [UserCallbacks(job.callbacks)] if job.callbacks else []
        loggers = make_loggers(parse_loggers(config.logger), job.loggers, Path(run_dir) if run_dir else None)
        callbacks += loggers + users
    if launcher is not None:  # in a process of its own, ending it on a hang is safe
        fixed = config.hang_timeout  # given: a fixed bound, no prediction needed
        predicted = (
            0.0
            if fixed is not None
            else _first_step_seconds(job, strategy, local_world=launcher.local_world_size)
        )
        allowance = Allowance(fixed=fixed, predicted_first=predicted, compiling=bool(config.compile))
        callbacks.append(Watchdog(rank=rank, allowance=allowance))
    if config.timeline and run_dir:
        callbacks.append(Timeline(Path(run_dir) / "pipeline.png"))
    recorder = StepRecorder() if job.record_steps else None
    if recorder is not None:
        callbacks.append(recorder)
    clock = StepClock(warmup=job.bench[0], steps=job.bench[1], model=job.model) if job.bench else None
    if clock is not None:
        callbacks.append(clock)
    return callbacks, recorder, clock


def _first_step_seconds(job: Job, strategy, *, local_world: int) -> float:
    """This rank's first step on a slow machine (watchdog.py), from the model's size and its share of the
    batch, of the cores (CPU processes of one machine share them) and of the links; its FLOPs are counted on a
    copy of the model on the meta device (a few milliseconds for a small model, a second for 600M parameters)."""
    parameters = list(job.model.parameters())
    # a copy: counting runs the loss, which learns from its first value whether it gives (sum, count) pairs
    objective = copy.copy(job.objective)
    flops, exchanged = first_step_work(
        flops_per_sample=flops_per_sample(job.model, job.dataset, objective),
        samples=-(-job.config.batch_size // max(1, strategy.data_world)),
        parameters=sum(p.numel() for p in parameters),
        parameter_bytes=sum(p.numel() * p.element_size() for p in parameters),
        world=strategy.world_size,
        checkpointing=job.config.activation_checkpointing,
    )
    return predicted_step_seconds(
        flops=flops,
        exchanged_bytes=exchanged,
        device_type=strategy.device.type,
        cores=usable_cores() / max(1, local_world),
    )


def _finish(strategy, trainer, history, checkpointer, stop, *, run_dir, steps_per_epoch: int) -> None:
    """The last checkpoint switched in and the strategy closed; a stop said in `history`, an interrupt raised."""
    if checkpointer is not None:
        checkpointer.finish()  # a checkpoint still being written in the background is switched in
    strategy.close()
    where = describe_position(trainer.position.epoch, trainer.position.step, steps_per_epoch)
    if trainer.should_stop and not (trainer.interrupted and stop.signalled):
        history.stopped = f"stopped by a callback (trainer.should_stop) {where}" + (
            ", checkpoint saved" if run_dir else "; nothing was saved (no run folder: give out=DIR)"
        )
    elif trainer.interrupted:
        number = stop.received or signal.SIGTERM  # a rank that only heard of it through the vote
        raise TrainingInterrupted(interrupted_message(number, run_dir, where), signal_number=number)


def _result(job: Job, strategy, history, recorder, clock) -> Optional[WorkerResult]:
    """Rank 0's result (None on the other ranks): the history, and the trained weights where asked for."""
    weights = (
        strategy.model_state() if job.return_weights else {}
    )  # every rank takes part (split models gather)
    if not strategy.is_main:
        return None
    weights = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
    return WorkerResult(
        history, weights, recorder.steps if recorder else None, clock.result if clock else None
    )
