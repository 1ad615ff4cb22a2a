"""Layers with torch's parameter names, shapes and default initialisations."""
from __future__ import annotations

import copy
import functools
import math
from typing import Any

import torch

from ..client.creation import empty, full, ones, zeros
from ..autograd import no_grad
from ..client.functions import cat, stack
from ..client.tensor import Tensor
from . import functional as F
from . import init
from .module import Module, ModuleList
from .parameter import Parameter


def _factory_keywords(cls: type) -> type:
    """torch's factory keywords on a layer's constructor, ``device=`` and ``dtype=``: its
    floating parameters and buffers made (and drawn) in that dtype, and on a GPU device handed
    to the workers at once (Module.to)."""
    made = cls.__init__

    @functools.wraps(made)
    def __init__(self, *args: Any, device: Any = None, dtype: Any = None, **kwargs: Any) -> None:
        before = torch.get_default_dtype()
        if dtype is not None:  # made and drawn in it, as torch draws them (not cast after)
            torch.set_default_dtype(dtype)
        try:
            made(self, *args, **kwargs)
        finally:
            torch.set_default_dtype(before)
        if device is not None:
            self.to(device)
    cls.__init__ = __init__
    return cls


def _affine(n: int, affine: bool) -> tuple[Parameter | None, Parameter | None]:
    """A normalization's per-channel scale and shift (ones and zeros), or none."""
    return (Parameter(ones(n)), Parameter(zeros(n))) if affine else (None, None)


def _kaiming(weight_shape: tuple, bias: bool, fan_in: int,
             outputs: int | None = None) -> tuple[Parameter, Parameter | None]:
    """torch's Linear and Conv parameters, drawn as torch draws them (reset_parameters): the
    weight by kaiming_uniform with a=√5, then the bias ~ U(-1/√fan_in, 1/√fan_in), one per
    output (the weight's first dimension unless ``outputs``: a transposed convolution's)."""
    weight = Parameter(empty(weight_shape))
    init.kaiming_uniform_(weight, a=math.sqrt(5))
    if not bias:
        return weight, None
    b = Parameter(empty(weight_shape[0] if outputs is None else outputs))
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    init.uniform_(b, -bound, bound)
    return weight, b


@_factory_keywords
class Linear(Module):
    """y = x Wᵀ + b; W and b ~ U(-1/√in, 1/√in), torch's default (kaiming_uniform, a=√5)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight, self.bias = _kaiming((out_features, in_features), bias, in_features)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@_factory_keywords
class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: int | None = None, _weight: Tensor | None = None,
                 _freeze: bool = False) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx = padding_idx
        if _weight is not None:  # torch's: the weight given, as it is
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError("Shape of weight does not match num_embeddings and "
                                 "embedding_dim")
            self.weight = Parameter(_weight, requires_grad=not _freeze)
            return
        self.weight = Parameter(empty(num_embeddings, embedding_dim))
        init.normal_(self.weight)
        if padding_idx is not None:
            with no_grad():
                self.weight[padding_idx] = 0.0

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, freeze: bool = True,
                        padding_idx: int | None = None) -> "Embedding":
        """torch's: an Embedding whose weight is ``embeddings`` (trained unless ``freeze``)."""
        if embeddings.ndim != 2:
            raise ValueError("Embeddings parameter is expected to be 2-dimensional")
        rows, cols = embeddings.shape
        return cls(rows, cols, padding_idx, _weight=embeddings, _freeze=freeze)

    def forward(self, indices: Tensor) -> Tensor:
        return F.embedding(indices, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


@_factory_keywords
class LayerNorm(Module):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True) -> None:
        super().__init__()
        self.normalized_shape = F.normalized(normalized_shape)
        self.eps = eps
        self.weight = Parameter(ones(self.normalized_shape)) if elementwise_affine else None
        self.bias = Parameter(zeros(self.normalized_shape)) if elementwise_affine and bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


@_factory_keywords
class RMSNorm(Module):
    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.normalized_shape = F.normalized(normalized_shape)
        self.eps = eps
        self.weight = Parameter(ones(self.normalized_shape)) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class Dropout(Module):
    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__()
        self.p, self.inplace = p, inplace

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training, self.inplace)


class ReLU(Module):
    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x, inplace=self.inplace)


class GELU(Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate=self.approximate)


class SiLU(Module):
    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, x: Tensor) -> Tensor:
        return F.silu(x, inplace=self.inplace)


class Softmax(Module):
    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return F.softmax(x, self.dim)


@_factory_keywords
class MultiheadSelfAttention(Module):
    """Self-attention over (batch, sequence, embed): one fused q/k/v projection, n_heads heads
    of scaled dot-product attention (causal by default), an output projection."""

    def __init__(self, embed_dim: int, num_heads: int, causal: bool = True, bias: bool = True,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads, self.causal, self.dropout = embed_dim, num_heads, causal, dropout
        self.qkv = Linear(embed_dim, 3 * embed_dim, bias)
        self.proj = Linear(embed_dim, embed_dim, bias)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        h = self.num_heads
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.reshape(B, T, h, C // h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Identity(Module):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()

    def forward(self, x: Tensor) -> Tensor:
        return x


class Flatten(Module):
    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(self.start_dim, self.end_dim)


class Tanh(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.tanh()


class Sigmoid(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.sigmoid()


class LeakyReLU(Module):
    def __init__(self, negative_slope: float = 0.01, inplace: bool = False) -> None:
        super().__init__()
        self.negative_slope, self.inplace = negative_slope, inplace

    def forward(self, x: Tensor) -> Tensor:
        return F.leaky_relu(x, self.negative_slope, self.inplace)


_REQUIRED = object()  # an argument torch's constructor has no default for


def _module_over(name: str, fn: Any, **defaults: Any) -> type:
    """The module class torch has over function ``fn`` (an activation, a resampling): its constructor takes ``defaults``'
    names, in that order, as torch's does, keeps them as attributes, and its forward calls
    ``fn`` with them."""
    names = list(defaults)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        Module.__init__(self)
        if len(args) > len(names) or set(kwargs) - set(names):
            raise TypeError(f"{name}.__init__() takes the arguments {names}")
        given = {**dict(zip(names, args)), **kwargs}
        for key, default in defaults.items():
            value = given.get(key, default)
            if value is _REQUIRED:
                raise TypeError(f"{name}.__init__() missing required argument: '{key}'")
            setattr(self, key, value)

    def forward(self, x: Tensor) -> Tensor:
        return fn(x, **{key: getattr(self, key) for key in names})

    def extra_repr(self) -> str:
        return ", ".join(f"{key}={getattr(self, key)}" for key in names if key != "inplace")
    return type(name, (Module,), {"__init__": __init__, "forward": forward,
                                  "extra_repr": extra_repr, "__module__": __name__,
                                  "__qualname__": name, "__doc__": f"torch.nn.{name}"})


def _legacy_dim(fn: Any) -> Any:
    """Softmin's and LogSoftmax's dim=None: torch's old rule (0 for 0-, 1- and 3-dimensional
    input, else 1)."""
    def call(x: Tensor, dim: int | None) -> Tensor:
        return fn(x, dim if dim is not None else 0 if x.dim() in (0, 1, 3) else 1)
    return call


Hardtanh = _module_over("Hardtanh", F.hardtanh, min_val=-1.0, max_val=1.0, inplace=False)
ReLU6 = _module_over("ReLU6", F.relu6, inplace=False)
ELU = _module_over("ELU", F.elu, alpha=1.0, inplace=False)
CELU = _module_over("CELU", F.celu, alpha=1.0, inplace=False)
SELU = _module_over("SELU", F.selu, inplace=False)
Softplus = _module_over("Softplus", F.softplus, beta=1.0, threshold=20.0)
Mish = _module_over("Mish", F.mish, inplace=False)
Hardsigmoid = _module_over("Hardsigmoid", F.hardsigmoid, inplace=False)
Hardswish = _module_over("Hardswish", F.hardswish, inplace=False)
Softsign = _module_over("Softsign", F.softsign)
Tanhshrink = _module_over("Tanhshrink", F.tanhshrink)
LogSigmoid = _module_over("LogSigmoid", F.logsigmoid)
GLU = _module_over("GLU", F.glu, dim=-1)
Threshold = _module_over("Threshold", F.threshold, threshold=_REQUIRED, value=_REQUIRED,
                        inplace=False)
Softmin = _module_over("Softmin", _legacy_dim(F.softmin), dim=None)
LogSoftmax = _module_over("LogSoftmax", _legacy_dim(F.log_softmax), dim=None)


Upsample = _module_over("Upsample", F.interpolate, size=None, scale_factor=None,
                        mode="nearest", align_corners=None, recompute_scale_factor=None)
PixelShuffle = _module_over("PixelShuffle", F.pixel_shuffle, upscale_factor=_REQUIRED)
PixelUnshuffle = _module_over("PixelUnshuffle", F.pixel_unshuffle, downscale_factor=_REQUIRED)


class Dropout1d(Dropout):
    def forward(self, x: Tensor) -> Tensor:
        return F.dropout1d(x, self.p, self.training, self.inplace)


class Dropout2d(Dropout):
    def forward(self, x: Tensor) -> Tensor:
        return F.dropout2d(x, self.p, self.training, self.inplace)


class _Pad(Module):
    """torch's padding modules: F.pad's ``mode`` over the last ``dims`` dimensions, ``padding``
    one number for every side or (left, right[, top, bottom])."""
    mode, dims = "constant", 1

    def __init__(self, padding: int | tuple[int, ...], value: float = 0.0) -> None:
        super().__init__()
        self.padding = (padding,) * 2 * self.dims if isinstance(padding, int) else tuple(padding)
        if self.mode == "constant":
            self.value = value

    def forward(self, x: Tensor) -> Tensor:
        return F.pad(x, self.padding, self.mode, getattr(self, "value", None))

    def extra_repr(self) -> str:
        return f"{self.padding}" + (f", value={self.value}" if self.mode == "constant" else "")


class ConstantPad1d(_Pad):
    def __init__(self, padding: int | tuple[int, ...], value: float) -> None:
        super().__init__(padding, value)


class ConstantPad2d(ConstantPad1d):
    dims = 2


class ZeroPad1d(_Pad):
    def __init__(self, padding: int | tuple[int, ...]) -> None:
        super().__init__(padding, 0.0)


class ZeroPad2d(ZeroPad1d):
    dims = 2


class ReflectionPad1d(_Pad):
    mode = "reflect"


class ReflectionPad2d(ReflectionPad1d):
    dims = 2


class ReplicationPad1d(_Pad):
    mode = "replicate"


class ReplicationPad2d(ReplicationPad1d):
    dims = 2


@_factory_keywords
class PReLU(Module):
    def __init__(self, num_parameters: int = 1, init: float = 0.25) -> None:
        super().__init__()
        self.num_parameters = num_parameters
        self.weight = Parameter(full((num_parameters,), init))

    def forward(self, x: Tensor) -> Tensor:
        return F.prelu(x, self.weight)


class Unflatten(Module):
    def __init__(self, dim: int, unflattened_size: tuple[int, ...]) -> None:
        super().__init__()
        self.dim, self.unflattened_size = dim, tuple(unflattened_size)

    def forward(self, x: Tensor) -> Tensor:
        dim = self.dim % x.dim()
        return x.view(*x.shape[:dim], *self.unflattened_size, *x.shape[dim + 1:])


class CrossEntropyLoss(Module):
    def __init__(self, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.ignore_index, self.reduction, self.label_smoothing = \
            ignore_index, reduction, label_smoothing

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(input, target, self.ignore_index, self.reduction,
                               self.label_smoothing)


class MSELoss(Module):
    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(input, target, self.reduction)


class _Loss(Module):
    """A loss module over its function: ``reduction`` and the function's other keywords, kept
    as attributes under torch's names."""

    def __init__(self, reduction: str = "mean", **options: Any) -> None:
        super().__init__()
        self.reduction = reduction
        self._options = tuple(options)
        for key, value in options.items():
            setattr(self, key, value)

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return self.fn(input, target, reduction=self.reduction,
                       **{key: getattr(self, key) for key in self._options})


class L1Loss(_Loss):
    fn = staticmethod(F.l1_loss)


class BCELoss(_Loss):
    fn = staticmethod(F.binary_cross_entropy)


class BCEWithLogitsLoss(_Loss):
    fn = staticmethod(F.binary_cross_entropy_with_logits)


class SmoothL1Loss(_Loss):
    fn = staticmethod(F.smooth_l1_loss)

    def __init__(self, reduction: str = "mean", beta: float = 1.0) -> None:
        super().__init__(reduction, beta=beta)


class HuberLoss(_Loss):
    fn = staticmethod(F.huber_loss)

    def __init__(self, reduction: str = "mean", delta: float = 1.0) -> None:
        super().__init__(reduction, delta=delta)


class KLDivLoss(_Loss):
    fn = staticmethod(F.kl_div)

    def __init__(self, reduction: str = "mean", log_target: bool = False) -> None:
        super().__init__(reduction, log_target=log_target)


class CosineSimilarity(Module):
    def __init__(self, dim: int = 1, eps: float = 1e-8) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        return F.cosine_similarity(x1, x2, self.dim, self.eps)


class PairwiseDistance(Module):
    def __init__(self, p: float = 2.0, eps: float = 1e-6, keepdim: bool = False) -> None:
        super().__init__()
        self.norm, self.eps, self.keepdim = p, eps, keepdim

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        return F.pairwise_distance(x1, x2, self.norm, self.eps, self.keepdim)


@_factory_keywords
class GroupNorm(Module):
    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5,
                 affine: bool = True) -> None:
        super().__init__()
        if num_channels % num_groups:
            raise ValueError("num_channels must be divisible by num_groups")
        self.num_groups, self.num_channels, self.eps, self.affine = \
            num_groups, num_channels, eps, affine
        self.weight, self.bias = _affine(num_channels, affine)

    def forward(self, x: Tensor) -> Tensor:
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


@_factory_keywords
class _InstanceNorm(Module):
    dims: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = False, track_running_stats: bool = False) -> None:
        super().__init__()
        if track_running_stats:
            raise NotImplementedError("gtmpi's InstanceNorm: track_running_stats=True is not "
                                      "supported yet")
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        self.weight, self.bias = _affine(num_features, affine)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim not in self.dims:
            raise ValueError(f"expected {' or '.join(f'{d}D' for d in self.dims)} input "
                             f"(got {x.ndim}D input)")
        if x.ndim == self.dims[0]:  # unbatched: one sample
            return F.instance_norm(x.unsqueeze(0), weight=self.weight, bias=self.bias,
                                   eps=self.eps).squeeze(0)
        return F.instance_norm(x, weight=self.weight, bias=self.bias, eps=self.eps)


class InstanceNorm1d(_InstanceNorm):
    dims = (2, 3)


class InstanceNorm2d(_InstanceNorm):
    dims = (3, 4)


class NLLLoss(Module):
    def __init__(self, ignore_index: int = -100, reduction: str = "mean") -> None:
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.nll_loss(input, target, self.ignore_index, self.reduction)


@_factory_keywords
class MultiheadAttention(Module):
    """torch.nn.MultiheadAttention's API, parameters and state-dict keys (``in_proj_weight``,
    ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``), for query, key and value of the
    same width. Without attention weights wanted it is torch's fused attention kernel; with
    them, the scores are formed and returned (averaged over heads unless told)."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False) -> None:
        super().__init__()
        if add_bias_kv or add_zero_attn or (kdim or embed_dim) != embed_dim or \
                (vdim or embed_dim) != embed_dim:
            raise NotImplementedError("gtmpi's MultiheadAttention: add_bias_kv, add_zero_attn "
                                      "and kdim/vdim other than embed_dim are not supported")
        if embed_dim % num_heads:
            raise AssertionError("embed_dim must be divisible by num_heads")
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.batch_first, self.head_dim = batch_first, embed_dim // num_heads
        # torch's order of draws: the projection's Linear, then in_proj_weight
        self.in_proj_weight = Parameter(empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = Parameter(zeros(3 * embed_dim)) if bias else None
        self.out_proj = Linear(embed_dim, embed_dim, bias)
        init.xavier_uniform_(self.in_proj_weight)
        if bias:
            init.zeros_(self.out_proj.bias)

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Tensor | None = None, need_weights: bool = True,
                attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        if not self.batch_first and query.ndim == 3:  # (L, N, E) -> (N, L, E)
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        N, L, E = query.shape
        S, h, d = key.shape[1], self.num_heads, self.head_dim
        w = self.in_proj_weight.chunk(3)
        b = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
        q, k, v = (F.linear(t, wi, bi).reshape(N, n, h, d).transpose(1, 2)
                   for t, wi, bi, n in zip((query, key, value), w, b, (L, S, S)))
        mask = _additive(attn_mask, key_padding_mask, is_causal, N, h, L, S, q.dtype)
        p = self.dropout if self.training else 0.0
        if need_weights:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            weights = (scores if mask is None else scores + mask).softmax(-1)
            y = F.dropout(weights, p) @ v
        else:
            y, weights = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p), None
        y = self.out_proj(y.transpose(1, 2).reshape(N, L, E))
        if not self.batch_first and query.ndim == 3:
            y = y.transpose(0, 1)
        if weights is not None and average_attn_weights:
            weights = weights.mean(1)
        return y, weights


class _RNNBase(Module):
    """torch's LSTM and GRU: ``num_layers`` layers (each direction's parameters under torch's
    names, weight_ih_l0, weight_hh_l0_reverse, ..., drawn as torch draws them), the input's
    projection for every step in one matmul, then the recurrence step by step; dropout
    between layers in training; (L, N, H_in), batch_first (N, L, H_in) or unbatched (L, H_in)
    input, as torch's."""
    gates = 0

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 bidirectional: bool = False, proj_size: int = 0) -> None:
        super().__init__()
        if proj_size:
            raise NotImplementedError(f"gtmpi's {type(self).__name__}: proj_size")
        if not 0 <= dropout <= 1:
            raise ValueError("dropout should be a number in range [0, 1] representing the "
                             "probability of an element being zeroed")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional = bidirectional
        directions = 2 if bidirectional else 1
        for layer in range(num_layers):
            width = input_size if layer == 0 else hidden_size * directions
            for suffix in [f"_l{layer}", f"_l{layer}_reverse"][:directions]:
                setattr(self, "weight_ih" + suffix,
                        Parameter(empty(self.gates * hidden_size, width)))
                setattr(self, "weight_hh" + suffix,
                        Parameter(empty(self.gates * hidden_size, hidden_size)))
                if bias:
                    setattr(self, "bias_ih" + suffix, Parameter(empty(self.gates * hidden_size)))
                    setattr(self, "bias_hh" + suffix, Parameter(empty(self.gates * hidden_size)))
        bound = 1.0 / math.sqrt(hidden_size)
        for weight in self.parameters():
            init.uniform_(weight, -bound, bound)

    def forward(self, input: Tensor, hx: Any = None) -> tuple[Tensor, Any]:
        unbatched = input.dim() == 2
        x = input.unsqueeze(1) if unbatched else \
            input.transpose(0, 1) if self.batch_first else input
        directions = 2 if self.bidirectional else 1
        states = self._initial(x, hx, unbatched, directions)
        last: list[list[Tensor]] = [[] for _ in states]
        for layer in range(self.num_layers):
            outs = []
            for direction in range(directions):
                at = layer * directions + direction
                suffix = f"_l{layer}" + ("_reverse" if direction else "")
                w_ih, w_hh = getattr(self, "weight_ih" + suffix), getattr(self, "weight_hh" + suffix)
                b_ih = getattr(self, "bias_ih" + suffix) if self.bias else None
                b_hh = getattr(self, "bias_hh" + suffix) if self.bias else None
                projected = F.linear(x, w_ih, b_ih)  # every step's input at once
                state = [s[at] for s in states]
                ys: list[Tensor] = [None] * x.shape[0]  # type: ignore[list-item]
                for t in (reversed(range(x.shape[0])) if direction else range(x.shape[0])):
                    state = self.cell(projected[t], F.linear(state[0], w_hh, b_hh), state)
                    ys[t] = state[0]
                outs.append(stack(ys, 0))
                for kept, s in zip(last, state):
                    kept.append(s)
            x = outs[0] if directions == 1 else cat(outs, -1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout)
        output = x.squeeze(1) if unbatched else x.transpose(0, 1) if self.batch_first else x
        finals = [stack(kept, 0) for kept in last]
        if unbatched:
            finals = [f.squeeze(1) for f in finals]
        return output, (tuple(finals) if len(finals) > 1 else finals[0])

    def _initial(self, x: Tensor, hx: Any, unbatched: bool, directions: int) -> list[Tensor]:
        """The initial states (h, and c for an LSTM), (layers * directions, N, H) each."""
        count = 2 if self.gates == 4 else 1
        if hx is None:
            shape = (self.num_layers * directions, x.shape[1], self.hidden_size)
            return [x.new_zeros(*shape) for _ in range(count)]
        given = list(hx) if isinstance(hx, (tuple, list)) else [hx]
        return [h.unsqueeze(1) if unbatched else h for h in given]

    def cell(self, projected: Tensor, recurrent: Tensor, state: list[Tensor]) -> list[Tensor]:
        raise NotImplementedError


class LSTM(_RNNBase):
    gates = 4

    def cell(self, projected: Tensor, recurrent: Tensor, state: list[Tensor]) -> list[Tensor]:
        i, f, g, o = (projected + recurrent).chunk(4, -1)
        c = f.sigmoid() * state[1] + i.sigmoid() * g.tanh()
        return [o.sigmoid() * c.tanh(), c]


class GRU(_RNNBase):
    gates = 3

    def cell(self, projected: Tensor, recurrent: Tensor, state: list[Tensor]) -> list[Tensor]:
        (xr, xz, xn), (hr, hz, hn) = projected.chunk(3, -1), recurrent.chunk(3, -1)
        r, z = (xr + hr).sigmoid(), (xz + hz).sigmoid()
        n = (xn + r * hn).tanh()
        return [n + z * (state[0] - n)]


class TransformerEncoderLayer(Module):
    """torch's: self-attention then a feed-forward block, each with dropout, a residual and a
    layer norm (after, or before with ``norm_first``); torch's submodules and state-dict keys
    (``self_attn``, ``linear1``, ``linear2``, ``norm1``, ``norm2``). Composed of gtmpi's layers:
    torch's fused fast path in evaluation is its numbers within rounding."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: Any = "relu", layer_norm_eps: float = 1e-5,
                 batch_first: bool = False, norm_first: bool = False, bias: bool = True) -> None:
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout1, self.dropout2 = Dropout(dropout), Dropout(dropout)
        if isinstance(activation, str):
            if activation not in ("relu", "gelu"):
                raise RuntimeError(f"activation should be relu/gelu, not {activation}")
            activation = F.relu if activation == "relu" else F.gelu
        self.activation = activation

    def forward(self, src: Tensor, src_mask: Tensor | None = None,
                src_key_padding_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        x = src
        if self.norm_first:
            x = x + self._attention(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self._feed_forward(self.norm2(x))
        x = self.norm1(x + self._attention(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self._feed_forward(x))

    def _attention(self, x: Tensor, mask: Tensor | None, padding: Tensor | None,
                   is_causal: bool) -> Tensor:
        return self.dropout1(self.self_attn(x, x, x, attn_mask=mask, key_padding_mask=padding,
                                            need_weights=False, is_causal=is_causal)[0])

    def _feed_forward(self, x: Tensor) -> Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class TransformerEncoder(Module):
    """torch's: ``num_layers`` copies of ``encoder_layer`` (deep copies: the same initial
    weights, as torch's), then ``norm`` if given."""

    def __init__(self, encoder_layer: TransformerEncoderLayer, num_layers: int,
                 norm: Module | None = None, enable_nested_tensor: bool = True,
                 mask_check: bool = True) -> None:
        super().__init__()
        self.layers = ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers, self.norm = num_layers, norm

    def forward(self, src: Tensor, mask: Tensor | None = None,
                src_key_padding_mask: Tensor | None = None,
                is_causal: bool | None = None) -> Tensor:
        out = src
        for layer in self.layers:
            out = layer(out, src_mask=mask, src_key_padding_mask=src_key_padding_mask,
                        is_causal=bool(is_causal))
        return self.norm(out) if self.norm is not None else out


def _additive(attn_mask: Tensor | None, key_padding_mask: Tensor | None, is_causal: bool,
              N: int, h: int, L: int, S: int, dtype) -> Tensor | None:
    """torch's masks of MultiheadAttention as one additive float mask: boolean True (and a
    padded key) is a position not attended to, a float mask is added as it is."""
    mask = None
    if attn_mask is None and is_causal:
        attn_mask = ones(L, S).triu(1) > 0
    if attn_mask is not None:
        mask = zeros(attn_mask.shape, dtype=dtype).masked_fill(attn_mask, float("-inf")) \
            if attn_mask.dtype == torch.bool else attn_mask.to(dtype)
        mask = mask.reshape(N, h, L, S) if mask.ndim == 3 else mask
    if key_padding_mask is not None:
        pad = zeros(N, S, dtype=dtype).masked_fill(key_padding_mask, float("-inf")) \
            if key_padding_mask.dtype == torch.bool else key_padding_mask.to(dtype)
        pad = pad.reshape(N, 1, 1, S)
        mask = pad if mask is None else mask + pad
    return mask


def _convolution(layer: Module, in_channels: int, out_channels: int, kernel_size: Any,
                 groups: int, padding_mode: str) -> tuple[int, ...]:
    """A convolution's checks and its sizes kept under torch's names; its kernel per dim."""
    if padding_mode != "zeros":
        raise NotImplementedError("gtmpi's convolutions pad with zeros only")
    if in_channels % groups or out_channels % groups:
        raise ValueError("in_channels and out_channels must be divisible by groups")
    kernel = (kernel_size,) * layer.dims if isinstance(kernel_size, int) else tuple(kernel_size)
    layer.in_channels, layer.out_channels, layer.kernel_size = in_channels, out_channels, kernel
    return kernel


@_factory_keywords
class _ConvNd(Module):
    """torch's Conv1d/Conv2d: weight (out, in/groups, *kernel) and bias ~ U(-1/√fan_in,
    1/√fan_in) (kaiming_uniform with a=√5), padding by zeros."""

    dims = 0

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros"):
        super().__init__()
        kernel = _convolution(self, in_channels, out_channels, kernel_size, groups, padding_mode)
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.weight, self.bias = _kaiming((out_channels, in_channels // groups, *kernel), bias,
                                          in_channels // groups * math.prod(kernel))

    def forward(self, x: Tensor) -> Tensor:
        conv = F.conv1d if self.dims == 1 else F.conv2d
        return conv(x, self.weight, self.bias, self.stride, self.padding, self.dilation,
                    self.groups)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}")


class Conv1d(_ConvNd):
    dims = 1


@_factory_keywords
class _ConvTransposeNd(_ConvNd):
    """torch's ConvTranspose1d/2d: weight (in, out/groups, *kernel) and bias ~ U(-1/√fan_in,
    1/√fan_in), fan_in from the weight's second dimension (torch's rule), padding by zeros."""

    dims = 0

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 output_padding=0, groups: int = 1, bias: bool = True, dilation=1,
                 padding_mode: str = "zeros"):
        Module.__init__(self)
        kernel = _convolution(self, in_channels, out_channels, kernel_size, groups, padding_mode)
        self.stride, self.padding, self.output_padding = stride, padding, output_padding
        self.groups, self.dilation = groups, dilation
        self.weight, self.bias = _kaiming((in_channels, out_channels // groups, *kernel), bias,
                                          out_channels // groups * math.prod(kernel),
                                          out_channels)

    def forward(self, x: Tensor, output_size: Any = None) -> Tensor:
        if output_size is not None:
            raise NotImplementedError(f"gtmpi's {type(self).__name__}: output_size= (give "
                                      "output_padding)")
        conv = F.conv_transpose1d if self.dims == 1 else F.conv_transpose2d
        return conv(x, self.weight, self.bias, self.stride, self.padding, self.output_padding,
                    self.groups, self.dilation)


class ConvTranspose1d(_ConvTransposeNd):
    dims = 1


class ConvTranspose2d(_ConvTransposeNd):
    dims = 2


class Conv2d(_ConvNd):
    dims = 2


class _Pool(Module):
    """torch's pooling layers: their constructor's arguments, kept under torch's names, given
    to the F form of the same name."""

    function: Any = None
    names: tuple[str, ...] = ()
    defaults: tuple = ()
    shown: tuple[str, ...] = ("kernel_size", "stride", "padding")  # torch's repr

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        if len(args) > len(self.names):
            raise TypeError(f"{type(self).__name__}() takes at most {len(self.names)} arguments")
        values = dict(zip(self.names, self.defaults))
        values.update(zip(self.names, args))
        for name, value in kwargs.items():
            if name not in values:
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument "
                                f"'{name}'")
            values[name] = value
        if "stride" in values and values["stride"] is None:
            values["stride"] = values["kernel_size"]  # as torch's constructor keeps it
        for name, value in values.items():
            setattr(self, name, value)

    def forward(self, x: Tensor) -> Tensor:
        return type(self).function(x, *(getattr(self, name) for name in self.names))

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)}" for name in self.shown)


_MAX = ("kernel_size", "stride", "padding", "dilation", "return_indices", "ceil_mode")
_AVG = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")


class MaxPool1d(_Pool):
    names, defaults = _MAX, (None, None, 0, 1, False, False)
    shown = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool1d(x, self.kernel_size, self.stride, self.padding, self.dilation,
                            self.ceil_mode, self.return_indices)


class MaxPool2d(_Pool):
    names, defaults = _MAX, (None, None, 0, 1, False, False)
    shown = MaxPool1d.shown

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation,
                            self.ceil_mode, self.return_indices)


class AvgPool1d(_Pool):
    names, defaults = _AVG, (None, None, 0, False, True)
    function = staticmethod(F.avg_pool1d)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in ("kernel_size", "stride", "padding"):  # torch keeps these as 1-tuples
            value = getattr(self, name)
            setattr(self, name, (value,) if isinstance(value, int) else tuple(value))


class AvgPool2d(_Pool):
    names, defaults = (*_AVG, "divisor_override"), (None, None, 0, False, True, None)
    function = staticmethod(F.avg_pool2d)


class AdaptiveAvgPool1d(_Pool):
    names = shown = ("output_size",)
    defaults = (None,)
    function = staticmethod(F.adaptive_avg_pool1d)


class AdaptiveAvgPool2d(_Pool):
    names = shown = ("output_size",)
    defaults = (None,)
    function = staticmethod(F.adaptive_avg_pool2d)


@_factory_keywords
class _BatchNorm(Module):
    """torch's BatchNorm: affine weight and bias, running mean and variance with momentum and
    a count of batches seen, all in the state dict under torch's names."""

    dims: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True):
        super().__init__()
        if momentum is None:
            raise NotImplementedError("gtmpi's BatchNorm: momentum=None (a cumulative average) "
                                      "is not supported")
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        self.weight, self.bias = _affine(num_features, affine)
        if track_running_stats:
            self.register_buffer("running_mean", zeros(num_features))
            self.register_buffer("running_var", ones(num_features))
            self.register_buffer("num_batches_tracked", zeros((), dtype=torch.int64))

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim not in self.dims:
            raise ValueError(f"expected {' or '.join(f'{d}D' for d in self.dims)} input "
                             f"(got {x.ndim}D input)")
        batch_stats = self.training or not self.track_running_stats
        if self.training and self.track_running_stats:
            self.num_batches_tracked += 1
        return F.batch_norm(x, self.running_mean if self.track_running_stats else None,
                            self.running_var if self.track_running_stats else None,
                            self.weight, self.bias, batch_stats, self.momentum, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


class BatchNorm1d(_BatchNorm):
    dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    dims = (4,)
