"""The nearest valid name to a mistyped one, offered only when it is genuinely near.

`difflib`'s ratio suggested `--skip-bad` for `--clip-grad` and `momentum=` for `monitor=`: names that share a
few letters are not near. A name is suggested when it is a typo away (an edit distance of one per four
letters, at least one: `epoch`, `batchsize`, `--shw`), when the two begin alike for three quarters of the
shorter and at least three letters, not just in a whole first word (`--optim`, `--strategy` for
`--strategies`, but not `val` for `val_every`), or when one
name's words are a run of the other's and at least half its length (`loss_fn` and `loss`, `lr_schedule` and
`schedule`); otherwise nothing is. Case and `-`/`_` do not count.
"""

from __future__ import annotations

import os
import re
from typing import Iterable, Optional

from .declare import flag_name


def _bare(name: str) -> str:
    return name.lstrip("-").lower().replace("-", "_")


def edit_distance(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of neighbours that turn `a` into `b`."""
    rows = [list(range(len(b) + 1))]
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def _words_within(short: str, long: str) -> bool:
    words, within = short.split("_"), long.split("_")
    return (
        len(short) >= 3
        and 2 * len(short) >= len(long)
        and any(within[i : i + len(words)] == words for i in range(len(within) - len(words) + 1))
    )


def _begin_alike(short: str, long: str) -> bool:
    common = len(os.path.commonprefix([short, long]))
    ends_a_word = common < len(long) and long[common] == "_" and common == len(short)  # `val` of `val_every`
    return common >= 3 and 4 * common >= 3 * len(short) and not ends_a_word


def nearest(name: str, known: Iterable[str]) -> Optional[str]:
    """The known name nearest to `name` if one is near enough to be what was meant, else None."""
    word, best = _bare(name), None
    if len(word) < 2:
        return None
    for candidate in known:
        other = _bare(candidate)
        if other == word:
            return candidate  # the same name in another case or spelling of `-`/`_`
        if not other:
            continue
        distance = edit_distance(word, other)
        short, long = sorted((word, other), key=len)
        if distance <= max(1, len(other) // 4) or _begin_alike(short, long) or _words_within(short, long):
            if best is None or distance < best[0]:
                best = (distance, candidate)
    return best[1] if best else None


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
    known = FOREIGN.get(_bare(name))
    if known is None:
        return None
    setting, value, words = known
    words = re.sub(r"\{(\w+)=([^}]*)\}", lambda match: spell(match[1], match[2]), words)
    return f"polytrain calls it {spell(setting, value)}" + (f" ({words})" if words else "")
