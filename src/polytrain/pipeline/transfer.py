"""Activations of any shape sent between pipeline ranks (evaluation runs the stages without a schedule): a
fixed-size header (dtype, rank, sizes) goes first."""

from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 10


def send(x: torch.Tensor, dst: int) -> tuple:
    """Start sending `x` to rank `dst`: (the works to wait on, the tensors to keep referenced until then)."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
    header[2 : 2 + x.dim()] = torch.tensor(x.shape)
    header, x = header.to(x.device), x.contiguous()
    return [dist.isend(header, dst), dist.isend(x, dst)], (header, x)


def receive(src: int, device: torch.device) -> torch.Tensor:
    """The next tensor rank `src` sends, whatever its shape and dtype."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src)
    dtype, dims = _DTYPES[int(header[0])], int(header[1])
    x = torch.empty(header[2 : 2 + dims].tolist(), dtype=dtype, device=device)
    dist.recv(x, src)
    return x
