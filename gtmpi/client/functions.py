"""torch-style free functions (gtmpi.exp(x), gtmpi.cat([...]), ...), all through tensor.apply."""
from __future__ import annotations

import builtins
from typing import Any, Sequence

import torch

from .tensor import Dims, MinMax, Operand, Sort, Tensor, TopK, apply


def _unary(name: str):
    def fn(x: Tensor) -> Tensor:
        return apply(name, x)
    fn.__name__ = name
    return fn


exp, log, sqrt, rsqrt = _unary("exp"), _unary("log"), _unary("sqrt"), _unary("rsqrt")
sin, cos, tanh, sigmoid = _unary("sin"), _unary("cos"), _unary("tanh"), _unary("sigmoid")
abs, neg = _unary("abs"), _unary("neg")


def relu(x: Tensor, inplace: bool = False) -> Tensor:
    return x.relu_() if inplace else apply("relu", x)


def silu(x: Tensor, inplace: bool = False) -> Tensor:
    return x.copy_(apply("silu", x)) if inplace else apply("silu", x)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return apply("gelu", x, approximate=approximate) if approximate != "none" else apply("gelu", x)


def softmax(x: Tensor, dim: int, dtype: torch.dtype | None = None) -> Tensor:
    """``dtype``: the input is cast to it first, as torch's (a bfloat16 input's softmax in
    float32)."""
    return x.softmax(dim, dtype)


def log_softmax(x: Tensor, dim: int, dtype: torch.dtype | None = None) -> Tensor:
    return x.log_softmax(dim, dtype)


def outer(a: Tensor, b: Tensor) -> Tensor:
    return a.outer(b)


def _method(name: str):
    """gtmpi.NAME(x, ...) for the Tensor method x.NAME(...)."""
    def fn(x: Tensor, *args: Any, **kw: Any) -> Any:
        return getattr(x, name)(*args, **kw)
    fn.__name__ = name
    return fn


(tile, broadcast_to, log2, log10, exp2, sinh, cosh, frac, logaddexp, logit, xlogy, signbit,
 heaviside, nan_to_num, remainder, floor_divide, fmod, count_nonzero, aminmax, diff, dot, inner,
 take_along_dim, diagonal, var_mean, std_mean, kthvalue, median) = map(_method, (
    "tile", "broadcast_to", "log2", "log10", "exp2", "sinh", "cosh", "frac", "logaddexp",
    "logit", "xlogy", "signbit", "heaviside", "nan_to_num", "remainder", "floor_divide", "fmod",
    "count_nonzero", "aminmax", "diff", "dot", "inner", "take_along_dim", "diagonal",
    "var_mean", "std_mean", "kthvalue", "median"))


def bernoulli(p: Tensor, *, generator: Any = None) -> Tensor:
    """1 with each element's probability, else 0 (the workers' draws, not torch's)."""
    from .creation import rand, rand_like
    drawn = rand_like(p) if generator is None else \
        rand(*p.shape, dtype=p.dtype, generator=generator, device=p.device)
    return (drawn < p).to(p.dtype)


cumprod, cummax, cummin = _method("cumprod"), _method("cummax"), _method("cummin")


def searchsorted(sorted_sequence: Tensor, values: Operand, *, out_int32: bool = False,
                 right: bool = False, side: str | None = None) -> Tensor:
    """Where each value would go in the sorted last dimension (torch's kernel)."""
    if side is not None:
        right = side == "right"
    return apply("searchsorted", sorted_sequence, values, out_int32, right)


def bucketize(values: Tensor, boundaries: Tensor, *, out_int32: bool = False,
              right: bool = False) -> Tensor:
    """Each value's bucket among 1-D ``boundaries`` (searchsorted with the roles swapped)."""
    return searchsorted(boundaries, values, out_int32=out_int32, right=right)


def broadcast_tensors(*tensors: Tensor) -> tuple[Tensor, ...]:
    shape = torch.broadcast_shapes(*(tuple(t.shape) for t in tensors))
    return tuple(t.expand(*shape) for t in tensors)


def hstack(tensors: Sequence[Tensor]) -> Tensor:
    return cat(list(tensors), 0 if tensors[0].dim() == 1 else 1)


def vstack(tensors: Sequence[Tensor]) -> Tensor:
    return cat([t.reshape(1, -1) if t.dim() < 2 else t for t in tensors], 0)


def column_stack(tensors: Sequence[Tensor]) -> Tensor:
    return cat([t.reshape(-1, 1) if t.dim() < 2 else t for t in tensors], 1)


def clamp_min(x: Tensor, min: Operand) -> Tensor:
    return x.clamp_min(min)


def clamp_max(x: Tensor, max: Operand) -> Tensor:
    return x.clamp_max(max)


def movedim(x: Tensor, source: int | Sequence[int], destination: int | Sequence[int]) -> Tensor:
    return x.movedim(source, destination)


moveaxis = movedim


def swapaxes(x: Tensor, axis0: int, axis1: int) -> Tensor:
    return x.swapaxes(axis0, axis1)


swapdims = swapaxes


def masked_select(x: Tensor, mask: Tensor) -> Tensor:
    return x.masked_select(mask)


def addcmul(x: Tensor, tensor1: Operand, tensor2: Operand, *, value: float = 1) -> Tensor:
    return x.addcmul(tensor1, tensor2, value=value)


def addcdiv(x: Tensor, tensor1: Operand, tensor2: Operand, *, value: float = 1) -> Tensor:
    return x.addcdiv(tensor1, tensor2, value=value)


def isclose(a: Tensor, b: Operand, rtol: float = 1e-05, atol: float = 1e-08,
            equal_nan: bool = False) -> Tensor:
    return a.isclose(b, rtol, atol, equal_nan)


def logical_xor(a: Tensor, b: Operand) -> Tensor:
    return a.logical_xor(b)


def meshgrid(*tensors: Tensor | Sequence[Tensor], indexing: str = "ij") -> tuple[Tensor, ...]:
    """Each 1-D tensor viewed along its own dimension and expanded to the grid ('xy': the first
    two dimensions swapped, as numpy's)."""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    if indexing not in ("ij", "xy"):
        raise ValueError(f'torch.meshgrid: indexing must be one of "xy" or "ij", but received: '
                         f"{indexing}")
    n = len(tensors)
    order = list(range(n))
    if indexing == "xy" and n >= 2:
        order[0], order[1] = 1, 0
    shape = [tensors[order[d]].numel() for d in range(n)]
    grids = []
    for i, t in enumerate(tensors):
        at = order.index(i)
        grids.append(t.reshape(*[-1 if d == at else 1 for d in range(n)]).expand(*shape))
    return tuple(grids)


def cdist(x1: Tensor, x2: Tensor, p: float = 2.0) -> Tensor:
    """The p-norm distance of each row of x1 to each row of x2 (batched), as torch's exact
    form computes it (not its matrix-product shortcut for large inputs)."""
    diff = (x1.unsqueeze(-2) - x2.unsqueeze(-3)).abs()
    if p == 2.0:
        return (diff * diff).sum(-1).sqrt()
    if p == 1.0:
        return diff.sum(-1)
    if p == float("inf"):
        return diff.amax(-1)
    return (diff ** p).sum(-1) ** (1.0 / p)


def diag(x: Tensor, diagonal: int = 0) -> Tensor:
    """A vector's square matrix, or a matrix's main diagonal (the others: not yet)."""
    if diagonal != 0:
        raise NotImplementedError("gtmpi.diag: only the main diagonal (diagonal=0) so far")
    if x.dim() == 1:
        from .creation import eye
        return eye(x.shape[0], dtype=x.dtype, device=x.device) * x
    if x.dim() == 2:
        n = builtins.min(x.shape)
        return x[:n, :n].reshape(-1)[::n + 1]
    raise RuntimeError(f"diag(): Supports 1D or 2D tensors. Got {x.dim()}D")


def lerp(a: Tensor, end: Operand, weight: Operand) -> Tensor:
    return a.lerp(end, weight)


def argsort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> Tensor:
    return x.argsort(dim, descending, stable)


def repeat_interleave(x: Tensor, repeats: int, dim: int | None = None) -> Tensor:
    return x.repeat_interleave(repeats, dim)


def nonzero(x: Tensor, *, as_tuple: bool = False) -> Tensor | tuple[Tensor, ...]:
    return x.nonzero(as_tuple=as_tuple)


def unique(x: Tensor, sorted: bool = True, return_inverse: bool = False,
           return_counts: bool = False, dim: int | None = None) -> Tensor | tuple[Tensor, ...]:
    return x.unique(sorted, return_inverse, return_counts, dim)


def matmul(a: Operand, b: Operand) -> Tensor:
    return apply("matmul", a, b)


def where(condition: Operand, x: Operand, y: Operand) -> Tensor:
    return apply("where", condition, x, y)


def clamp(x: Tensor, min: Operand | None = None, max: Operand | None = None) -> Tensor:
    return apply("clamp", x, min, max)


clip = clamp


def maximum(a: Operand, b: Operand) -> Tensor:
    return apply("maximum", a, b)


def minimum(a: Operand, b: Operand) -> Tensor:
    return apply("minimum", a, b)


def cat(tensors: Sequence[Tensor], dim: int = 0, *, axis: int | None = None) -> Tensor:
    """torch's cat; GT's ``axis=`` names the dim too."""
    return apply("cat", *tensors, dim=dim if axis is None else axis)


concatenate = cat


def stack(tensors: Sequence[Tensor], dim: int = 0, *, axis: int | None = None) -> Tensor:
    return apply("stack", *tensors, dim=dim if axis is None else axis)


def split(x: Tensor, split_size_or_sections: int | Sequence[int] | None = None, dim: int = 0,
          **gt: Any) -> tuple[Tensor, ...]:
    return x.split(split_size_or_sections, dim, **gt)


def chunk(x: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    return x.chunk(chunks, dim)


def reshape(x: Tensor, shape: Sequence[int]) -> Tensor:
    return x.reshape(shape)


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    return x.transpose(dim0, dim1)


def permute(x: Tensor, dims: Sequence[int]) -> Tensor:
    return x.permute(dims)


def squeeze(x: Tensor, dim: Dims = None) -> Tensor:
    return x.squeeze(dim)


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    return x.unsqueeze(dim)


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    return x.flatten(start_dim, end_dim)


def sum(x: Tensor, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor:
    return x.sum(dim, keepdim, **kw)


def mean(x: Tensor, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor:
    return x.mean(dim, keepdim, **kw)


def max(x: Tensor, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor | MinMax:
    return x.max(dim, keepdim, **kw)


def min(x: Tensor, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor | MinMax:
    return x.min(dim, keepdim, **kw)


def argmax(x: Tensor, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor:
    return x.argmax(dim, keepdim, **kw)


def argmin(x: Tensor, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor:
    return x.argmin(dim, keepdim, **kw)


def var(x: Tensor, dim: Dims = None, unbiased: bool | None = None, keepdim: bool = False,
        **kw: Any) -> Tensor:
    return x.var(dim, unbiased, keepdim, **kw)


def std(x: Tensor, dim: Dims = None, unbiased: bool | None = None, keepdim: bool = False,
        **kw: Any) -> Tensor:
    return x.std(dim, unbiased, keepdim, **kw)


floor, ceil, round, trunc = _unary("floor"), _unary("ceil"), _unary("round"), _unary("trunc")
sign, erf, log1p, expm1 = _unary("sign"), _unary("erf"), _unary("log1p"), _unary("expm1")
tan, asin, acos, atan = _unary("tan"), _unary("asin"), _unary("acos"), _unary("atan")
lgamma, digamma = _unary("lgamma"), _unary("digamma")
arcsin, arccos, arctan = asin, acos, atan


def atan2(a: Tensor, b: Operand) -> Tensor:
    return a.atan2(b)


arctan2 = atan2


def hypot(a: Tensor, b: Operand) -> Tensor:
    return a.hypot(b)
reciprocal, square, logical_not = _unary("reciprocal"), _unary("square"), _unary("logical_not")
isnan, isinf, isfinite = _unary("isnan"), _unary("isinf"), _unary("isfinite")


def logical_and(a: Operand, b: Operand) -> Tensor:
    return apply("logical_and", a, b)


def logical_or(a: Operand, b: Operand) -> Tensor:
    return apply("logical_or", a, b)


def masked_fill(x: Tensor, mask: Operand, value: Operand) -> Tensor:
    return x.masked_fill(mask, value)


def tril(x: Tensor, diagonal: int = 0) -> Tensor:
    return x.tril(diagonal)


def triu(x: Tensor, diagonal: int = 0) -> Tensor:
    return x.triu(diagonal)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    if a.ndim != 3 or b.ndim != 3:
        raise RuntimeError("batch1 must be a 3D tensor" if a.ndim != 3 else
                           "batch2 must be a 3D tensor")
    return apply("matmul", a, b)


def mm(a: Tensor, b: Tensor) -> Tensor:
    if a.ndim != 2 or b.ndim != 2:
        raise RuntimeError("self must be a matrix" if a.ndim != 2 else "mat2 must be a matrix")
    return apply("matmul", a, b)


def einsum(equation: str, *operands: Tensor | Sequence[Tensor]) -> Tensor:
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    return apply("einsum", *operands, equation=equation)


def gather(x: Tensor, dim: int, index: Tensor) -> Tensor:
    return x.gather(dim, index)


def index_select(x: Tensor, dim: int, index: Tensor) -> Tensor:
    return x.index_select(dim, index)


def topk(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> TopK:
    return x.topk(k, dim, largest, sorted)


def sort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> Sort:
    return x.sort(dim, descending, stable)


def cumsum(x: Tensor, dim: int) -> Tensor:
    return x.cumsum(dim)


def prod(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    return x.prod(dim, keepdim)


def logsumexp(x: Tensor, dim: Dims, keepdim: bool = False) -> Tensor:
    return x.logsumexp(dim, keepdim)


def norm(x: Tensor, p: float | str = "fro", dim: Dims = None, keepdim: bool = False) -> Tensor:
    return x.norm(p, dim, keepdim)


def any(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    return x.any(dim, keepdim)


def all(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    return x.all(dim, keepdim)


def flip(x: Tensor, dims: Sequence[int]) -> Tensor:
    return x.flip(dims)


def roll(x: Tensor, shifts: int | Sequence[int], dims: Dims = None) -> Tensor:
    return x.roll(shifts, dims)


def unbind(x: Tensor, dim: int = 0) -> tuple[Tensor, ...]:
    return x.unbind(dim)


def allclose(a: Operand, b: Operand, rtol: float = 1e-5, atol: float = 1e-8,
             equal_nan: bool = False) -> bool:
    """A read of both: the answer is a Python bool, as in torch."""
    return torch.allclose(_host(a), _host(b), rtol, atol, equal_nan)


def equal(a: Operand, b: Operand) -> bool:
    return torch.equal(_host(a), _host(b))


def _host(x) -> torch.Tensor:
    return x.cpu_torch() if isinstance(x, Tensor) else torch.as_tensor(x)


def is_tensor(x: Any) -> bool:
    return isinstance(x, Tensor)


def addmm(input: Operand, mat1: Tensor, mat2: Tensor, *, beta: float = 1,
          alpha: float = 1) -> Tensor:
    """beta * input + alpha * (mat1 @ mat2), composed: each part keeps its own gradient."""
    return _scaled_sum(input, mm(mat1, mat2), beta, alpha)


def baddbmm(input: Operand, batch1: Tensor, batch2: Tensor, *, beta: float = 1,
            alpha: float = 1) -> Tensor:
    return _scaled_sum(input, bmm(batch1, batch2), beta, alpha)


def _scaled_sum(input, product: Tensor, beta: float, alpha: float) -> Tensor:
    return (input if beta == 1 else input * beta) + (product if alpha == 1 else product * alpha)


def scatter(x: Tensor, dim: int, index: Tensor, src: Operand) -> Tensor:
    return x.scatter(dim, index, src)


def scatter_add(x: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    return x.scatter_add(dim, index, src)
