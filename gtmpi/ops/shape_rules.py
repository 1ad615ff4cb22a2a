"""Exact shape and dtype rules for the ops a training step is made of, where running torch's
kernel on meta tensors is slow the first time: a meta linear, layer norm, reduction or cat
imports torch's decompositions with dynamo and sympy behind them (0.3-1.3 s, once per process).

A rule returns the result Sigs for the common, valid case and None for anything else (an
error, a dtype torch would promote, an unusual form); meta tensors then decide, so torch's own
messages still come from torch. tests/test_shapes.py checks every rule against meta.
"""
from __future__ import annotations

from typing import Callable

import torch

Size = torch.Size
_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_INDEX = frozenset({torch.int64, torch.int32})
_GRAPH = (Size([0]), torch.uint8)  # a fused op's second result: the handle to torch's record
Rule = Callable[[tuple, int, dict], "tuple | None"]
RULES: dict[str, Rule] = {}


def rule(*names: str):
    def register(fn: Rule) -> Rule:
        for name in names:
            RULES[name] = fn
        return fn
    return register


def _tensors(args: tuple, tmask: int, n: int) -> bool:
    """The first n operands are tensors."""
    return tmask & ((1 << n) - 1) == (1 << n) - 1


def _float(*sigs) -> bool:
    """Tensors of one floating dtype."""
    return sigs[0][1] in _FLOAT and all(s[1] == sigs[0][1] for s in sigs)


def _dims(dim, ndim: int) -> tuple[int, ...] | None:
    """Reduced dims, normalised; None where torch would refuse them (or for 0-d tensors,
    which meta handles)."""
    if ndim == 0:
        return None
    dims = tuple(range(ndim)) if dim is None else (dim,) if type(dim) is int else dim
    if not isinstance(dims, tuple) or not all(type(d) is int and -ndim <= d < ndim for d in dims):
        return None
    dims = tuple(d % ndim for d in dims)
    return dims if len(set(dims)) == len(dims) else None


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    """Batch dims broadcast (torch.broadcast_shapes imports what this module avoids)."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    if any(x != y and 1 not in (x, y) for x, y in zip(a, b)):
        return None
    return tuple(y if x == 1 else x for x, y in zip(a, b))


def _reduced(shape: Size, dims: tuple[int, ...], keepdim: bool) -> Size:
    if keepdim:
        return Size(1 if i in dims else n for i, n in enumerate(shape))
    return Size(n for i, n in enumerate(shape) if i not in dims)


@rule("linear")
def _linear(args, tmask, kw):
    x, w, b = args
    if not _tensors(args, tmask, 2) or len(w[0]) != 2 or not x[0] or x[0][-1] != w[0][1]:
        return None
    if b is not None and not (tmask & 4 and b[0] == Size([w[0][0]]) and b[1] == x[1]):
        return None
    return ((Size((*x[0][:-1], w[0][0])), x[1]),) if _float(x, w) else None


@rule("linear_grad")
def _linear_grad(args, tmask, kw):
    g, x, w = args[:3]
    if not _tensors(args, tmask, 3) or not _float(g, x, w) or len(w[0]) != 2 or \
            len(g[0]) != len(x[0]) or g[0][:-1] != x[0][:-1] or g[0][-1] != w[0][0] or \
            x[0][-1] != w[0][1]:
        return None
    shapes = {0: x[0], 1: w[0], 2: Size([w[0][0]])}
    return tuple((shapes[i], g[1]) for i in kw["grads"])


@rule("matmul")
def _matmul(args, tmask, kw):
    (a, da), (b, db) = args if tmask == 3 else ((None, None), (None, None))
    if a is None or not _float((a, da), (b, db)) or not a or not b:
        return None
    k_a = a[-1]
    k_b = b[-2] if len(b) > 1 else b[0]
    if k_a != k_b:
        return None
    if len(a) == 1 and len(b) == 1:
        shape: tuple = ()
    elif len(b) == 1:
        shape = a[:-1]
    elif len(a) == 1:
        shape = (*b[:-2], b[-1])
    else:
        batch = _broadcast(a[:-2], b[:-2])
        if batch is None:
            return None
        shape = (*batch, a[-2], b[-1])
    return ((Size(shape), da),)


@rule("layer_norm")
def _layer_norm(args, tmask, kw):
    x, shape, w, b, _ = args
    return _norm(x, shape, (w, b), tmask, kw)


@rule("rms_norm")
def _rms_norm(args, tmask, kw):
    x, shape, w, _ = args
    return _norm(x, shape, (w,), tmask, kw)


def _norm(x, shape, affine, tmask, kw):
    if not tmask & 1 or x[1] not in _FLOAT or not isinstance(shape, tuple) or not shape or \
            len(shape) > len(x[0]) or tuple(x[0][-len(shape):]) != shape:
        return None
    for i, p in enumerate(affine):
        if p is not None and not (tmask >> (i + 2) & 1 and p == (Size(shape), x[1])):
            return None
    return ((x[0], x[1]), _GRAPH)


@rule("scaled_dot_product_attention")
def _attention(args, tmask, kw):
    q, k, v, mask = args[:4]
    if not _tensors(args, tmask, 3) or mask is not None or not _float(q, k, v):
        return None
    (qs, _), (ks, _), (vs, _) = q, k, v
    if not len(qs) == len(ks) == len(vs) >= 2 or not qs[:-2] == ks[:-2] == vs[:-2] or \
            qs[-1] != ks[-1] or ks[-2] != vs[-2]:
        return None
    return ((Size((*qs[:-1], vs[-1])), q[1]), _GRAPH)


@rule("embedding")
def _embedding(args, tmask, kw):
    idx, w, padding_idx = args
    if not _tensors(args, tmask, 2) or idx[1] not in _INDEX or w[1] not in _FLOAT or \
            len(w[0]) != 2 or kw and kw.get("offset") is not None:
        return None
    if padding_idx is not None and not 0 <= padding_idx < w[0][0]:
        return None
    return ((Size((*idx[0], w[0][1])), w[1]), _GRAPH)


@rule("cross_entropy")
def _cross_entropy(args, tmask, kw):
    x, t, _, reduction, smoothing = args
    if not _tensors(args, tmask, 2) or x[1] not in _FLOAT or t[1] != torch.int64 or \
            len(x[0]) != 2 or t[0] != Size([x[0][0]]) or not 0.0 <= smoothing <= 1.0:
        return None
    if reduction in ("mean", "sum"):
        return ((Size([]), x[1]), _GRAPH)
    return ((Size([x[0][0]]), x[1]), _GRAPH) if reduction == "none" else None


@rule("sum", "mean", "amax", "amin", "argmax", "argmin")
def _reduction(args, tmask, kw, name=None):
    (shape, dtype), dim, keepdim = args
    if tmask != 1 or type(keepdim) is not bool:
        return None
    dims = _dims(dim, len(shape))
    if dims is None:
        return None
    return shape, dtype, dims, keepdim


def _reduce_as(name: str) -> Rule:
    def fn(args, tmask, kw):
        got = _reduction(args, tmask, kw)
        if got is None:
            return None
        shape, dtype, dims, keepdim = got
        if name in ("argmax", "argmin"):
            if args[1] is None and keepdim or any(n == 0 for n in shape):
                return None
            return ((_reduced(shape, dims, keepdim), torch.int64),)
        if name in ("mean", "amax", "amin") and dtype not in _FLOAT:
            return None  # integer mean is an error; integer extrema meta knows
        if name in ("amax", "amin") and any(shape[d] == 0 for d in dims):
            return None
        out = torch.int64 if name == "sum" and dtype not in _FLOAT else dtype
        if name == "sum" and dtype not in _FLOAT and dtype not in (torch.bool, torch.int64,
                                                                    torch.int32):
            return None
        return ((_reduced(shape, dims, keepdim), out),)
    return fn


for _name in ("sum", "mean", "amax", "amin", "argmax", "argmin"):
    RULES[_name] = _reduce_as(_name)


@rule("max_dim", "min_dim")
def _extremum_dim(args, tmask, kw):
    (shape, dtype), dim, keepdim = args
    if tmask != 1 or type(dim) is not int or dtype not in _FLOAT:
        return None
    dims = _dims(dim, len(shape))
    if dims is None or shape[dims[0]] == 0:
        return None
    out = _reduced(shape, dims, bool(keepdim))
    return ((out, dtype), (out, torch.int64))


@rule("var", "std")
def _spread(args, tmask, kw):
    (shape, dtype), dim, correction, keepdim = args
    if tmask != 1 or dtype not in _FLOAT or type(keepdim) is not bool:
        return None
    dims = _dims(dim, len(shape))
    return None if dims is None else ((_reduced(shape, dims, keepdim), dtype),)


@rule("softmax", "log_softmax")
def _softmax(args, tmask, kw):
    (shape, dtype), dim = args
    if tmask != 1 or dtype not in _FLOAT or type(dim) is not int or _dims(dim, len(shape)) is None:
        return None
    return ((shape, dtype),)


@rule("cat")
def _cat(args, tmask, kw):
    if not args or tmask != (1 << len(args)) - 1 or not _float(*args) and \
            not all(a[1] == args[0][1] for a in args):
        return None
    first = args[0][0]
    dims = _dims(kw["dim"], len(first))
    if dims is None:
        return None
    d = dims[0]
    if any(len(a[0]) != len(first) or a[0][:d] != first[:d] or a[0][d + 1:] != first[d + 1:]
           for a in args):
        return None
    return ((Size((*first[:d], sum(a[0][d] for a in args), *first[d + 1:])), args[0][1]),)


@rule("stack")
def _stack(args, tmask, kw):
    if not args or tmask != (1 << len(args)) - 1 or any(a != args[0] for a in args):
        return None
    shape, dtype = args[0]
    dim = kw["dim"]
    if type(dim) is not int or not -(len(shape) + 1) <= dim <= len(shape):
        return None
    dim %= len(shape) + 1
    return ((Size((*shape[:dim], len(args), *shape[dim:])), dtype),)
