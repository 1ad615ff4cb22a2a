"""ZeRO-1 and ZeRO-2 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", 2020) for every optimizer here, by a config alone: a replicated signal with
``zero: 1`` or ``zero: 2`` (configs/zero1.yaml, configs/zero2.yaml) says that what it places on
n workers is n data-parallel copies, of which each worker need only update 1/n.

At each step, a parameter replicated over such workers is updated in pieces: each worker takes
its piece of the parameter along dim 0 (S(0), no communication) and of its gradient (a piece of
the all-reduced gradient at level 1; at level 2 backward reduce-scattered each gradient into
the pieces as soon as it was complete, half an all-reduce's traffic, and freed the whole
partial sum: the placer's reduce_soon), runs the optimizer's own instruction on its pieces,
whose state (Adam's moments, SGD's momentum) lives only there, 1/n of it per worker, and the
updated pieces are all-gathered into the parameter. Parameters too small to cut (a scalar,
fewer rows than workers) are updated whole, as without ZeRO.
"""
from __future__ import annotations

from ..client.runtime import runtime
from ..client.tensor import Tensor
from ..placement.types import Placement


def level(p: Tensor) -> int:
    """The ZeRO level ``p``'s update runs at: its signal's, if it is replicated over several
    workers and has a row for each of them; else 0."""
    placer = runtime().dispatcher.placer
    if not placer.zero or not placer.active:
        return 0
    where = placer.placement(p.id)
    n = len(where.mesh)
    if where.kind != "R" or n < 2 or p.ndim == 0 or p.shape[0] < n:
        return 0
    return placer.zero.get(where.mesh, 0)


def pieces(params: list[Tensor]) -> list[Tensor]:
    """Each worker's piece of each parameter (S(0) over its workers, a copy), with its
    gradient's piece as ``.grad`` (reduce-scattered where the gradient is a partial sum)."""
    placer = runtime().dispatcher.placer
    out = []
    for p in params:
        piece = _cut(p, placer)
        piece.grad = _cut(p.grad, placer)
        out.append(piece)
    return out


def gather(params: list[Tensor], shards: list[Tensor], zero: int) -> None:
    """The updated pieces all-gathered into the parameters; at level 2 each gradient stays its
    pieces (read whole, it is gathered then)."""
    rt = runtime()
    placer = rt.dispatcher.placer
    # one agreement on every piece and parameter, where each copy would agree on its own
    rt.agree([t.id for t in (*params, *shards)])
    with placer.asking():
        for p, piece in zip(params, shards):
            p.copy_(piece)
            if zero >= 2:
                p.grad = piece.grad


def _cut(t: Tensor, placer) -> Tensor:
    piece = t.detach()
    mesh = placer.placement(t.id).mesh
    placer.place(piece.id, piece._sig, Placement(mesh, "S", 0), "ZeRO: a piece per worker")
    return piece
