"""The user's tensor: a handle to a logical tensor whose data lives on workers.

Every op infers the result's shape and dtype here (ops.shapes: torch's semantics, cached),
hands one instruction to the dispatcher and returns a new handle at once. Only reads
(numpy, item, tolist, repr, float, bool, ...) wait for workers.
"""
from __future__ import annotations

import builtins
import copy
import math
import numbers
import operator
import time
from collections import namedtuple
from contextlib import ExitStack
from typing import Any, Callable, Iterator, Sequence, Union

import numpy as np
import torch

from ..ops import OPS, Kind, infer
from ..ops.table import FUSED_FNS
from ..ops.shapes import RESTRIDING, SCALARS, VIEWS, signature_key, view_strides
from ..transport.buffers import NUMPY_DTYPES
from ..placement.types import Placement
from .dtypes import DTypeLike, as_dtype
from . import gradmode, host
from .generator import Generator, worker_seed
from .runtime import current, runtime

MinMax = namedtuple("MinMax", ["values", "indices"])
TopK = namedtuple("TopK", ["values", "indices"])
Sort = namedtuple("Sort", ["values", "indices"])
AMinMax = namedtuple("AMinMax", ["min", "max"])
_clock = time.perf_counter_ns
_CPU = torch.device("cpu")
Operand = Union["Tensor", bool, int, float, np.ndarray, torch.Tensor]
Dims = Union[int, Sequence[int], None]  # one dim, several, or all


class Tensor:
    __slots__ = ("_id", "_host", "_recipe", "_sig", "requires_grad", "grad", "_node", "_slot",
                 "_strides", "_state", "_scope", "_shared", "_version", "_aliased",
                 "__weakref__")
    __array_priority__ = 1000  # numpy defers to our reflected operators instead of reading us

    def __init__(self, tensor_id: int | None, sig: tuple[torch.Size, torch.dtype],
                 host: torch.Tensor | None = None, recipe: tuple | None = None):
        self._id = tensor_id
        # the value, while the client holds it itself (client/host.py); then no id yet
        self._host = host
        self._recipe = recipe  # the creation op that makes _host where it is used
        self._state = False  # a module's parameter or buffer, or computed from them on the
        # client (placed by 'parameters')
        self._scope: tuple = ()  # the signal scopes open where a held value was made
        # the held value's storage is another held tensor's too (a view made here): an in-place
        # op there could change its bytes while they travel, so its upload sends a copy
        self._shared = False
        self._sig = sig
        self.requires_grad = False
        self.grad: Tensor | None = None
        self._node = None  # the autograd Node that made this tensor; None for leaves
        self._slot = 0     # which of that Node's results this is
        self._strides: tuple | None = None  # a view's layout where not contiguous (shapes.py)
        # in-place ops under autograd made this tensor another value (torch's version counter:
        # a gradient rule that saved it refuses to run on what it is now)
        self._version = 0
        # a view, or viewed: its storage may be another tensor's, so an in-place op under
        # autograd (which makes a new value, _rebind) could not reach that other tensor
        self._aliased = False

    @staticmethod
    def held(value: torch.Tensor, recipe: tuple | None = None, scope: tuple = ()) -> "Tensor":
        """A tensor whose value the client holds (client/host.py)."""
        if value.numel() > host.HOST_NUMEL and not value.is_meta and \
                host.meta(runtime(), value.numel()):
            value = value.to("meta")
        t = Tensor(None, (value.shape, value.dtype), value, recipe)
        t._scope = scope
        return t

    @property
    def id(self) -> int | None:
        """The logical tensor's id on the workers; a tensor the client holds is placed now."""
        return self._id if self._host is None else self._place()

    @id.setter
    def id(self, tensor_id: int | None) -> None:
        self._id = tensor_id

    def _host_value(self) -> torch.Tensor:
        """The value the client holds; a dry run's meta value reads as zeros."""
        v = self._host
        return torch.zeros(v.shape, dtype=v.dtype) if v.is_meta else v

    def _place(self, beside: tuple | None = None, constant: bool = False) -> int:
        """Hand a host-held value to the workers: its recipe run there, else its bytes. Where:
        by the signals open where it was made; else, outside any signal's scope, by a config's
        ``parameters`` signal for a module's parameters and buffers and its ``uploads`` signal
        for the rest of what the program uploads but scalars (its batches: data parallelism by
        a config alone); else whole on every worker of ``beside`` (the mesh of the op that needs it:
        made where it is used, nothing sent between workers); else on the home worker.
        ``constant``: first used beside a split batch as no batch is (_beside_a_batch): whole
        where it is used, whatever 'uploads' says."""
        rt = runtime()
        book, placer = rt.signals, rt.dispatcher.placer
        implicit = self._implicit(book, constant)
        scopes = self._scope or ((implicit,) if implicit is not None else ())
        value, recipe = self._host, self._recipe
        self._host = self._recipe = None
        with ExitStack() as inside:
            for name in scopes:
                inside.enter_context(book.scope(name))
            if not scopes and beside is not None and not placer.signals:
                placer.enter(Placement(beside, "R"), "")
                inside.callback(placer.exit)
            if recipe is not None:
                for operand in recipe[1:]:  # a constant computed from constants: theirs first
                    if isinstance(operand, Tensor):
                        operand.id
            if recipe is None and value.is_meta:  # a dry run's: zeros, made where placed
                recipe = ("zeros", tuple(value.shape), value.dtype)
            made = apply(*recipe) if recipe is not None else upload(value, self._shared)
        self._id, made._id = made._id, None
        return self._id

    def _implicit(self, book: Any, constant: bool = False) -> str | None:
        """The config's signal that places this held value outside any signal's scope:
        ``parameters`` for a module's parameters and buffers, ``uploads`` for the rest of what
        the program uploads but numbers and constants; None where the config has no such
        signal, or a signal's scope is open."""
        # (a number is no batch: a scalar the program uploads goes where it is used, whole)
        implicit = "parameters" if self._state else \
            "uploads" if self._recipe is None and len(self._sig[0]) and not constant else None
        return implicit if implicit in book.signals and not book.open else None

    def __del__(self) -> None:
        try:
            tensor_id = self._id
        except AttributeError:  # interrupted (Ctrl-C) inside __init__: never made
            return
        if tensor_id is None:  # held by the client, or never made: nothing on a worker
            return
        try:
            rt = current()
            if rt is not None and not rt.closed:
                rt.dispatcher.frees.append(tensor_id)
        except Exception:  # interpreter shutdown: modules half torn down, workers gone anyway
            pass

    # metadata, known without asking a worker ----------------------------------------------

    @property
    def shape(self) -> torch.Size:
        return self._sig[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._sig[1]

    @property
    def ndim(self) -> int:
        return len(self._sig[0])

    def dim(self) -> int:
        return len(self._sig[0])

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    @property
    def data(self) -> Tensor:
        return self.detach()

    @data.setter
    def data(self, value: Tensor) -> None:
        """torch's ``t.data = value``: this tensor is ``value``'s storage from now on (a change
        of either in place shows in both), with its shape and dtype; it stays this object (a
        module's parameter, an optimizer's key), with its requires_grad and .grad, and no
        autograd history moves. Captures see its id change (client/replay.py: Guard)."""
        if not isinstance(value, Tensor):
            raise TypeError(f"data must be a Tensor, not {type(value).__name__}")
        value.id  # placed first (one the client holds): the alias is of its storage
        with gradmode.no_grad():
            alias = apply("alias", value)
        rt = runtime()
        if self._id is not None:
            rt.dispatcher.frees.append(self._id)  # what it was, unless something else holds it
        self._id, alias._id = alias._id, None
        self._sig, self._strides = alias._sig, alias._strides
        self._host = self._recipe = None

    # autograd ---------------------------------------------------------------------------------

    @property
    def is_leaf(self) -> bool:
        return self._node is None

    @property
    def grad_fn(self) -> Any:
        return self._node

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        if self._node is not None and not requires_grad:
            raise RuntimeError("you can only change requires_grad flags of leaf variables.")
        if requires_grad and not (self.dtype.is_floating_point or self.dtype.is_complex):
            raise RuntimeError("only Tensors of floating point and complex dtype can require gradients")
        self.requires_grad = requires_grad
        return self

    def detach(self) -> Tensor:
        """The same worker tensor under a second id, outside any graph (shares storage)."""
        with gradmode.no_grad():
            return apply("alias", self)

    def backward(self, gradient: Any = None, retain_graph: bool = False) -> None:
        gradmode.autograd().backward(self, gradient, retain_graph)

    def __deepcopy__(self, memo: dict) -> Tensor:
        """torch's: a leaf copied (its values, requires_grad and gradient) beside the original;
        copy.deepcopy(model) for an average of weights or a snapshot."""
        if self._node is not None:
            raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) "
                               "support the deepcopy protocol at the moment.")
        if id(self) in memo:
            return memo[id(self)]
        with gradmode.no_grad():
            copied = self._copied(self.clone())
        copied.requires_grad = self.requires_grad
        memo[id(self)] = copied
        if self.grad is not None:
            copied.grad = copy.deepcopy(self.grad, memo)
        return copied

    def _copied(self, values: Tensor) -> Tensor:
        """What deepcopy makes of this tensor's copied ``values`` (a Parameter: a Parameter)."""
        return values

    # reads: these wait ------------------------------------------------------------------------

    def _bytes(self) -> np.ndarray:
        return runtime().read(self.id, self._sig)

    def cpu_torch(self) -> torch.Tensor:
        """The value as a plain CPU torch tensor."""
        if self._host is not None:
            return self._host_value().clone()
        buf = self._bytes()
        if not buf.size:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(buf, dtype=self.dtype).reshape(self.shape)

    def numpy(self) -> np.ndarray:
        if self.requires_grad:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use "
                               "tensor.detach().numpy() instead.")
        np_dtype = NUMPY_DTYPES.get(self.dtype)
        if np_dtype is None or self._host is not None:
            return self.cpu_torch().numpy()  # bfloat16: raises torch's own error
        return self._bytes().view(np_dtype).reshape(self.shape)

    def item(self) -> Any:
        if self.numel() != 1:
            raise RuntimeError(f"a Tensor with {self.numel()} elements cannot be converted to Scalar")
        np_dtype = NUMPY_DTYPES.get(self.dtype)
        if np_dtype is None or self._host is not None:
            return (self._host_value() if self._host is not None else self.cpu_torch()).item()
        return self._bytes().view(np_dtype)[0].item()

    def tolist(self) -> Any:
        return (self._host_value() if self._host is not None else self.cpu_torch()).tolist()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        arr = self.detach().numpy()
        return arr if dtype is None else arr.astype(dtype)

    def __repr__(self) -> str:
        if not self.requires_grad:
            return repr(self.cpu_torch())
        text = repr(self.cpu_torch().requires_grad_())  # torch's layout of the suffix
        if self._node is None:
            return text
        return text.replace("requires_grad=True", f"grad_fn=<{self._node.name()}>")

    def __format__(self, spec: str) -> str:
        if self.ndim == 0:  # f"{loss:.3f}", as torch formats its 0-d tensors
            return format(self.item(), spec)
        return format(repr(self), spec)

    def __float__(self) -> float:
        return float(self._scalar())

    def __int__(self) -> int:
        return int(self._scalar())

    def _scalar(self) -> Any:
        if self.numel() != 1:
            raise ValueError("only one element tensors can be converted to Python scalars")
        return self.item()

    def __index__(self) -> int:
        if self._host is not None and not self._host.is_meta:  # torch's own check and value
            return self._host.__index__()
        if self.dtype.is_floating_point or self.dtype.is_complex or self.numel() != 1:
            raise TypeError("only integer tensors of a single element can be converted to an index")
        return int(self.item())

    def __bool__(self) -> bool:
        if self.numel() != 1:
            raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
        return bool(self.item())

    def __iter__(self) -> Iterator["Tensor"]:
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        if self.numel() <= host.HOST_NUMEL and not self._scope and host.allowed(runtime()) \
                and not (self.requires_grad and gradmode.is_grad_enabled()):
            # rows held here, as torch's unbind makes them: a placed tensor read once for all
            # (indices read back one at a time cost a round trip each), a held one's rows views
            # of its value (an op each would cost the client its whole path per row)
            if self._host is None:
                rows = self.cpu_torch().unbind(0)
            else:
                rows = _sharing(self)._host.unbind(0)
            rows = [_sharing(Tensor.held(r)) for r in rows]
            if self._state:  # rows of a module's state: state too, as an op's results
                for r in rows:
                    r._state = True
            return iter(rows)
        return (self[i] for i in range(len(self)))

    __hash__ = object.__hash__

    # arithmetic (the reflected forms put the scalar first: the kernel is Python's operator) --

    def __add__(self, o: Operand) -> Tensor: return apply("add", self, o)
    def __radd__(self, o: Operand) -> Tensor: return apply("add", o, self)
    def __sub__(self, o: Operand) -> Tensor: return apply("sub", self, o)
    def __rsub__(self, o: Operand) -> Tensor: return apply("sub", o, self)
    def __mul__(self, o: Operand) -> Tensor: return apply("mul", self, o)
    def __rmul__(self, o: Operand) -> Tensor: return apply("mul", o, self)
    def __truediv__(self, o: Operand) -> Tensor: return apply("truediv", self, o)
    def __rtruediv__(self, o: Operand) -> Tensor: return apply("truediv", o, self)
    def __floordiv__(self, o: Operand) -> Tensor: return apply("floordiv", self, o)
    def __rfloordiv__(self, o: Operand) -> Tensor: return apply("floordiv", o, self)
    def __mod__(self, o: Operand) -> Tensor: return apply("mod", self, o)
    def __rmod__(self, o: Operand) -> Tensor: return apply("mod", o, self)
    def __pow__(self, o: Operand) -> Tensor: return apply("pow", self, o)
    def __rpow__(self, o: Operand) -> Tensor: return apply("pow", o, self)
    def __matmul__(self, o: Operand) -> Tensor: return apply("matmul", self, o)
    def __rmatmul__(self, o: Operand) -> Tensor: return apply("matmul", o, self)
    def __and__(self, o: Operand) -> Tensor: return apply("and", self, o)
    def __rand__(self, o: Operand) -> Tensor: return apply("and", o, self)
    def __or__(self, o: Operand) -> Tensor: return apply("or", self, o)
    def __ror__(self, o: Operand) -> Tensor: return apply("or", o, self)
    def __xor__(self, o: Operand) -> Tensor: return apply("xor", self, o)
    def __rxor__(self, o: Operand) -> Tensor: return apply("xor", o, self)
    def __lt__(self, o: Operand) -> Tensor: return apply("lt", self, o)
    def __le__(self, o: Operand) -> Tensor: return apply("le", self, o)
    def __gt__(self, o: Operand) -> Tensor: return apply("gt", self, o)
    def __ge__(self, o: Operand) -> Tensor: return apply("ge", self, o)
    def __eq__(self, o: Operand) -> Tensor: return apply("eq", self, o)  # type: ignore[override]
    def __ne__(self, o: Operand) -> Tensor: return apply("ne", self, o)  # type: ignore[override]
    def __neg__(self) -> Tensor: return apply("neg", self)
    def __pos__(self) -> Tensor: return self
    def __abs__(self) -> Tensor: return apply("abs", self)
    def __invert__(self) -> Tensor: return apply("invert", self)

    def __iadd__(self, o: Operand) -> Tensor: return apply("iadd", self, o)
    def __isub__(self, o: Operand) -> Tensor: return apply("isub", self, o)
    def __imul__(self, o: Operand) -> Tensor: return apply("imul", self, o)
    def __itruediv__(self, o: Operand) -> Tensor: return apply("itruediv", self, o)

    def add(self, o: Operand) -> Tensor: return apply("add", self, o)
    def sub(self, o: Operand) -> Tensor: return apply("sub", self, o)
    def mul(self, o: Operand) -> Tensor: return apply("mul", self, o)
    def div(self, o: Operand) -> Tensor: return apply("truediv", self, o)
    def pow(self, o: Operand) -> Tensor: return apply("pow", self, o)
    def matmul(self, o: Operand) -> Tensor: return apply("matmul", self, o)
    def maximum(self, o: Operand) -> Tensor: return apply("maximum", self, o)
    def minimum(self, o: Operand) -> Tensor: return apply("minimum", self, o)
    def abs(self) -> Tensor: return apply("abs", self)
    def neg(self) -> Tensor: return apply("neg", self)
    def exp(self) -> Tensor: return apply("exp", self)
    def log(self) -> Tensor: return apply("log", self)
    def sqrt(self) -> Tensor: return apply("sqrt", self)
    def rsqrt(self) -> Tensor: return apply("rsqrt", self)
    def sin(self) -> Tensor: return apply("sin", self)
    def cos(self) -> Tensor: return apply("cos", self)
    def tanh(self) -> Tensor: return apply("tanh", self)
    def sigmoid(self) -> Tensor: return apply("sigmoid", self)
    def relu(self) -> Tensor: return apply("relu", self)
    def softmax(self, dim: int, dtype: torch.dtype | None = None) -> Tensor:
        return apply("softmax", self if dtype is None else self.to(dtype), dim)

    def log_softmax(self, dim: int, dtype: torch.dtype | None = None) -> Tensor:
        return apply("log_softmax", self if dtype is None else self.to(dtype), dim)

    def clamp(self, min: Operand | None = None, max: Operand | None = None) -> Tensor:
        return apply("clamp", self, min, max)

    clip = clamp

    def clamp_min(self, min: Operand) -> Tensor:
        return self.clamp(min=min)

    def clamp_max(self, max: Operand) -> Tensor:
        return self.clamp(max=max)

    def movedim(self, source: int | Sequence[int], destination: int | Sequence[int]) -> Tensor:
        source = [source] if isinstance(source, int) else list(source)
        destination = [destination] if isinstance(destination, int) else list(destination)
        n = self.dim()
        if len(source) != len(destination):
            raise RuntimeError(f"movedim: Invalid source or destination dims: source ({source} "
                               f"dims) should contain the same number of dims as destination "
                               f"({destination} dims)")
        source, destination = [d % n for d in source], [d % n for d in destination]
        order: list[int | None] = [None] * n
        for s_, d_ in zip(source, destination):
            order[d_] = s_
        rest = iter(d for d in range(n) if d not in source)
        return self.permute(*[next(rest) if o is None else o for o in order])

    moveaxis = movedim

    def swapaxes(self, axis0: int, axis1: int) -> Tensor:
        return self.transpose(axis0, axis1)

    swapdims = swapaxes

    def masked_select(self, mask: Tensor) -> Tensor:
        shape = torch.broadcast_shapes(tuple(self.shape), tuple(mask.shape))
        return self.expand(*shape)[mask.expand(*shape)]

    def addcmul(self, tensor1: Operand, tensor2: Operand, *, value: float = 1) -> Tensor:
        return self + value * tensor1 * tensor2

    def addcdiv(self, tensor1: Operand, tensor2: Operand, *, value: float = 1) -> Tensor:
        return self + value * tensor1 / tensor2

    def isclose(self, other: Operand, rtol: float = 1e-05, atol: float = 1e-08,
                equal_nan: bool = False) -> Tensor:
        # torch's test; equal values too (two infinities of one sign)
        scale = other.abs() if isinstance(other, Tensor) else builtins.abs(other)
        close = ((self - other).abs() <= atol + rtol * scale) | (self == other)
        if equal_nan:
            close = close | (self.isnan() & (other.isnan() if isinstance(other, Tensor) else
                                             other != other))
        return close

    def logical_xor(self, other: Operand) -> Tensor:
        return self.bool() != (other.bool() if isinstance(other, Tensor) else bool(other))

    # composed of the table's ops by torch's definitions (gradients follow from the ops') ------

    def tile(self, dims: Sequence[int]) -> Tensor:
        dims = tuple(dims)
        return self.repeat(*(1,) * (self.dim() - len(dims)), *dims)

    def broadcast_to(self, size: Sequence[int]) -> Tensor:
        return self.expand(*size)

    def log2(self) -> Tensor: return self.log() * (1 / math.log(2))
    def log10(self) -> Tensor: return self.log() * (1 / math.log(10))
    def exp2(self) -> Tensor: return (self * math.log(2)).exp()
    def sinh(self) -> Tensor: return (self.expm1() - (-self).expm1()) * 0.5
    def cosh(self) -> Tensor: return (self.exp() + (-self).exp()) * 0.5
    def frac(self) -> Tensor: return self - self.trunc()

    def logaddexp(self, other: Tensor) -> Tensor:
        high = self.maximum(other)
        return high + (-(self - other).abs()).exp().log1p()

    def logit(self, eps: float | None = None) -> Tensor:
        x = self if eps is None else self.clamp(eps, 1 - eps)
        return (x / (1 - x)).log()

    def xlogy(self, other: Operand) -> Tensor:
        # 0 where x is 0 (its log term ignored), as torch's
        return (self * other.log() if isinstance(other, Tensor) else self * math.log(other)) \
            .masked_fill(self == 0, 0.0)

    def signbit(self) -> Tensor:
        return (self < 0) | ((self == 0) & (1 / self < 0))  # -0.0 too

    def heaviside(self, values: Operand) -> Tensor:
        return (self > 0).to(self.dtype).masked_fill(self == 0, 0.0) + \
            (values * (self == 0) if isinstance(values, Tensor) else (self == 0) * values)

    def nan_to_num(self, nan: float = 0.0, posinf: float | None = None,
                   neginf: float | None = None) -> Tensor:
        info = torch.finfo(self.dtype)
        out = self.masked_fill(self.isnan(), nan)
        out = out.masked_fill(self == math.inf, info.max if posinf is None else posinf)
        return out.masked_fill(self == -math.inf, info.min if neginf is None else neginf)

    def remainder(self, other: Operand) -> Tensor: return self % other
    def floor_divide(self, other: Operand) -> Tensor: return self // other

    def fmod(self, other: Operand) -> Tensor:
        # the dividend's sign (C's), where remainder takes the divisor's
        return self - (self / other).trunc() * other

    def count_nonzero(self, dim: Dims = None) -> Tensor:
        return (self != 0).sum(dim) if dim is not None else (self != 0).sum()

    def aminmax(self, *, dim: int | None = None, keepdim: bool = False) -> AMinMax:
        if dim is None:
            return AMinMax(self.amin(), self.amax())
        return AMinMax(self.amin(dim, keepdim), self.amax(dim, keepdim))

    def diff(self, n: int = 1, dim: int = -1, prepend: Tensor | None = None,
             append: Tensor | None = None) -> Tensor:
        x = apply("cat", *[t for t in (prepend, self, append) if t is not None], dim=dim) \
            if prepend is not None or append is not None else self
        for _ in range(n):
            length = x.shape[dim]
            x = x.narrow(dim, 1, length - 1) - x.narrow(dim, 0, length - 1)
        return x

    def dot(self, other: Tensor) -> Tensor:
        if self.dim() != 1 or other.dim() != 1:
            raise RuntimeError(f"1D tensors expected, but got {self.dim()}D and "
                               f"{other.dim()}D tensors")
        return (self * other).sum()

    def inner(self, other: Tensor) -> Tensor:
        if self.dim() == 0 or other.dim() == 0:
            return self * other
        k = self.shape[-1]
        return (self.reshape(-1, k) @ other.reshape(-1, k).t()).reshape(
            *self.shape[:-1], *other.shape[:-1])

    def take_along_dim(self, indices: Tensor, dim: int | None = None) -> Tensor:
        if dim is None:
            return self.reshape(-1).gather(0, indices.reshape(-1))
        ours, theirs = list(self.shape), list(indices.shape)
        ours[dim] = theirs[dim] = 1  # broadcast along every other dimension
        shape = list(torch.broadcast_shapes(tuple(ours), tuple(theirs)))
        wanted = list(shape)
        shape[dim], wanted[dim] = self.shape[dim], indices.shape[dim]
        return self.expand(*shape).gather(dim, indices.expand(*wanted))

    def diagonal(self, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Tensor:
        x = self.movedim((dim1, dim2), (-2, -1))
        x = x[..., :, offset:] if offset >= 0 else x[..., -offset:, :]
        size = max(0, builtins.min(x.shape[-2], x.shape[-1]))
        square = x[..., :size, :size].reshape(*x.shape[:-2], size * size)
        return square[..., ::size + 1]

    def trace(self) -> Tensor:
        return self.diagonal().sum()

    def var_mean(self, dim: Dims = None, unbiased: bool | None = None, keepdim: bool = False,
                 *, correction: int | None = None) -> tuple[Tensor, Tensor]:
        return (self.var(dim, unbiased, keepdim, correction=correction),
                self.mean(dim, keepdim) if dim is not None else self.mean())

    def std_mean(self, dim: Dims = None, unbiased: bool | None = None, keepdim: bool = False,
                 *, correction: int | None = None) -> tuple[Tensor, Tensor]:
        return (self.std(dim, unbiased, keepdim, correction=correction),
                self.mean(dim, keepdim) if dim is not None else self.mean())

    def kthvalue(self, k: int, dim: int = -1, keepdim: bool = False) -> MinMax:
        """The k-th smallest along ``dim`` (from a sort: where values tie, which index comes
        is the sort's)."""
        ordered = self.sort(dim)
        values, indices = ordered.values.select(dim, k - 1), ordered.indices.select(dim, k - 1)
        if keepdim:
            values, indices = values.unsqueeze(dim), indices.unsqueeze(dim)
        return MinMax(values, indices)

    def median(self, dim: int | None = None, keepdim: bool = False) -> Tensor | MinMax:
        """The lower of the two middle values, as torch's."""
        if dim is None:
            flat = self.reshape(-1)
            return flat.kthvalue((flat.shape[0] + 1) // 2, 0).values
        return self.kthvalue((self.shape[dim] + 1) // 2, dim, keepdim)

    def where(self, condition: Operand, other: Operand) -> Tensor:
        return apply("where", condition, self, other)

    def masked_fill(self, mask: Operand, value: Operand) -> Tensor:
        return apply("masked_fill", self, mask, value)

    def leaky_relu(self, negative_slope: float = 0.01) -> Tensor:
        return apply("leaky_relu", self, negative_slope)

    def floor(self) -> Tensor: return apply("floor", self)
    def ceil(self) -> Tensor: return apply("ceil", self)
    def round(self) -> Tensor: return apply("round", self)
    def trunc(self) -> Tensor: return apply("trunc", self)
    def sign(self) -> Tensor: return apply("sign", self)
    def erf(self) -> Tensor: return apply("erf", self)
    def tan(self) -> Tensor: return apply("tan", self)
    def asin(self) -> Tensor: return apply("asin", self)
    def acos(self) -> Tensor: return apply("acos", self)
    def atan(self) -> Tensor: return apply("atan", self)
    def lgamma(self) -> Tensor: return apply("lgamma", self)
    def digamma(self) -> Tensor: return apply("digamma", self)
    def atan2(self, other: Operand) -> Tensor: return apply("atan2", self, other)
    def hypot(self, other: Operand) -> Tensor: return apply("hypot", self, other)

    arcsin, arccos, arctan, arctan2 = asin, acos, atan, atan2
    def erfinv(self) -> Tensor: return apply("erfinv", self)
    def log1p(self) -> Tensor: return apply("log1p", self)
    def expm1(self) -> Tensor: return apply("expm1", self)
    def reciprocal(self) -> Tensor: return apply("reciprocal", self)
    def square(self) -> Tensor: return apply("square", self)
    def logical_not(self) -> Tensor: return apply("logical_not", self)
    def logical_and(self, o: Operand) -> Tensor: return apply("logical_and", self, o)
    def logical_or(self, o: Operand) -> Tensor: return apply("logical_or", self, o)
    def isnan(self) -> Tensor: return apply("isnan", self)
    def isinf(self) -> Tensor: return apply("isinf", self)
    def isfinite(self) -> Tensor: return apply("isfinite", self)

    # along dims (placed on whole tensors) -----------------------------------------------------

    def cumsum(self, dim: int) -> Tensor: return apply("cumsum", self, dim)
    def cumprod(self, dim: int) -> Tensor: return apply("cumprod", self, dim)
    def cummax(self, dim: int) -> MinMax: return MinMax(*apply("cummax", self, dim))
    def cummin(self, dim: int) -> MinMax: return MinMax(*apply("cummin", self, dim))
    def prod(self, dim: int | None = None, keepdim: bool = False) -> Tensor: return apply("prod", self, dim, keepdim)
    def any(self, dim: int | None = None, keepdim: bool = False) -> Tensor: return apply("any", self, dim, keepdim)
    def all(self, dim: int | None = None, keepdim: bool = False) -> Tensor: return apply("all", self, dim, keepdim)

    def logsumexp(self, dim: Dims, keepdim: bool = False) -> Tensor:
        return apply("logsumexp", self, _dims(dim), keepdim)

    def norm(self, p: float | str = "fro", dim: Dims = None, keepdim: bool = False) -> Tensor:
        """The vector 2-norm ("fro" over all elements is the same), or any p-norm."""
        p = 2 if p in ("fro", None) else float("inf") if p == "inf" else p
        return apply("vector_norm", self, _dims(dim), keepdim, p)

    def topk(self, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> TopK:
        return TopK(*apply("topk", self, dim, k, largest, sorted))

    def sort(self, dim: int = -1, descending: bool = False, stable: bool = False) -> Sort:
        return Sort(*apply("sort", self, dim, descending, stable))

    def gather(self, dim: int, index: Tensor) -> Tensor: return apply("gather", self, dim, index)
    def scatter(self, dim: int, index: Tensor, src: Operand) -> Tensor: return apply("scatter", self, dim, index, src)
    def scatter_add(self, dim: int, index: Tensor, src: Tensor) -> Tensor: return apply("scatter_add", self, dim, index, src)
    def scatter_add_(self, dim: int, index: Tensor, src: Tensor) -> Tensor:
        return self._assign(self.scatter_add(dim, index, src))

    def argsort(self, dim: int = -1, descending: bool = False, stable: bool = False) -> Tensor:
        return self.sort(dim, descending, stable).indices

    # how many results there are is data: read here, as torch's own waits for the GPU; the
    # results are held by the client and go where they are used

    def nonzero(self, *, as_tuple: bool = False) -> Tensor | tuple[Tensor, ...]:
        return self._held(torch.nonzero(self.cpu_torch(), as_tuple=as_tuple))

    def unique(self, sorted: bool = True, return_inverse: bool = False,
               return_counts: bool = False, dim: int | None = None) -> Tensor | tuple[Tensor, ...]:
        return self._held(torch.unique(self.cpu_torch(), sorted, return_inverse, return_counts,
                                       dim))

    def _held(self, found: torch.Tensor | tuple) -> Tensor | tuple[Tensor, ...]:
        device = self.device
        return tuple(hold(f, device) for f in found) if isinstance(found, tuple) else \
            hold(found, device)

    def outer(self, other: Tensor) -> Tensor:
        if self.ndim != 1 or other.ndim != 1:
            raise RuntimeError("outer: expected 1-D tensors, but got "
                               f"{self.ndim}-D and {other.ndim}-D")
        return self.reshape(-1, 1) * other.reshape(1, -1)

    def lerp(self, end: Operand, weight: Operand) -> Tensor:
        return self + weight * (end - self)

    def lerp_(self, end: Operand, weight: Operand) -> Tensor:
        return self._assign(self.lerp(end, weight))

    def repeat_interleave(self, repeats: int, dim: int | None = None) -> Tensor:
        """Each element (along ``dim``; of the flattened tensor without one) ``repeats`` times
        in a row; a tensor of repeats per element would need its values on the client."""
        if not isinstance(repeats, int):
            raise NotImplementedError("repeat_interleave with a tensor of repeats: its output's "
                                      "shape depends on the values; give an int")
        x = self.reshape(-1) if dim is None else self
        d = 0 if dim is None else dim % x.ndim
        shape = tuple(x.shape)
        grown = x.unsqueeze(d + 1).expand(*shape[:d + 1], repeats, *shape[d + 1:])
        return grown.reshape(*shape[:d], shape[d] * repeats, *shape[d + 1:])
    def index_select(self, dim: int, index: Tensor) -> Tensor: return apply("index_select", self, dim, index)
    def tril(self, diagonal: int = 0) -> Tensor: return apply("tril", self, diagonal)
    def triu(self, diagonal: int = 0) -> Tensor: return apply("triu", self, diagonal)
    def repeat(self, *sizes: int) -> Tensor: return apply("repeat", self, _sizes(sizes))
    def flip(self, *dims: int) -> Tensor: return apply("flip", self, _sizes(dims))
    def roll(self, shifts: int | Sequence[int], dims: Dims = None) -> Tensor:
        return apply("roll", self, shifts, dims)

    def unbind(self, dim: int = 0) -> tuple[Tensor, ...]:
        return tuple(self.select(dim, i) for i in range(self.shape[dim]))

    def select(self, dim: int, index: int) -> Tensor:
        return self[(slice(None),) * (dim % max(self.ndim, 1)) + (index,)]

    # in place: torch's method forms ----------------------------------------------------------

    def add_(self, o: Operand, alpha: float = 1) -> Tensor:
        return apply("iadd", self, o if alpha == 1 else o * alpha)

    def sub_(self, o: Operand, alpha: float = 1) -> Tensor:
        return apply("isub", self, o if alpha == 1 else o * alpha)

    def mul_(self, o: Operand) -> Tensor: return apply("imul", self, o)
    def div_(self, o: Operand) -> Tensor: return apply("itruediv", self, o)

    def clamp_(self, min: Operand | None = None, max: Operand | None = None) -> Tensor:
        return apply("clamp_", self, min, max)

    def masked_fill_(self, mask: Operand, value: Operand) -> Tensor:
        return apply("masked_fill_", self, mask, value)

    def exp_(self) -> Tensor: return self._assign(self.exp())
    def log_(self) -> Tensor: return self._assign(self.log())
    def sqrt_(self) -> Tensor: return self._assign(self.sqrt())
    def abs_(self) -> Tensor: return self._assign(self.abs())
    def neg_(self) -> Tensor: return self._assign(self.neg())
    def relu_(self) -> Tensor: return self._assign(self.relu())
    def tanh_(self) -> Tensor: return self._assign(self.tanh())
    def sigmoid_(self) -> Tensor: return self._assign(self.sigmoid())
    def pow_(self, o: Operand) -> Tensor: return self._assign(self.pow(o))
    def square_(self) -> Tensor: return self._assign(self.square())

    clip_ = clamp_

    def addcmul_(self, tensor1: Operand, tensor2: Operand, *, value: float = 1) -> Tensor:
        return self.add_(value * tensor1 * tensor2)

    def addcdiv_(self, tensor1: Operand, tensor2: Operand, *, value: float = 1) -> Tensor:
        return self.add_(value * tensor1 / tensor2)

    def normal_(self, mean: float = 0.0, std: float = 1.0, *, generator: Any = None) -> Tensor:
        if self._draws_here(generator):
            self._host.normal_(mean, std, generator=generator)
            return self
        return apply("normal_", self, float(mean), float(std), worker_seed(generator))

    def uniform_(self, a: float = 0.0, b: float = 1.0, *, generator: Any = None) -> Tensor:
        if self._draws_here(generator):
            self._host.uniform_(a, b, generator=generator)
            return self
        return apply("uniform_", self, float(a), float(b), worker_seed(generator))

    def _draws_here(self, generator: Any) -> bool:
        """Whether an in-place draw fills the value the client holds, from torch's CPU
        generator (or ``generator``), as torch draws a CPU tensor's values."""
        if self._host is None or isinstance(generator, Generator) or \
                not host.allowed(runtime()):
            return False
        self._recipe = None
        return True

    # dtype and device -------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The device of the (first) worker that holds it; the CPU while the client does."""
        if self._host is not None:
            return _CPU
        return runtime().device_of(self.id)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def to(self, *args: Any, **kwargs: Any) -> Tensor:
        """torch's forms: to(dtype), to(device), to(device, dtype), to(other), with keywords
        dtype=, device=, non_blocking=, copy=. Which workers hold a tensor is the runtime's
        choice (signals and configs); a GPU device hands a value the client holds to them now."""
        dtype, device = split_device(args, kwargs)
        if device is not None and device.type != "cpu":
            self.id  # a host-held value's upload starts now, as torch's copy to the GPU
        return self if dtype is None or dtype == self.dtype else apply("to", self, dtype)

    def cpu(self) -> Tensor:
        """Itself: reads (numpy, item, tolist) bring data to the host whatever its device."""
        return self

    def cuda(self, device: Any = None) -> Tensor:
        self.id
        return self

    def pin_memory(self, device: Any = None) -> Tensor:
        """Itself: a host-held value is uploaded from memory gtmpi owns, without a wait."""
        return self

    def is_pinned(self, device: Any = None) -> bool:
        return False

    def type_as(self, other: Tensor) -> Tensor:
        return self.to(other.dtype)

    def view_as(self, other: Tensor) -> Tensor:
        return self.view(other.shape)

    def reshape_as(self, other: Tensor) -> Tensor:
        return self.reshape(other.shape)

    def new_zeros(self, *size: int, dtype: DTypeLike = None, requires_grad: bool = False,
                  **kw: Any) -> Tensor:
        return filled("zeros", size, as_dtype(dtype) or self.dtype, requires_grad, kw)

    def new_ones(self, *size: int, dtype: DTypeLike = None, requires_grad: bool = False,
                 **kw: Any) -> Tensor:
        return filled("ones", size, as_dtype(dtype) or self.dtype, requires_grad, kw)

    def new_full(self, size: Sequence[int], fill_value: float, dtype: DTypeLike = None,
                 requires_grad: bool = False, **kw: Any) -> Tensor:
        return filled("full", (size,), as_dtype(dtype) or self.dtype, requires_grad, kw,
                      fill_value)

    def new_empty(self, *size: int, dtype: DTypeLike = None, **kw: Any) -> Tensor:
        return self.new_zeros(*size, dtype=dtype, **kw)

    def new_tensor(self, data: Any, dtype: DTypeLike = None, requires_grad: bool = False,
                   **kw: Any) -> Tensor:
        return from_data(data, as_dtype(dtype) or self.dtype, requires_grad, kw)

    def type(self, dtype: Any) -> Tensor:
        return self.to(dtype)

    def float(self) -> Tensor: return self.to(torch.float32)
    def double(self) -> Tensor: return self.to(torch.float64)
    def half(self) -> Tensor: return self.to(torch.float16)
    def bfloat16(self) -> Tensor: return self.to(torch.bfloat16)
    def int(self) -> Tensor: return self.to(torch.int32)
    def long(self) -> Tensor: return self.to(torch.int64)
    def bool(self) -> Tensor: return self.to(torch.bool)

    # reductions: torch's dim/keepdim and GT's axis/keepdims -----------------------------------

    def sum(self, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor:
        return _reduce("sum", self, dim, keepdim, kw)
    def mean(self, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor:
        return _reduce("mean", self, dim, keepdim, kw)
    def argmax(self, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor:
        return _reduce("argmax", self, dim, keepdim, kw)
    def argmin(self, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor:
        return _reduce("argmin", self, dim, keepdim, kw)

    def max(self, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor | MinMax:
        return _extreme("max", self, dim, keepdim, kw)

    def min(self, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor | MinMax:
        return _extreme("min", self, dim, keepdim, kw)

    def amax(self, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor:
        return _reduce("amax", self, dim, keepdim, kw)
    def amin(self, dim: Dims = None, keepdim: bool = False, **kw: Any) -> Tensor:
        return _reduce("amin", self, dim, keepdim, kw)

    def var(self, dim: Dims = None, unbiased: bool | None = None, keepdim: bool = False, *,
            correction: int | None = None, ddof: int | None = None, **kw: Any) -> Tensor:
        return _spread("var", self, dim, unbiased, keepdim, correction, ddof, kw)

    def std(self, dim: Dims = None, unbiased: bool | None = None, keepdim: bool = False, *,
            correction: int | None = None, ddof: int | None = None, **kw: Any) -> Tensor:
        return _spread("std", self, dim, unbiased, keepdim, correction, ddof, kw)

    # shape ------------------------------------------------------------------------------------

    def reshape(self, *shape: int) -> Tensor: return apply("reshape", self, _sizes(shape))
    def view(self, *shape: int) -> Tensor: return apply("view", self, _sizes(shape))
    def permute(self, *dims: int) -> Tensor: return apply("permute", self, _sizes(dims))
    def unsqueeze(self, dim: int) -> Tensor: return apply("unsqueeze", self, dim)
    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor:
        return apply("flatten", self, start_dim, end_dim)

    def narrow(self, dim: int, start: int, length: int) -> Tensor:
        size = self.shape[dim]
        if start < 0:
            start += size
        if not 0 <= start <= size or length < 0 or start + length > size:
            raise RuntimeError(f"start ({start}) + length ({length}) exceeds dimension size "
                               f"({size}).")
        return self[(slice(None),) * (dim % self.ndim) + (slice(start, start + length),)]

    def unflatten(self, dim: int, sizes: Sequence[int]) -> Tensor:
        dim %= self.ndim
        sizes = list(sizes)
        known = math.prod(s for s in sizes if s != -1)
        whole = self.shape[dim]
        if sizes.count(-1) > 1 or (-1 not in sizes and known != whole) or \
                (-1 in sizes and (known == 0 or whole % known)):
            raise RuntimeError(f"unflatten: Provided sizes {sizes} don't multiply up to the "
                               f"size of dim {dim} ({whole}) in the input tensor")
        return self.reshape(*self.shape[:dim], *sizes, *self.shape[dim + 1:])
    def expand(self, *sizes: int) -> Tensor: return apply("expand", self, _sizes(sizes))
    def expand_as(self, other: Tensor) -> Tensor: return apply("expand", self, tuple(other.shape))
    def contiguous(self) -> Tensor: return apply("contiguous", self)
    def is_contiguous(self) -> bool:
        if self._host is not None:
            return self._host.is_contiguous()
        return view_strides(self._strides) is None
    def clone(self) -> Tensor: return apply("clone", self)
    def split(self, split_size_or_sections: int | Sequence[int] | None = None, dim: int = 0, *,
              split_size: int | Sequence[int] | None = None,
              axis: int | None = None) -> tuple[Tensor, ...]:
        """torch's split; GT's ``split_size=`` and ``axis=`` too."""
        sections = split_size if split_size_or_sections is None else split_size_or_sections
        if sections is None:
            raise TypeError("split() missing required argument 'split_size_or_sections'")
        if isinstance(sections, list):
            sections = tuple(sections)
        return apply("split", self, sections, dim if axis is None else axis)
    def chunk(self, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
        return apply("chunk", self, chunks, dim)

    def squeeze(self, dim: int | Sequence[int] | None = None) -> Tensor:
        return apply("squeeze", self, tuple(dim) if isinstance(dim, list) else dim)

    def transpose(self, *dims: int) -> Tensor:
        """transpose(d0, d1) as torch; transpose() with no argument reverses the dims, as GT."""
        if not dims:
            return apply("permute", self, tuple(range(self.ndim - 1, -1, -1)))
        return apply("transpose", self, *dims)

    @property
    def T(self) -> "Tensor":
        return self if self.ndim < 2 else self.transpose()

    def t(self) -> Tensor:
        if self.ndim > 2:
            raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {self.ndim}D")
        return self if self.ndim < 2 else self.transpose(0, 1)

    @property
    def mT(self) -> Tensor:
        return self.transpose(-2, -1)

    # indexing -----------------------------------------------------------------------------------

    def __getitem__(self, key: Any) -> Tensor:
        template, tensors, shape_as = _index(key)
        return apply("getitem", self, *tensors, key=template, shape_as=shape_as)

    def __setitem__(self, key: Any, value: Operand) -> None:
        mask = key[0] if type(key) is tuple and len(key) == 1 else key
        if isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.ndim and \
                not (self.requires_grad and gradmode.is_grad_enabled()) and \
                tuple(mask.shape) == tuple(self.shape[:mask.ndim]) and \
                (type(value) in (int, float, bool) or isinstance(value, Tensor) and not value.ndim):
            # a fill through a mask (a sampler's top-k cut): torch reads the mask's count
            # here, a fill needs none, so no wait for the workers per call
            if mask.ndim < self.ndim:
                mask = mask.reshape(*mask.shape, *(1,) * (self.ndim - mask.ndim))
            apply("masked_fill_", self, mask, value)
            return
        template, tensors, shape_as = _index(key)
        apply("setitem", self, value, *tensors, key=template, shape_as=shape_as)

    # in place -----------------------------------------------------------------------------------

    def zero_(self) -> Tensor: return apply("zero_", self)
    def fill_(self, value: Operand) -> Tensor: return apply("fill_", self, value)
    def copy_(self, src: Operand) -> Tensor: return apply("copy_", self, src)

    def _assign(self, result: Tensor) -> Tensor:
        """An in-place op given as its out-of-place ``result``, made just now: copied in, or,
        where autograd records it, this tensor becomes ``result`` (_rebind)."""
        if gradmode.is_grad_enabled() and (self.requires_grad or result.requires_grad):
            return _rebind(self, "copy_", result)
        return self.copy_(result)


# the one path every op takes -------------------------------------------------------------------

def apply(name: str, *args: Any, key: tuple | None = None, shape_as: tuple | None = None,
          **kw: Any) -> Any:
    """Infer, issue, return handles. ``kw`` holds keyword constants of the kernel.

    ``shape_as`` = (n, template, sigs): for shape inference only, the last n tensor operands
    and the index ``key`` are replaced (a boolean mask becomes index vectors of its true count).
    """
    if name in host.HOST_OPS:
        held = _on_host(name, args, key, kw)
        if held is not None:
            return held
    rt = runtime()
    if rt.autocast is not None:  # gtmpi.autocast: operands cast as torch's lists say
        fused = rt.autocast.fused(name, args)
        if fused is not None:
            kw["cast"] = fused
        else:
            cast = rt.autocast.operands(name, args)
            if cast is not None:
                args = cast
    issued = _clock() if rt.dispatcher.trace is not None else 0
    tmask = 0
    wire = []
    sigs = []
    operands = []
    grad = False
    held = []  # operands the client holds: placed once the others' mesh is known
    for i, a in enumerate(args):
        if not isinstance(a, _PLAIN) and a is not None:
            a = _operand(a)
        operands.append(a)
        if isinstance(a, Tensor):
            grad = grad or a.requires_grad
            tmask |= 1 << i
            if a._host is not None:
                held.append(i)
            wire.append(a._id)
            sigs.append(a._sig)
        else:
            wire.append(a)
            sigs.append(a)
    if held:  # those a signal places first: the rest go where the op's placed operands are
        for i in sorted(held, key=lambda i: not operands[i]._scope):
            a = operands[i]
            wire[i] = a._id if a._host is None else a._place(
                _mesh_beside(rt, wire, tmask),
                _beside_a_batch(rt, name, operands, wire, tmask, i, key))
    if key is not None:
        kw["key"] = key
    recording = grad and gradmode.is_grad_enabled()
    if recording and name in _RECORDED:  # torch records it on the worker for these operands
        kw["grads"] = tuple(i for i, a in enumerate(operands)
                            if isinstance(a, Tensor) and a.requires_grad)
    kw = kw or None
    saving = rt.selective if recording and rt.selective is not None and \
        rt.selective.saves(name) else None
    if saving is not None and saving.recompute:  # kept by the first run: not computed again
        return saving.reuse(name, operands, kw)
    key = None  # the signature's cache key, for shape inference and the placer alike
    try:
        if shape_as is None:
            try:
                key = signature_key(name, tuple(sigs), tmask, kw)
            except TypeError:  # an unhashable constant
                pass
            outs, multi = infer(name, tuple(sigs), tmask, kw, key)
        else:
            n, template, index_sigs = shape_as
            lead = len(sigs) - n
            outs, multi = infer(name, tuple(sigs[:lead]) + index_sigs,
                                tmask & ((1 << lead) - 1) | ((1 << len(index_sigs)) - 1) << lead,
                                {**kw, "key": template})
    except Exception as e:  # torch's error, raised from here: not through a dozen frames of
        raise e.with_traceback(None)  # shape inference and meta kernels below the user's op
    if name in _INPLACE:
        if recording:
            if name in _OUT_OF_PLACE:
                return _rebind(operands[0], name, _out_of_place(name, operands, kw))
            gradmode.autograd().record(name, operands, kw, None)  # raises: in place needs no_grad()
        rt.dispatcher.submit((name, args[0].id, tuple(wire), tmask, kw), True, issued, sigs,
                             outs, key=key)
        rt.note_site(args[0].id)
        return args[0]
    if multi:
        ids = tuple(rt.new_id() for _ in outs)
        rt.dispatcher.submit((name, ids, tuple(wire), tmask, kw), True, issued, sigs, outs,
                             key=key)
        for i in ids:
            rt.note_site(i)
        result = tuple(Tensor(i, s) for i, s in zip(ids, outs))
        if name in _RECORDED:  # a fused kernel: its result, and the Graph its gradient reads
            result, graph = result
            if recording:
                gradmode.autograd().record(name, operands, kw, result, graph)
            if saving is not None:
                saving.keep(name, result, graph)
            return result
    else:
        strides = None
        if name in VIEWS and (name in RESTRIDING or operands[0]._strides is not None):
            # worked out only when a view needs it (kept as how it came about until then)
            strides = (name, tuple(sigs), tmask, kw, operands[0]._strides)
            if name == "view":
                strides = view_strides(strides)  # raises at the line where torch would
        out = rt.new_id()
        rt.dispatcher.submit((name, out, tuple(wire), tmask, kw),
                             name == "matmul" or outs[0][0].numel() >= _URGENT_NUMEL, issued,
                             sigs, outs, key=key)
        rt.note_site(out)
        result = Tensor(out, outs[0])
        result._strides = strides
    if name in _ALIASING:
        operands[0]._aliased = True
        for r in (result if isinstance(result, tuple) else (result,)):
            r._aliased = True
    if recording:
        gradmode.autograd().record(name, operands, kw, result)
    if saving is not None:
        saving.keep(name, result)
    return result


def _on_host(name: str, args: tuple, key: tuple | None, kw: dict) -> Any:
    """The op run here, as torch's CPU runs it, when every tensor operand is held by the
    client and small (in place on a held tensor: any size), no gradient is recorded, and
    nothing places what it makes; else None (a worker runs it). Every op of a program's batch
    making (an index's arithmetic, a row cut from a dataset) comes here: its cost is rank 0's
    host time per iteration where the GPU's step is short, so it stays lean."""
    if len(args) == 2 and not kw and key is None and name in _FRESH:
        a, b = args
        t = a if type(b) in _SCALARS else b if type(a) in _SCALARS else None
        if type(t) is Tensor:
            made = _held_with_scalar(name, t, args)
            if made is not None:
                return made
    total, held, values, foreign = 0, None, [], False
    grad = None
    for a in args:
        if isinstance(a, Tensor):
            value = a._host
            if value is None or a._scope:
                return None  # a signal's tensor is computed where the signal places it
            if a.requires_grad:
                if grad is None:
                    grad = gradmode.is_grad_enabled()
                if grad:
                    return None
            total += value.numel()
            held = a
            a = value
        elif type(a) not in _SCALARS and isinstance(a, (np.ndarray, torch.Tensor)):
            a = torch.as_tensor(a)
            total += a.numel()
            foreign = True
        values.append(a)
    if held is None:
        return None
    inplace = name in _INPLACE
    rt = runtime()
    # rows taken from a held dataset (x[idx], x[a:b]) are taken here whatever its size, as
    # torch's loader takes a batch from host memory: placed, the dataset would be split by a
    # data-parallel config and every batch would gather it whole
    if inplace:
        if not isinstance(args[0], Tensor):
            return None
    elif total > host.HOST_NUMEL and not (name in _SELECTIONS and isinstance(args[0], Tensor)):
        return None
    if not host.allowed(rt) or \
            (rt.autocast is not None and rt.autocast.operands(name, args) is not None):
        return None  # an autocast region's op runs as the workers cast it
    if key is not None:
        kw = {**kw, "key": key}
    kernel = OPS[name].kernel
    if foreign:  # a program's own torch tensor may require grad: held values never do
        with torch.no_grad():
            out = kernel(*values, **kw)
    else:
        out = kernel(*values, **kw) if kw else kernel(*values)
    if inplace:
        args[0]._recipe = None  # changed: its recipe no longer makes it
        return args[0]
    multi = isinstance(out, (tuple, list))
    results = tuple(map(Tensor.held, out)) if multi else (Tensor.held(out),)
    if name in _FRESH:  # a new value, or an operand itself (to() of its own dtype)
        for r in results:
            made = r._host
            for v, a in zip(values, args):
                if made is v and isinstance(a, Tensor):
                    _sharing(r)
                    _sharing(a)
    else:
        _share_storages(results, values, args)
    _inherit(name, args, key, kw, results)
    return results if multi else results[0]


def _held_with_scalar(name: str, t: Tensor, args: tuple) -> Tensor | None:
    """_on_host's own path for its commonest op, a held tensor and a Python number (an
    index's arithmetic, ``data[i:i + block_size]``: nanoGPT's batch making does 192 a batch),
    giving what its general path gives; None where that path must decide."""
    value = t._host
    if value is None or t._scope or t.requires_grad or value.numel() > host.HOST_NUMEL:
        return None
    rt = runtime()
    if rt.autocast is not None or not host.allowed(rt):
        return None
    kernel = OPS[name].kernel
    out = kernel(value, args[1]) if args[0] is t else kernel(args[0], value)
    r = Tensor.held(out)
    if out is value:  # an operand itself
        _sharing(r)
        _sharing(t)
    if t._state:  # as _inherit gives it
        r._state = True
    elif t._recipe is not None:
        r._recipe = (name, *args)
    return r


def _share_storages(results: tuple, values: list, args: tuple) -> None:
    """Marks a result and its operand that share one storage (a view made here)."""
    storages = {v.untyped_storage().data_ptr(): a for v, a in zip(values, args)
                if isinstance(a, Tensor)}
    for r in results:  # a view: the result and its operand share one storage
        owner = storages.get(r._host.untyped_storage().data_ptr())
        if owner is not None:
            _sharing(r)
            _sharing(owner)


def _inherit(name: str, args: tuple, key: tuple | None, kw: dict, results: tuple) -> None:
    """What held results take from their operands: a module's state, or a recipe."""
    state, kept, made = False, True, True
    for a in args:
        if isinstance(a, Tensor):
            state = state or a._state
            if a._recipe is None:
                made = False
                kept = kept and a._state
    if state and kept:
        # computed from a module's state (a causal mask sliced and compared) and no data of the
        # program's: state too, placed by 'parameters', not split as an upload would be
        for r in results:
            r._state = True
    elif made and len(results) == 1 and key is None and not kw:
        # computed from constants alone (a causal mask made in forward: tril of ones, compared):
        # a constant too, made again by the same op where it is used, not uploaded as the
        # program's data (which a data-parallel config splits)
        results[0]._recipe = (name, *args)


def _sharing(t: Tensor) -> Tensor:
    t._shared = True
    return t


def _beside_a_batch(rt: Any, name: str, operands: list, wire: list, tmask: int, i: int,
                    key: tuple | None) -> bool:
    """Whether held operand ``i`` is a constant beside a batch, not a batch: another operand
    lies split along a dim that ``i`` lacks where broadcasting aligns them (a per-channel
    scale, a (T, C) bias beside a (B, T, C) batch), or ``i`` indexes another's dims but the
    first (an index list given to index_select, or in x[:, idx]). Split like a batch, such a
    constant would gather the batch at its use."""
    placer = rt.dispatcher.placer
    if not placer.active:
        return False
    mine = operands[i]._sig[0]
    for j, tid in enumerate(wire):
        if j == i or not tmask >> j & 1 or operands[j]._host is not None:
            continue
        split = [d for kind, d in placer.placement(tid).per_axis() if kind == "S"]
        if not split:
            continue
        if name == "index_select":
            return i == 2 and operands[1] not in split
        if name == "getitem":
            return i > 0 and bool(key) and key[0] == slice(None)
        if OPS[name].kind is Kind.ELEMENTWISE:
            other = operands[j]._sig[0]
            for d in split:
                at = d - (len(other) - len(mine))  # i's dim aligned with the split one
                if at < 0 or mine[at] == 1 < other[d]:
                    return True
    return False


def _mesh_beside(rt: Any, wire: list, tmask: int) -> tuple | None:
    """The mesh of an op's first placed operand, where it spans several workers."""
    placer = rt.dispatcher.placer
    if not placer.active:
        return None
    for i, tid in enumerate(wire):
        if tmask >> i & 1 and tid is not None:
            mesh = placer.placement(tid).mesh
            return mesh if len(mesh) > 1 else None
    return None


def upload(value: torch.Tensor, copy: bool = True) -> Tensor:
    """Send a CPU tensor's bytes to the worker that will hold it: a private copy, as the caller
    may change its array afterwards, unless ``copy`` is False (a held value that nothing else
    can reach: a parameter's, whose copy cost GPT-3 6.7B's float32 weights minutes of page
    faults on rank 0)."""
    value = value.contiguous()
    if copy:
        value = value.clone()
    rt = runtime()
    out = rt.new_id()
    sig = (value.shape, value.dtype)
    rt.dispatcher.upload(("upload", out, sig, 0, None), value)
    rt.note_site(out)
    return Tensor(out, sig)


_PLAIN = (Tensor, *SCALARS)  # operands that need no conversion
_URGENT_NUMEL = 1 << 16  # results this large are worth a message of their own to an idle worker
_INPLACE = frozenset(name for name, op in OPS.items() if op.kind is Kind.INPLACE)
_SELECTIONS = frozenset({"getitem", "index_select"})
# ops whose result may share its first operand's storage (a view, or the operand itself)
_ALIASING = VIEWS | frozenset(name for name, op in OPS.items()
                              if op.kind in (Kind.SHAPE, Kind.INDEX)) | {"to"}
# in-place ops that autograd records as their out-of-place form, the tensor becoming its result
_OUT_OF_PLACE = {"iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "truediv",
                 "clamp_": "clamp", "masked_fill_": "masked_fill", "copy_": None}


def _out_of_place(name: str, operands: list, kw: dict | None) -> Tensor:
    target = operands[0]
    if name == "copy_":  # the source as the target's shape and dtype, a value of its own
        src = operands[1] if isinstance(operands[1], Tensor) else \
            apply("full", tuple(target.shape), operands[1], target.dtype)
        return apply("clone", apply("expand", src.to(target.dtype), tuple(target.shape)))
    # the op reads the target through a second name: a rule that saves its operand saves that
    # one, which stays the old value when the target becomes the result (x.mul_(3) as torch's)
    aliased = target._aliased
    before = apply("alias", target)
    target._aliased = aliased
    return apply(_OUT_OF_PLACE[name], before, *operands[1:], **(kw or {}))


def _rebind(target: Tensor, name: str, result: Tensor) -> Tensor:
    """``name`` in place on ``target`` where autograd records it: ``target`` becomes
    ``result`` (its value, its place in the graph), as torch's in-place op makes the tensor the
    op's output. Refused where that could not be the in-place op: a leaf that requires grad
    (torch's error), a view or a viewed tensor (the other tensors of its storage would keep
    the old value). A gradient rule that saved ``target`` and runs later refuses (_version)."""
    if target.requires_grad and target._node is None:
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                           "operation.")
    if target._aliased:
        raise RuntimeError(f"gtmpi: in-place '{name}' under autograd on a view, or on a tensor "
                           "a view was taken of: not supported (the views would keep the old "
                           "values); use the out-of-place op, or gtmpi.no_grad()")
    if tuple(result.shape) != tuple(target.shape):
        raise RuntimeError(f"output with shape {list(target.shape)} doesn't match the "
                           f"broadcast shape {list(result.shape)}")
    if result.dtype != target.dtype:
        result = result.to(target.dtype)
    rt = runtime()
    if target._id is not None:
        rt.dispatcher.frees.append(target._id)
    target._id, result._id = result._id, None
    target._host = target._recipe = None
    target._sig, target._strides = result._sig, result._strides
    target._node, target._slot = result._node, result._slot
    target.requires_grad = result.requires_grad
    target._version += 1
    return target
_RECORDED = frozenset(FUSED_FNS)
_SCALARS = frozenset({int, float, bool})  # an operand that is no array, at a glance
# ops whose result is a new value or, at most, an operand itself: no view of one
_FRESH = frozenset(name for name, op in OPS.items()
                   if op.kind in (Kind.ELEMENTWISE, Kind.REDUCE, Kind.MATMUL)) | \
    {"cat", "stack", "clone", "contiguous"}


def _operand(a) -> Any:
    """Numpy arrays and torch tensors become gtmpi tensors; numpy scalars Python scalars."""
    if isinstance(a, (np.ndarray, torch.Tensor)):
        return from_data(a, None, False, {})
    if isinstance(a, numbers.Number):
        return a.item() if hasattr(a, "item") else a
    return a


def hold(value: torch.Tensor, device: torch.device | None, recipe: tuple | None = None) -> Tensor:
    """A CPU value kept by the client until a worker needs it (client/host.py), or on the
    workers at once where it is placed now (a GPU device, a signal's scope): by its recipe,
    else by its bytes, straight to where the signal places it."""
    rt = runtime()
    if rt.dispatcher.placer.signals:  # a scope open (a signal's, beside()): placed by it
        return apply(*recipe) if recipe is not None else upload(value)
    t = Tensor.held(value, recipe)
    # one a config's 'uploads' would split waits for its first use however it was made
    # (device="cuda", host tensors off): that use tells a batch (split) from a constant beside
    # one (whole: _beside_a_batch); placed now, a per-channel scale would be split and its use
    # would gather the batch
    if not host.allowed(rt, device) and t._implicit(rt.signals) != "uploads":
        t.id  # placed now, as a held value is at its first use
    return t


def constant(name: str, make: Callable[[], torch.Tensor], args: tuple,
             device: torch.device | None, numel: int) -> Tensor:
    """A small tensor of known values, held by the client with its recipe (a worker that needs
    it runs the recipe: no bytes move); a large one made by a worker."""
    if numel <= host.HOST_NUMEL and host.allowed(runtime(), device):
        return hold(make(), device, (name, *args))
    return apply(name, *args)  # not held: made by a worker, with no value computed here


def filled(name: str, size: tuple, dtype: torch.dtype | None, requires_grad: bool, kw: dict,
           *values: Any) -> Tensor:
    """torch's zeros, ones or full (``values``: its fill value) of ``size``, on the device
    ``kw`` names."""
    device, shape = with_device(kw), _sizes(size)
    t = constant(name, lambda: getattr(torch, name)(shape, *values, dtype=dtype),
                 (shape, *values, dtype), device, math.prod(shape))
    return t.requires_grad_() if requires_grad else t


def from_data(data: Any, dtype: Any, requires_grad: bool, kw: dict) -> Tensor:
    """torch.tensor's copy of ``data`` (nested lists, scalars, numpy, torch, gtmpi)."""
    device = with_device(kw)
    dtype = as_dtype(dtype)
    if isinstance(data, Tensor):
        with gradmode.no_grad():
            t = data.clone() if dtype is None or dtype == data.dtype else data.to(dtype)
    else:
        if isinstance(data, torch.Tensor):
            value = data.detach().to("cpu", dtype or data.dtype)
        elif isinstance(data, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(data))
            value = value.to(dtype) if dtype is not None else value
        else:
            value = torch.tensor(data, dtype=dtype)
        t = hold(value.clone(), device)
    return t.requires_grad_() if requires_grad else t


def _sizes(args: tuple) -> tuple:
    """Accept f(2, 3), f((2, 3)) and f([2, 3]) alike."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


def _dims(dim) -> Any:
    return tuple(dim) if isinstance(dim, list) else dim


def with_device(kw: dict) -> torch.device | None:
    """torch's device= (and pin_memory=, layout=) on creation, checked. Which worker holds a
    tensor is the runtime's choice, by signals and configs; the device says only whether the
    client may hold it until used (none or the CPU: client/host.py)."""
    device = kw.pop("device", None)
    kw.pop("pin_memory", None)
    kw.pop("layout", None)
    if kw:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(kw)}")
    if device is None or isinstance(device, torch.device):
        return device
    return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)


def split_device(args: tuple, kwargs: dict) -> tuple[torch.dtype | None, torch.device | None]:
    """The dtype and the device among .to()'s arguments (devices checked)."""
    dtype = as_dtype(kwargs.pop("dtype", None))
    kwargs.pop("non_blocking", None)
    kwargs.pop("copy", None)
    kwargs.pop("memory_format", None)
    device = with_device(kwargs)
    for a in args:
        if isinstance(a, Tensor):
            dtype = a.dtype
            device = a.device
        elif isinstance(a, torch.device):
            device = a
        elif isinstance(a, int) and not isinstance(a, bool):
            device = torch.device("cuda", a)
        elif isinstance(a, str) and _is_device(a):
            device = torch.device(a)
        else:
            try:
                dtype = as_dtype(a)
            except TypeError:
                if isinstance(a, str):
                    torch.device(a)  # neither a dtype nor a device: torch's error names it
                raise
    return dtype, device


def _is_device(name: str) -> bool:
    try:
        torch.device(name)
    except RuntimeError:
        return False
    return True


def _axis(dim, kw: dict):
    if "axis" in kw:
        dim = kw.pop("axis")
    return tuple(dim) if isinstance(dim, list) else dim


def _keepdim(keepdim: bool, kw: dict) -> bool:
    keepdim = kw.pop("keepdims", keepdim)
    if kw:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(kw)}")
    return bool(keepdim)


def _reduce(name: str, x: Tensor, dim, keepdim, kw: dict):
    dim = _axis(dim, kw)
    return apply(name, x, dim, _keepdim(keepdim, kw))


def _extreme(which: str, x: Tensor, dim, keepdim, kw: dict):
    """torch's max/min: all elements, (values, indices) along an int dim, or the elementwise
    maximum with another tensor. GT's axis= (and a tuple of dims) gives the values only."""
    if isinstance(dim, Tensor):
        return apply("maximum" if which == "max" else "minimum", x, dim)
    by_axis = "axis" in kw
    dim = _axis(dim, kw)
    keepdim = _keepdim(keepdim, kw)
    if isinstance(dim, int) and not by_axis:
        return MinMax(*apply(f"{which}_dim", x, dim, keepdim))
    return apply("amax" if which == "max" else "amin", x, dim, keepdim)


def _spread(name, x, dim, unbiased, keepdim, correction, ddof, kw):
    dim = _axis(dim, kw)
    if correction is None:
        correction = ddof if ddof is not None else (0 if unbiased is False else 1)
    return apply(name, x, dim, correction, _keepdim(keepdim, kw))


def _index(key) -> tuple[tuple, list, tuple | None]:
    """Split an index key into a picklable template ("T" marks each tensor) and its tensors.

    With boolean masks present, also return what shape inference uses instead: each k-dim
    mask stands as k int64 index vectors of its true count (read from the worker, as torch
    itself must synchronise for boolean indexing).
    """
    items = key if isinstance(key, tuple) else (key,)
    template, tensors, meta_template, meta_sigs, has_mask = [], [], [], [], False
    for item in items:
        if isinstance(item, (np.ndarray, torch.Tensor)):
            item = _operand(item)
        if isinstance(item, Tensor):
            template.append("T")
            tensors.append(item)
            if item.dtype == torch.bool:
                has_mask = True
                count = int(apply("sum", item, None, False).item())
                k = max(item.ndim, 1)
                meta_template.extend(["T"] * k)
                meta_sigs.extend([(torch.Size([count]), torch.int64)] * k)
            else:
                meta_template.append("T")
                meta_sigs.append(item._sig)
        else:
            if isinstance(item, slice):  # bounds that are tensors are read here, as torch does
                item = slice(*(b if b is None or type(b) is int else operator.index(b)
                               for b in (item.start, item.stop, item.step)))
            elif isinstance(item, Sequence) and not isinstance(item, str):
                item = list(item)
            template.append(item)
            meta_template.append(item)
    shape_as = (len(tensors), tuple(meta_template), tuple(meta_sigs)) if has_mask else None
    return tuple(template), tensors, shape_as
