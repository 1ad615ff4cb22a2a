"""Indices checked on the GPU, without waiting for it, for a server's clients.

On a GPU, an index out of range (a token id past the embedding's rows, a bad class in a
cross-entropy, a gather past a dim's end) is a device-side assert: the worker's CUDA context
is lost, and with it every client of a server that uses the worker. So a worker serving a
server's client checks every operand the op table marks as indices (``Op.indices``) on the
device: a bad one is set to an index in range, in its own tensor (so that every later use,
gradients included, is in range too), and the worker's flag for that client is raised. The
next read or sync of that client sees the flag (a read waits for the device anyway) and fails
with an IndexError; the flag stays raised, because what the client computed since is not what
it asked for. Its other tensors, and every other client's, are untouched.
"""
from __future__ import annotations

from typing import Any

import torch

from ..ops.table import IndexArg, Op

MESSAGE = ("IndexError: an index out of range in an op of this client (an embedding's id, a "
           "cross-entropy's class, a gather's, scatter's or index's position): on a GPU it "
           "would have ended the worker for every client of the server, so it was set in range "
           "and what this client computed since is not reliable; start it again")


class IndexGuard:
    """One client's flag on one worker's device, and the checks that raise it."""

    def __init__(self, device: torch.device) -> None:
        self.bad = torch.zeros((), dtype=torch.bool, device=device)  # written in place: a
        # CUDA graph captured with the checks in it raises this same flag when launched

    def check(self, op: Op, args: tuple | list, kw: dict[str, Any]) -> tuple | list:
        """``args`` with every index operand of ``op`` in range (changed in place where it can
        be, else replaced); the flag raised if any was not."""
        specs = op.indices(args, kw)
        if not specs:
            return args
        args = list(args)
        for spec in specs:
            idx = args[spec.pos]
            if isinstance(idx, torch.Tensor) and idx.numel():
                args[spec.pos] = self._in_range(idx, spec)
        return args

    def _in_range(self, idx: torch.Tensor, spec: IndexArg) -> torch.Tensor:
        if spec.size == 0:  # nothing is in range: known on the host, an ordinary op error
            raise IndexError(f"index into a dimension of size 0 (operand {spec.pos})")
        ok = (idx >= (-spec.size if spec.negative else 0)) & (idx < spec.size)
        if spec.also is not None:
            ok |= idx == spec.also
        self.bad |= ~ok.all()
        safe = torch.where(ok, idx, torch.zeros((), dtype=idx.dtype, device=idx.device))
        try:
            idx.copy_(safe)
            return idx
        except RuntimeError:  # an expanded view cannot be written: this use alone is safe
            return safe

    def raised(self) -> bool:
        return bool(self.bad)
