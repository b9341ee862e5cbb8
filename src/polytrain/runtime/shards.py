"""Checkpoints written as shards by every rank at once (torch.distributed.checkpoint, "DCP").

A strategy that splits the model (FSDP2) gives `{"model": ..., "optimizer": ...}` from `get_state_dict`: each
tensor a DTensor holding this rank's shard, keyed by the one-device parameter names. Every rank writes its own
shards in parallel into `NAME.tmp/` of the run folder (one `__RANK_0.distcp` per rank, plus `.metadata`,
written last by rank 0 once every rank is done); rank 0 then renames the folder to `NAME` (e.g.
`checkpoint-7`). Nothing is gathered to one rank. The folder becomes the run's checkpoint only when
checkpoint.py replaces the small `checkpoint.pt` (position, history, RNG, scheduler: and the folder's name)
and the pointer files `model.pt` / `best.pt`; older folders are removed after that, so a crash at any point
leaves the previous complete checkpoint in place.

With --async-checkpoint, `save_async` copies the state (a snapshot, in memory) and DCP writes it from a thread
over a process group of its own, while training goes on; `publish` renames the folder once every rank's write is
done, and only then does checkpoint.py switch it in (a crash before leaves the previous checkpoint).

Reading: a strategy that shards loads the folder collectively (`dcp.load` re-shards for any number of ranks);
any other reader (one device, data parallelism, `evaluate`, `export`) reads whole tensors in one process
without a process group (`no_dist`), one tensor at a time where it asks for that.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError, first_line

POINTER = "polytrain-shards-1"  # the format of model.pt / best.pt that name a shard folder
STEMS = ("checkpoint", "best")


@contextlib.contextmanager
def quiet():
    """DCP warns that it runs in one process when asked to (no_dist); that is the intent here (also of each rank
    reading its pieces of a pretrained checkpoint on its own, runtime/pretrained.py)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent.*")
        yield


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def next_name(run_dir: Path, stem: str) -> str:
    """A folder name no earlier save of this run used: STEM-N, N one more than any there."""
    numbers = [0]
    for path in Path(run_dir).glob(f"{stem}-*"):
        number = path.name[len(stem) + 1 :].removesuffix(".tmp")
        if number.isdigit():
            numbers.append(int(number))
    return f"{stem}-{max(numbers) + 1}"


def _planners():
    """DCP's default planners, which also find the blocks of a `Blocks` value (strategies/checkpoint_parts.py:
    a rank's rows that lie apart in the one-device tensor) by their offsets."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            value = self.state_dict.get(index.fqn)
            return value.piece(index.offset) if hasattr(value, "piece") else super().lookup_object(index)

    class LoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # DefaultLoadPlanner's, without its pass that gives meta tensors storage (the templates here have
            # storage), which turns values of other types (Blocks) into None
            from torch.distributed.checkpoint._nested_dict import flatten_state_dict

            self.original_state_dict = state_dict
            if self.flatten_state_dict:
                state_dict, self.mappings = flatten_state_dict(state_dict)
            self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

        def lookup_tensor(self, index):
            value = self.state_dict.get(index.fqn)
            return value.piece(index.offset) if hasattr(value, "piece") else super().lookup_tensor(index)

    return SavePlanner, LoadPlanner


def piece_planner():
    """A DCP load planner that reads a value's blocks (`Blocks` of strategies/checkpoint_parts.py, `Pieces` of
    runtime/pretrained.py) into the views it hands out for them, and other tensors as DCP's own does."""
    return _planners()[1]()


def save(state: dict, run_dir: Path, name: str, *, is_main: bool) -> None:
    """Every rank writes its shards of `state` into RUN_DIR/NAME.tmp; rank 0 renames it to NAME when all are
    written. A failure removes the partial folder and is raised on every rank."""
    import torch.distributed.checkpoint as dcp

    temporary = Path(run_dir) / f"{name}.tmp"
    try:
        with quiet():
            dcp.save(state, checkpoint_id=temporary, planner=_planners()[0](), no_dist=not _distributed())
    except BaseException:  # DCP's CheckpointException is a BaseException: what every rank raised
        if is_main:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    if is_main:
        publish(run_dir, name)


def publish(run_dir: Path, name: str) -> None:
    """Rename the complete NAME.tmp to NAME (rank 0, after every rank's write finished)."""
    os.replace(Path(run_dir) / f"{name}.tmp", Path(run_dir) / name)
    _sync_folder(Path(run_dir))


ASYNC_NEEDS = "2.6"  # dcp.async_save with a stager of the caller's (async_stager=)


def check_async() -> None:
    """One line where this torch cannot write checkpoints in the background."""
    import inspect

    import torch.distributed.checkpoint as dcp

    if "async_stager" not in inspect.signature(getattr(dcp, "async_save", lambda: None)).parameters:
        raise ConfigError(
            f"--async-checkpoint needs torch {ASYNC_NEEDS} or newer (torch.distributed.checkpoint.async_save); "
            f"this is {torch.__version__}: upgrade torch, or drop --async-checkpoint"
        )


def snapshot(value):
    """A copy of a state dict's tensors (DTensors, Blocks) that the next steps do not change."""
    if isinstance(value, dict):
        return {key: snapshot(item) for key, item in value.items()}
    if isinstance(value, list):
        return [snapshot(item) for item in value]
    if hasattr(value, "piece"):
        return value.clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


class _Staged:
    """DCP's stager for a state that is a snapshot already: passed on as it is."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def save_async(state: dict, run_dir: Path, name: str, *, group):
    """Every rank starts writing a snapshot of `state` into RUN_DIR/NAME.tmp in the background (over `group`, a
    process group apart from training's) and returns at once: a future that completes when its part is written
    (rank 0's: when the whole folder is). `publish` it after `result()`."""
    import torch.distributed.checkpoint as dcp

    with quiet():
        return dcp.async_save(
            snapshot(state),
            checkpoint_id=Path(run_dir) / f"{name}.tmp",
            planner=_planners()[0](),
            process_group=group,
            async_stager=_Staged(),
        )


def _sync_folder(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def remove_unused(run_dir: Path, keep) -> None:
    """Remove the shard folders of this run that no pointer names any more (and any left half-written)."""
    for stem in STEMS:
        for path in Path(run_dir).glob(f"{stem}-*"):
            if path.is_dir() and path.name not in keep:
                shutil.rmtree(path, ignore_errors=True)


def check(folder: Path):
    """The folder's DCP metadata, after checking that every file it lists is there and long enough; a missing
    or damaged file is one `CheckpointError` naming it."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = Path(folder)
    fix = "the checkpoint is incomplete or damaged; restore the file from a copy, or start the run again"
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: the shard folder is missing; {fix}")
    if not (folder / ".metadata").is_file():
        raise CheckpointError(f"{folder / '.metadata'} is missing: {fix}")
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as error:  # an unreadable index: nothing in the folder can be placed
        raise CheckpointError(f"{folder / '.metadata'} is damaged ({first_line(error)}): {fix}") from None
    needed = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, length in sorted(needed.items()):
        path = folder / relative
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: {fix}")
        if path.stat().st_size < length:
            raise CheckpointError(f"{path} is truncated ({path.stat().st_size:,} of {length:,} bytes): {fix}")
    return metadata


def model_entries(metadata) -> dict:
    """name -> (shape, dtype) of every model tensor in the checkpoint (one-device names)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = {}
    for key, item in metadata.state_dict_metadata.items():
        path = (metadata.planner_data or {}).get(key)
        if isinstance(item, TensorStorageMetadata) and path and path[0] == "model" and len(path) == 2:
            entries[path[1]] = (tuple(item.size), item.properties.dtype)
    return entries


def _load(template: dict, folder: Path, *, no_dist: bool) -> None:
    import torch.distributed.checkpoint as dcp

    try:
        with quiet():
            dcp.load(template, checkpoint_id=folder, planner=_planners()[1](), no_dist=no_dist)
    except BaseException as error:  # CheckpointException: each failing rank's error, wrapped
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(
            f"{folder}: the shards do not fit this run ({first_line(error)}); resume with the run's "
            f"model and settings"
        ) from None


def load_into(folder: Path, template: dict) -> None:
    """Fill `template` (the strategy's own sharded state dict) from the folder; every rank of the group calls
    it, and DCP reads the pieces of each shard that this rank holds now, whatever the world size was."""
    _load(template, Path(folder), no_dist=not _distributed())


def read_pieces(folder: Path, template: dict) -> None:
    """Fill `template` (as `load_into`'s) in this process alone, each tensor with the piece it holds (a
    DTensor's shard or slice: its own rows, read from the files that hold them), whatever the ranks that wrote
    the folder; no rank waits for another (--init-from a run)."""
    _load(template, Path(folder), no_dist=True)


def _empty(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def read_tensor(folder: Path, name: str, shape, dtype) -> torch.Tensor:
    """One whole model tensor, read in this process alone."""
    template = {"model": {name: _empty(shape, dtype)}}
    _load(template, Path(folder), no_dist=True)
    return template["model"][name]


def read_model(folder: Path, names=None) -> dict:
    """The whole model's state dict, read in this process alone (in the order of `names` where given)."""
    entries = model_entries(check(folder))
    order = [name for name in (names or entries) if name in entries]
    template = {"model": {name: _empty(*entries[name]) for name in order}}
    _load(template, Path(folder), no_dist=True)
    return template["model"]


def read_whole(folder: Path) -> dict:
    """Everything in the folder (model and optimizer, nested as it was saved), read in this process alone."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    check(folder)
    state = {}
    try:
        with quiet():  # as torch's dcp_to_torch_save reads a checkpoint whole
            _load_state_dict(
                state,
                storage_reader=FileSystemReader(str(folder)),
                planner=_EmptyStateDictLoadPlanner(),
                no_dist=True,
            )
    except Exception as error:
        raise CheckpointError(f"{folder}: the shards cannot be read ({first_line(error)})") from None
    return state


def numbered_optimizer(named: dict, names: list) -> dict:
    """An optimizer state dict keyed by parameter names (DCP's) in torch.optim's numbering of one device."""
    index = {name: i for i, name in enumerate(names)}
    try:
        return {
            "state": {index[name]: value for name, value in named["state"].items()},
            "param_groups": [
                dict(group, params=[index[name] for name in group["params"]])
                for group in named["param_groups"]
            ],
        }
    except KeyError as error:
        raise CheckpointError(
            f"the checkpoint's optimizer names parameter {error}, which this model lacks; resume with the "
            f"run's model"
        ) from None
