"""torch-style free functions (gtmpi.exp(x), gtmpi.cat([...]), ...), all through tensor.apply."""
from __future__ import annotations

from typing import Sequence

from .tensor import Tensor, apply


def _unary(name: str):
    def fn(x: Tensor) -> Tensor:
        return apply(name, x)
    fn.__name__ = name
    return fn


exp, log, sqrt, rsqrt = _unary("exp"), _unary("log"), _unary("sqrt"), _unary("rsqrt")
sin, cos, tanh, sigmoid = _unary("sin"), _unary("cos"), _unary("tanh"), _unary("sigmoid")
relu, silu, abs, neg = _unary("relu"), _unary("silu"), _unary("abs"), _unary("neg")


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return apply("gelu", x, approximate=approximate) if approximate != "none" else apply("gelu", x)


def softmax(x: Tensor, dim: int) -> Tensor:
    return apply("softmax", x, dim)


def log_softmax(x: Tensor, dim: int) -> Tensor:
    return apply("log_softmax", x, dim)


def matmul(a, b) -> Tensor:
    return apply("matmul", a, b)


def where(condition, x, y) -> Tensor:
    return apply("where", condition, x, y)


def clamp(x: Tensor, min=None, max=None) -> Tensor:
    return apply("clamp", x, min, max)


clip = clamp


def maximum(a, b) -> Tensor:
    return apply("maximum", a, b)


def minimum(a, b) -> Tensor:
    return apply("minimum", a, b)


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    return apply("cat", *tensors, dim=dim)


concatenate = cat


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    return apply("stack", *tensors, dim=dim)


def split(x: Tensor, split_size_or_sections, dim: int = 0) -> tuple[Tensor, ...]:
    return x.split(split_size_or_sections, dim)


def chunk(x: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    return x.chunk(chunks, dim)


def reshape(x: Tensor, shape) -> Tensor:
    return x.reshape(shape)


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    return x.transpose(dim0, dim1)


def permute(x: Tensor, dims) -> Tensor:
    return x.permute(dims)


def squeeze(x: Tensor, dim=None) -> Tensor:
    return x.squeeze(dim)


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    return x.unsqueeze(dim)


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    return x.flatten(start_dim, end_dim)


def sum(x: Tensor, dim=None, keepdim: bool = False, **kw) -> Tensor:
    return x.sum(dim, keepdim, **kw)


def mean(x: Tensor, dim=None, keepdim: bool = False, **kw) -> Tensor:
    return x.mean(dim, keepdim, **kw)


def max(x: Tensor, dim=None, keepdim: bool = False, **kw):
    return x.max(dim, keepdim, **kw)


def min(x: Tensor, dim=None, keepdim: bool = False, **kw):
    return x.min(dim, keepdim, **kw)


def argmax(x: Tensor, dim=None, keepdim: bool = False, **kw) -> Tensor:
    return x.argmax(dim, keepdim, **kw)


def argmin(x: Tensor, dim=None, keepdim: bool = False, **kw) -> Tensor:
    return x.argmin(dim, keepdim, **kw)


def var(x: Tensor, dim=None, unbiased=None, keepdim: bool = False, **kw) -> Tensor:
    return x.var(dim, unbiased, keepdim, **kw)


def std(x: Tensor, dim=None, unbiased=None, keepdim: bool = False, **kw) -> Tensor:
    return x.std(dim, unbiased, keepdim, **kw)
