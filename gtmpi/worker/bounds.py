"""Indices checked on the GPU, without waiting for it: every GPU worker's ops (a server's
clients' always; an ordinary job's unless GTMPI_INDEX_GUARD=0).

On a GPU, an index out of range (a token id past the embedding's rows, a bad class in a
cross-entropy, a gather past a dim's end) is a device-side assert: the worker's CUDA context is
lost, and with it every client of a server that uses the worker. So a worker serving a server's
client checks every operand the op table marks as indices (``Op.indices``) on the device: a bad
one is set to an index in range, in its own tensor (so that every later use, gradients included,
is in range too), and the worker's flag for that client is raised. A read of a value made after
that op, or a sync, sees the flag and fails with an IndexError (a read copies the flag as it
stood when its value was made, beside the work queued since, so a loop that reads its loss every
step never drains the GPU for the check); the flag stays raised, because what the client
computed since is not what it asked for. Its other tensors, and every other client's, are
untouched. In an ordinary job the guard also keeps the first bad op's id, so that the IndexError
names the program's line that issued it, and the worker keeps its CUDA context (torch's
device-side assert would end it, every later op failing).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ..ops.table import IndexArg, Op

MESSAGE = ("IndexError: an index out of range in an op of this client (an embedding's id, a "
           "cross-entropy's class, a gather's, scatter's or index's position): on a GPU it "
           "would have ended the worker for every client of the server, so it was set in range "
           "and what this client computed since is not reliable; start it again")


ORDINARY = ("IndexError: index out of range (checked on the device: it was set in range, so "
            "what the program computed since is not reliable; the worker is unharmed)")
NAMES_KEPT = 4096  # the ops last checked, by id: which one the first bad index was in


def everywhere(device: torch.device) -> bool:
    """Whether a worker on ``device`` checks its ops' indices, not only a server's for its
    clients: on GPUs by default (it cost GPT-2 small's replayed step 0.6% on an H200, against
    a lost CUDA context), on CPUs only with GTMPI_INDEX_GUARD=1 (torch raises there anyway)."""
    wanted = os.environ.get("GTMPI_INDEX_GUARD")
    if wanted is None:
        return device.type == "cuda"
    return wanted == "1" and device.type != "meta"


class IndexGuard:
    """One client's flag on one worker's device, and the checks that raise it."""

    def __init__(self, device: torch.device) -> None:
        # written in place: a CUDA graph captured with the checks in it raises this same flag,
        # and keeps the first bad op's id in the same tensor, when launched
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        self.first = torch.full((), -1, dtype=torch.int64, device=device)
        self.names: dict[int, str] = {}
        self._host: torch.Tensor | None = None  # where a read copies the flag to, pinned

    def check(self, op: Op, args: tuple | list, kw: dict[str, Any], out: int = -1) -> tuple | list:
        """``args`` with every index operand of ``op`` (whose result is ``out``) in range
        (changed in place where it can be, else replaced); the flag raised if any was not."""
        specs = op.indices(args, kw)
        if not specs:
            return args
        args = list(args)
        if len(self.names) >= NAMES_KEPT:
            self.names.clear()
        self.names[out] = op.name
        for spec in specs:
            idx = args[spec.pos]
            if isinstance(idx, torch.Tensor) and idx.numel():
                args[spec.pos] = self._in_range(idx, spec, out)
        return args

    def culprit(self) -> tuple[int, str]:
        """The id and op of the first op whose index was out of range (a read: the host
        waits)."""
        tid = int(self.first)
        return tid, self.names.get(tid, "an indexing op")

    def _in_range(self, idx: torch.Tensor, spec: IndexArg, out: int) -> torch.Tensor:
        if spec.size == 0:  # nothing is in range: known on the host, an ordinary op error
            raise IndexError(f"index into a dimension of size 0 (operand {spec.pos})")
        low = -spec.size if spec.negative else 0
        if spec.also is None:
            # both ends in one kernel, and a bad index clamped to the nearest end: 9 kernel
            # launches a check against 13 (each embedding of a step run op by op pays them)
            least, most = torch.aminmax(idx)
            wrong = (least < low) | (most >= spec.size)
            safe = None
        else:
            ok = (idx >= low) & (idx < spec.size) | (idx == spec.also)
            wrong = ~ok.all()
            safe = torch.where(ok, idx, torch.zeros((), dtype=idx.dtype, device=idx.device))
        self.first.masked_fill_(wrong & (self.first < 0), out)
        self.bad |= wrong
        try:
            # through .data: its version stays, as torch's records that saved this index (the
            # positions of a micro-batch whose backward is still to come, reused by the next
            # micro-batch's forward) would refuse it; in range, its values are unchanged
            if safe is None:
                idx.data.clamp_(low, spec.size - 1)
            else:
                idx.data.copy_(safe)
            return idx
        except RuntimeError:  # an expanded view cannot be written: this use alone is safe
            return idx.clamp(low, spec.size - 1) if safe is None else safe

    def raised(self, after: Any = None, stream: Any = None) -> bool:
        """Whether an index was out of range in any op issued so far (the host waits for the
        whole queue), or, given ``after`` (a CUDA event), in any op issued before it: waited for
        on ``stream``, as a read waits for its value alone, so that the work queued since goes
        on (a loop that reads its loss every step would otherwise drain the GPU at each)."""
        if after is None:
            return bool(self.bad)
        if self._host is None:
            self._host = torch.empty((), dtype=torch.bool, pin_memory=True)
        with torch.cuda.stream(stream):
            stream.wait_event(after)
            self._host.copy_(self.bad, non_blocking=True)
        stream.synchronize()
        return bool(self._host)
