"""Atomic checkpoints that load without unpickling arbitrary objects.

A file is written to a temporary name in the same folder, flushed to disk, then renamed over the old one,
so a crash leaves either the previous complete checkpoint or the new complete one, never half of one.
Loading uses `torch.load(weights_only=True)`: tensors, numbers, strings, lists and dicts only.

A strategy that shards the model (`writes_shards`) writes no whole copy: every rank writes its own shards into a
new folder (shards.py), and `checkpoint.pt` keeps only where training stands (position, history,
RNG, scheduler) and that folder's name; `model.pt` and `best.pt` are then small pointers naming a folder
(`{"format": "polytrain-shards-1", "shards": NAME, "names": [...]}`), which `load_weights` follows and
`polytrain export` turns into one file. The pointers are replaced atomically after the folder is complete,
and older folders are removed only then. Any strategy resumes either form; one-file checkpoints of earlier
versions load as before.

With `--async-checkpoint` the shards are written in the background while training goes on (shards.save_async):
`checkpoint.pt` and the pointers are replaced only when that write is complete (`finish`: at the next save and
at the end of training), so a crash in between leaves the previous checkpoint.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from ..errors import CheckpointError, first_line
from ..optim.steps import Position, describe_position, planned_steps  # noqa: F401 (the names checkpoints use)
from ..run_dir import atomic_write
from . import shards
from .base_apart import check_base, read_base, read_record, without_base

FORMAT = "polytrain-checkpoint-1"
TRAINING_STATE = ("position", "history", "validations", "monitor")  # the trainer's part, as `save` writes it


def atomic_torch_save(obj, path: Path) -> None:
    """torch.save straight into the temporary file (no copy of the bytes in memory: a whole model's would be
    twice its size on the main rank, in a buffer and in its value), renamed over `path` once complete."""
    atomic_write(path, lambda handle: torch.save(obj, handle))


def safe_load(path: Path) -> dict:
    """`torch.load(weights_only=True)` with every failure turned into a one-line `CheckpointError`."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint; pass the folder of a run that saved one")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # weights_only loading runs no code; any failure means a damaged file
        raise CheckpointError(
            f"{path}: not a loadable polytrain checkpoint ({first_line(error)}); it is damaged or "
            f"was not written by polytrain"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a polytrain checkpoint")
    return state


def check_model_state(state, model, path: Path, *, values: bool = True) -> None:
    """Refuse a state dict whose names or shapes differ from `model`'s (a module, or the state dict it
    expects), naming the first difference (and, with `values`, one holding NaN or infinite numbers)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: the model weights are missing or damaged")
    expected = model if isinstance(model, dict) else model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise CheckpointError(
            f"{path}: weights belong to a different model ({'missing' if missing else 'extra'} "
            f"{name!r}); use the --model the run was trained with"
        )
    for key, tensor in expected.items():
        value = state[key]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointError(
                f"{path}: {key!r} has shape {shape}, the model expects {tuple(tensor.shape)}; "
                f"use the --model and dataset the run was trained with"
            )
        if values and tensor.is_floating_point() and not torch.isfinite(value).all():
            raise CheckpointError(f"{path}: {key!r} holds NaN or infinite values; the file is damaged")


def shard_folder(state: dict, path: Path) -> Optional[Path]:
    """The shard folder a pointer file (model.pt, best.pt) names, or None for a plain state dict."""
    if not isinstance(state.get("format"), str) or state["format"] != shards.POINTER:
        return None
    name = state.get("shards")
    if not isinstance(name, str) or not name or Path(name).name != name:
        raise CheckpointError(f"{path}: names no shard folder; the file is damaged")
    return Path(path).parent / name


def check_shards(folder: Path, expected) -> None:
    """Refuse a shard folder that is damaged or holds another model's names or shapes (read from its index)."""
    entries = shards.model_entries(shards.check(folder))
    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in entries.items()}
    check_model_state(meta, expected, folder, values=False)


def read_weights(path: Path) -> dict:
    """The whole state dict a weights file (model.pt, best.pt) holds, read from its shards where it names
    them (in this process, no process group); a LoRA run's completed from its base (base_apart.py)."""
    state = safe_load(path)
    folder = shard_folder(state, path)
    state = state if folder is None else shards.read_model(folder, state.get("names"))
    record = read_record(Path(path).parent)
    if record is not None:
        check_base(record, Path(path).parent)
        state = {**read_base(record), **state}
    return state


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Load `model.pt` (a plain state dict, or a pointer to shards) into `model` after checking it fits; a LoRA
    run's, without its base, completed from the base (base_apart.py), checked to be the one it started from."""
    record = read_record(Path(path).parent)
    expected = without_base(model.state_dict(), record)
    state = safe_load(path)
    folder = shard_folder(state, path)
    if folder is not None:
        check_shards(folder, expected)
        path, state = folder, shards.read_model(folder, list(expected))
    check_model_state(state, expected, path)
    if record is not None:
        check_base(record, Path(path).parent)
        state = {**read_base(record), **state}
    model.load_state_dict(state)


def pointer(name: str, names) -> dict:
    return {"format": shards.POINTER, "shards": name, "names": list(names)}


def pointed_folder(path: Path) -> Optional[str]:
    """The shard folder's name that model.pt, best.pt or checkpoint.pt names, read without loading weights."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # missing or damaged: it keeps no folder alive
        return None
    if not isinstance(state, dict):
        return None
    name = state.get("shards")
    return name if isinstance(name, str) else None


class Checkpointer:
    """Writes `checkpoint.pt` (everything needed to resume), `model.pt` (weights) and `best.pt` (the weights
    of the best validation) into a run folder."""

    def __init__(
        self, run_dir: Path, *, is_main: bool, asynchronous: bool = False, base: Optional[dict] = None
    ):
        self.run_dir = Path(run_dir)
        # a LoRA fine-tune's base (base_apart.py): its tensors are left out of every file, read back from it
        self.base = base
        self.is_main = is_main
        self.asynchronous = asynchronous  # shards written in the background (--async-checkpoint)
        self.pending = None  # such a write in progress: (its future, folder name, what rank 0 then writes)
        self.group = None  # the process group of background writes, apart from training's
        if asynchronous:
            shards.check_async()

    @property
    def path(self) -> Path:
        return self.run_dir / "checkpoint.pt"

    def save(self, trainer, position) -> None:
        strategy = trainer.strategy
        self.finish()  # the previous checkpoint is switched in first: they stay in order
        name = future = None
        if strategy.writes_shards and self.asynchronous and torch.distributed.is_initialized():
            name = strategy.broadcast_object(
                shards.next_name(self.run_dir, "checkpoint") if self.is_main else None
            )
            self.group = self.group or torch.distributed.new_group(backend="gloo")
            future = shards.save_async(
                self._own_parts(strategy.shard_state()), self.run_dir, name, group=self.group
            )
            state = {"shards": name, "scheduler": strategy.scheduler.state_dict()}
        elif strategy.writes_shards:  # every rank writes its own shards: nothing is gathered
            name = self._write_shards(strategy, "checkpoint", strategy.shard_state())
            state = {"shards": name, "scheduler": strategy.scheduler.state_dict()}
        else:
            state = strategy.state_dict()  # every rank takes part (split strategies gather)
            if "model" in state:
                state["model"] = without_base(state["model"], self.base)
        rng = strategy.gather_object(rng_state(strategy.device))  # each rank's own random streams
        if not self.is_main:
            self.pending = (future, name, None) if future is not None else None
            return
        state["gradients"] = strategy.gradients.state_dict()  # fp16's loss scale: the same on every rank
        state.update(
            format=FORMAT,
            position=asdict(position),
            history=list(trainer.history.epochs),
            validations=list(trainer.history.validations),
            monitor=trainer.monitor.state(),
            rng=rng,
            batch_size=trainer.train_loader.batch_size,
            steps_per_epoch=trainer.steps_per_epoch,
            train_samples=trainer.train_loader.num_samples,
        )
        weights = (
            pointer(name, without_base(strategy.expected_state(), self.base)) if name else state["model"]
        )
        if future is not None:  # written when the shards are
            self.pending = (future, name, copy.deepcopy((state, weights)))
        else:
            self._switch_in(state, weights)

    def _switch_in(self, state: dict, weights: dict) -> None:
        atomic_torch_save(state, self.path)
        atomic_torch_save(weights, self.run_dir / "model.pt")
        self._remove_unused()

    def finish(self) -> None:
        """Wait until the checkpoint written in the background is complete (every rank), then switch it in
        (rank 0: the folder renamed, then checkpoint.pt and model.pt replaced). A failed write leaves the
        previous checkpoint in place, its partial folder removed, and is raised."""
        if self.pending is None:
            return
        (future, name, written), self.pending = self.pending, None
        try:
            future.result()
        except BaseException:
            if self.is_main:
                shutil.rmtree(self.run_dir / f"{name}.tmp", ignore_errors=True)
            raise
        if self.is_main:
            shards.publish(self.run_dir, name)
            self._switch_in(*written)

    def _write_shards(self, strategy, stem: str, state: dict) -> str:
        """Every rank writes its part of `state` into a new folder of the run; its name (the same on all)."""
        name = strategy.broadcast_object(shards.next_name(self.run_dir, stem) if self.is_main else None)
        shards.save(self._own_parts(state), self.run_dir, name, is_main=self.is_main)
        return name

    def _own_parts(self, state: dict) -> dict:
        """A rank's parts (`{"model": ..., "optimizer": ...}`) less the base's tensors."""
        return dict(state, model=without_base(state["model"], self.base)) if self.base else state

    def _remove_unused(self) -> None:
        """Remove shard folders that no file of the run names any more (after the pointers were replaced)."""
        if any(self.run_dir.glob("checkpoint-*")) or any(self.run_dir.glob("best-*")):
            files = (self.path, self.run_dir / "model.pt", self.run_dir / "best.pt")
            keep = {pointed_folder(path) for path in files} - {None}
            shards.remove_unused(self.run_dir, keep | ({f"{self.pending[1]}.tmp"} if self.pending else set()))

    def save_best(self, trainer) -> None:
        """`best.pt`: the whole model by its original names, as `model.pt` holds it, after a validation that
        improved the monitored figure. Every rank calls it (split strategies gather the model; strategies that
        write shards write them, and best.pt names their folder)."""
        strategy = trainer.strategy
        if strategy.writes_shards:
            name = self._write_shards(strategy, "best", strategy.shard_state(optimizer=False))
            if self.is_main:
                names = without_base(strategy.expected_state(), self.base)
                atomic_torch_save(pointer(name, names), self.run_dir / "best.pt")
                self._remove_unused()
            return
        weights = without_base(trainer.strategy.model_state(), self.base)
        if self.is_main:
            atomic_torch_save(
                {name: tensor.detach().cpu() for name, tensor in weights.items()}, self.run_dir / "best.pt"
            )

    def resume(
        self, strategy, *, batch_size: int, steps_per_epoch: int, train_samples: int
    ) -> Optional[dict]:
        """Where the run left off, on every rank: the checkpoint read and checked on the main rank and sent to
        all in one broadcast (None where the run has none), loaded into `strategy`, each rank's random streams
        restored. Returns the trainer's part of it (Trainer(resumed=...)): where training stood; the weights are
        not kept."""
        read = None
        if self.is_main and self.path.is_file():
            read = self.read(
                strategy, batch_size=batch_size, steps_per_epoch=steps_per_epoch, train_samples=train_samples
            )
        state = strategy.broadcast_object(read)
        if state is not None:
            self.apply(strategy, state)
            restore_rng(state.get("rng"), rank=strategy.rank, device=strategy.device)
            state = {key: state[key] for key in TRAINING_STATE if key in state}
        return state

    def read(self, strategy, *, batch_size: int, steps_per_epoch: int, train_samples: int) -> dict:
        """The checkpoint, checked against this run (on the main rank); `apply` then loads it."""
        state = safe_load(self.path)
        if state.get("format") != FORMAT:
            raise CheckpointError(f"{self.path}: not a polytrain checkpoint (format {state.get('format')!r})")
        written = state.get("train_samples")
        if written is not None and written != train_samples:
            raise CheckpointError(
                f"{self.path}: written for {written:,} training samples, but this run's training "
                f"set has {train_samples:,}: the dataset changed; resume with the data the run had"
            )
        if (state.get("batch_size"), state.get("steps_per_epoch")) != (batch_size, steps_per_epoch):
            raise CheckpointError(
                f"{self.path}: written with global batch {state.get('batch_size')} "
                f"({state.get('steps_per_epoch')} steps per epoch), this run has {batch_size} "
                f"({steps_per_epoch}); resume with the run's own batch size and data"
            )
        expected = without_base(strategy.expected_state(), self.base)
        if isinstance(state.get("shards"), str):
            folder = shard_folder(dict(state, format=shards.POINTER), self.path)
            check_shards(folder, expected)
            if strategy.writes_shards:
                return (
                    state  # every rank reads its own shards in `apply` (the base's parts were read at start)
                )
            whole = shards.read_whole(folder)  # a strategy that loads whole state dicts
            state = dict(state, model=whole["model"])
            state["optimizer"] = shards.numbered_optimizer(whole["optimizer"], strategy.parameter_names)
            del state["shards"]
        check_model_state(state.get("model"), expected, self.path)
        if self.base:  # the whole model, its base read again from the folder (checked as the run resumed)
            state["model"] = {**read_base(self.base, set(strategy.expected_state())), **state["model"]}
        return state

    def apply(self, strategy, state: dict) -> None:
        """Load a read checkpoint into `strategy`; every rank calls it (sharded strategies load collectively)."""
        try:
            if "shards" in state:
                folder = self.run_dir / state["shards"]
                strategy.load_shards(
                    lambda template: shards.load_into(folder, self._own_parts(template)), state["scheduler"]
                )
            else:
                strategy.load_state_dict(state)
            strategy.gradients.load_state_dict(state.get("gradients", {}))
        except (KeyError, ValueError, RuntimeError, TypeError) as error:
            raise CheckpointError(
                f"{self.path}: optimizer or scheduler state does not fit this run "
                f"({str(error).splitlines()[0][:120]}); resume with the original settings"
            ) from None


def rng_state(device: torch.device) -> dict:
    """This process's random streams: dropout and other random layers draw from them."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(saved, *, rank: int, device: torch.device) -> None:
    """Give rank r the streams rank r had when the checkpoint was written (exact on the same device count;
    on another count, rank r takes rank r mod the old count's streams)."""
    if isinstance(saved, torch.Tensor):  # checkpoints of earlier versions held rank 0's CPU stream
        saved = [{"cpu": saved}]
    mine = saved[rank % len(saved)] if isinstance(saved, list) and saved else None
    if not isinstance(mine, dict):
        return
    if isinstance(mine.get("cpu"), torch.Tensor):
        torch.set_rng_state(mine["cpu"])
    if device.type == "cuda" and isinstance(mine.get("cuda"), torch.Tensor):
        torch.cuda.set_rng_state(mine["cuda"], device)


@dataclass
class Progress:
    """How far a run has come, read from its checkpoint without building anything."""

    epoch: int  # whole epochs done
    step: int  # steps done in the epoch after those
    steps_per_epoch: int
    history: list

    @property
    def steps_done(self) -> int:
        return self.epoch * self.steps_per_epoch + self.step

    def where(self) -> str:
        return describe_position(self.epoch, self.step, self.steps_per_epoch)


def has_checkpoint(run_dir) -> bool:
    """Whether the run in `run_dir` has written a checkpoint (a run stopped before its first has none)."""
    return (Path(run_dir) / "checkpoint.pt").is_file()


def read_progress(run_dir) -> Optional[Progress]:
    """The run's progress, or None when it has no checkpoint yet."""
    if not has_checkpoint(run_dir):
        return None
    path = Path(run_dir) / "checkpoint.pt"
    state = safe_load(path)
    position = state.get("position")
    if not isinstance(position, dict) or not isinstance(state.get("steps_per_epoch"), int):
        raise CheckpointError(f"{path}: not a polytrain checkpoint (no position); it is damaged")
    return Progress(
        int(position.get("epoch", 0)),
        int(position.get("step", 0)),
        state["steps_per_epoch"],
        list(state.get("history") or []),
    )
