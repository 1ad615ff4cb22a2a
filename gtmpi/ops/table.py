"""The op vocabulary: every tensor op gtmpi knows, one row each.

Each layer reads this one table. The client infers shapes by running a row's kernel on meta
tensors (ops/shapes.py); the worker runs the same kernel on real tensors (worker/executor.py).
Gradient and placement rules join the table as further columns, keyed by the same names.

A kernel takes torch tensors and plain constants positionally (plus keyword constants) and
returns a tensor or a tuple of tensors. Kernels of kind CREATE also get ``device=``, kernels of
kind COMM the worker's data plane as ``plane=``.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch
import torch.nn.functional as F


class Kind(Enum):
    CREATE = "create"            # no tensor inputs; needs the worker's device
    ELEMENTWISE = "elementwise"  # broadcasting pointwise math
    REDUCE = "reduce"            # reduces or normalises along dims
    MATMUL = "matmul"
    SHAPE = "shape"              # moves or views data without arithmetic
    INDEX = "index"
    INPLACE = "inplace"          # writes into its first operand; result id is that operand's
    COMM = "comm"                # between workers (worker.dataplane); inserted by placement


@dataclass(frozen=True)
class Op:
    name: str
    kind: Kind
    kernel: Callable[..., Any]
    # Python scalar operands change only the result dtype, never its shape, so the shape cache
    # may key them by type rather than value (x * 2.0 and x * 3.0 share one entry).
    scalar_by_type: bool = False
    # Evaluated on meta tensors instead of the kernel, where the kernel cannot run on meta.
    meta: Callable[..., Any] | None = None


def _seeded(sample: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A random op whose values depend only on (seed, shape, dtype): the same on every run,
    whatever the number of workers, because each op carries its own seed."""
    def kernel(shape, dtype, seed, device):
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return sample(shape, dtype=dtype, device=device, generator=gen)
    return kernel


def _meta_empty(shape, dtype, seed, device):
    return torch.empty(shape, dtype=dtype, device=device)


def index_key(template: tuple, tensors: tuple) -> tuple:
    """Rebuild an index key: the string "T" stands for the next index tensor, in order."""
    it = iter(tensors)
    return tuple(next(it) if item == "T" else item for item in template)


def _getitem(x, *tensors, key):
    return x[index_key(key, tensors)]


def _setitem(x, value, *tensors, key):
    x[index_key(key, tensors)] = value
    return x


def _copy(x, src):
    return x.copy_(src)


def _sgd_step(p, g, buf, lr, momentum, dampening, weight_decay, nesterov, first):
    """torch.optim.SGD's update of one parameter, in place (buf: the momentum buffer)."""
    if weight_decay:
        g = g.add(p, alpha=weight_decay)
    if momentum:
        if first:
            buf.copy_(g)
        else:
            buf.mul_(momentum).add_(g, alpha=1 - dampening)
        g = g.add(buf, alpha=momentum) if nesterov else buf
    return p.add_(g, alpha=-lr)


def _adam_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, decoupled, step):
    """torch.optim.Adam's (decoupled: AdamW's) update of one parameter, in place."""
    if weight_decay and decoupled:
        p.mul_(1 - lr * weight_decay)
    elif weight_decay:
        g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    return p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))


def _torch_grad(fn, x, g):
    """g pulled back through fn at x by torch's own autograd on the worker: one instruction
    for gradients torch computes better than a chain of ours."""
    with torch.enable_grad():
        leaf = x.detach().requires_grad_()
        (grad,) = torch.autograd.grad(fn(leaf), leaf, g)
    return grad


def _cross_entropy_grad(g, x, target, ignore_index, reduction, label_smoothing):
    """d cross_entropy / d logits."""
    return _torch_grad(lambda logits: F.cross_entropy(
        logits, target, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing), x, g)


def _getitem_grad(g, *tensors, key, shape):
    """The gradient of x[key] for x of ``shape``: g scattered back, repeated indices summed."""
    return _torch_grad(lambda base: base[index_key(key, tensors)],
                       torch.zeros(shape, dtype=g.dtype, device=g.device), g)


_ops = [
    # creation
    Op("zeros", Kind.CREATE, lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device)),
    Op("ones", Kind.CREATE, lambda shape, dtype, device: torch.ones(shape, dtype=dtype, device=device)),
    Op("full", Kind.CREATE, lambda shape, value, dtype, device: torch.full(shape, value, dtype=dtype, device=device)),
    Op("arange", Kind.CREATE,
       lambda start, end, step, dtype, device: torch.arange(start, end, step, dtype=dtype, device=device)),
    Op("eye", Kind.CREATE, lambda n, m, dtype, device: torch.eye(n, m, dtype=dtype, device=device)),
    Op("randn", Kind.CREATE, _seeded(torch.randn), meta=_meta_empty),
    Op("rand", Kind.CREATE, _seeded(torch.rand), meta=_meta_empty),
    # elementwise: Python operators so that a scalar may stand on either side (2.0 - x)
    *(Op(name, Kind.ELEMENTWISE, fn, scalar_by_type=True) for name, fn in [
        ("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
        ("truediv", operator.truediv), ("floordiv", operator.floordiv), ("mod", operator.mod),
        ("pow", operator.pow), ("lt", operator.lt), ("le", operator.le), ("gt", operator.gt),
        ("ge", operator.ge), ("eq", operator.eq), ("ne", operator.ne), ("and", operator.and_),
        ("or", operator.or_), ("xor", operator.xor), ("invert", operator.invert),
        ("neg", operator.neg), ("abs", torch.abs), ("exp", torch.exp), ("log", torch.log),
        ("sqrt", torch.sqrt), ("rsqrt", torch.rsqrt), ("sin", torch.sin), ("cos", torch.cos),
        ("tanh", torch.tanh), ("sigmoid", torch.sigmoid), ("relu", torch.relu),
        ("gelu", F.gelu), ("silu", F.silu), ("where", torch.where), ("clamp", torch.clamp),
        ("maximum", torch.maximum), ("minimum", torch.minimum), ("sign", torch.sign),
    ]),
    Op("gelu_grad", Kind.ELEMENTWISE,
       lambda g, x, approximate="none": torch.ops.aten.gelu_backward(g, x, approximate=approximate)),
    Op("to", Kind.ELEMENTWISE, lambda x, dtype: x.to(dtype)),
    Op("matmul", Kind.MATMUL, operator.matmul),
    Op("linear", Kind.MATMUL, F.linear),
    Op("cross_entropy", Kind.REDUCE, lambda x, target, ignore_index, reduction, label_smoothing:
       F.cross_entropy(x, target, ignore_index=ignore_index, reduction=reduction,
                       label_smoothing=label_smoothing)),
    Op("cross_entropy_grad", Kind.REDUCE, _cross_entropy_grad,
       meta=lambda g, x, *rest: torch.empty_like(x)),
    # reductions over all elements (dim=None) or over dims
    Op("sum", Kind.REDUCE, lambda x, dim, keepdim: x.sum(dim=dim, keepdim=keepdim)),
    Op("mean", Kind.REDUCE, lambda x, dim, keepdim: x.mean(dim=dim, keepdim=keepdim)),
    Op("amax", Kind.REDUCE, lambda x, dim, keepdim: x.amax(dim=() if dim is None else dim, keepdim=keepdim)),
    Op("amin", Kind.REDUCE, lambda x, dim, keepdim: x.amin(dim=() if dim is None else dim, keepdim=keepdim)),
    Op("max_dim", Kind.REDUCE, lambda x, dim, keepdim: tuple(torch.max(x, dim, keepdim))),
    Op("min_dim", Kind.REDUCE, lambda x, dim, keepdim: tuple(torch.min(x, dim, keepdim))),
    Op("argmax", Kind.REDUCE, lambda x, dim, keepdim: torch.argmax(x, dim, keepdim)),
    Op("argmin", Kind.REDUCE, lambda x, dim, keepdim: torch.argmin(x, dim, keepdim)),
    Op("var", Kind.REDUCE,
       lambda x, dim, correction, keepdim: torch.var(x, dim, correction=correction, keepdim=keepdim)),
    Op("std", Kind.REDUCE,
       lambda x, dim, correction, keepdim: torch.std(x, dim, correction=correction, keepdim=keepdim)),
    Op("softmax", Kind.REDUCE, lambda x, dim: torch.softmax(x, dim)),
    Op("log_softmax", Kind.REDUCE, lambda x, dim: torch.log_softmax(x, dim)),
    # shape
    Op("reshape", Kind.SHAPE, torch.reshape),
    Op("view", Kind.SHAPE, lambda x, shape: x.view(shape)),
    Op("permute", Kind.SHAPE, torch.permute),
    Op("transpose", Kind.SHAPE, torch.transpose),
    Op("squeeze", Kind.SHAPE, lambda x, dim: x.squeeze() if dim is None else x.squeeze(dim)),
    Op("unsqueeze", Kind.SHAPE, torch.unsqueeze),
    Op("flatten", Kind.SHAPE, torch.flatten),
    Op("expand", Kind.SHAPE, lambda x, shape: x.expand(shape)),
    Op("contiguous", Kind.SHAPE, lambda x: x.contiguous()),
    Op("clone", Kind.SHAPE, torch.clone),
    # a second id for the same worker tensor (detach: shares storage, as in torch)
    Op("alias", Kind.SHAPE, lambda x: x),
    Op("cat", Kind.SHAPE, lambda *xs, dim: torch.cat(xs, dim)),
    Op("stack", Kind.SHAPE, lambda *xs, dim: torch.stack(xs, dim)),
    Op("split", Kind.SHAPE, lambda x, sections, dim: tuple(torch.split(x, sections, dim))),
    Op("chunk", Kind.SHAPE, lambda x, chunks, dim: tuple(torch.chunk(x, chunks, dim))),
    Op("narrow", Kind.SHAPE, lambda x, dim, start, length: x.narrow(dim, start, length).contiguous()),
    # indexing
    Op("getitem", Kind.INDEX, _getitem),
    Op("getitem_grad", Kind.INDEX, _getitem_grad,
       meta=lambda g, *tensors, key, shape: torch.empty(shape, dtype=g.dtype, device=g.device)),
    # in place: the result is the first operand, mutated (views on a worker alias as in torch)
    Op("setitem", Kind.INPLACE, _setitem),
    Op("iadd", Kind.INPLACE, operator.iadd, scalar_by_type=True),
    Op("isub", Kind.INPLACE, operator.isub, scalar_by_type=True),
    Op("imul", Kind.INPLACE, operator.imul, scalar_by_type=True),
    Op("itruediv", Kind.INPLACE, operator.itruediv, scalar_by_type=True),
    Op("zero_", Kind.INPLACE, torch.Tensor.zero_),
    Op("fill_", Kind.INPLACE, torch.Tensor.fill_, scalar_by_type=True),
    Op("copy_", Kind.INPLACE, _copy),
    # optimizer updates: one instruction per parameter; hyper-parameters and the step count
    # change every step, so the shape cache keys them by type
    Op("sgd_step", Kind.INPLACE, _sgd_step, scalar_by_type=True),
    Op("adam_step", Kind.INPLACE, _adam_step, scalar_by_type=True),
]

# between workers: inserted by the dispatcher where placements need them, never by the client
# (shape and dtype, of the whole tensor, let a worker whose operand failed still take part)
_ops += [
    Op("all_reduce", Kind.COMM, lambda x, group, shape, dtype, plane: plane.all_reduce(x, group)),
    Op("all_reduce_", Kind.COMM,
       lambda x, group, shape, dtype, plane: plane.all_reduce(x, group, inplace=True)),
    Op("all_gather", Kind.COMM, lambda x, group, dim, sizes, shape, dtype, plane:
       plane.all_gather(x, group, dim, sizes)),
    Op("reduce_scatter", Kind.COMM, lambda x, group, dim, sizes, index, shape, dtype, plane:
       plane.reduce_scatter(x, group, dim, sizes, index)),
    Op("all_to_all", Kind.COMM,
       lambda x, group, src, dst, src_sizes, dst_sizes, index, shape, dtype, plane:
       plane.all_to_all(x, group, src, dst, src_sizes, dst_sizes, index)),
    Op("send", Kind.COMM, lambda x, dst, shape, dtype, plane: plane.send(x, dst)),
    Op("recv", Kind.COMM, lambda shape, dtype, src, plane: plane.recv(shape, dtype, src)),
]

OPS: dict[str, Op] = {op.name: op for op in _ops}
assert len(OPS) == len(_ops), "duplicate op name in the table"
