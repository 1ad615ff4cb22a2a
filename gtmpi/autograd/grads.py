"""Gradient rules, one per differentiable op of ops/table.py, keyed by the same names.

A rule takes the Node (its operands, keyword constants, saved outputs) and the gradient of
its output (a tuple of them for ops with several results, None where a result got none) and
returns one gradient per operand (None for constants and for operands that need none). Rules
run with autograd off and are written with gtmpi's own ops, so they execute on the workers.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

from ..client.creation import zeros
from ..client.functions import cat, where
from ..client.tensor import Tensor, apply
from ..ops.table import FUSED_FNS
from .node import Node

Rule = Callable[[Node, Any], tuple]
GRADS: dict[str, Rule] = {}

# What each rule reads beyond shapes and dtypes: (operand positions, whether it reads the op's
# results). The graph keeps only those alive; an op missing here keeps all its operands.
_NOTHING: tuple = ((), False)
SAVES: dict[str, tuple[tuple[int, ...] | slice, bool]] = {
    **dict.fromkeys(["add", "sub", "neg", "to", "sum", "mean", "reshape", "view", "flatten",
                     "squeeze", "unsqueeze", "contiguous", "clone", "alias", "permute",
                     "transpose", "expand", "cat", "stack", "split", "chunk", *FUSED_FNS],
                    _NOTHING),
    **dict.fromkeys(["exp", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "softmax",
                     "log_softmax", "max_dim", "min_dim"], ((), True)),
    **dict.fromkeys(["abs", "log", "sin", "cos", "gelu", "silu", "where", "var"], ((0,), False)),
    **dict.fromkeys(["mul", "truediv", "mod", "maximum", "minimum", "matmul"], ((0, 1), False)),
    "pow": ((0, 1), True), "clamp": ((0, 1, 2), False), "amax": ((0,), True),
    "amin": ((0,), True), "std": ((0,), True),
    "linear": ((0, 1, 2), False),  # the bias too: its placement decides its gradient's
    "getitem": (slice(1, None), False),  # the index tensors, not the indexed one
    "square": ((0,), False),
    "masked_scale": ((1,), False),  # the mask: as torch's dropout, which saves its mask alone
}


@functools.lru_cache(maxsize=4096)
def kept(op: str, n: int) -> tuple[frozenset[int] | range, bool]:
    """The operand positions (of n) that op's rule reads, and whether it reads the results."""
    keep, uses_output = SAVES.get(op, (None, False))
    if keep is None:
        return range(n), uses_output
    return frozenset(range(n)[keep] if isinstance(keep, slice) else keep), uses_output


def rule(*names: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for name in names:
            GRADS[name] = fn
        return fn
    return register


def sum_to(g: Tensor, shape: Sequence[int]) -> Tensor:
    """Undo broadcasting: sum g over the dims that broadcasting added or stretched."""
    lead = g.ndim - len(shape)
    if lead:
        g = g.sum(tuple(range(lead)))
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if dims:
        g = g.sum(dims, keepdim=True)
    return g


# operands whose gradients a rule is not asked for now: the other half of a backward split
# into the inputs' gradients and, later, the weights' (zero-bubble pipelines; engine.py)
MASKED: set[int] = set()


def _t(x: Any) -> bool:
    """Whether operand x (a tensor or its Ghost; constants never) wants a gradient."""
    return getattr(x, "requires_grad", False) and id(x) not in MASKED


def _each(node: Node, *grads: Any) -> tuple:
    """Gradients for tensor operands that require grad, broadcasting undone; None elsewhere."""
    return tuple(sum_to(g, x.shape) if _t(x) and g is not None else None
                 for x, g in zip(node.operands, grads))


def _out(node: Node) -> Tensor:
    return node.saved[0]


# elementwise --------------------------------------------------------------------------------

@rule("add")
def _add(node, g):
    return _each(node, g, g)


@rule("sub")
def _sub(node, g):
    return _each(node, g, -g)


@rule("mul")
def _mul(node, g):
    a, b = node.operands
    return _each(node, g * b if _t(a) else None, g * a if _t(b) else None)


@rule("truediv")
def _truediv(node, g):
    a, b = node.operands
    return _each(node, g / b if _t(a) else None, -g * a / (b * b) if _t(b) else None)


@rule("mod")
def _mod(node, g):
    a, b = node.operands
    return _each(node, g if _t(a) else None, -g * apply("floordiv", a, b) if _t(b) else None)


@rule("pow")
def _pow(node, g):
    a, b = node.operands
    ga = g * b * a ** (b - 1) if _t(a) else None
    log_a = apply("log", a) if isinstance(a, Tensor) else math.log(a)
    gb = g * _out(node) * log_a if _t(b) else None
    return _each(node, ga, gb)


@rule("neg")
def _neg(node, g):
    return (-g,)


@rule("abs")
def _abs(node, g):
    return (g * apply("sign", node.operands[0]),)


@rule("exp")
def _exp(node, g):
    return (g * _out(node),)


@rule("log")
def _log(node, g):
    return (g / node.operands[0],)


@rule("sqrt")
def _sqrt(node, g):
    return (g / (2 * _out(node)),)


@rule("rsqrt")
def _rsqrt(node, g):
    return (-0.5 * g * _out(node) ** 3,)


@rule("sin")
def _sin(node, g):
    return (g * apply("cos", node.operands[0]),)


@rule("cos")
def _cos(node, g):
    return (-g * apply("sin", node.operands[0]),)


@rule("tanh")
def _tanh(node, g):
    y = _out(node)
    return (g * (1 - y * y),)


@rule("sigmoid")
def _sigmoid(node, g):
    y = _out(node)
    return (g * y * (1 - y),)


@rule("relu")
def _relu(node, g):
    return (g * (_out(node) > 0),)


@rule("masked_scale")
def _masked_scale(node, g):
    x, mask, scale = node.operands
    return (apply("masked_scale", g, mask, scale) if _t(x) else None, None, None)


@rule("gelu")
def _gelu(node, g):
    return (apply("gelu_grad", g, node.operands[0], **(node.kw or {})),)


@rule("silu")
def _silu(node, g):
    return (apply("silu_grad", g, node.operands[0]),)


@rule("to")
def _to(node, g):
    return (g.to(node.operands[0].dtype), None)


@rule("where")
def _where(node, g):
    c, x, y = node.operands
    return _each(node, None, where(c, g, 0.0) if _t(x) else None, where(c, 0.0, g) if _t(y) else None)


@rule("masked_fill")
def _masked_fill(node, g):
    # elementwise, so a batch split stays split (torch's vjp here gathered it: issue 34)
    x, mask, value = node.operands
    return _each(node, where(mask, 0.0, g) if _t(x) else None, None,
                 where(mask, g, 0.0) if _t(value) else None)


@rule("clamp")
def _clamp(node, g):
    x, lo, hi = node.operands
    inside = g
    if lo is not None:
        inside = where(x >= lo, inside, 0.0)
    if hi is not None:
        inside = where(x <= hi, inside, 0.0)
    g_lo = where(x < lo, g, 0.0) if _t(lo) else None
    g_hi = where(x > hi, g, 0.0) if _t(hi) else None
    return _each(node, inside, g_lo, g_hi)


@rule("maximum", "minimum")
def _extremum(node, g):
    a, b = node.operands
    a_wins = a > b if node.op == "maximum" else a < b
    tie = (a == b) * 0.5
    return _each(node, g * (a_wins + tie) if _t(a) else None, g * ((~a_wins) * 1.0 - tie) if _t(b) else None)


# matmul -------------------------------------------------------------------------------------

@rule("matmul")
def _matmul(node, g):
    a, b = node.operands
    a2 = a.unsqueeze(0) if a.ndim == 1 else a
    b2 = b.unsqueeze(-1) if b.ndim == 1 else b
    if a.ndim == 1:
        g = g.unsqueeze(-2)
    if b.ndim == 1:
        g = g.unsqueeze(-1)
    ga = _shaped(sum_to(g @ b2.transpose(-1, -2), a2.shape), a.shape) if _t(a) else None
    gb = _shaped(sum_to(a2.transpose(-1, -2) @ g, b2.shape), b.shape) if _t(b) else None
    return ga, gb


def _shaped(g: Tensor, shape) -> Tensor:
    return g if g.shape == shape else g.reshape(shape)


@rule("linear")
def _linear(node, g):
    wanted = tuple(i for i, t in enumerate(node.operands) if _t(t))
    x = node.operands[0]
    # the input's gradient is whole once this op gives it: where it comes out as partial sums
    # (tensor parallelism), the dispatcher may sum them while the weight's gradient computes
    sole = x._node is not None and x._node.uses[x._slot] == 1
    extra = {"sole": True} if sole and 0 in wanted else {}
    if node.kw and "cast" in node.kw:
        extra["cast"] = node.kw["cast"]
    return _scatter(node, wanted, apply("linear_grad", g, *node.operands, grads=wanted, **extra))


@rule(*FUSED_FNS)
def _fused(node, g):
    """torch's own backward kernel, on the worker's record of the forward (ops/table.py)."""
    wanted = node.kw["grads"]
    like = tuple(node.operands[i]._sig for i in wanted)
    return _scatter(node, wanted, apply(f"{node.op}_grad", node.saved[0], g, grads=wanted,
                                        like=like))


def _scatter(node: Node, positions: tuple[int, ...], grads: tuple) -> tuple:
    """One gradient per operand: ``grads`` at ``positions``, None elsewhere."""
    out: list = [None] * len(node.operands)
    for i, grad in zip(positions, grads):
        out[i] = grad
    return tuple(out)


# reductions ---------------------------------------------------------------------------------

def _dims(dim, ndim: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return tuple(sorted(d % ndim for d in dims)) if ndim else ()


def _unreduce(g: Tensor, x: Tensor, dim, keepdim: bool) -> Tensor:
    """g of a reduction over ``dim``, reshaped so it broadcasts against x."""
    if not keepdim:
        for d in _dims(dim, x.ndim):
            g = g.unsqueeze(d)
    return g


def _count(x: Tensor, dims: tuple[int, ...]) -> int:
    """How many elements of x a reduction over ``dims`` folds into one."""
    return math.prod(x.shape[d] for d in dims)


@rule("sum")
def _sum(node, g):
    x, dim, keepdim = node.operands
    return (_unreduce(g, x, dim, keepdim).expand(x.shape), None, None)


@rule("mean")
def _mean(node, g):
    x, dim, keepdim = node.operands
    count = _count(x, _dims(dim, x.ndim))
    return (_unreduce(g, x, dim, keepdim).expand(x.shape) / count, None, None)


@rule("amax", "amin")
def _amax(node, g):
    x, dim, keepdim = node.operands
    dims = _dims(dim, x.ndim)
    hit = x == _unreduce(_out(node), x, dim, keepdim)
    share = hit / hit.sum(dims, keepdim=True) if dims else hit * 1.0
    return (_unreduce(g, x, dim, keepdim) * share, None, None)


@rule("max_dim", "min_dim")
def _max_dim(node, grads):
    x, dim, keepdim = node.operands
    g, _ = grads
    if g is None:
        return (None, None, None)
    indices = _unreduce(node.saved[1], x, dim, keepdim)
    positions = apply("arange", 0, x.shape[dim], 1, None).reshape(
        [x.shape[dim] if d == dim % x.ndim else 1 for d in range(x.ndim)])
    return (_unreduce(g, x, dim, keepdim) * (positions == indices), None, None)


@rule("var")
def _var(node, g):
    x, dim, correction, keepdim = node.operands
    dims = _dims(dim, x.ndim)
    count = _count(x, dims)
    centred = x - x.mean(dims, keepdim=True)
    return (_unreduce(g, x, dim, keepdim) * centred * (2.0 / max(count - correction, 0)),
            None, None, None)


@rule("std")
def _std(node, g):
    x, dim, correction, keepdim = node.operands
    g_var = g / (2 * _out(node))
    return _var(node, g_var)


@rule("softmax")
def _softmax(node, g):
    y = _out(node)
    dim = node.operands[1]
    return (y * (g - (g * y).sum(dim, keepdim=True)), None)


@rule("log_softmax")
def _log_softmax(node, g):
    dim = node.operands[1]
    return (g - apply("exp", _out(node)) * g.sum(dim, keepdim=True), None)


# shape ----------------------------------------------------------------------------------------

@rule("reshape", "view", "flatten", "squeeze", "unsqueeze", "contiguous", "clone", "alias")
def _reshape(node, g):
    return (_shaped(g, node.operands[0].shape),) + (None,) * (len(node.operands) - 1)


@rule("permute")
def _permute(node, g):
    dims = node.operands[1]
    inverse = [0] * len(dims)
    for i, d in enumerate(dims):
        inverse[d % len(dims)] = i
    return (g.permute(inverse), None)


@rule("transpose")
def _transpose(node, g):
    _, d0, d1 = node.operands
    return (g.transpose(d0, d1), None, None)


@rule("expand")
def _expand(node, g):
    return (sum_to(g, node.operands[0].shape), None)


@rule("cat")
def _cat(node, g):
    dim = node.kw["dim"]
    sizes = [x.shape[dim] for x in node.operands]
    return tuple(p if _t(x) else None for x, p in zip(node.operands, g.split(sizes, dim)))


@rule("stack")
def _stack(node, g):
    dim = node.kw["dim"]
    parts = g.split(1, dim)
    return tuple(p.squeeze(dim) if _t(x) else None for x, p in zip(node.operands, parts))


@rule("split", "chunk")
def _split(node, grads):
    x, _, dim = node.operands
    pieces = list(grads)
    if any(p is None for p in pieces):
        sizes = _piece_sizes(node)
        pieces = [p if p is not None else zeros(_with(x.shape, dim, n), dtype=x.dtype)
                  for p, n in zip(pieces, sizes)]
    return (cat(pieces, dim), None, None)


def _piece_sizes(node: Node) -> list[int]:
    x, sections, dim = node.operands
    total = x.shape[dim]
    if node.op == "chunk":
        step = -(-total // sections)
        return [min(step, total - i) for i in range(0, total, step)]
    if isinstance(sections, int):
        return [min(sections, total - i) for i in range(0, total, sections)]
    return list(sections)


def _with(shape, dim: int, n: int) -> tuple:
    s = list(shape)
    s[dim] = n
    return tuple(s)


# indexing -------------------------------------------------------------------------------------

@rule("getitem")
def _getitem(node, g):
    x, *index = node.operands
    gx = apply("getitem_grad", g, *index, key=node.kw["key"], shape=tuple(x.shape))
    return (gx,) + (None,) * len(index)


@rule("square")
def _square(node, g):  # elementwise, so placed as its operands are (a split batch stays split)
    (x,) = node.operands
    return (g * (2 * x),)


@rule("einsum")
def _einsum(node, g):
    """Each operand's gradient is an einsum too (placed by its rule, a split letter kept);
    where an operand has a letter that only it carries (summed away, so the gradient must be
    spread along it), torch's own gradient serves."""
    lhs, _, out = node.kw["equation"].replace(" ", "").partition("->")
    terms = lhs.split(",")
    if "." in lhs or any(len(set(t)) != len(t) for t in terms) or \
            any(set(t) - set(out) - set("".join(terms[:i] + terms[i + 1:]))
                for i, t in enumerate(terms)):
        return _by_torch(node, g)
    grads = []
    for i, (term, x) in enumerate(zip(terms, node.operands)):
        if not _t(x):
            grads.append(None)
            continue
        others = [(t, y) for j, (t, y) in enumerate(zip(terms, node.operands)) if j != i]
        grads.append(apply("einsum", g, *(y for _, y in others),
                           equation=",".join([out, *(t for t, _ in others)]) + "->" + term))
    return tuple(grads)


@rule("function")
def _function(node, g):
    """A gradient given as a Python function (engine.function: activation checkpointing's
    recompute): one per operand."""
    return node.kw["backward"](g)


# ops whose gradient torch's autograd computes on the worker, from the op's own kernel run
# again (ops/table.py's "vjp"): rare in training loops, exact, and one instruction each
@rule("floor", "ceil", "round", "trunc", "erf", "erfinv", "log1p", "expm1", "reciprocal",
      "tan", "asin", "acos", "atan", "lgamma", "digamma", "atan2", "hypot",
      "leaky_relu", "cumsum", "cumprod", "cummax", "cummin", "prod", "logsumexp", "vector_norm", "normalize",
      "topk", "sort", "gather", "scatter", "scatter_add", "index_select", "tril", "triu", "repeat", "flip", "roll", "pad",
      "conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d", "batch_norm", "max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d",
      "adaptive_avg_pool1d", "adaptive_avg_pool2d")
def _by_torch(node, g):
    gs = g if node.outputs > 1 else (g,)
    outs = tuple(j for j, x in enumerate(gs) if x is not None)
    want = tuple(i for i, a in enumerate(node.operands) if _t(a))
    grads: list = [None] * len(node.operands)
    if outs and want:
        got = apply("vjp", *(gs[j] for j in outs), *node.operands, op=node.op, grads=want,
                    outs=outs, kw=tuple(sorted((node.kw or {}).items())))
        for i, gi in zip(want, got):
            grads[i] = gi
    return tuple(grads)
