"""ZeRO-1, ZeRO-2 and ZeRO-3 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", 2020) for every optimizer here, by a config alone: a replicated signal with
``zero: 1`` or ``zero: 2`` (configs/zero1.yaml, configs/zero2.yaml) says that what it places on
n workers is n data-parallel copies, of which each worker need only update 1/n.

At each step, a parameter replicated over such workers is updated in pieces: each worker takes
its piece of the parameter along dim 0 (S(0), no communication) and of its gradient (a piece of
the all-reduced gradient at level 1; at level 2 backward reduce-scattered each gradient into
the pieces as soon as it was complete, half an all-reduce's traffic, and freed the whole
partial sum: the placer's reduce_soon), runs the optimizer's own instruction on its pieces,
whose state (Adam's moments, SGD's momentum) lives only there, 1/n of it per worker, and the
updated pieces are all-gathered into the parameter: a bucket of parameters at a time, cut by
one instruction per worker and gathered by one flat all-gather. Parameters too small to cut
(a scalar, fewer rows than workers) are updated whole, as without ZeRO.

At level 3 (FSDP) the parameters themselves become their pieces when the optimizer is made
(``shard``, no communication): each worker holds 1/n of every weight, gradient and optimizer
state. An op that reads a weight gets it gathered whole for that op alone (the placer's
``gathered``: all-gathered before the op, freed once it is sent; backward gathers it again),
its gradient is reduce-scattered into pieces as at level 2, and the step updates the pieces
where they lie, with nothing to gather after it.
"""
from __future__ import annotations

from ..client.creation import zeros_like
from ..client.runtime import runtime
from ..client.tensor import Tensor
from ..placement.types import Placement


def level(p: Tensor) -> int:
    """The ZeRO level ``p``'s update runs at: its signal's, if it is replicated over several
    workers and has a row for each of them; else 0."""
    placer = runtime().dispatcher.placer
    if not placer.zero or not placer.active:
        return 0
    if p.id in placer.gathered:
        return 3
    where = placer.placement(p.id)
    n = len(where.mesh)
    if where.kind != "R" or n < 2 or p.ndim == 0 or p.shape[0] < n:
        return 0
    return min(placer.zero.get(where.mesh, 0), 2)  # not sharded (yet): its update as at 2


def shard(params: list[Tensor]) -> None:
    """Level 3: each parameter at that level becomes its workers' pieces along dim 0 (each
    keeps its own rows of the replicated value and frees the rest: nothing moves)."""
    placer = runtime().dispatcher.placer
    if 3 not in placer.zero.values():
        return
    for p in params:
        p.id  # placed now (a config's 'parameters' signal places a module's on first use)
        if level(p) and placer.zero.get(placer.placement(p.id).mesh) == 3:
            placer.replace(p.id, p._sig, Placement(placer.placement(p.id).mesh, "S", 0))
            placer.gathered.add(p.id)


def pieces(params: list[Tensor]) -> list[Tensor]:
    """Each worker's piece of each parameter (S(0) over its workers, a copy), with its
    gradient's piece as ``.grad`` (reduce-scattered where the gradient is a partial sum).
    Replicated ones are cut by one instruction per worker for the whole bucket; a gradient
    that is pieces already (ZeRO-2) is its own piece."""
    rt = runtime()
    placer = rt.dispatcher.placer
    mesh = placer.placement(params[0].id).mesh
    cut: dict[int, Tensor] = {}
    # the parameters' and the gradients' apart: a failed gradient fails the pieces cut with
    # it, and a parameter's failed piece would fail the parameter (its update is skipped)
    for tensors in (params, [p.grad for p in params]):
        whole = [t for t in tensors if placer.placement(t.id) == Placement(mesh, "R")]
        cut.update((id(t), Tensor(rt.new_id(), t._sig)) for t in whole)
        if whole:
            placer.cut_rows([t.id for t in whole], [t._sig for t in whole],
                            [cut[id(t)].id for t in whole])

    def piece_of(t: Tensor) -> Tensor:
        if id(t) in cut:
            return cut[id(t)]
        return t if placer.placement(t.id) == Placement(mesh, "S", 0) else _cut(t, placer)

    out = []
    for p in params:
        piece = piece_of(p)
        piece.grad = piece_of(p.grad)
        out.append(piece)
    return out


def gather(params: list[Tensor], shards: list[Tensor], zero: int) -> None:
    """The updated pieces all-gathered into the parameters (one collective per bucket and
    dtype); at level 2 each gradient stays its pieces (read whole, it is gathered then)."""
    rt = runtime()
    # one agreement on every piece and parameter, where each copy would agree on its own
    rt.agree([t.id for t in (*params, *shards)])
    rt.dispatcher.placer.gather_rows([p.id for p in params], [s.id for s in shards],
                                     [p._sig for p in params])
    if zero >= 2:
        for p, piece in zip(params, shards):
            p.grad = piece.grad


def zero_state(p: Tensor) -> Tensor:
    """Zeros for a piece of state of ``p`` (a moment, a momentum buffer), placed as its
    update would make them: whole beside ``p`` without ZeRO, its workers' pieces along dim 0
    with it."""
    p.id  # placed first (a model's parameters are placed on first use)
    z = zeros_like(p)
    return _cut(z, runtime().dispatcher.placer) if level(p) in (1, 2) else z


def _cut(t: Tensor, placer) -> Tensor:
    piece = t.detach()
    mesh = placer.placement(t.id).mesh
    placer.place(piece.id, piece._sig, Placement(mesh, "S", 0), "ZeRO: a piece per worker")
    return piece
