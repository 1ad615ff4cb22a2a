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

from .table import OPS, Kind

Sig = tuple  # (torch.Size, torch.dtype) of one tensor
META = torch.device("meta")
SCALARS = (bool, int, float, complex)
_CACHE_LIMIT = 65536
_cache: dict[tuple, tuple[tuple[Sig, ...], bool]] = {}


def _freeze(v: Any) -> Any:
    """A hashable stand-in for a constant (slices and lists are not hashable). Scalars carry
    their type: 4 == 4.0 == True as dict keys, but not as torch arguments."""
    if type(v) in SCALARS:
        return (type(v), v)
    if isinstance(v, slice):
        return ("slice", v.start, v.stop, v.step)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, *map(_freeze, v))
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
            parts.append(_freeze(a))
    if kw:
        parts.append(tuple((k, _freeze(v)) for k, v in kw.items()))
    return (name, *parts)


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


def _probe(op, args: tuple, tmask: int, kw: dict | None) -> tuple[Sig, ...] | None:
    """Pointwise ops: the shape is the broadcast; the dtype comes from running the kernel on
    one-element CPU tensors of the operands' ranks and dtypes (rank matters: 0-d tensors
    promote like scalars). A few µs instead of meta's 30-170. None where the CPU kernel lacks
    that dtype (a GPU may have it): then meta decides."""
    shape = broadcast_shape([a[0] for i, a in enumerate(args) if tmask >> i & 1])
    if op.kind is Kind.INPLACE and shape != args[0][0]:
        raise RuntimeError(f"output with shape {list(args[0][0])} doesn't match the broadcast "
                           f"shape {list(shape)}")
    probes = [torch.ones((1,) * len(a[0]), dtype=a[1]) if tmask >> i & 1 else a
              for i, a in enumerate(args)]
    try:
        out = op.kernel(*probes, **(kw or {}))
    except Exception:
        return None
    return ((shape, out.dtype),)


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
        return op.sigs(args), False
    if op.kind is Kind.ELEMENTWISE or op.scalar_by_type:
        fast = _probe(op, args, tmask, kw)
        if fast is not None:
            return fast, False
    elif name == "matmul" and tmask == 3:
        _check_matmul(args[0][0], args[1][0])
    margs = [torch.empty(a[0], dtype=a[1], device=META) if tmask >> i & 1 else a
             for i, a in enumerate(args)]
    kwargs = dict(kw or {})
    if op.kind is Kind.CREATE:
        kwargs["device"] = META
    out = (op.meta or op.kernel)(*margs, **kwargs)
    if isinstance(out, torch.Tensor):
        return ((out.shape, out.dtype),), False
    return tuple((o.shape, o.dtype) for o in out), True


def infer(name: str, args: tuple, tmask: int, kw: dict | None) -> tuple[tuple[Sig, ...], bool]:
    """Output Sigs of an op and whether it returns a tuple. Tensor operands are given as Sigs.

    Raises torch's own exception (shape mismatch, bad dim, bad dtype) synchronously.
    """
    key = signature_key(name, args, tmask, kw)
    try:
        hit = _cache.get(key)
    except TypeError:  # an unhashable constant: no caching for this call
        return _evaluate(name, args, tmask, kw)
    if hit is None:
        hit = _evaluate(name, args, tmask, kw)
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        _cache[key] = hit
    return hit
