"""Placement rules, one per op of the table, as data where they can be.

A rule sees one op whose tensor operands all live on one mesh, and the placement type of each;
it returns the placements the operands must have (the dispatcher inserts what converts them)
and the placement of the result. Every op has a rule: the fallback replicates the operands
and computes the whole result on every member, so any op is right on any placement; the
rules below are what makes the common ones cheap (DTensor's sharding propagation, per axis
of a one-dimensional mesh):

  R with S -> S; P passes only through linear ops (all tensor operands P: add, sub, shape
  ops, sums) and multilinear ones (exactly one P factor: mul, matmul); P never meets S.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from ..ops.table import FUSED_FNS, OPS, Kind
from .types import Placement, make


class PlacementError(ValueError):
    """An op whose operands' placements cannot be combined (a varying tensor meeting pieces)."""


class Plan(NamedTuple):
    wants: tuple[Placement | None, ...]  # per operand: the placement it must have (None: constant)
    out: Placement | tuple[Placement, ...]  # of the result, or of each result
    # vocabulary-parallel kernels (Megatron's embedding and cross-entropy): the operand split
    # along the vocabulary; each member is given its piece's first index there as ``offset``,
    # and the mesh's group as ``group`` for the collectives the kernel runs itself
    vocab: int | None = None
    # the conversions of operands are the layout's own (sequence parallelism's gather before a
    # column-parallel layer), not a fallback that strict placement stops
    intended: bool = False
    # keyword constants every member's kernel is given (a mean over a split dim divides its
    # piece's sum by the whole count)
    kw: dict | None = None
    # a random fill of the result's pieces: each member draws the whole tensor from the op's
    # seed and keeps its piece (drawing its piece's shape alone, every member would draw the
    # same first numbers: not a one-worker run's, and alike on every member)
    drawn: bool = False
    # keyword constants of each member's own, in the mesh's order (a strided slice's key)
    local: tuple[dict, ...] | None = None


Rule = Callable[..., Plan]
RULES: dict[str, Rule] = {}


def written(name: str, args: tuple, tmask: int) -> tuple[int, ...]:
    """The operands an in-place op writes (default: the first): these are placed where the op
    runs themselves, never copied, or the write would land in the copy. The multi-tensor
    updates write their parameters and optimizer state, not the gradients."""
    n = bin(tmask).count("1")  # their tensors come first: params, grads, then state
    if name == "adam_foreach":
        return (*range(n // 4), *range(n // 2, n))
    if name == "sgd_foreach":
        params = n // 3 if args[-5] else n // 2  # args[-5]: the momentum
        return (*range(params), *range(2 * params, n))
    if name == "zero_foreach":
        return tuple(range(n))
    if name == "mul_foreach":  # the last operand is the factor
        return tuple(range(n - 1))
    if name == "batch_norm_update_":  # the running mean and variance
        return (0, 1)
    return (0,)

# linear in each tensor operand: P in every tensor operand gives P
_LINEAR = {"add", "sub", "neg", "to", "sum", "mean", "alias", "contiguous", "clone", "transpose",
           "permute", "unsqueeze", "reshape", "view", "flatten", "squeeze", "expand"}
# linear in one operand at a time: exactly one P factor, the others R, gives P
_MULTILINEAR = {"mul", "matmul", "linear", "masked_scale"}
_DIM_REDUCTIONS = {"sum", "mean", "amax", "amin", "var", "std", "argmax", "argmin",
                   "max_dim", "min_dim"}


def plan(name: str, mesh: tuple[int, ...], grid: tuple[int, ...], args: tuple, tmask: int,
         kw: dict | None, kinds: list[Placement | None], sigs: list) -> Plan:
    """The plan for one op on ``mesh`` (of axis sizes ``grid``, () for one axis);
    ``kinds[i]`` is operand i's placement there (None for constants), ``sigs[i]`` its
    (shape, dtype). Each axis of a named mesh is planned on its own, as DTensor does."""
    if not grid:
        return _plan_axis(name, mesh, args, tmask, kw, kinds, sigs)
    plans = [_plan_axis(name, mesh, args, tmask, kw,
                        [None if p is None else _view(p, a) for p in kinds], sigs)
             for a in range(len(grid))]
    wants = tuple(None if p is None else make(mesh, grid, [(q.wants[i].kind, q.wants[i].dim)
                                                           for q in plans])
                  for i, p in enumerate(kinds))
    if isinstance(plans[0].out, tuple):
        out = tuple(make(mesh, grid, [(q.out[j].kind, q.out[j].dim) for q in plans])
                    for j in range(len(plans[0].out)))
    else:
        out = make(mesh, grid, [(q.out.kind, q.out.dim) for q in plans])
    if any(_nested(p) for p in (*wants, *outs(out)) if p is not None) or \
            any(q.vocab is not None for q in plans):
        # one dim cut along two axes, or a vocabulary split on a mesh of several axes (whose
        # kernels would need the line's offset and group): not supported, made whole
        return replicate(mesh, kinds)
    # the constants are the whole tensor's (a count), the same whichever axis asked for them
    return Plan(wants, out, kw=next((q.kw for q in plans if q.kw), None),
                drawn=any(q.drawn for q in plans))


def outs(out: Placement | tuple[Placement, ...], n: int = 1) -> tuple[Placement, ...]:
    """A plan's placement of each of its n results."""
    return out if isinstance(out, tuple) else (out,) * n


def dual(forward: Plan, wanted: tuple[int, ...], mesh: tuple[int, ...],
         grid: tuple[int, ...]) -> tuple[Placement, tuple[Placement, ...]]:
    """Where a gradient op runs, from its forward op's plan (the duality law, per mesh axis):
    the incoming gradient as the dual of the forward result (P -> R, S(d) -> S(d), R -> R), and
    the gradient of each operand at positions ``wanted`` as the dual of the placement it had:
    S(k) -> S(k), P -> R, and R -> P where the result lay in pieces (each member's piece
    contributes a part), R where every member computed the whole."""
    out = outs(forward.out)[0]
    out_axes = _axes(out, grid)
    grad = make(mesh, grid, [("R", 0) if k == "P" else (k, d) for k, d in out_axes])
    duals = []
    for i in wanted:
        axes = []
        for (k, d), (ko, _) in zip(_axes(forward.wants[i], grid), out_axes):
            if k == "P":
                axes.append(("R", 0))
            elif k == "R" and ko in ("S", "P"):
                axes.append(("P", 0))
            else:
                axes.append((k, d))
        duals.append(make(mesh, grid, axes))
    return grad, tuple(duals)


def _axes(p: Placement, grid: tuple[int, ...]) -> list[tuple[str, int]]:
    """(kind, dim) per axis; a replicated placement is R along every axis."""
    return p.per_axis() if p.grid or p.kind != "R" else [("R", 0)] * max(len(grid), 1)


def _view(p: Placement, axis: int) -> Placement:
    """One axis of a placement, as a one-axis placement (R on every axis if replicated)."""
    kind, dim = p.axes[axis] if p.grid else (p.kind, p.dim)
    return Placement(p.mesh, kind, dim)


def _nested(p: Placement) -> bool:
    dims = [d for k, d in p.per_axis() if k == "S"]
    return len(dims) != len(set(dims))


def _plan_axis(name: str, mesh: tuple[int, ...], args: tuple, tmask: int, kw: dict | None,
               kinds: list[Placement | None], sigs: list) -> Plan:
    tensors = [p for p in kinds if p is not None]
    if any(p.kind == "V" for p in tensors):
        clash = sorted({p.kind for p in tensors} - {"R", "I", "V"})
        if clash:
            raise PlacementError(f"op '{name}': a varying (V) operand cannot meet {clash[0]}: "
                                 "its values have no global meaning to combine with pieces")
        return Plan(tuple(kinds), Placement(mesh, "V"))
    if all(p.kind in ("R", "I") for p in tensors):
        out = "I" if tensors and all(p.kind == "I" for p in tensors) else "R"
        return Plan(tuple(kinds), Placement(mesh, out))
    # beyond here I counts as R: the same values
    kinds = [Placement(mesh, "R") if p is not None and p.kind == "I" else p for p in kinds]
    tensors = [p for p in kinds if p is not None]
    rule = RULES.get(name) or _KIND_RULES.get(OPS[name].kind)
    result = rule(name, mesh, args, kw, kinds, sigs) if rule is not None else None
    if result is None and any(p.kind == "P" for p in tensors) and \
            any(p.kind == "S" for p in tensors):
        # P never meets S: sum the partial operands (all-reduce), keep the pieces where they are
        whole = [Placement(mesh, "R") if p is not None and p.kind == "P" else p for p in kinds]
        result = rule(name, mesh, args, kw, whole, sigs) if rule is not None else None
    return result if result is not None else replicate(mesh, kinds)


def replicate(mesh: tuple[int, ...], kinds: list[Placement | None]) -> Plan:
    r = Placement(mesh, "R")
    return Plan(tuple(None if p is None else r for p in kinds), r)


def _partial(name: str, mesh, kinds) -> Plan | None:
    """P passing through a linear or multilinear op, or None."""
    tensors = [p for p in kinds if p is not None]
    partial = sum(p.kind == "P" for p in tensors)
    if partial == 0 or any(p.kind == "S" for p in tensors):
        return None
    if name in _LINEAR and partial == len(tensors):
        if name in ("add", "sub") and None in kinds:
            return None  # P + c would add c once per member
        return Plan(tuple(kinds), Placement(mesh, "P"))
    if name in ("add", "sub") and None not in kinds:
        # P + R: the whole operand is taken as a partial sum (the first member's piece, zeros
        # elsewhere: nothing moves), so the sum stays partial until something needs it whole
        # (a row-parallel layer's bias, added before its output is reduce-scattered)
        p = Placement(mesh, "P")
        return Plan(tuple(p for _ in kinds), p)
    if name in _MULTILINEAR and partial == 1:
        return Plan(tuple(kinds), Placement(mesh, "P"))
    return None


def _elementwise(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """Broadcasting pointwise: S operands agree on one output dim; R operands are cut to
    their piece locally where they span that dim."""
    split = any(p is not None and p.kind == "S" for p in kinds)
    if any(p is not None and p.kind == "P" for p in kinds) and not split:
        if name == "truediv" and kinds[1] is not None and kinds[1].kind == "P":
            return None
        return _partial("mul" if name == "truediv" else name, mesh, kinds)
    # beside a split operand a partial sum is summed into pieces lined up with it (a
    # reduce-scatter, half an all-reduce's bytes): sequence parallelism's residual add of a
    # row-parallel layer's output
    ndim = max(len(s[0]) for s, p in zip(sigs, kinds) if p is not None)
    dims = {p.dim + ndim - len(s[0]) for s, p in zip(sigs, kinds) if p is not None and p.kind == "S"}
    if len(dims) != 1:
        return None
    (d,) = dims
    wants = _lined_up(mesh, d, ndim, kinds, sigs)
    return None if wants is None else Plan(wants, Placement(mesh, "S", d))


def _lined_up(mesh, d: int, ndim: int, kinds, sigs) -> tuple | None:
    """Operands of a broadcasting op whose result is S(d): each one sharded along the dim that
    lines up with d, or whole where it broadcasts along d; None where that cannot be."""
    length = {s[0][p.dim] for s, p in zip(sigs, kinds) if p is not None and p.kind == "S"}
    wants = []
    for s, p in zip(sigs, kinds):
        if p is None:
            wants.append(None)
            continue
        k = d - (ndim - len(s[0]))  # this operand's dim that lines up with d
        if k < 0 or s[0][k] == 1:
            if p.kind == "S":
                return None
            wants.append(Placement(mesh, "R"))  # broadcast along d: every member uses it whole
        elif p.kind == "S" and p.dim != k:
            return None
        elif length and s[0][k] not in length:
            return None
        else:
            wants.append(Placement(mesh, "S", k))
    return tuple(wants)


def _matmul(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """a @ b: split along a batch dim (attention's q @ kᵀ and att @ v of a split batch, bmm),
    the split stays where it is, as in DTensor's rules (an operand that broadcasts along it is
    used whole, one that spans it whole is cut); with a 2-D b (weights), Megatron's column and
    row parallel patterns."""
    if (partial := _partial(name, mesh, kinds)) is not None:
        return partial
    (a_shape, _), (b_shape, _) = sigs[0], sigs[1]
    ndim = max(len(a_shape), len(b_shape))
    if ndim >= 3 and kinds[0] is not None and kinds[1] is not None:
        dims = {p.dim + ndim - len(sh[0]) for sh, p in zip(sigs, kinds) if p.kind == "S"}
        if len(dims) == 1 and (d := next(iter(dims))) < ndim - 2:
            wants = _lined_up(mesh, d, ndim, kinds, sigs)
            if wants is not None:
                return Plan(wants, Placement(mesh, "S", d))
    if len(b_shape) != 2 or len(a_shape) < 1 or kinds[0] is None or kinds[1] is None:
        return None
    a, b = kinds
    last = len(a_shape) - 1
    p = Placement(mesh, "P")
    if a.kind == "S" and a.dim < last and b.kind == "R":
        return Plan((a, b), Placement(mesh, "S", a.dim))
    if a.kind == "R" and b.kind == "S" and b.dim == 1:
        return Plan((a, b), Placement(mesh, "S", last))
    if (a.kind, b.kind) in (("S", "S"), ("R", "S"), ("S", "R")) and \
            (a.kind != "S" or a.dim == last) and (b.kind != "S" or b.dim == 0):
        return Plan((Placement(mesh, "S", last), Placement(mesh, "S", 0)), p)
    return None


def _einsum(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """An explicit einsum ("bhqd,bhkd->bhqk"): operands split along one letter that the
    result keeps give a result split there; operands without that letter are used whole, and
    whole ones with it are cut. Multilinear: one partial-sum factor gives a partial sum."""
    if (partial := _partial(name, mesh, kinds)) is not None:
        return partial
    lhs, arrow, out = kw["equation"].replace(" ", "").partition("->")
    terms = lhs.split(",")
    if not arrow or "." in lhs or len(terms) != len(kinds) or \
            any(len(t) != len(sh[0]) for t, sh in zip(terms, sigs)):
        return None
    letters = {t[p.dim] for t, p in zip(terms, kinds) if p is not None and p.kind == "S"}
    if len(letters) != 1 or (letter := next(iter(letters))) not in out:
        return None
    wants = []
    for t, p in zip(terms, kinds):
        if p is None:
            wants.append(None)
        elif letter not in t:
            if p.kind == "S":
                return None
            wants.append(Placement(mesh, "R"))
        elif p.kind == "S" and t[p.dim] != letter:
            return None
        else:
            wants.append(Placement(mesh, "S", t.index(letter)))
    return Plan(tuple(wants), Placement(mesh, "S", out.index(letter)))


def _linear(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """linear(x, W, b), W of shape (out, in): column parallel shards W's rows (and b), row
    parallel its columns; there the result is a partial sum, so the bias is too (the first
    member adds it, the others zeros: cut from the whole, nothing moves)."""
    x, w, b = kinds
    last = len(sigs[0][0]) - 1
    if (partial := _partial(name, mesh, [x, w])) is not None:
        return partial if b is None else None
    if x.kind == "S" and x.dim < last and w.kind == "R" and (b is None or b.kind == "R"):
        return Plan((x, w, b), Placement(mesh, "S", x.dim))
    if x.kind in ("R", "S") and (x.kind == "R" or x.dim < last) and w.kind == "S" and w.dim == 0:
        # column parallel; an input split along another dim (sequence parallelism's split
        # sequence) is gathered whole first, and the weight keeps its split
        return Plan((Placement(mesh, "R"), w, None if b is None else Placement(mesh, "S", 0)),
                    Placement(mesh, "S", last), intended=x.kind == "S")
    if w.kind in ("R", "S") and x.kind in ("R", "S") and (b is None or b.kind in ("R", "P")) \
            and (w.kind != "S" or w.dim == 1) and (x.kind != "S" or x.dim == last):
        p = Placement(mesh, "P")
        return Plan((Placement(mesh, "S", last), Placement(mesh, "S", 1), None if b is None else p), p)
    return None


def _reduction(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """Over dims other than the sharded one: the result stays sharded; a sum (or mean) over
    the sharded dim is partial."""
    x = kinds[0]
    if x.kind == "P":
        return _partial(name, mesh, kinds)
    if name not in _DIM_REDUCTIONS and name not in ("softmax", "log_softmax"):
        return None
    ndim = len(sigs[0][0])
    dim = args[1]
    if name in ("softmax", "log_softmax"):
        return Plan(tuple(kinds), x) if dim % ndim != x.dim else None
    keepdim = args[-1]
    reduced = set(range(ndim)) if dim is None else \
        {d % ndim for d in ((dim,) if isinstance(dim, int) else dim)}
    if x.dim in reduced:
        if name == "sum":  # the whole sum is the sum of the pieces' sums
            return Plan(tuple(kinds), Placement(mesh, "P"))
        if name == "mean":  # and the whole mean the sum of each piece's sum over the count
            count = math.prod(sigs[0][0][d] for d in reduced)
            return Plan(tuple(kinds), Placement(mesh, "P"), kw={"count": count})
        return None
    out_dim = x.dim if keepdim else x.dim - sum(d < x.dim for d in reduced)
    return Plan(tuple(kinds), Placement(mesh, "S", out_dim))


def _dim_map(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """Shape ops that move dims without mixing them: the sharded dim moves along."""
    x = kinds[0]
    if x.kind == "P":
        return _partial(name, mesh, kinds)
    ndim = len(sigs[0][0])
    if name in ("contiguous", "clone", "alias", "to"):
        return Plan(tuple(kinds), x)
    if name == "transpose":
        d0, d1 = args[1] % ndim, args[2] % ndim
        new = {d0: d1, d1: d0}.get(x.dim, x.dim)
    elif name == "permute":
        new = [d % ndim for d in args[1]].index(x.dim)
    elif name == "unsqueeze":
        at = args[1] % (ndim + 1)
        new = x.dim + (1 if at <= x.dim else 0)
    else:
        return None
    return Plan(tuple(kinds), Placement(mesh, "S", new))


def _reshape(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """view, reshape, flatten, squeeze, expand of a tensor in pieces along dim d (row-major, as
    torch/distributed/tensor/_ops/_view_ops.py reasons): dims map in blocks of equal size
    products; the pieces stay pieces where d leads its block (merged with the dims after it,
    or split into the block's dims, the pieces going to its leading one) and every piece is a
    whole number of the output's rows there, the same for every member. Anything else mixes
    the pieces: None, and they are gathered."""
    x = kinds[0]
    if x.kind == "P":
        return _partial(name, mesh, kinds)
    if x.kind != "S":
        return None
    shape = tuple(sigs[0][0])
    out = tuple(OPS[name].kernel(torch.empty(shape, device="meta"), *args[1:]).shape)
    if name == "expand":  # new leading dims; expanded dims were of size 1, never the split one
        new = x.dim + len(out) - len(shape)
        return Plan(tuple(kinds), Placement(mesh, "S", new)) if out[new] == shape[x.dim] else None
    for ins, outs_ in _blocks(shape, out):
        if x.dim not in ins:
            continue
        lead = [d for d in ins if shape[d] != 1]
        lead_out = [d for d in outs_ if out[d] != 1]
        if not lead or lead[0] != x.dim or not lead_out:
            return None
        inner = math.prod(shape[d] for d in ins if d > x.dim)
        inner_out = math.prod(out[d] for d in outs_ if d > lead_out[0])
        if shape[x.dim] == out[lead_out[0]] and inner == inner_out:
            # the split dim itself, only renumbered (logits (B, T, V) as (B*T, V)): the pieces
            # are the result's, even or not (a vocabulary of 50257 over two workers)
            return Plan(tuple(kinds), Placement(mesh, "S", lead_out[0]))
        n, k = shape[x.dim], len(mesh)  # members along the axis divide len(mesh): k suffices
        if n % k or (n // k * inner) % inner_out:
            return None
        return Plan(tuple(kinds), Placement(mesh, "S", lead_out[0]))
    return None


def _along(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """split, chunk, narrow, cat and stack along a dim other than the split one: each member
    cuts or joins its own pieces (stack adds a dim, which may shift the split one)."""
    tensors = [p for p in kinds if p is not None]
    if any(p.kind == "P" for p in tensors):
        return _partial(name, mesh, kinds)
    first = tensors[0]
    if first.kind != "S" or any(p != first for p in tensors):
        return None
    ndim = len(sigs[0][0])
    if name in ("cat", "stack"):
        dim = kw["dim"] % (ndim + (name == "stack"))
    else:
        dim = (args[1] if name == "narrow" else args[2]) % ndim
    if name == "stack":
        return Plan(tuple(kinds), Placement(mesh, "S", first.dim + (dim <= first.dim)))
    return None if dim == first.dim else Plan(tuple(kinds), first)


def _blocks(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Runs of dims of shapes a and b with equal products, in order: how a row-major reshape
    from a to b maps dims (size-1 dims ride with their neighbours)."""
    i = j = 0
    blocks = []
    while i < len(a) or j < len(b):
        ins, outs_, pa, pb = [], [], 1, 1
        if i < len(a):
            ins.append(i)
            pa *= a[i]
            i += 1
        if j < len(b):
            outs_.append(j)
            pb *= b[j]
            j += 1
        while pa != pb:
            if (pa < pb and i < len(a)) or j >= len(b):
                if i >= len(a):
                    return []
                ins.append(i)
                pa *= a[i]
                i += 1
            else:
                outs_.append(j)
                pb *= b[j]
                j += 1
        blocks.append((ins, outs_))
    return blocks


def _inplace(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """The target keeps its placement; every other tensor operand is brought to it."""
    target = kinds[0]
    if target.kind == "P":
        linear = name in ("iadd", "isub") and all(p is None or p.kind == "P" for p in kinds)
        scaled = name in ("imul", "itruediv") and all(p is None for p in kinds[1:])
        return Plan(tuple(kinds), target) if linear or scaled or name == "zero_" else None
    if target.kind == "R":
        return Plan(tuple(None if p is None else target for p in kinds), target)
    wants = _lined_up(mesh, target.dim, len(sigs[0][0]), kinds, sigs)
    return None if wants is None else Plan(wants, target)


def _cross_entropy(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """Rows of logits and their targets split alike: each member's losses are its rows'. A
    sum is then partial, per-row losses stay split; a mean needs the global count of rows
    (nn.functional.cross_entropy divides a sum by it when the rows are split)."""
    x, target = kinds[0], kinds[1]
    reduction, label_smoothing = args[-2], args[-1]
    if x.kind == "S" and x.dim == 0 and target == x and reduction in ("sum", "none"):
        return Plan(tuple(kinds), Placement(mesh, "P") if reduction == "sum" else x)
    if x.kind == "S" and x.dim == 1 and target.kind == "R" and not label_smoothing:
        # logits split along the classes (a vocabulary-parallel head): Megatron's parallel
        # cross-entropy, whose kernel sums the softmax's pieces itself; every member gets the
        # whole loss
        return Plan(tuple(kinds), Placement(mesh, "R"), vocab=0)
    return None


def _linear_cross_entropy(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """Rows of the input and their targets split alike, the head whole: each member's loss
    sums its rows' (a partial sum), its input's gradient stays split and its weight's is
    partial."""
    x, weight, target, bias = kinds[:4]
    if x.kind == "S" and x.dim == 0 and target == x and weight.kind == "R" and \
            (bias is None or bias.kind == "R") and args[5] == "sum":
        return Plan(tuple(kinds), Placement(mesh, "P"))
    return None


def _norm(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """layer_norm and rms_norm: rows split along a dim before the normalized ones stay split;
    the weight and bias are used whole."""
    x = kinds[0]
    if x.kind != "S" or x.dim >= len(sigs[0][0]) - len(args[1]):
        return None
    r = Placement(mesh, "R")
    return Plan((x, *(None if p is None else r for p in kinds[1:])), x)


def _embedding(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """Indices split along any dim (batch, sequence) look up a whole table: rows split alike.
    Whole indices in a table split along its rows (Megatron's vocabulary-parallel embedding):
    each member looks up the rows it holds, zeros for the others, a partial sum."""
    indices, weight = kinds[0], kinds[1]
    if indices.kind == "R" and weight.kind == "S" and weight.dim == 0:
        return Plan((indices, weight, None), Placement(mesh, "P"), vocab=1)
    if indices.kind != "S" or weight.kind != "R":
        return None
    return Plan((indices, weight, None), indices)


def _attention(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """q, k, v split alike along a dim before the last two (batch, or heads as tensor
    parallelism splits them): each member attends within its piece. A mask is cut alike where
    it spans that dim, used whole where it broadcasts along it."""
    qkv = kinds[:3]
    ndim = len(sigs[0][0])
    dims = {p.dim for p in qkv if p.kind == "S"}
    if len(dims) != 1 or any(p.kind not in ("S", "R") for p in qkv):
        return None
    (d,) = dims
    if d >= ndim - 2 or any(len(s[0]) != ndim or s[0][d] != sigs[0][0][d] for s in sigs[1:3]):
        return None
    split = Placement(mesh, "S", d)
    mask = kinds[3]
    if mask is not None:
        lined = _lined_up(mesh, d, ndim, [split, mask], [sigs[0], sigs[3]])
        if lined is None:
            return None
        mask = lined[1]
    return Plan((split, split, split, mask, *kinds[4:]), split)


class Rows(NamedTuple):
    """An op that works along some dims of its first operand and on every other index alone
    (a cumulative sum along the last dim: each row by itself), so a split along any other dim
    stays where it is. ``mixes(args, ndim)``: the dims it works along (None: all of them);
    ``kept(args)``: whether those dims stay in the result (False: reduced away); ``lined``:
    the operands indexed as the first one is (gather's index, scatter's source), cut alike;
    every other tensor operand is used whole (index_select's index, a convolution's
    weights)."""
    mixes: Callable[[tuple, int], set[int] | None]
    kept: Callable[[tuple], bool] = lambda args: True
    lined: tuple[int, ...] = ()


def _dims_at(pos: int) -> Callable[[tuple, int], set[int] | None]:
    """The dims named by argument ``pos`` (an int, a sequence, or None: all)."""
    def mixes(args: tuple, ndim: int) -> set[int] | None:
        dim = args[pos]
        if dim is None:
            return None
        return {d % max(ndim, 1) for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}
    return mixes


def _keepdim_at(pos: int) -> Callable[[tuple], bool]:
    return lambda args: bool(args[pos])


def _last(n: int) -> Callable[[tuple, int], set[int]]:
    return lambda args, ndim: set(range(max(ndim - n, 0), ndim))


ROWS: dict[str, Rows] = {
    "cumsum": Rows(_dims_at(1)),
    "cumprod": Rows(_dims_at(1)),
    "cummax": Rows(_dims_at(1)),
    "cummin": Rows(_dims_at(1)),
    # each row of values searched in its own row of the sorted sequence (a 1-D sequence, as
    # bucketize's boundaries, is no row of the batch: the values are then gathered)
    "searchsorted": Rows(_last(1), lined=(1,)),
    "prod": Rows(_dims_at(1), _keepdim_at(2)),
    "logsumexp": Rows(_dims_at(1), _keepdim_at(2)),
    "vector_norm": Rows(_dims_at(1), _keepdim_at(2)),
    "any": Rows(_dims_at(1), _keepdim_at(2)),
    "all": Rows(_dims_at(1), _keepdim_at(2)),
    "normalize": Rows(_dims_at(1)),
    "topk": Rows(_dims_at(1)),
    "sort": Rows(_dims_at(1)),
    "gather": Rows(_dims_at(1), lined=(2,)),
    "scatter": Rows(_dims_at(1), lined=(2, 3)),
    "scatter_add": Rows(_dims_at(1), lined=(2, 3)),
    "index_select": Rows(_dims_at(1)),
    "flip": Rows(_dims_at(1)),
    "roll": Rows(_dims_at(2)),  # with no dims, torch rolls the flattened tensor: all
    "tril": Rows(_last(2)),
    "triu": Rows(_last(2)),
    "pad": Rows(lambda args, ndim: _last(len(args[1]) // 2)(args, ndim)),
    "one_hot": Rows(lambda args, ndim: set()),  # each index its own row of the result
    # a batch of images or sequences, each convolved alone with whole weights
    "conv1d": Rows(lambda args, ndim: set(range(1, ndim))),
    "conv2d": Rows(lambda args, ndim: set(range(1, ndim))),
    "conv_transpose1d": Rows(lambda args, ndim: set(range(1, ndim))),
    "conv_transpose2d": Rows(lambda args, ndim: set(range(1, ndim))),
    # each image or sequence pooled alone (unbatched, (C, L) or (C, H, W): each channel)
    **{name: Rows(lambda args, ndim: set(range(1, ndim)))
       for name in ("max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d",
                    "adaptive_avg_pool1d", "adaptive_avg_pool2d")},
}


def _rows(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """An op of ROWS on operands split along a dim it does not work along: each member runs
    it on its piece; the lined-up operands are cut alike (a whole one locally), the others
    used whole."""
    spec = ROWS[name]
    lined = (0, *spec.lined)
    split = [(i, p) for i, p in enumerate(kinds) if p is not None and p.kind == "S"]
    if not split or any(p is not None and p.kind == "P" for p in kinds) or \
            any(i not in lined for i, _ in split):
        return None
    ndim = len(sigs[0][0])
    dims = {p.dim for _, p in split}
    mixed = spec.mixes(args, ndim)
    if len(dims) != 1 or mixed is None or (d := next(iter(dims))) in mixed:
        return None
    wants = []
    for i, (p, sig) in enumerate(zip(kinds, sigs)):
        if p is None:
            wants.append(None)
        elif i not in lined:
            wants.append(Placement(mesh, "R"))
        elif len(sig[0]) != ndim or sig[0][d] != sigs[0][0][d]:
            return None  # indexed otherwise than the first (a gather's shorter index)
        else:
            wants.append(Placement(mesh, "S", d))
    out = d if spec.kept(args) else d - sum(m < d for m in mixed)
    return Plan(tuple(wants), Placement(mesh, "S", out))


def _vjp(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """torch's gradient of an op (ops/table.py's vjp) where that op's own rule keeps a split
    where it is: the incoming gradients lie as its results did, each operand's gradient as the
    operand did, and a whole operand beside pieces (a convolution's weights) gets a partial
    sum from each member (the duality law, as dual() says it for a whole plan)."""
    op, n = kw["op"], len(kw["outs"])
    rule = RULES.get(op) or _KIND_RULES.get(OPS[op].kind)
    forward = None if rule is None else rule(op, mesh, args[n:], dict(kw["kw"]), kinds[n:],
                                             sigs[n:])
    if forward is None or forward.kw or forward.vocab is not None:
        return None
    results = outs(forward.out, max(kw["outs"]) + 1)
    if any(p is not None and p.kind == "P" for p in (*forward.wants, *results)):
        return None
    split = any(p.kind == "S" for p in results)
    grads = []
    for i in kw["grads"]:
        want = forward.wants[i]
        grads.append(Placement(mesh, "P") if want.kind == "R" and split else want)
    return Plan((*(results[j] for j in kw["outs"]), *forward.wants), tuple(grads))


def _basic(key: tuple, ndim: int) -> list[int | None] | None:
    """Per dim of the tensor a basic index key (ints, slices, None, ...) reads: the result's dim
    it becomes where the key takes it whole (``:``), else None; None for any other key (index
    tensors, lists, masks: they pick elements, which the rows of a piece do not hold alike)."""
    items = _expanded(key, ndim)
    if items is None:
        return None
    whole, out = [], 0
    for item in items:
        if item is None:
            out += 1
            continue
        whole.append(out if item == slice(None) else None)
        out += type(item) is slice
    return whole


def _getitem(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """x[key] with a basic key that takes the split dim whole (x[:, -1], x[..., :3]): each
    member indexes its piece; a whole x indexed along dim 0 by split indices: each member
    picks its rows."""
    x = kinds[0]
    key = kw["key"]
    if x.kind == "R" and len(kinds) == 2 and key[:1] == ("T",) and \
            all(k == slice(None) for k in key[1:]) and kinds[1] is not None and \
            kinds[1].kind == "S" and kinds[1].dim == 0 and kinds[1].mesh == x.mesh:
        # a dataset whole on every member, its rows picked by indices split as a batch is
        # (x[idx]): each member picks its rows, and the batch stays split, nothing gathered
        return Plan(tuple(kinds), Placement(mesh, "S", 0))
    if x.kind != "S":
        return _partial(name, mesh, kinds)
    if _indexed_past(key, x.dim, kinds):
        return Plan((x, *(Placement(mesh, "R") for _ in kinds[1:])), Placement(mesh, "S", x.dim))
    whole = _basic(key, len(sigs[0][0]))
    if whole is None or len(kinds) > 1:
        return None
    if whole[x.dim] is None:
        return _strided(mesh, x, key, tuple(sigs[0][0]), kinds, None)
    return Plan(tuple(kinds), Placement(mesh, "S", whole[x.dim]))


def _strided(mesh: tuple, x: Placement, key: tuple, shape: tuple, kinds: tuple,
             grad_of: Placement | None) -> Plan | None:
    """x[start:stop:step] along the split dim (x[::2]): each member slices its own rows, from
    the first of them the slice takes, where the rows each member keeps are the result's
    pieces as a split of it lays them out; the gradient (``grad_of``: the incoming gradient's
    placement) scatters each member's piece into its own rows."""
    if x.grid or x.dim >= len(shape):
        return None
    items = _expanded(key, len(shape))
    if items is None:
        return None
    at = [i for i, item in enumerate(items) if item is not None][x.dim]
    cut = items[at]
    if type(cut) is not slice or (cut.step or 1) <= 0:
        return None
    start, stop, step = cut.indices(shape[x.dim])
    picked = range(start, stop, step)
    keys, counts = [], []
    for first, length in zip(x.starts(shape), x.sizes(shape)):
        mine = [i - first for i in picked if first <= i < first + length]
        counts.append(len(mine))
        here = slice(mine[0], mine[-1] + 1, step) if mine else slice(0, 0, 1)
        keys.append(tuple(here if i == at else item for i, item in enumerate(items)))
    whole = _basic(tuple(slice(None) if i == at else item for i, item in enumerate(items)),
                   len(shape))
    out = Placement(mesh, "S", whole[x.dim])
    if tuple(counts) != Placement(mesh, "S").sizes((len(picked),)):
        return None  # its members' rows are not the result's pieces
    if grad_of is None:
        return Plan(tuple(kinds), out, local=tuple({"key": k} for k in keys))
    if grad_of != out:
        return None
    return Plan(tuple(kinds), x, local=tuple({"key": k, "shape": x.local_shape(shape, m)}
                                             for m, k in enumerate(keys)))


def _expanded(key: tuple, ndim: int) -> list | None:
    """A basic key with its Ellipsis spelled out as whole slices, and a whole slice for each
    dim it does not name (None: not a basic key)."""
    if any(not (item is None or item is Ellipsis or type(item) in (int, slice)) for item in key):
        return None
    used = sum(item is not None and item is not Ellipsis for item in key)
    if used > ndim or sum(item is Ellipsis for item in key) > 1:
        return None
    items: list = []
    for item in key:
        items += [slice(None)] * (ndim - used) if item is Ellipsis else [item]
    return items + [slice(None)] * (ndim - sum(item is not None for item in items))


def _indexed_past(key: tuple, dim: int, kinds: tuple) -> bool:
    """Whether ``key`` takes dims up to ``dim`` whole and picks by whole index tensors only
    past it, in one group (x[:, :, idx] on a batch split along dim 0: torch leaves the picked
    dims where they are, so each member indexes its piece and ``dim`` stays where it was)."""
    if len(key) <= dim or any(k != slice(None) for k in key[:dim + 1]) or \
            any(k is None or k is Ellipsis for k in key) or \
            any(p is None or p.kind != "R" for p in kinds[1:]):
        return False
    at = [i for i, k in enumerate(key) if type(k) is str and k == "T"]
    return bool(at) and at == list(range(at[0], at[-1] + 1))


def _getitem_grad(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """The gradient of x[key] with such a key: each member's piece scattered into its own
    rows of x."""
    g = kinds[0]
    if g.kind != "S":
        return _partial(name, mesh, kinds)
    if _indexed_past(kw["key"], g.dim, kinds):
        return Plan((g, *(Placement(mesh, "R") for _ in kinds[1:])), Placement(mesh, "S", g.dim))
    shape = tuple(kw["shape"])
    whole = _basic(kw["key"], len(shape))
    if whole is None or len(kinds) > 1:
        return None
    if g.dim in whole:
        return Plan(tuple(kinds), Placement(mesh, "S", whole.index(g.dim)))
    for dim in range(len(shape)):  # a strided slice's: the dim of x it cut
        plan = _strided(mesh, Placement(mesh, "S", dim), kw["key"], shape, kinds, g)
        if plan is not None:
            return plan
    return None


def _setitem(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """x[key] = value with such a key on a split x: each member writes its rows, the value cut
    alike where it spans them, whole where it broadcasts along them."""
    x = kinds[0]
    if x.kind != "S":
        return _partial(name, mesh, kinds)
    shape = tuple(sigs[0][0])
    whole = _basic(kw["key"], len(shape))
    if whole is None or len(kinds) > 2 or whole[x.dim] is None:
        return None
    if kinds[1] is None:
        return Plan(tuple(kinds), x)
    indexed = torch.empty(shape, device="meta")[kw["key"]].shape
    lined = _lined_up(mesh, whole[x.dim], len(indexed),
                      [Placement(mesh, "S", whole[x.dim]), kinds[1]],
                      [(indexed, sigs[0][1]), sigs[1]])
    return None if lined is None else Plan((x, lined[1]), x)


def _repeat(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """x.repeat(sizes) that repeats the split dim once (new dims lead): each member repeats
    its piece."""
    x, sizes = kinds[0], args[1]
    lead = len(sizes) - len(sigs[0][0])
    if x.kind != "S" or lead < 0 or sizes[x.dim + lead] != 1:
        return _partial(name, mesh, kinds)
    return Plan(tuple(kinds), Placement(mesh, "S", x.dim + lead))


def _drawn(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """normal_ and uniform_ in place on pieces: they stay pieces, drawn from the whole."""
    target = kinds[0]
    return Plan(tuple(kinds), target, drawn=True) if target.kind == "S" else None


def _alike(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """Multi-tensor updates: every tensor operand where the first lives (the optimizer groups
    parameters by placement; gradients are brought to them). Zeroing keeps partial sums."""
    p = kinds[0]
    if p.kind not in ("R", "S") and name != "zero_foreach":
        return None
    return Plan(tuple(None if k is None else p for k in kinds), p)


def _same_everywhere(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """A result every member computes alike from its own pieces (a count kept beside them):
    whole on each, nothing moves."""
    p = kinds[0]
    if any(k != p for k in kinds):
        return None
    return Plan(tuple(kinds), Placement(mesh, "R"))


def _power_sum(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """A sum of p-th powers over tensors split alike is the sum of the pieces' sums."""
    p = kinds[0]
    if p.kind != "S" or math.isinf(kw["norm_type"]) or any(k != p for k in kinds):
        return None
    return Plan(tuple(kinds), Placement(mesh, "P"))


def _sum_alike(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """Sums of tensors all placed alike: pieces and partial sums add where they lie."""
    p = kinds[0]
    if any(k != p for k in kinds):
        return None
    return Plan(tuple(kinds), p)


def _scale_foreach(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """Tensors times one whole factor, in place: pieces and partial sums scale as they lie."""
    p = kinds[0]
    if p.kind not in ("R", "S", "P"):
        return None
    return Plan((p,) * (len(kinds) - 1) + (Placement(mesh, "R"),), p)


def _where_they_lie(name, mesh, args, kw, kinds, sigs) -> Plan | None:
    """Each member works on the pieces it holds, all laid out alike (a sharded checkpoint's
    files): nothing moves; the result is each member's own count."""
    p = kinds[0]
    if any(k is not None and k != p for k in kinds):
        return None
    return Plan(tuple(kinds), Placement(mesh, "R"))


_KIND_RULES = {Kind.ELEMENTWISE: _elementwise, Kind.REDUCE: _reduction, Kind.SHAPE: _dim_map,
               Kind.INPLACE: _inplace}
RULES.update({"matmul": _matmul, "einsum": _einsum, "linear": _linear,
              "cross_entropy": _cross_entropy, "linear_cross_entropy": _linear_cross_entropy,
              "layer_norm": _norm, "rms_norm": _norm, "embedding": _embedding,
              "scaled_dot_product_attention": _attention, "sgd_foreach": _alike,
              "adam_foreach": _alike, "zero_foreach": _alike, "mul_foreach": _scale_foreach,
              "norm_foreach": _power_sum, "add_foreach": _sum_alike,
              "adam_steps": _same_everywhere, "vjp": _vjp, "save_pieces": _where_they_lie,
              "load_piece_": _where_they_lie})
RULES.update({_name: _rows for _name in ROWS})
# gradient ops placed by dual() from their forward op's plan, in the dispatcher's placer
DUAL = {"linear_grad", *(f"{name}_grad" for name in FUSED_FNS)}
RULES.update({"getitem": _getitem, "getitem_grad": _getitem_grad, "setitem": _setitem,
              "normal_": _drawn, "uniform_": _drawn, "repeat": _repeat})
for _name in ("cat", "stack", "split", "chunk", "narrow"):
    RULES[_name] = _along
for _name in ("view", "reshape", "flatten", "squeeze", "expand"):
    RULES[_name] = _reshape
