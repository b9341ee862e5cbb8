"""The run folder: config.json, metrics.jsonl, model.pt, checkpoint.pt, curves.png."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Optional

import torch

from .checkpoint import atomic_write_bytes
from .errors import UserError
from .version import __version__


def new_run_dir(out: Optional[str], *, root: str = "runs") -> Path:
    """`out` as given (it must not hold another run), or a fresh time-stamped folder under `runs/`."""
    if out is not None:
        path = Path(out).expanduser()
        if (path / "config.json").exists():
            raise UserError(f"--out {path} already holds a run; choose a new folder, or continue it with "
                            f"--resume {path}")
        if path.exists() and not path.is_dir():
            raise UserError(f"--out {path} is a file; give a folder name")
        return path
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, suffix = Path(root) / stamp, 1
    while path.exists():
        suffix += 1
        path = Path(root) / f"{stamp}-{suffix}"
    return path


def write_config(run_dir: Path, settings: dict) -> None:
    record = dict(settings, versions={"polytrain": __version__, "torch": torch.__version__,
                                      "python": platform.python_version()})
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run_dir / "config.json", (json.dumps(record, indent=2) + "\n").encode())


def read_config(run_dir) -> dict:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{run_dir} is not a polytrain run folder (no config.json); pass the --out folder of a run")
    try:
        settings = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{path} is damaged (not JSON); restore it or start a new run") from None
    if not isinstance(settings, dict):
        raise UserError(f"{path} is damaged (not a JSON object); restore it or start a new run")
    settings.pop("versions", None)
    return settings


def resolve_run_dir(text) -> Path:
    """A run folder as given, or for `.../LATEST` (when no such folder exists) the newest run folder beside it."""
    path = Path(text).expanduser()
    if path.name != "LATEST" or path.exists():
        return path
    runs = [folder for folder in path.parent.glob("*") if (folder / "config.json").is_file()]
    if not runs:
        raise UserError(f"{path}: there is no run folder in {path.parent}/ yet; train one with polytrain train")
    return max(runs, key=lambda folder: (folder / "config.json").stat().st_mtime_ns)
