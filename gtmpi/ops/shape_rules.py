"""Exact shape and dtype rules for the ops a training step is made of, where running torch's
kernel on meta tensors is slow the first time: a meta linear, layer norm, reduction or cat
imports torch's decompositions with dynamo and sympy behind them (0.3-1.3 s, once per process).

A rule returns the result Sigs for the common, valid case and None for anything else (an
error, a dtype torch would promote, an unusual form); meta tensors then decide, so torch's own
messages still come from torch. Where a meta kernel's words differ from the CPU and GPU
kernels' (linear's mismatched sizes), the rule raises the kernels' error itself.
tests/test_shapes.py checks every rule against torch.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

Size = torch.Size
_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_INDEX = frozenset({torch.int64, torch.int32})
_GRAPH = (Size([0]), torch.uint8)  # a fused op's second result: the handle to torch's record
Rule = Callable[[tuple, int, dict], "tuple | None"]
RULES: dict[str, Rule] = {}


def rule(*names: str) -> Callable[[Rule], Rule]:
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


def broadcast_shape(shapes: list) -> torch.Size:
    """The broadcast of several shapes, or torch's eager message where they do not fit."""
    out: list[int] = []
    for shape in shapes:
        width = max(len(out), len(shape))
        merged = []
        for i in range(width, 0, -1):
            a = out[-i] if i <= len(out) else 1
            b = shape[-i] if i <= len(shape) else 1
            if a != b and a != 1 and b != 1:
                raise RuntimeError(f"The size of tensor a ({a}) must match the size of tensor b "
                                   f"({b}) at non-singleton dimension {width - i}")
            merged.append(b if a == 1 else a)
        out = merged
    return torch.Size(out)


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    """Batch dims broadcast, or None where they do not (torch.broadcast_shapes imports what
    this module avoids)."""
    try:
        return tuple(broadcast_shape([a, b]))
    except RuntimeError:
        return None


def _reduced(shape: Size, dims: tuple[int, ...], keepdim: bool) -> Size:
    if keepdim:
        return Size(1 if i in dims else n for i, n in enumerate(shape))
    return Size(n for i, n in enumerate(shape) if i not in dims)


@rule("linear")
def _linear(args, tmask, kw):
    x, w, b = args
    if not _tensors(args, tmask, 2) or len(w[0]) != 2 or not x[0]:
        return None
    if x[0][-1] != w[0][1]:  # the CPU and GPU kernels' words (meta's differ)
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({math.prod(x[0][:-1])}x"
                           f"{x[0][-1]} and {w[0][1]}x{w[0][0]})")
    cast = kw.get("cast") if kw else None  # autocast's, inside the kernel (gtmpi/amp.py)
    if cast is not None:
        floating = _float(x) and _float(w) and (b is None or _float(b))
        return ((Size((*x[0][:-1], w[0][0])), cast),) if floating and \
            (b is None or (tmask & 4 and b[0] == Size([w[0][0]]))) else None
    if b is not None and not (tmask & 4 and b[0] == Size([w[0][0]]) and b[1] == x[1]):
        return None
    return ((Size((*x[0][:-1], w[0][0])), x[1]),) if _float(x, w) else None


@rule("linear_grad")
def _linear_grad(args, tmask, kw):
    g, x, w = args[:3]
    cast = kw.get("cast")
    if not _tensors(args, tmask, 3) or len(w[0]) != 2 or \
            not (_float(g, x, w) if cast is None else _float(x) and _float(w) and _float(g)) or \
            len(g[0]) != len(x[0]) or g[0][:-1] != x[0][:-1] or g[0][-1] != w[0][0] or \
            x[0][-1] != w[0][1]:
        return None
    shapes = {0: x[0], 1: w[0], 2: Size([w[0][0]])}
    if cast is None:
        return tuple((shapes[i], g[1]) for i in kw["grads"])
    # cast inside: each gradient in its operand's dtype, as autocast's casts give them
    dtypes = {0: x[1], 1: w[1], 2: args[3][1] if tmask & 8 else g[1]}
    return tuple((shapes[i], dtypes[i]) for i in kw["grads"])


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
    dtype = torch.float32 if kw and kw.get("nll_float32") else x[1]
    if reduction in ("mean", "sum"):
        return ((Size([]), dtype), _GRAPH)
    return ((Size([x[0][0]]), dtype), _GRAPH) if reduction == "none" else None


@rule("linear_cross_entropy")
def _linear_cross_entropy(args, tmask, kw):
    x, w, t, b, _, reduction, chunk = args
    cast = kw.get("cast") if kw else None
    if not _tensors(args, tmask, 3) or x[1] not in _FLOAT or t[1] != torch.int64 or \
            len(x[0]) != 2 or len(w[0]) != 2 or x[0][1] != w[0][1] or \
            t[0] != Size([x[0][0]]) or reduction not in ("mean", "sum") or \
            (cast is None and w[1] != x[1]) or (b is not None and b[0] != Size([w[0][0]])):
        return None
    return ((Size([]), torch.float32 if kw and kw.get("float32") else x[1]), _GRAPH)


def _reduction(args, tmask, kw):
    """(shape, dtype, dims, keepdim) of a reduction's operands, or None."""
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


@rule("flip", "roll")
def _same(args, tmask, kw):
    """flip(x, dims), roll(x, shifts, dims): the operand's Sig, for dims torch takes."""
    dims = args[1] if len(args) == 2 else args[2]
    if tmask != 1 or not args[0][0]:
        return None
    if dims is None and len(args) == 3 and type(args[1]) is int:
        return (args[0],)
    dims = (dims,) if type(dims) is int else dims
    if not isinstance(dims, tuple) or _dims(dims, len(args[0][0])) is None or \
            len(args) == 3 and not (type(args[1]) is int and len(dims) == 1 or
                                    isinstance(args[1], tuple) and len(args[1]) == len(dims)):
        return None
    return (args[0],)


@rule("tril", "triu")
def _triangle(args, tmask, kw):
    return (args[0],) if tmask == 1 and len(args[0][0]) >= 2 and type(args[1]) is int else None


@rule("normalize")
def _normalize(args, tmask, kw):
    (shape, dtype), dim = args[:2]
    if tmask != 1 or dtype not in _FLOAT or type(dim) is not int or _dims(dim, len(shape)) is None:
        return None
    return (args[0],)


@rule("cumsum")
def _cumsum(args, tmask, kw):
    (shape, dtype), dim = args
    if tmask != 1 or type(dim) is not int or _dims(dim, len(shape)) is None:
        return None
    return ((shape, dtype if dtype in _FLOAT else torch.int64),)


@rule("logsumexp", "vector_norm")
def _float_reduction(args, tmask, kw):
    (shape, dtype), dim, keepdim = args[:3]
    if tmask != 1 or dtype not in _FLOAT or type(keepdim) is not bool or \
            dim is None and len(args) == 3:  # logsumexp wants its dims named
        return None
    dims = _dims(dim, len(shape))
    return None if dims is None else ((_reduced(shape, dims, keepdim), dtype),)


@rule("any", "all")
def _predicate(args, tmask, kw):
    (shape, dtype), dim, keepdim = args
    if tmask != 1 or type(keepdim) is not bool or dtype == torch.uint8:
        return None
    if dim is None:  # the kernel's x.any(): every element, keepdim aside
        return ((Size([]), torch.bool),)
    dims = _dims(dim, len(shape))
    return None if dims is None else ((_reduced(shape, dims, keepdim), torch.bool),)


@rule("topk")
def _topk(args, tmask, kw):
    (shape, dtype), dim, k = args[:3]
    dims = _dims(dim, len(shape)) if type(dim) is int else None
    if tmask != 1 or dims is None or type(k) is not int or not 0 <= k <= shape[dims[0]]:
        return None
    out = Size(k if i == dims[0] else n for i, n in enumerate(shape))
    return ((out, dtype), (out, torch.int64))


@rule("sort")
def _sort(args, tmask, kw):
    (shape, dtype), dim = args[:2]
    if tmask != 1 or type(dim) is not int or _dims(dim, len(shape)) is None:
        return None
    return ((shape, dtype), (shape, torch.int64))


def _indexes(x: tuple, dim, index: tuple) -> bool:
    """gather's and scatter's index: int64, of x's rank, no longer than x off ``dim``."""
    if index[1] != torch.int64 or len(index[0]) != len(x[0]) or type(dim) is not int or \
            _dims(dim, len(x[0])) is None:
        return False
    d = dim % len(x[0])
    return all(i <= n for j, (i, n) in enumerate(zip(index[0], x[0])) if j != d)


@rule("gather")
def _gather(args, tmask, kw):
    x, dim, index = args
    return ((index[0], x[1]),) if tmask == 5 and _indexes(x, dim, index) else None


@rule("scatter_add")
def _scatter_add(args, tmask, kw):
    return _scatter(args, tmask, kw) if tmask & 8 else None


@rule("scatter")
def _scatter(args, tmask, kw):
    """x.scatter(dim, index, src): x's Sig, for an int64 index no larger than x or src."""
    x, dim, index, src = args
    if tmask & 5 != 5 or not _indexes(x, dim, index):
        return None
    if tmask & 8:
        if src[1] != x[1] or len(src[0]) != len(x[0]) or \
                any(i > n for i, n in zip(index[0], src[0])):
            return None
    elif type(src) not in (int, float, bool):
        return None
    return (x,)


@rule("index_select")
def _index_select(args, tmask, kw):
    x, dim, index = args
    if tmask != 5 or index[1] not in _INDEX or len(index[0]) != 1 or type(dim) is not int or \
            _dims(dim, len(x[0])) is None:
        return None
    d = dim % len(x[0])
    return ((Size(index[0][0] if i == d else n for i, n in enumerate(x[0])), x[1]),)


@rule("repeat")
def _repeat(args, tmask, kw):
    (shape, dtype), sizes = args
    if tmask != 1 or not isinstance(sizes, tuple) or len(sizes) < len(shape) or \
            not all(type(s) is int and s >= 0 for s in sizes):
        return None
    padded = (1,) * (len(sizes) - len(shape)) + tuple(shape)
    return ((Size(a * b for a, b in zip(padded, sizes)), dtype),)


@rule("one_hot")
def _one_hot(args, tmask, kw):
    (shape, dtype), n = args
    if tmask != 1 or dtype != torch.int64 or type(n) is not int or n <= 0:
        return None
    return ((Size((*shape, n)), torch.int64),)


@rule("pad")
def _pad(args, tmask, kw):
    (shape, dtype), pad, mode, _ = args
    if tmask != 1 or mode != "constant" or not isinstance(pad, tuple) or len(pad) % 2 or \
            len(pad) // 2 > len(shape) or not all(type(p) is int for p in pad):
        return None
    out = list(shape)
    for i in range(len(pad) // 2):
        out[-1 - i] += pad[2 * i] + pad[2 * i + 1]
    return None if min(out, default=0) < 0 else ((Size(out), dtype),)


@rule("arange")
def _arange(args, tmask, kw):
    start, end, step, dtype = args
    numbers = (start, end, step)
    if not all(type(v) in (int, float) for v in numbers) or step == 0 or \
            (end - start) / step < 0:
        return None
    if dtype is None:
        dtype = torch.int64 if all(type(v) is int for v in numbers) else \
            torch.get_default_dtype()
    if dtype not in _FLOAT and dtype != torch.int64 and dtype != torch.int32:
        return None
    length = math.ceil((end - start) / step)
    return ((Size([length]), dtype),)


@rule("getitem")
def _getitem(args, tmask, kw):
    """x[idx], x[:, idx], x[..., idx] with one integer index tensor among full slices: the
    indexed dim is replaced by the index's shape (advanced indexing's simplest case)."""
    key = kw.get("key")
    if tmask != 3 or not isinstance(key, tuple) or key.count("T") != 1:
        return None
    (shape, dtype), (ishape, idtype) = args
    if idtype not in _INDEX:
        return None
    items = list(key)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(shape) - len(items) + 1)
    full = slice(None)
    if len(items) > len(shape) or any(i != "T" and i != full for i in items):
        return None
    d = items.index("T")
    return ((Size((*shape[:d], *ishape, *shape[d + 1:])), dtype),)


@rule("einsum")
def _einsum(args, tmask, kw):
    """Explicit equations of single letters ('bij,bkj->bik'), operands of one float dtype."""
    equation = kw.get("equation")
    if not isinstance(equation, str) or tmask != (1 << len(args)) - 1 or not _float(*args):
        return None
    equation = equation.replace(" ", "")
    if "->" not in equation or "." in equation:
        return None
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    if len(terms) != len(args):
        return None
    sizes: dict[str, int] = {}
    for term, (shape, _) in zip(terms, args):
        if len(term) != len(shape) or not term.isalpha() or len(set(term)) != len(term):
            return None
        for letter, n in zip(term, shape):
            if sizes.setdefault(letter, n) != n:
                return None
    if not set(output) <= set(sizes) or len(set(output)) != len(output):
        return None
    return ((Size(sizes[c] for c in output), args[0][1]),)


@rule("conv1d", "conv2d")
def _conv(args, tmask, kw):
    """(N, C, *spatial) by a (O, C/groups, *kernel) weight, with int or per-dim stride,
    padding and dilation: torch's output size per spatial dim."""
    x, w, b, stride, padding, dilation, groups = args
    (xs, dt), (ws, _) = x, w
    k = len(ws) - 2
    if tmask & 3 != 3 or not _float(x, w) or len(xs) != k + 2 or type(groups) is not int or \
            groups < 1 or xs[1] != ws[1] * groups or ws[0] % groups:
        return None
    if b is not None and not (tmask & 4 and b == (Size([ws[0]]), dt)):
        return None
    per_dim = []
    for v in (stride, padding, dilation):
        v = (v,) * k if type(v) is int else v
        if not isinstance(v, tuple) or len(v) != k or not all(type(i) is int for i in v):
            return None
        per_dim.append(v)
    out = []
    for n, kernel, s, p, d in zip(xs[2:], ws[2:], *per_dim):
        size = (n + 2 * p - d * (kernel - 1) - 1) // s + 1
        if s < 1 or d < 1 or p < 0 or size < 1:
            return None
        out.append(size)
    return ((Size((xs[0], ws[0], *out)), dt),)


@rule("batch_norm")
def _batch_norm(args, tmask, kw):
    x, mean, var, weight, bias = args[:5]
    if not tmask & 1 or x[1] not in _FLOAT or len(x[0]) < 2:
        return None
    channels = (Size([x[0][1]]), x[1])
    for i, p in enumerate((mean, var, weight, bias), 1):
        if p is not None and not (tmask >> i & 1 and p == channels):
            return None
    return (x,)
