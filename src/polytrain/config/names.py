"""What a message says of a name polytrain does not know: the nearest valid one (`nearest`, in errors.py,
re-exported here), or what polytrain calls another trainer's name for a setting (`foreign`), written as a flag,
a keyword or a config file's key."""

from __future__ import annotations

import re
from typing import Optional

from ..errors import bare_name, edit_distance, nearest  # noqa: F401 (re-exported)
from .declare import flag_name

# Other trainers' names for polytrain's settings: (the setting, a value to show with it, what to know besides).
# `{name=value}` in the words is another setting, spelled as the caller spells settings.
_PER_STEP = (
    "polytrain's batch size is the batch per optimizer step, so accumulating saves memory and never "
    "changes the training"
)
FOREIGN = {
    "gpus": ("devices", "N", "with {device=cuda}"),
    "num_gpus": ("devices", "N", "with {device=cuda}"),
    "accelerator": ("device", "cuda", "or cpu, or auto; the count is {devices=N}"),
    "accumulate_grad_batches": (
        "accumulate",
        "K",
        "polytrain's batch size is the batch per optimizer step "
        "(Lightning's batch size x accumulate_grad_batches x devices), so accumulating "
        "saves memory and never changes the training",
    ),
    "gradient_accumulation_steps": ("accumulate", "K", _PER_STEP),
    "grad_accum": ("accumulate", "K", _PER_STEP),
    "gradient_clip_val": (
        "clip_grad_norm",
        "X",
        "or {clip_grad_value=X} for Lightning's gradient_clip_algorithm='value'",
    ),
    "max_grad_norm": ("clip_grad_norm", "X", ""),
    "early_stopping_patience": ("patience", "N", ""),
    "fp16": ("precision", "fp16", ""),
    "learning_rate": ("lr", "X", ""),
    "lr_scheduler": (
        "schedule",
        "NAME",
        "constant, cosine, onecycle, or any torch.optim.lr_scheduler class by "
        "name with {schedule_args=K=V,...}",
    ),
    "num_train_epochs": ("epochs", "N", ""),
    "max_epochs": ("epochs", "N", ""),
}


def _placeholder(value: str) -> bool:
    """`N`, `X`, `NAME`: a value to fill in, not one to write as it stands."""
    return value.isalpha() and value.isupper()


def as_flag(name: str, value: Optional[str] = None) -> str:
    """`--batch-size 64`."""
    return flag_name(name) + (f" {value}" if value else "")


def as_keyword(name: str, value: Optional[str] = None) -> str:
    """`batch_size=64`, `device='cuda'`."""
    return f"{name}=" + ("" if not value else value if _placeholder(value) else repr(value))


def as_key(name: str, value: Optional[str] = None) -> str:
    """A file's `batch_size = 64`, `device = "cuda"`."""
    if not value:
        return repr(name)
    return f"{name} = " + (value if _placeholder(value) else '"' + value + '"')


def foreign(name: str, spell) -> Optional[str]:
    """What to say of another trainer's name for a setting (`spell(setting, value)` writes a polytrain setting
    as a flag, a keyword or a file's key: `as_flag`, `as_keyword`, `as_key`), or None."""
    known = FOREIGN.get(bare_name(name))
    if known is None:
        return None
    setting, value, words = known
    words = re.sub(r"\{(\w+)=([^}]*)\}", lambda match: spell(match[1], match[2]), words)
    return f"polytrain calls it {spell(setting, value)}" + (f" ({words})" if words else "")
