"""Files written whole or not at all: the bytes go to a temporary name in the same folder, are flushed to disk,
then renamed over the old file, and the folder is flushed, so a crash leaves the previous file or the new one,
never half of one. Every module that writes a run's files uses this, from the lowest (loggers, callbacks) up."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
