"""`--dataset tokens --data-dir DIR`: the token shards `polytrain tokenize` wrote (data/corpus.py), read
through memory maps, never a whole shard.

The manifest names every shard with its token count and SHA-256. Before any worker starts, each shard's size is
checked against its count, and its checksum once: a shard that passed is stamped in `verified.json` beside it
(by size and modification time), so a later run of the same corpus reads nothing twice; where the folder is
not writable, each run checks again. A split's shards are one sequence of tokens (`MappedTokens`): a training
window of `--context` + 1 tokens may cross from one shard into the next, as it crosses documents, which the
end-of-text ids separate. Each rank maps the files itself and copies only the windows of its samples; pages
the system drops are read again. The windows, their seeded order, the rank slices and a resume are those of
the built-in text (text.py), so one device and N devices read the same tokens in the same steps.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch

from ..errors import DataError
from .corpus import FORMAT, MANIFEST
from .text import TokenDataset
from .tokenizer import FILE, file_sha256

STAMPS = "verified.json"


class MappedTokens:
    """The shards of one split as one sequence of token ids, read through memory maps opened on first use
    (a copy sent to a worker process holds the file names only)."""

    def __init__(self, paths: List[str], counts: List[int], dtype: str, limit: Optional[int] = None):
        self.paths, self.counts, self.dtype = list(paths), [int(c) for c in counts], np.dtype(dtype)
        self.ends = np.cumsum(self.counts)
        total = int(self.ends[-1]) if self.counts else 0
        self.length = total if limit is None else min(int(limit), total)
        self._maps = None

    def __len__(self) -> int:
        return self.length

    def __getstate__(self):
        return dict(self.__dict__, _maps=None)

    def head(self, count: int) -> "MappedTokens":
        """The first `count` tokens."""
        return MappedTokens(self.paths, self.counts, self.dtype.name, limit=count)

    def _shards(self):
        if self._maps is None:
            self._maps = [
                np.memmap(path, dtype=self.dtype, mode="r", shape=(count,))
                for path, count in zip(self.paths, self.counts)
            ]
        return self._maps

    def windows(self, starts, length: int) -> torch.Tensor:
        """int64 (len(starts), length): the `length` tokens from each start."""
        maps = self._shards()
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, start in enumerate(starts.tolist()):
            if start < 0 or start + length > self.length:
                raise IndexError(f"tokens {start}..{start + length} lie outside the split's {self.length}")
            shard = int(np.searchsorted(self.ends, start, side="right"))
            begin, filled = start - (int(self.ends[shard]) - self.counts[shard]), 0
            while filled < length:
                take = min(length - filled, self.counts[shard] - begin)
                out[row, filled : filled + take] = maps[shard][begin : begin + take]
                filled, shard, begin = filled + take, shard + 1, 0
        return torch.from_numpy(out)


class ShardedTokens(TokenDataset):
    """A tokenized corpus on disk: its splits as `MappedTokens`, its vocabulary the tokenizer's."""

    unit = "tokens"

    def __init__(
        self,
        folder: Path,
        manifest: dict,
        train: MappedTokens,
        val: MappedTokens,
        *,
        context: int,
        name: str = "tokens",
        source: Optional[str] = None,
    ):
        self.folder, self.manifest = folder, manifest
        tokenizer = manifest["tokenizer"]
        self.vocab_size = int(tokenizer["vocab_size"])
        self.tokenizer_file = folder / tokenizer["file"]
        self.tokenizer_sha256 = tokenizer["sha256"]
        self.end_of_text_id = int(tokenizer["end_of_text_id"])
        super().__init__(name, train, val, [], context=context, source=source or str(folder))

    @property
    def num_classes(self) -> int:
        return self.vocab_size

    def head(self, windows: int) -> "ShardedTokens":
        shorter = copy.copy(self)
        shorter.train_tokens = self.train_tokens.head((max(1, windows) + 1) * self.context)
        shorter.val_tokens = self.val_tokens.head(max(1, windows) * self.context + 1)
        return shorter


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        partial = any(p.name.endswith(".partial") for p in folder.iterdir()) if folder.is_dir() else False
        why = (
            "an interrupted polytrain tokenize left it unfinished; run it again"
            if partial
            else "write one with: polytrain tokenize FILES --out DIR"
        )
        raise DataError(f"--data-dir {folder} holds no {MANIFEST} of token shards; {why}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise DataError(
            f"{path} is not readable JSON ({error}); write the shards again with polytrain tokenize"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(
            f"{path} is not a manifest of polytrain tokenize ({FORMAT}); write the shards again with "
            f"polytrain tokenize"
        )
    return manifest


def _stamps(folder: Path) -> dict:
    try:
        stamps = json.loads((folder / STAMPS).read_text())
        return stamps if isinstance(stamps, dict) else {}
    except (OSError, ValueError):
        return {}


def check_shards(folder: Path, manifest: dict) -> None:
    """Every shard present, of the size its count says, and of its checksum (checked once, then stamped)."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    stamps, stamped = _stamps(folder), False
    for split in ("train", "val"):
        for shard in manifest[split]["shards"]:
            path = folder / shard["file"]
            if not path.is_file():
                raise DataError(
                    f"{path}, named by {folder / MANIFEST}, is missing; copy the whole folder, or tokenize again"
                )
            stat = path.stat()
            if stat.st_size != shard["tokens"] * itemsize:
                raise DataError(
                    f"{path} holds {stat.st_size:,} bytes where {folder / MANIFEST} says "
                    f"{shard['tokens']:,} {manifest['dtype']} tokens ({shard['tokens'] * itemsize:,} bytes); "
                    f"it is damaged: copy it again, or tokenize again"
                )
            stamp = [stat.st_size, stat.st_mtime_ns, shard["sha256"]]
            if stamps.get(shard["file"]) == stamp:
                continue
            if file_sha256(path) != shard["sha256"]:
                raise DataError(
                    f"{path} does not match its checksum in {folder / MANIFEST} (SHA-256); it is damaged: copy "
                    f"it again, or tokenize again"
                )
            stamps[shard["file"]], stamped = stamp, True
    if stamped:
        try:
            from ..run_dir import atomic_write_bytes

            atomic_write_bytes(folder / STAMPS, json.dumps(stamps).encode())
        except OSError:
            pass  # a folder this user cannot write: the next run checks again


def load_token_shards(
    data_dir: Optional[str], *, context: int, name: str = "tokens", source: Optional[str] = None
) -> ShardedTokens:
    """The shards in `data_dir`, checked; `name` and `source` are the dataset's and its data's in messages
    (--dataset hf reads the shards it wrote from a text column, data/hf.py)."""
    if data_dir is None:
        raise DataError("--dataset tokens needs --data-dir DIR: a folder polytrain tokenize wrote")
    folder = Path(data_dir).expanduser()
    if not folder.is_dir():
        raise DataError(f"--data-dir {folder} is not a folder; give the --out folder of polytrain tokenize")
    manifest = read_manifest(folder)
    tokenizer = folder / manifest["tokenizer"]["file"]
    if not tokenizer.is_file() or file_sha256(tokenizer) != manifest["tokenizer"]["sha256"]:
        raise DataError(
            f"{tokenizer} is missing or is not the tokenizer that wrote these shards (its SHA-256 differs from "
            f"{folder / MANIFEST}'s); copy the folder whole, or tokenize again"
        )
    check_shards(folder, manifest)

    def split(name: str) -> MappedTokens:
        shards = manifest[name]["shards"]
        return MappedTokens(
            [os.fspath(folder / s["file"]) for s in shards], [s["tokens"] for s in shards], manifest["dtype"]
        )

    return ShardedTokens(
        folder, manifest, split("train"), split("val"), context=context, name=name, source=source
    )


def check_same_tokenizer(dataset, folder: Optional[str], what: str) -> None:
    """One line where `folder` (the checkpoint or run of --init-from, or the run resumed) keeps a tokenizer
    other than the one that wrote the token shards: their ids would stand for other text."""
    ours = getattr(dataset, "tokenizer_sha256", None)
    theirs = Path(folder) / FILE if folder is not None else None
    if ours is None or theirs is None or not theirs.is_file() or file_sha256(theirs) == ours:
        return
    raise DataError(
        f"--data-dir {dataset.folder} was tokenized by another tokenizer than {what} {folder} keeps ({theirs}: "
        f"its SHA-256 differs), so its ids would stand for other text; tokenize the corpus with: polytrain "
        f"tokenize FILES --tokenizer {theirs} --out DIR"
    )
