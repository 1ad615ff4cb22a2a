"""Shape and dtype inference on the client, with torch's exact semantics and error messages.

The oracle is the op's own kernel run on meta tensors (no data, no device). That costs
10-170 µs an op (and about a second of imports at the first one), so pointwise ops take a
cheaper exact rule (_probe), and all results are cached by (op, operand shapes and dtypes,
constants): a training loop repeats the same signatures and pays a dict lookup per op after
its first step.
"""
from __future__ import annotations

from typing import Any

import torch

from .shape_rules import RULES, broadcast_shape
from .table import OPS, Kind, Seed

# ops whose kernel returns a tuple even of one tensor (their rule's single Sig is still a tuple)
_TUPLED = frozenset({"linear_grad", "add_foreach"})

Sig = tuple  # (torch.Size, torch.dtype) of one tensor
META = torch.device("meta")
SCALARS = (bool, int, float, complex)
_CACHE_LIMIT = 65536
_cache: dict[tuple, tuple[tuple[Sig, ...], bool]] = {}


def freeze(v: Any) -> Any:
    """A hashable stand-in for a constant (slices and lists are not hashable). Scalars carry
    their type: 4 == 4.0 == True as dict keys, but not as torch arguments."""
    t = type(v)
    if t in SCALARS:
        return (t, v)
    if v is None:
        return None
    if t is Seed:  # a random op's seed changes no shape, placement or program
        return ("seed",)
    if t is tuple:
        if all(type(x) is int for x in v):  # a shape, the commonest constant
            return ("ints", v)
        if len(v) == 2 and type(v[0]) is torch.Size and type(v[1]) is torch.dtype:
            return v  # a tensor's Sig: ints and a dtype, hashable as it is
    if isinstance(v, slice):
        return ("slice", v.start, v.stop, v.step)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, *map(freeze, v))
    return v


def signature_key(name: str, args: tuple, tmask: int, kw: dict | None) -> tuple:
    """Cache key; tensor operands appear as their Sig."""
    by_type = OPS[name].scalar_by_type
    parts = []
    for i, a in enumerate(args):
        if tmask >> i & 1:
            parts.append(a)
        elif by_type and type(a) in SCALARS:
            parts.append(type(a))
        else:
            parts.append(freeze(a))
    if kw:
        parts.append(tuple((k, freeze(v)) for k, v in kw.items()))
    return (name, *parts)


def _probe(op, args: tuple, tmask: int, kw: dict | None) -> tuple[Sig, ...] | None:
    """Pointwise ops: the shape is the broadcast; the dtype comes from running the kernel on
    one-element CPU tensors of the operands' ranks and dtypes (rank matters: 0-d tensors
    promote like scalars). A few µs instead of meta's 30-170. None where the CPU kernel lacks
    a floating dtype (a GPU may have it): then meta decides. For integer and boolean operands
    the CPU's refusal is torch's everywhere (gelu of an int tensor), and is raised."""
    shape = broadcast_shape([a[0] for i, a in enumerate(args) if tmask >> i & 1])
    if op.kind is Kind.INPLACE and shape != args[0][0]:
        raise RuntimeError(f"output with shape {list(args[0][0])} doesn't match the broadcast "
                           f"shape {list(shape)}")
    probes = [torch.ones((1,) * len(a[0]), dtype=a[1]) if tmask >> i & 1 else a
              for i, a in enumerate(args)]
    try:
        out = op.kernel(*probes, **(kw or {}))
    except Exception:
        if _integral(args, tmask):
            raise
        return None
    return ((shape, out.dtype),)


def _integral(args: tuple, tmask: int) -> bool:
    """Whether every tensor operand is of an integer or boolean dtype."""
    return all(not (a[1].is_floating_point or a[1].is_complex)
               for i, a in enumerate(args) if tmask >> i & 1)


_C_NAMES = {torch.int64: "long int", torch.int32: "int", torch.float32: "float",
            torch.float64: "double", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16",
            torch.bool: "bool", torch.uint8: "unsigned char", torch.int8: "signed char",
            torch.int16: "short int"}
_INDEX_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool)
# not reductions, but a dim after the tensor too; checked here, as torch's meta kernels of
# some versions assert rather than raise IndexError
_DIM_FIRST = frozenset({"sort", "topk", "gather", "scatter", "scatter_add", "index_select",
                        "cumprod", "cummax", "cummin"})
PROBE_NUMEL = 1 << 16  # integer operands of a non-pointwise op: run the CPU kernel this small


def _check(name: str, op, args: tuple, tmask: int, kw: dict | None) -> None:
    """What torch checks at the line and meta tensors do not: dims of reductions, dtypes of
    matrix products and index tensors, and ops with no kernel for integer operands."""
    tensors = [a for i, a in enumerate(args) if tmask >> i & 1]
    if (op.kind is Kind.REDUCE or name in _DIM_FIRST) and len(args) > 1 and tmask & 1:
        ndim = len(args[0][0])
        for d in (args[1] if isinstance(args[1], (tuple, list)) else (args[1],)):
            top = max(ndim, 1)
            if type(d) is int and not -top <= d < top:
                raise IndexError(f"Dimension out of range (expected to be in range of "
                                 f"[{-top}, {top - 1}], but got {d})")
    if name in ("clamp", "clamp_") and args[1] is None and args[2] is None:
        raise RuntimeError(f"torch.{name}: At least one of 'min' or 'max' must not be None")
    if op.kind is Kind.MATMUL and name != "linear_grad" and tmask & 3 == 3 and \
            args[0][1] != args[1][1] and not (kw and "cast" in kw):  # autocast's, inside
        a, b = (_C_NAMES.get(t[1], str(t[1])) for t in args[:2])
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a} != {b}")
    if op.kind is Kind.INDEX or name == "setitem":
        lead = 1 if op.kind is Kind.INDEX else 2
        for a in tensors[lead:]:
            if a[1] not in _INDEX_DTYPES:
                raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    if op.kind in (Kind.REDUCE, Kind.FUSED) and tensors and not (
            tensors[0][1].is_floating_point or tensors[0][1].is_complex):
        # torch has no kernel for some ops on integers (softmax, layer_norm); meta does not know
        probes = [torch.zeros(a[0], dtype=a[1]) if tmask >> i & 1 else a
                  for i, a in enumerate(args)]
        if sum(p.numel() for p in probes if isinstance(p, torch.Tensor)) <= PROBE_NUMEL:
            try:
                op.kernel(*probes, **(kw or {}))
            except NotImplementedError:
                raise
            except Exception:
                pass  # not the dtype: meta tells the rest


# integer division of integer tensors by a Python zero raises in torch, whatever the values
_INTEGER_DIVISION = frozenset({"floordiv", "mod"})


def _check_matmul(a: torch.Size, b: torch.Size) -> None:
    """torch's eager message for mismatched inner dimensions."""
    if a and b and a[-1] != b[-2 if len(b) > 1 else 0]:
        rows = a.numel() // a[-1] if a[-1] else 0
        k = b[-2] if len(b) > 1 else b[0]
        cols = b[-1] if len(b) > 1 else 1
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({rows}x{a[-1]} and {k}x{cols})")


def _evaluate(name: str, args: tuple, tmask: int, kw: dict | None) -> tuple[tuple[Sig, ...], bool]:
    op = OPS[name]
    if op.sigs is not None:
        return op.sigs(args), name in _TUPLED
    _check(name, op, args, tmask, kw)
    if op.kind is Kind.ELEMENTWISE or op.scalar_by_type:
        fast = _probe(op, args, tmask, kw)
        if fast is not None:
            return fast, False
    elif name == "matmul" and tmask == 3:
        _check_matmul(args[0][0], args[1][0])
    rule = RULES.get(name)
    if rule is not None:
        got = rule(args, tmask, kw or {})
        if got is not None:
            return got, len(got) > 1 or name in _TUPLED
    margs = [torch.empty(a[0], dtype=a[1], device=META) if tmask >> i & 1 else a
             for i, a in enumerate(args)]
    kwargs = dict(kw or {})
    if op.kind is Kind.CREATE:
        kwargs["device"] = META
    out = (op.meta or op.kernel)(*margs, **kwargs)
    if isinstance(out, torch.Tensor):
        return ((out.shape, out.dtype),), False
    return tuple((o.shape, o.dtype) for o in out), True


def infer(name: str, args: tuple, tmask: int, kw: dict | None,
          key: tuple | None = None) -> tuple[tuple[Sig, ...], bool]:
    """Output Sigs of an op and whether it returns a tuple. Tensor operands are given as Sigs;
    ``key``, their signature_key where the caller has it.

    Raises torch's own exception (shape mismatch, bad dim, bad dtype) synchronously.
    """
    if name in _INTEGER_DIVISION and tmask == 1 and args[1] == 0 and type(args[1]) in (int, bool) \
            and not args[0][1].is_floating_point:
        raise RuntimeError("ZeroDivisionError")
    try:
        if key is None:
            key = signature_key(name, args, tmask, kw)
        hit = _cache.get(key)
    except TypeError:  # an unhashable constant: no caching for this call
        return _evaluate(name, args, tmask, kw)
    if hit is None:
        hit = _evaluate(name, args, tmask, kw)
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        _cache[key] = hit
    return hit


# Ops that give a view in torch, and those whose view of a contiguous tensor may not be
# contiguous. The client keeps a tensor's layout only where it may not be its shape's
# contiguous one, so that a view that torch refuses (``x.T.view(-1)``) raises at the line: as
# how it came about, (op, operand Sigs, tmask, kw, the operand's layout), worked out into
# strides (on meta tensors, cached) only when a view needs them.
VIEWS = frozenset({"view", "reshape", "transpose", "permute", "squeeze", "unsqueeze", "flatten",
                   "expand", "alias", "getitem"})
RESTRIDING = frozenset({"transpose", "permute", "expand", "getitem"})
_strides_cache: dict[tuple, tuple | None] = {}


def view_strides(layout: tuple | None) -> tuple | None:
    """The strides of a layout (None: contiguous); raises torch's error where torch cannot
    make the view it describes."""
    if layout is None or type(layout[0]) is int:
        return layout
    name, args, tmask, kw, parent = layout
    if tmask != 1:
        return None  # indexed by tensors: a copy
    strides = view_strides(parent)
    key = (signature_key(name, args, tmask, kw), strides)
    try:
        return _strides_cache[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable constant
        key = None
    shape, dtype = args[0]
    x = torch.empty_strided(shape, strides or _contiguous(shape), dtype=dtype, device=META)
    out = OPS[name].kernel(x, *args[1:], **(kw or {}))
    result = None if out.is_contiguous() else tuple(out.stride())
    if key is not None:
        if len(_strides_cache) >= _CACHE_LIMIT:
            _strides_cache.clear()
        _strides_cache[key] = result
    return result


def _contiguous(shape: tuple) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))
