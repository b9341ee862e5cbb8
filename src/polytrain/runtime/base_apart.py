"""A LoRA fine-tune's checkpoints without its base: `--lora R --init-from FOLDER` (a Hugging Face checkpoint) writes
the tensors that train (the adapters, a classifier's head) and their optimizer state, and leaves the frozen base in
FOLDER, recorded by its hash.

At the start of such a run the launching process writes `base.json` into the run folder: the folder, the sha256 of
its weight files, and for each tensor the base supplies (a frozen parameter `--init-from` fills) its name there,
whether it is stored transposed (GPT-2's Conv1D), its shape and dtype in the model. `checkpoint.pt`, `model.pt`,
`best.pt` and their shard folders then leave those tensors out (runtime/checkpoint.py `Checkpointer(base=...)`),
so that a fine-tune's checkpoint is its adapters' size. Whatever reads the run's weights completes them from the
base (`read_base`): `--resume` (where each rank of a sharded run had read its part of the base as it started),
`generate`, `evaluate` and `export`, each after checking that the folder still holds the weights the run started
from (one line where it is gone or holds others: a different base gives another model). A run whose folder has no
`base.json` (a run of an earlier version, a full fine-tune, a base that is a polytrain run) writes every tensor.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch

from ..config.pretrained import weight_files
from ..errors import CheckpointError, ConfigError, first_line
from ..run_dir import atomic_write_bytes

RECORD = "base.json"
FORMAT = "polytrain-base-1"
CHUNK = 1 << 24


def weights_sha256(folder) -> str:
    """The sha256 of a checkpoint folder's weight files (their names and bytes, in the index's order)."""
    digest = hashlib.sha256()
    for path in weight_files(Path(folder)):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            while block := handle.read(CHUNK):
                digest.update(block)
    return digest.hexdigest()


def make_record(weights, model: torch.nn.Module) -> Optional[dict]:
    """The record of the base `weights` (runtime/pretrained.py `Pretrained`: a Hugging Face folder and the model's
    names in it) supplies to `model` (adapters added, --freeze applied): every tensor it fills that does not
    train; None where it fills none."""
    held = model.state_dict(keep_vars=True)
    tensors = {}
    for name, stored in weights.names.items():
        tensor = held.get(name)
        if tensor is None or tensor.requires_grad:
            continue  # (trained: in the checkpoints)
        tensors[name] = dict(
            stored=list(stored) if isinstance(stored, tuple) else stored,
            transposed=name in weights.transposed,
            shape=list(tensor.shape),
            dtype=str(tensor.dtype).removeprefix("torch."),
        )
    if not tensors:
        return None
    folder = Path(weights.folder).resolve()
    return dict(format=FORMAT, init_from=str(folder), sha256=weights_sha256(folder), tensors=tensors)


def write_record(run_dir, record: dict) -> None:
    atomic_write_bytes(Path(run_dir) / RECORD, (json.dumps(record, indent=1) + "\n").encode())


def read_record(run_dir) -> Optional[dict]:
    """The run's base record, or None where its checkpoints hold every tensor; one line where it is damaged."""
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"{path}: not readable ({first_line(error)}); the run folder is damaged"
        ) from None
    if (
        not isinstance(record, dict)
        or record.get("format") != FORMAT
        or not isinstance(record.get("tensors"), dict)
    ):
        raise CheckpointError(f"{path}: not a polytrain base record; the run folder is damaged")
    return record


def check_base(record: dict, run_dir) -> None:
    """One line where the base (the recorded folder, which `read_base` reads) is gone, or holds other weights
    than those the run started from."""
    folder = Path(record["init_from"])
    named = f"{run_dir} trained adapters on the base {record['init_from']} (its weights are not in the run's checkpoints)"
    try:
        found = weights_sha256(folder)
    except (ConfigError, OSError):
        raise CheckpointError(
            f"{named}, and {folder} holds no weights now; put the base back there"
        ) from None
    if found != record["sha256"]:
        raise CheckpointError(
            f"{named}, and {folder} holds other weights (sha256 {found[:12]}, the run's {record['sha256'][:12]}); "
            f"give the base the run started from"
        )


def base_names(record: Optional[dict]) -> frozenset:
    return frozenset(record["tensors"]) if record else frozenset()


def without_base(state: dict, record: Optional[dict]) -> dict:
    """`state` (name -> tensor) less the tensors the base supplies."""
    names = base_names(record)
    return {name: value for name, value in state.items() if name not in names} if names else state


@torch.no_grad()
def read_base(record: dict, names=None) -> dict:
    """The base's tensors (those of `names`, default all) by the model's names, whole, in the model's dtypes, read
    from the recorded folder's files (one line where one is missing or of another shape)."""
    from contextlib import ExitStack

    from safetensors import safe_open

    folder = Path(record["init_from"])
    wanted = {name: entry for name, entry in record["tensors"].items() if names is None or name in names}
    found = {}
    with ExitStack() as stack:
        where = {}
        for path in weight_files(folder):
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            where.update(dict.fromkeys(handle.keys(), handle))

        def get(key: str) -> torch.Tensor:
            if key not in where:
                raise CheckpointError(
                    f"{folder} has no tensor {key!r}, which the run's base had; put the base back"
                )
            return where[key].get_tensor(key)

        for name, entry in wanted.items():
            stored = entry["stored"]
            tensor = torch.stack([get(key) for key in stored]) if isinstance(stored, list) else get(stored)
            tensor = tensor.t() if entry["transposed"] else tensor
            if list(tensor.shape) != entry["shape"]:
                raise CheckpointError(
                    f"{folder}: {stored} has shape {list(tensor.shape)}, the run's base {entry['shape']}; give the "
                    f"base the run started from"
                )
            found[name] = tensor.to(getattr(torch, entry["dtype"])).contiguous()
    return found


def base_listing(record: dict) -> list:
    """[(name, shape, dtype)] of the base's tensors, as runtime/export.py lists a run's."""
    return [
        (name, tuple(entry["shape"]), getattr(torch, entry["dtype"]))
        for name, entry in record["tensors"].items()
    ]
