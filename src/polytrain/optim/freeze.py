"""--freeze PATTERN: parameters that do not train, chosen by their one-device names.

Frozen parameters get `requires_grad=False` before any strategy wraps the model, so no gradient is computed or
exchanged for them (DDP leaves them out of its buckets; FSDP2 reduce-scatters only what requires a gradient; a
pipeline stage and a parameter server step only what has a gradient; a tensor-parallel split keeps the flag on
each slice), and the optimizer is built over the others only: no optimizer state either. The memory check counts neither
for them.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import List

import torch.nn as nn

from ..errors import UserError


def patterns_of(text: str) -> List[str]:
    """The comma-separated globs of a --freeze value."""
    return [part.strip() for part in text.split(",") if part.strip()]


def frozen_names(names: List[str], text: str) -> List[str]:
    """The parameter names of `names` that a --freeze value matches; one line where a glob matches none or
    they match every parameter."""
    patterns = patterns_of(text)
    if not patterns:
        raise UserError(f"--freeze {text!r} names no pattern; give globs such as 'embed.*,layers.0.*'")
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name in names):
            shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
            raise UserError(
                f"--freeze {pattern!r} matches no parameter; the model's parameters are named e.g. {shown}"
            )
    frozen = [name for name in names if any(fnmatchcase(name, pattern) for pattern in patterns)]
    if len(frozen) == len(names):
        raise UserError(
            f"--freeze {text!r} matches every parameter of the model, which would train nothing; freeze fewer"
        )
    return frozen


def freeze(model: nn.Module, text: str) -> str:
    """Set `requires_grad=False` on the parameters of `model` that `text` matches; the start-up line that
    says how many are frozen. Every strategy then leaves them alone (tests/test_freeze.py: data, sharded,
    pipeline and parameter servers against SGD by hand, tensor parallelism against one device in verify)."""
    named = dict(model.named_parameters())
    frozen = frozen_names(list(named), text)
    for name in frozen:
        named[name].requires_grad_(False)
    held = sum(named[name].numel() for name in frozen)
    total = sum(p.numel() for p in named.values())
    return (
        f"frozen: {held:,} of {total:,} parameters ({len(frozen)} of {len(named)} tensors, --freeze {text}): "
        f"no gradients, no optimizer state"
    )
