"""`polytrain tokenize`: text files, streamed, written as token shards with a manifest (data/token_shards.py
reads them).

The corpus is read in blocks, never whole: memory stays flat whatever its size. Each block is cut into pieces
at a line break that has a non-space character on both sides (`CUT`); byte-level BPE pre-tokenizers (GPT-2's,
Llama 3's, Qwen2's) never join tokens across such a break, so encoding the pieces apart gives the ids of the
whole text. The pieces are encoded in batches by the tokenizers library's `encode_batch`, on every core. A
document is a text file, or one line of a .jsonl file (its `--text-key` field), and each is followed by the
tokenizer's end-of-text id. Files named are read whatever their names; in a folder, the files `--glob`
matches (every file by default) whose start is UTF-8 text, hidden files and folders (.git) skipped and named
in one line. The last bytes of the input are held out as the validation split (`validation_bytes`).

Each split's tokens go into shards of at most `--shard-tokens` ids, uint16 where the vocabulary allows, else
uint32 (flat little-endian arrays, as nanoGPT's train.bin, read through np.memmap). A shard is written under a
hidden temporary name and renamed when complete; manifest.json (tokenizer file and hash, dtype, token counts,
each shard's SHA-256) is written last, atomically. Readers read only what a manifest names, so an interrupted
run leaves nothing a later run would read, and the next `tokenize` into the same folder removes its leftovers.
Without a tokenizer the first pass trains a byte-level BPE one on the training part of the corpus
(data/tokenizer.py).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataError, UserError
from . import tokenizer as tokenizers_file

MANIFEST = "manifest.json"
FORMAT = "polytrain-tokens/1"
CUT = re.compile(r"(?<=\S)\n(?=\S)")  # a line break between two non-space characters
FALLBACK_CUT = re.compile(r"(?<=\S)(?= \S)")  # before a space between words, in a text without such breaks
BLOCK = 1 << 20  # characters read at a time
PIECE = 1 << 14  # characters per piece, about
BATCH = 1 << 20  # characters per encode_batch call, about
SHARD_NAME = re.compile(r"^(train|val)-\d{5}\.bin$")
SNIFF = 1 << 16  # bytes read from the start of a file found in a folder to tell text from binary
NAMED = 5  # skipped paths named in the line that reports them
VAL_FRACTION = 0.005  # of a large corpus's bytes held out for validation by default
VAL_FLOOR = 1 << 20  # bytes held out by default at least, where VAL_CAP allows
VAL_CAP = 0.1  # of the corpus's bytes, the most the floor holds out


@dataclass
class Piece:
    text: str
    nbytes: int  # the piece's size in the input (UTF-8 bytes)
    offset: int  # where it starts in the whole input, in bytes
    ends_document: bool
    split: str = "train"  # the split its ids go to: "train" or "val"


@dataclass
class CorpusFiles:
    """The files a corpus is read from, in order, and what the folders given held that is not read."""

    files: List[Path]
    hidden: List[Path] = field(default_factory=list)  # hidden files and folders (.git), not looked into
    not_text: List[Path] = field(default_factory=list)  # files whose start is not UTF-8 text (images, .pyc)

    def skipped(self) -> Optional[str]:
        """One line naming what was skipped, or None."""

        def named(paths: List[Path]) -> str:
            more = f" and {len(paths) - NAMED:,} more" if len(paths) > NAMED else ""
            return ", ".join(str(path) for path in paths[:NAMED]) + more

        parts = [f"{len(self.hidden):,} hidden ({named(self.hidden)})"] if self.hidden else []
        if self.not_text:
            parts.append(f"{len(self.not_text):,} not UTF-8 text ({named(self.not_text)})")
        if not parts:
            return None
        return f"skipped {'; '.join(parts)}; name a file on the command line to read it anyway"


def is_text(path: Path) -> bool:
    """Whether a file's start is UTF-8 text without a NUL byte (as git tells binary files): a file that turns
    out otherwise further on is refused in one line while it is read."""
    with open(path, "rb") as handle:
        start = handle.read(SNIFF)
    if b"\0" in start:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(start, final=False)  # a character cut at SNIFF is fine
    except UnicodeDecodeError:
        return False
    return True


def _in_folder(folder: Path, pattern: str, chosen: CorpusFiles) -> None:
    """Add the files under `folder` that `pattern` matches, in name order, to `chosen`: its text files to
    `files`, the rest to what is skipped."""
    try:
        matched = sorted(folder.glob(pattern))
    except (ValueError, NotImplementedError) as error:  # pathlib's words for an empty or absolute pattern
        raise UserError(
            f"--glob {pattern!r}: {error}; give a pattern inside the folder, e.g. '**/*.py'"
        ) from None
    hidden, files = set(), []
    for path in matched:
        parts = path.relative_to(folder).parts
        secret = next((index for index, part in enumerate(parts) if part.startswith(".")), None)
        if secret is not None:
            hidden.add(folder.joinpath(*parts[: secret + 1]))
        elif path.is_file():
            files.append(path)
    chosen.hidden.extend(sorted(hidden))
    for path in files:
        (chosen.files if is_text(path) else chosen.not_text).append(path)


def corpus_files(paths: Sequence[str], pattern: Optional[str] = None) -> CorpusFiles:
    """The files named, each read whatever its name, and the text files under the folders named that
    `pattern` (a pathlib glob inside the folder; default: every file, recursively) matches, hidden files
    and folders left out."""
    chosen = CorpusFiles([])
    folders = [Path(name).expanduser() for name in paths if Path(name).expanduser().is_dir()]
    if pattern is not None and not folders:
        raise UserError(
            f"--glob {pattern!r} chooses files in a folder, and no folder was given; give one, or drop --glob"
        )
    for name in paths:
        path = Path(name).expanduser()
        if path.is_dir():
            before = len(chosen.files), len(chosen.hidden) + len(chosen.not_text)
            _in_folder(path, pattern or "**/*", chosen)
            if len(chosen.files) == before[0]:
                passed = len(chosen.hidden) + len(chosen.not_text) - before[1]
                which = f" matching --glob {pattern!r}" if pattern else ""
                skipped = f" ({passed:,} hidden or not UTF-8 text, skipped)" if passed else ""
                fix = (
                    "give another --glob, or name text files"
                    if pattern
                    else "give text files or their folder"
                )
                raise UserError(f"{path} holds no text files{which}{skipped}; {fix}")
        elif path.is_file():
            chosen.files.append(path)
        else:
            raise UserError(f"{path} does not exist; give text files or folders of them")
    return chosen


def _cut(text: str, *, final: bool) -> Tuple[List[str], str]:
    """`text` cut into pieces of about PIECE characters at CUT, and the rest, kept for the next block (all of
    it a piece at the end of a document)."""
    pieces, start = [], 0
    while len(text) - start > PIECE:
        found = CUT.search(text, start + PIECE) or FALLBACK_CUT.search(text, start + PIECE)
        if found is None:
            break
        pieces.append(text[start : found.end()])
        start = found.end()
    rest = text[start:]
    if final:
        return pieces + ([rest] if rest else []), ""
    return pieces, rest


def _text_documents(path: Path) -> Iterator[Tuple[str, bool]]:
    """(piece, whether it ends the document) of a text file, one document, read in blocks."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    rest, consumed = "", 0
    with open(path, "rb") as handle:
        while True:
            block = handle.read(BLOCK)
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:
                raise DataError(
                    f"{path} is not UTF-8 text (byte {consumed + error.start} is {error.object[error.start]:#04x}); "
                    f"convert it, e.g. iconv -f latin1 -t utf-8 {path.name}"
                ) from None
            consumed += len(block)
            pieces, rest = _cut(rest + text, final=not block)
            for index, piece in enumerate(pieces):
                yield piece, not block and index == len(pieces) - 1
            if not block:
                return


def _jsonl_documents(path: Path, key: str) -> Iterator[Tuple[str, bool]]:
    """(piece, whether it ends the document) of a .jsonl file, a document per line (its `key` field)."""
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise DataError(f"{path}:{number} is not a JSON line ({error}); fix or remove it") from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                present = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
                raise DataError(
                    f"{path}:{number} has no text field {key!r} (it has: {present}); name the field with "
                    f"--text-key"
                )
            pieces, _ = _cut(record[key], final=True)
            for index, piece in enumerate(pieces):
                yield piece, index == len(pieces) - 1


def _split_at(text: str, into: int) -> Tuple[str, str]:
    """`text` cut at the first CUT (or FALLBACK_CUT) at or after its byte `into`, or not at all ("")."""
    start = len(text.encode("utf-8")[:into].decode("utf-8", errors="ignore"))
    found = CUT.search(text, start) or FALLBACK_CUT.search(text, start)
    return (text[: found.end()], text[found.end() :]) if found else (text, "")


def pieces_of(files: Sequence[Path], *, text_key: str, boundary: Optional[int] = None) -> Iterator[Piece]:
    """Every piece of every file in order, where it starts in the whole input; a piece across byte `boundary`
    (where validation starts) cut where the rule allows, so that the held-out part starts close to it, and
    the pieces from there on in the validation split."""
    offset = 0
    for path in files:
        documents = _jsonl_documents(path, text_key) if path.suffix == ".jsonl" else _text_documents(path)
        for text, ends in documents:
            size = len(text.encode("utf-8"))
            if boundary is not None and offset < boundary < offset + size:
                head, tail = _split_at(text, boundary - offset)
                if tail:
                    head_size = len(head.encode("utf-8"))
                    yield Piece(head, head_size, offset, False)
                    text, size, offset = tail, size - head_size, offset + head_size
            held_out = boundary is not None and offset >= boundary
            yield Piece(text, size, offset, ends, "val" if held_out else "train")
            offset += size


def batches_of(pieces: Iterator[Piece]) -> Iterator[List[Piece]]:
    batch, size = [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece.text)
        if size >= BATCH:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class Progress:
    """A bar with MB/s on a terminal (tqdm, bytes of input); one line per pass either way."""

    def __init__(self, what: str, total: int, *, show: bool):
        self.what, self.total, self.done, self.start = what, total, 0, time.perf_counter()
        self.bar = None
        if show and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=what, leave=False, file=sys.stderr)
        self.show = show

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)

    def close(self) -> float:
        """Seconds this pass took."""
        seconds = time.perf_counter() - self.start
        if self.bar is not None:
            self.bar.close()
        if self.show:
            rate = self.done / 2**20 / max(seconds, 1e-9)
            print(
                f"{self.what}: {self.done / 2**20:,.1f} MiB in {seconds:,.1f} s ({rate:,.1f} MiB/s)",
                flush=True,
            )
        return seconds


@dataclass
class ShardWriter:
    """One split's tokens as shards of at most `limit` ids, each renamed into place when complete."""

    folder: Path
    split: str
    dtype: np.dtype
    limit: int
    shards: List[dict] = field(default_factory=list)
    _handle: object = None
    _digest: object = None
    _count: int = 0

    def _name(self) -> str:
        return f"{self.split}-{len(self.shards):05d}.bin"

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self._handle is None:
                self._handle = open(self.folder / f".{self._name()}.partial", "wb")
                self._digest, self._count = hashlib.sha256(), 0
            take = ids[: self.limit - self._count]
            data = take.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
            self._handle.write(data)
            self._digest.update(data)
            self._count += len(take)
            ids = ids[len(take) :]
            if self._count == self.limit:
                self._close()

    def _close(self) -> None:
        if self._handle is None:
            return
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        name = self._name()
        os.replace(self.folder / f".{name}.partial", self.folder / name)
        self.shards.append(dict(file=name, tokens=self._count, sha256=self._digest.hexdigest()))
        self._handle = None

    def finish(self) -> dict:
        self._close()
        return dict(tokens=sum(shard["tokens"] for shard in self.shards), shards=self.shards)


class TokenShards:
    """A folder being written as token shards: one `ShardWriter` per split, the pieces of documents encoded in
    batches (each document followed by the end-of-text id), and manifest.json written last. The tokenizer file
    must already lie in the folder (tokenizer.json). `polytrain tokenize` and the text column of `--dataset hf`
    (data/hf.py) both write through it."""

    def __init__(
        self, folder: Path, tokenizer, *, named: Path, end_of_text: Optional[str], shard_tokens: int
    ):
        self.folder, self.tokenizer = folder, tokenizer
        self.token, self.eot = tokenizers_file.end_of_text(tokenizer, named, end_of_text)
        self.vocabulary = tokenizer.get_vocab_size(with_added_tokens=True)
        self.dtype = np.dtype(np.uint16 if self.vocabulary <= 1 << 16 else np.uint32)
        self.writers = {
            split: ShardWriter(folder, split, self.dtype, shard_tokens) for split in ("train", "val")
        }
        self._encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self.documents = 0

    def add(self, pieces: Sequence[Piece]) -> None:
        """Encode a batch of pieces (on every core) and write their ids to their splits."""
        encoded = self._encode([piece.text for piece in pieces], add_special_tokens=False)
        for piece, encoding in zip(pieces, encoded):
            ids = encoding.ids + [self.eot] if piece.ends_document else encoding.ids
            self.writers[piece.split].write(np.asarray(ids, dtype=np.int64))
            self.documents += piece.ends_document

    def finish(self, *, source: str, corpus: dict, seconds: float) -> dict:
        """Close the last shards and write the manifest (atomically); returns it."""
        manifest = dict(
            format=FORMAT,
            tokenizer=dict(
                file=tokenizers_file.FILE,
                sha256=tokenizers_file.file_sha256(self.folder / tokenizers_file.FILE),
                vocab_size=self.vocabulary,
                end_of_text=self.token,
                end_of_text_id=self.eot,
                source=source,
            ),
            dtype=self.dtype.name,
            train=self.writers["train"].finish(),
            val=self.writers["val"].finish(),
            corpus=dict(corpus, documents=self.documents),
            encode_seconds=round(seconds, 3),
        )
        from ..run_dir import atomic_write_bytes

        atomic_write_bytes(self.folder / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        return manifest


def prepare_folder(out: Path) -> None:
    """Refuse a folder that holds finished shards; remove what an interrupted run left in it."""
    if (out / MANIFEST).exists():
        raise UserError(
            f"{out} already holds token shards ({MANIFEST}); give another --out, or delete it first"
        )
    out.mkdir(parents=True, exist_ok=True)
    for path in out.iterdir():
        if path.name.endswith(".partial") or SHARD_NAME.match(path.name):
            path.unlink()


def validation_bytes(total: int, fraction: Optional[float] = None) -> int:
    """How many of a corpus's `total` bytes, its last, are held out for validation: `fraction` of them where
    given; by default a tenth of a corpus under 10 MiB, 1 MiB of one up to 200 MiB, and 0.005 of a larger one.
    A fixed fraction alone leaves a small corpus a few windows to validate on (0.005 of a 127k-token corpus is
    5 windows of 128); the floor of 1 MiB, about 250,000 tokens of BPE, gives a steady loss, and the cap of a
    tenth keeps most of a small corpus for training."""
    if fraction is not None:
        return int(total * fraction)
    return max(int(total * VAL_FRACTION), min(VAL_FLOOR, int(total * VAL_CAP)))


def next_command(out: str, tokenizer: Optional[str] = None) -> str:
    """The command that trains on the shards in `out`: from the checkpoint whose tokenizer they were written
    with (its ids mean something only to that model), else a new gpt of the tokenizer's vocabulary."""
    folder = tokenizers_file.checkpoint_folder(tokenizer) if tokenizer is not None else None
    model = f"--init-from {shlex.quote(str(folder))}" if folder is not None else "--model gpt"
    return f"polytrain train {model} --dataset tokens --data-dir {shlex.quote(str(out))}"


def tokenize_corpus(
    paths: Sequence[str],
    out: str,
    *,
    tokenizer: Optional[str] = None,
    vocab_size: Optional[int] = None,
    val_fraction: Optional[float] = None,
    glob: Optional[str] = None,
    shard_tokens: int = 100_000_000,
    text_key: str = "text",
    end_of_text: Optional[str] = None,
    show: bool = True,
) -> dict:
    """Write `paths` (text files, or folders whose text files `glob` chooses) into `out` as token shards;
    returns the manifest."""
    if tokenizer is not None and vocab_size is not None:
        raise UserError("--vocab-size trains a tokenizer and --tokenizer gives one; drop one of them")
    if val_fraction is not None and not 0 <= val_fraction < 1:
        raise UserError(f"--val-fraction {val_fraction} must be at least 0 and below 1, e.g. 0.005")
    if shard_tokens < 1:
        raise UserError(f"--shard-tokens {shard_tokens} must be 1 or more")
    chosen = corpus_files(paths, glob)
    if show and chosen.skipped():
        print(chosen.skipped(), flush=True)
    files = chosen.files
    total = sum(path.stat().st_size for path in files)
    if total == 0:
        raise UserError(f"{', '.join(map(str, paths))} hold no text; give files with text in them")
    held_from = total - validation_bytes(total, val_fraction)  # byte offset where validation starts
    folder = Path(out).expanduser()
    prepare_folder(folder)
    if tokenizer is not None:
        source = tokenizers_file.find_tokenizer(tokenizer)
        model = tokenizers_file.load(source)
        shutil.copyfile(source, folder / tokenizers_file.FILE)
        for companion in tokenizers_file.companions(source):  # its special tokens and chat template
            shutil.copyfile(companion, folder / companion.name)
    else:
        progress = Progress("training the tokenizer", held_from, show=show)

        def training_text():
            for piece in pieces_of(files, text_key=text_key, boundary=held_from):
                if piece.offset >= held_from:
                    return
                progress.update(piece.nbytes)
                yield piece.text

        model = tokenizers_file.train_byte_bpe(training_text(), vocab_size=vocab_size or 8192)
        progress.close()
        model.save(str(folder / tokenizers_file.FILE))
        source = folder / tokenizers_file.FILE
    shards = TokenShards(folder, model, named=source, end_of_text=end_of_text, shard_tokens=shard_tokens)
    progress = Progress("encoding", total, show=show)
    for batch in batches_of(pieces_of(files, text_key=text_key, boundary=held_from)):
        shards.add(batch)
        progress.update(sum(piece.nbytes for piece in batch))
    return shards.finish(
        source=str(source.resolve()) if tokenizer is not None else "trained here (byte-level BPE)",
        corpus=dict(files=len(files), bytes=total, val_fraction=round((total - held_from) / total, 6)),
        seconds=progress.close(),
    )
