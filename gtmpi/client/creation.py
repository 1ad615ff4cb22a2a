"""Creating tensors: from host data (uploaded as raw bytes) or made on the worker."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .gradmode import no_grad
from .dtypes import as_dtype
from .runtime import runtime
from .tensor import Tensor, _sizes, apply, with_device


def _grad(t: Tensor, requires_grad: bool) -> Tensor:
    return t.requires_grad_() if requires_grad else t


def tensor(data: Any, dtype=None, requires_grad: bool = False, **kw: Any) -> Tensor:
    """Like torch.tensor: copies ``data`` (nested lists, scalars, numpy, torch, gtmpi)."""
    with_device(kw)
    dtype = as_dtype(dtype)
    if isinstance(data, Tensor):
        with no_grad():
            copy = data.clone() if dtype is None or dtype == data.dtype else data.to(dtype)
        return _grad(copy, requires_grad)
    if isinstance(data, torch.Tensor):
        host = data.detach().to("cpu", dtype or data.dtype)
    elif isinstance(data, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(data))
        host = host.to(dtype) if dtype is not None else host
    else:
        host = torch.tensor(data, dtype=dtype)
    return _grad(upload(host), requires_grad)


def from_numpy(array: np.ndarray, requires_grad: bool = False) -> Tensor:
    """torch's from_numpy; GT's ``requires_grad=`` too (torch's has none)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected np.ndarray (got {type(array).__name__})")
    return _grad(upload(torch.from_numpy(np.ascontiguousarray(array))), requires_grad)


def upload(host: torch.Tensor) -> Tensor:
    """Send a CPU tensor's bytes to the worker that will hold it (a private copy: the caller
    may change its array afterwards)."""
    host = host.contiguous().clone()
    rt = runtime()
    out = rt.new_id()
    sig = (host.shape, host.dtype)
    rt.dispatcher.upload(("upload", out, sig, 0, None), host)
    rt.note_site(out)
    return Tensor(out, sig)


def _default(dtype) -> torch.dtype:
    dtype = as_dtype(dtype)
    return torch.get_default_dtype() if dtype is None else dtype


def zeros(*size, dtype=None, requires_grad: bool = False, **kw: Any) -> Tensor:
    with_device(kw)
    return _grad(apply("zeros", _sizes(size), _default(dtype)), requires_grad)


def ones(*size, dtype=None, requires_grad: bool = False, **kw: Any) -> Tensor:
    with_device(kw)
    return _grad(apply("ones", _sizes(size), _default(dtype)), requires_grad)


def empty(*size, dtype=None, requires_grad: bool = False, **kw: Any) -> Tensor:
    """Zero-filled: a worker never hands out uninitialised memory."""
    return zeros(*size, dtype=dtype, requires_grad=requires_grad, **kw)


def full(size, fill_value, dtype=None, requires_grad: bool = False, **kw: Any) -> Tensor:
    with_device(kw)
    return _grad(apply("full", _sizes((size,)), fill_value, as_dtype(dtype)), requires_grad)


def arange(start, end=None, step=1, dtype=None, requires_grad: bool = False,
           **kw: Any) -> Tensor:
    with_device(kw)
    if end is None:
        start, end = 0, start
    return _grad(apply("arange", start, end, step, as_dtype(dtype)), requires_grad)


def eye(n: int, m: int | None = None, dtype=None, requires_grad: bool = False,
        **kw: Any) -> Tensor:
    with_device(kw)
    return _grad(apply("eye", n, n if m is None else m, _default(dtype)), requires_grad)


def randn(*size, dtype=None, requires_grad: bool = False, **kw: Any) -> Tensor:
    with_device(kw)
    return _grad(apply("randn", _sizes(size), _default(dtype), runtime().next_seed()), requires_grad)


def rand(*size, dtype=None, requires_grad: bool = False, **kw: Any) -> Tensor:
    with_device(kw)
    return _grad(apply("rand", _sizes(size), _default(dtype), runtime().next_seed()), requires_grad)


def randint(low: int, high: int | None = None, size=None, dtype=None, **kw: Any) -> Tensor:
    """torch.randint(high, size) or (low, high, size); int64 unless told."""
    with_device(kw)
    if size is None:
        low, high, size = 0, low, high
    return apply("randint", low, high, _sizes((size,)), as_dtype(dtype) or torch.int64,
                 runtime().next_seed())


def randperm(n: int, dtype=None, **kw: Any) -> Tensor:
    """A random permutation of 0..n-1 (int64 unless told), seeded as every random op is."""
    with_device(kw)
    return apply("randperm", int(n), as_dtype(dtype) or torch.int64, runtime().next_seed())


def linspace(start, end, steps: int, dtype=None, requires_grad: bool = False,
             **kw: Any) -> Tensor:
    """Made on the host and uploaded: a constant of a few numbers, as torch.linspace makes it."""
    with_device(kw)
    return _grad(upload(torch.linspace(start, end, steps, dtype=_default(dtype))),
                 requires_grad)


def multinomial(probs: Tensor, num_samples: int, replacement: bool = False) -> Tensor:
    return apply("multinomial", probs, num_samples, replacement, runtime().next_seed())


def _tensor_argument(fn: str, t: Any) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}(): argument 'input' (position 1) must be Tensor, not "
                        f"{type(t).__name__}")


def zeros_like(t: Tensor, dtype=None, **kw: Any) -> Tensor:
    with_device(kw)
    _tensor_argument("zeros_like", t)
    with beside(t):
        return zeros(t.shape, dtype=dtype or t.dtype)


def ones_like(t: Tensor, dtype=None, **kw: Any) -> Tensor:
    with_device(kw)
    _tensor_argument("ones_like", t)
    with beside(t):
        return ones(t.shape, dtype=dtype or t.dtype)


def empty_like(t: Tensor, dtype=None, **kw: Any) -> Tensor:
    return zeros_like(t, dtype, **kw)


def full_like(t: Tensor, fill_value, dtype=None, **kw: Any) -> Tensor:
    with_device(kw)
    _tensor_argument("full_like", t)
    with beside(t):
        return full(t.shape, fill_value, dtype=dtype or t.dtype)


def randn_like(t: Tensor, dtype=None, **kw: Any) -> Tensor:
    with_device(kw)
    _tensor_argument("randn_like", t)
    with beside(t):
        return randn(t.shape, dtype=dtype or t.dtype)


def rand_like(t: Tensor, dtype=None, **kw: Any) -> Tensor:
    with_device(kw)
    with beside(t):
        return rand(t.shape, dtype=dtype or t.dtype)


def beside(t: Tensor):
    """torch's *_like keep the device; here: made where t lives, laid out like it."""
    return runtime().dispatcher.placer.beside(t.id)


def manual_seed(seed: int) -> None:
    """Random ops after this give the same numbers on every run, whatever the worker count."""
    runtime().manual_seed(seed)
