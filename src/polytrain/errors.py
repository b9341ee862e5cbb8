"""Errors a user can fix. The command line prints them as one line, without a traceback; a message about a
mistyped name offers the nearest valid one (`nearest`), only when it is genuinely near.

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
from typing import Iterable, Optional


class UserError(Exception):
    """A mistake in the user's input: the message names the problem and the fix."""


class DataError(UserError):
    """A missing, truncated, garbage or mismatched data file."""


class ConfigError(UserError):
    """A flag or setting with a value polytrain cannot use."""


class CheckpointError(UserError):
    """A checkpoint that is missing, damaged, or from another model."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an error's message (its class name when it has none), for one-line reports."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


def bare_name(name: str) -> str:
    """`--Batch-Size` -> `batch_size`: case and `-`/`_` do not count."""
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
    word, best = bare_name(name), None
    if len(word) < 2:
        return None
    for candidate in known:
        other = bare_name(candidate)
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
