"""`polytrain export RUN`: a run's weights as one file (safetensors or torch's .pt), by the one-device names.

Weights kept as shards (runtime/shards.py) are read one tensor at a time, from the checkpoint's index, and
written out before the next is read: the export holds at most the largest tensor (plus a file buffer), however
large the model. safetensors is written directly (an 8-byte little-endian header length, a JSON header giving
each tensor's dtype, shape and byte range, then the tensors' bytes), so no library has to hold every tensor at
once. torch.save needs every tensor at hand: the tensors are staged one by one into a temporary file, and
saved from its memory map, whose pages the system can drop at any time. The file appears only when complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint import safe_load, shard_folder
from ..errors import UserError
from . import shards

FORMATS = ("safetensors", "pt")
DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _raw(tensor: torch.Tensor):
    """The tensor's bytes in memory order, without a copy where it is contiguous."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _sources(path: Path):
    """[(name, shape, dtype)] and a function reading one tensor by name, of a weights file or its shards."""
    state = safe_load(path)
    folder = shard_folder(state, path)
    if folder is None:  # a one-file state dict: already whole, read it mapped from the disk
        whole = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        listing = [
            (name, tuple(t.shape), t.dtype) for name, t in whole.items() if isinstance(t, torch.Tensor)
        ]
        return listing, whole.__getitem__
    entries = shards.model_entries(shards.check(folder))
    order = [name for name in state.get("names") or entries if name in entries]
    order += [name for name in entries if name not in order]
    listing = [(name, *entries[name]) for name in order]
    return listing, lambda name: shards.read_tensor(folder, name, *entries[name])


def _aligned(offset: int) -> int:
    return (offset + 7) // 8 * 8


def _layout(listing) -> tuple:
    """Byte ranges of the tensors laid end to end (each start aligned to 8 bytes), and the total."""
    ranges, offset = {}, 0
    for name, shape, dtype in listing:
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        offset = _aligned(offset)
        ranges[name] = (offset, offset + size)
        offset += size
    return ranges, offset


def _write_tensors(handle, listing, read, ranges, start: int) -> None:
    for name, shape, dtype in listing:
        begin, end = ranges[name]
        handle.seek(start + begin)
        tensor = read(name)
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise UserError(f"{name}: read {tuple(tensor.shape)} {tensor.dtype}, listed {shape} {dtype}")
        handle.write(_raw(tensor))
        del tensor  # the next tensor is read only after this one is written
    handle.truncate(start + max((end for _, end in ranges.values()), default=0))


def _safetensors(listing, read, temporary: Path) -> None:
    for _, _, dtype in listing:
        if dtype not in DTYPES:
            raise UserError(f"safetensors has no {dtype}; export with --format pt")
    ranges, _ = _layout(listing)
    header = {
        name: {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": list(ranges[name])}
        for name, shape, dtype in listing
    }
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (_aligned(len(text)) - len(text))  # the tensors start 8-byte aligned
    with open(temporary, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        _write_tensors(handle, listing, read, ranges, 8 + len(text))
        handle.flush()
        os.fsync(handle.fileno())


def _torch_save(listing, read, temporary: Path) -> None:
    ranges, total = _layout(listing)
    staged = temporary.with_name(temporary.name + ".staged")
    try:
        with open(staged, "wb") as handle:
            _write_tensors(handle, listing, read, ranges, 0)
        storage = torch.UntypedStorage.from_file(str(staged), shared=False, nbytes=max(total, 1))
        state = {}
        for name, shape, dtype in listing:
            begin = ranges[name][0]
            view = torch.empty(0, dtype=dtype).set_(storage, begin // dtype.itemsize, shape)
            state[name] = view.clone() if view.numel() == 0 else view
        torch.save(state, temporary)
    finally:
        staged.unlink(missing_ok=True)


def export_weights(path: Path, out: Path, *, format: str = "safetensors") -> tuple:
    """Write the weights of `path` (model.pt or best.pt: a state dict or a pointer to shards) to `out` as one
    file; (tensors, bytes) written."""
    if format not in FORMATS:
        raise UserError(f"unknown export format {format!r}; choose safetensors or pt")
    listing, read = _sources(Path(path))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        (_safetensors if format == "safetensors" else _torch_save)(listing, read, temporary)
        os.replace(temporary, out)
    finally:
        temporary.unlink(missing_ok=True)
    return len(listing), _layout(listing)[1]


def default_out(run_dir: Path, weights: str, format: str) -> Path:
    stem = "model" if weights == "final" else "best"
    return Path(run_dir) / f"{stem}.{format}" if format != "pt" else Path(run_dir) / f"{stem}-export.pt"


def export_run(run_dir, *, weights: str = "final", format: str = "safetensors", out: Optional[str] = None):
    """Export a run folder's final or best weights; (file, tensors, bytes)."""
    from .inference import weights_file

    path = weights_file(run_dir, weights)
    target = Path(out) if out else default_out(Path(run_dir), weights, format)
    count, size = export_weights(path, target, format=format)
    return target, count, size
