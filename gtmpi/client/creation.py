"""Creating tensors: from host data (uploaded as raw bytes) or made on the worker."""
from __future__ import annotations

import math
from contextlib import AbstractContextManager
from typing import Any, Sequence, Union

import numpy as np
import torch

from . import host
from .dtypes import DTypeLike, as_dtype
from .generator import Generator, host_generator, worker_seed
from .runtime import runtime
from .tensor import Tensor, _sizes, apply, constant, filled, from_data, hold, with_device

Drawer = Union[Generator, torch.Generator, None]  # what random draws take as generator=


def _grad(t: Tensor, requires_grad: bool) -> Tensor:
    return t.requires_grad_() if requires_grad else t


def tensor(data: Any, dtype: DTypeLike = None, requires_grad: bool = False, **kw: Any) -> Tensor:
    """Like torch.tensor: copies ``data`` (nested lists, scalars, numpy, torch, gtmpi)."""
    return from_data(data, dtype, requires_grad, kw)


def from_numpy(array: np.ndarray, requires_grad: bool = False) -> Tensor:
    """torch's from_numpy (a copy, not a view of the array); GT's ``requires_grad=`` too."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected np.ndarray (got {type(array).__name__})")
    return _grad(hold(torch.from_numpy(np.array(array, order="C")), None), requires_grad)


def _drawn(make, name: str, args: tuple, device, generator: Any = None) -> Tensor:
    """A random tensor: drawn from torch's CPU generator where torch would draw it there (no
    device, or the CPU), so that torch.manual_seed gives torch's numbers; from a worker's
    generator, seeded per op, on a GPU."""
    rt = runtime()
    if host.allowed(rt, device) and not isinstance(generator, Generator) and \
            not host.varying(rt):
        return hold(make(), device)
    return apply(name, *args, worker_seed(generator))


def _default(dtype) -> torch.dtype:
    dtype = as_dtype(dtype)
    return torch.get_default_dtype() if dtype is None else dtype


def zeros(*size: int, dtype: DTypeLike = None, requires_grad: bool = False, **kw: Any) -> Tensor:
    return filled("zeros", size, _default(dtype), requires_grad, kw)


def ones(*size: int, dtype: DTypeLike = None, requires_grad: bool = False, **kw: Any) -> Tensor:
    return filled("ones", size, _default(dtype), requires_grad, kw)


def empty(*size: int, dtype: DTypeLike = None, requires_grad: bool = False, **kw: Any) -> Tensor:
    """Zero-filled: a worker never hands out uninitialised memory. Held by the client at any
    size where torch would make it on the CPU, inside a signal's scope too: a parameter's
    storage, which torch's init functions then fill with torch's numbers (nn.Linear,
    nn.Embedding), and which the signal places when it is first used."""
    device, shape, dtype = with_device(kw), _sizes(size), _default(dtype)
    rt = runtime()
    if host.allowed(rt, device):
        where = "meta" if host.meta(rt, math.prod(shape)) else "cpu"
        return _grad(Tensor.held(torch.zeros(shape, dtype=dtype, device=where),
                                 ("zeros", shape, dtype), host.scope(rt, (shape, dtype))),
                     requires_grad)
    return zeros(shape, dtype=dtype, requires_grad=requires_grad, device=device)


def full(size: Sequence[int], fill_value: float, dtype: DTypeLike = None,
         requires_grad: bool = False, **kw: Any) -> Tensor:
    return filled("full", (size,), as_dtype(dtype), requires_grad, kw, fill_value)


def arange(start: float, end: float | None = None, step: float = 1, dtype: DTypeLike = None,
           requires_grad: bool = False, **kw: Any) -> Tensor:
    device, dtype = with_device(kw), as_dtype(dtype)
    if end is None:
        start, end = 0, start
    count = max(0, math.ceil((end - start) / step)) if step else 0
    return _grad(constant("arange", lambda: torch.arange(start, end, step, dtype=dtype),
                          (start, end, step, dtype), device, count), requires_grad)


def eye(n: int, m: int | None = None, dtype: DTypeLike = None, requires_grad: bool = False,
        **kw: Any) -> Tensor:
    device, dtype, m = with_device(kw), _default(dtype), n if m is None else m
    return _grad(constant("eye", lambda: torch.eye(n, m, dtype=dtype), (n, m, dtype), device,
                          n * m), requires_grad)


def randn(*size: int, dtype: DTypeLike = None, requires_grad: bool = False,
          generator: Drawer = None, **kw: Any) -> Tensor:
    device, shape, dtype = with_device(kw), _sizes(size), _default(dtype)
    return _grad(_drawn(lambda: torch.randn(shape, dtype=dtype, generator=host_generator(
        generator)), "randn", (shape, dtype), device, generator), requires_grad)


def rand(*size: int, dtype: DTypeLike = None, requires_grad: bool = False,
         generator: Drawer = None, **kw: Any) -> Tensor:
    device, shape, dtype = with_device(kw), _sizes(size), _default(dtype)
    return _grad(_drawn(lambda: torch.rand(shape, dtype=dtype, generator=host_generator(
        generator)), "rand", (shape, dtype), device, generator), requires_grad)


def randint(low: int, high: int | None = None, size: Sequence[int] | None = None,
            dtype: DTypeLike = None, generator: Drawer = None, **kw: Any) -> Tensor:
    """torch.randint(high, size) or (low, high, size); int64 unless told."""
    device = with_device(kw)
    if size is None:
        low, high, size = 0, low, high
    shape, dtype = _sizes((size,)), as_dtype(dtype) or torch.int64
    return _drawn(lambda: torch.randint(low, high, shape, dtype=dtype,
                                        generator=host_generator(generator)),
                  "randint", (low, high, shape, dtype), device, generator)


def randperm(n: int, dtype: DTypeLike = None, generator: Drawer = None,
             **kw: Any) -> Tensor:
    """A random permutation of 0..n-1 (int64 unless told)."""
    device, dtype = with_device(kw), as_dtype(dtype) or torch.int64
    return _drawn(lambda: torch.randperm(int(n), dtype=dtype, generator=host_generator(generator)),
                  "randperm", (int(n), dtype), device, generator)


def linspace(start: float, end: float, steps: int, dtype: DTypeLike = None,
             requires_grad: bool = False, **kw: Any) -> Tensor:
    """Made on the host: a constant of a few numbers, as torch.linspace makes it."""
    device = with_device(kw)
    return _grad(hold(torch.linspace(start, end, steps, dtype=_default(dtype)), device),
                 requires_grad)


def multinomial(probs: Tensor, num_samples: int, replacement: bool = False, *,
                generator: Drawer = None) -> Tensor:
    """Drawn where ``probs`` lives: from torch's CPU generator (or ``generator``) for
    probabilities the client holds, else by the worker, seeded per op (or by ``generator``)."""
    if probs._host is not None and host.allowed(runtime()) and not isinstance(generator, Generator):
        return Tensor.held(torch.multinomial(probs._host, num_samples, replacement,
                                             generator=generator))
    return apply("multinomial", probs, num_samples, replacement, worker_seed(generator))


def _tensor_argument(fn: str, t: Any) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}(): argument 'input' (position 1) must be Tensor, not "
                        f"{type(t).__name__}")


def _like(fn: str, t: Any, dtype, kw: dict, name: str, *args: Any) -> Tensor:
    """torch's *_like keep t's device: made here (as ``name``'s function makes it) where the
    client holds t, else on t's workers, laid out like it."""
    with_device(kw)
    _tensor_argument(fn, t)
    dtype = as_dtype(dtype) or t.dtype
    if t._host is not None:
        return _MAKERS[name](t.shape, *args, dtype=dtype)
    with beside(t):
        seed = (worker_seed(),) if name in ("randn", "rand") else ()
        return apply(name, tuple(t.shape), *args, dtype, *seed)


def zeros_like(t: Tensor, dtype: DTypeLike = None, **kw: Any) -> Tensor:
    return _like("zeros_like", t, dtype, kw, "zeros")


def ones_like(t: Tensor, dtype: DTypeLike = None, **kw: Any) -> Tensor:
    return _like("ones_like", t, dtype, kw, "ones")


def empty_like(t: Tensor, dtype: DTypeLike = None, **kw: Any) -> Tensor:
    return zeros_like(t, dtype, **kw)


def full_like(t: Tensor, fill_value: float, dtype: DTypeLike = None, **kw: Any) -> Tensor:
    return _like("full_like", t, dtype, kw, "full", fill_value)


def randn_like(t: Tensor, dtype: DTypeLike = None, **kw: Any) -> Tensor:
    return _like("randn_like", t, dtype, kw, "randn")


def rand_like(t: Tensor, dtype: DTypeLike = None, **kw: Any) -> Tensor:
    return _like("rand_like", t, dtype, kw, "rand")


def beside(t: Tensor) -> AbstractContextManager:
    """Tensors made inside are laid out like t."""
    return runtime().dispatcher.placer.beside(t.id)


_MAKERS = {"zeros": zeros, "ones": ones, "full": full, "randn": randn, "rand": rand}


def manual_seed(seed: int) -> None:
    """torch's CPU generator (tensors the client draws) and every worker's random op after
    this: the same numbers on every run, whatever the worker count."""
    torch.manual_seed(seed)
    runtime().manual_seed(seed)
