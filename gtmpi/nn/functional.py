"""Layers and losses as functions of gtmpi tensors. Where torch has a fused kernel (layer and
RMS norm, attention, embedding, cross-entropy, linear) the function is that one instruction,
with torch's backward kernel as its gradient; the rest are composed from the op vocabulary.
Semantics and defaults follow torch.nn.functional."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch

from ..client.creation import beside, rand_like, tensor
from ..client.generator import worker_seed
from ..client.functions import (gelu, log_softmax, relu, sigmoid, silu, softmax, stack, tanh,
                                where)
from ..autograd import no_grad
from ..client.tensor import Tensor, apply

__all__ = ["linear", "relu", "gelu", "silu", "tanh", "sigmoid", "leaky_relu", "softmax",
           "log_softmax", "dropout", "layer_norm", "rms_norm", "embedding",
           "scaled_dot_product_attention", "one_hot", "pad", "normalize", "conv1d", "conv2d",
           "max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d", "adaptive_avg_pool1d",
           "adaptive_avg_pool2d",
           "batch_norm", "mse_loss", "nll_loss",
           "cross_entropy", "linear_cross_entropy", "LinearCrossEntropyOptions",
           "binary_cross_entropy",
           "binary_cross_entropy_with_logits"]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x Wᵀ + b as one instruction (three as matmul, transpose and add)."""
    if bias is not None and _split_along(weight, 1):
        # row parallel: the products are partial sums; the bias is added once, after them
        return apply("linear", x, weight, None) + bias
    return apply("linear", x, weight, bias)


def conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: int | tuple = 1,
           padding: int | tuple | str = 0, dilation: int | tuple = 1,
           groups: int = 1) -> Tensor:
    return _conv("conv1d", x, weight, bias, stride, padding, dilation, groups)


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: int | tuple = 1,
           padding: int | tuple | str = 0, dilation: int | tuple = 1,
           groups: int = 1) -> Tensor:
    return _conv("conv2d", x, weight, bias, stride, padding, dilation, groups)


def _conv(name: str, x, weight, bias, stride, padding, dilation, groups: int) -> Tensor:
    return apply(name, x, weight, bias, *map(_per_dim, (stride, padding, dilation)), groups)


def conv_transpose1d(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                     stride: int | tuple = 1, padding: int | tuple = 0,
                     output_padding: int | tuple = 0, groups: int = 1,
                     dilation: int | tuple = 1) -> Tensor:
    return _conv_transpose("conv_transpose1d", x, weight, bias, stride, padding, output_padding,
                           groups, dilation)


def conv_transpose2d(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                     stride: int | tuple = 1, padding: int | tuple = 0,
                     output_padding: int | tuple = 0, groups: int = 1,
                     dilation: int | tuple = 1) -> Tensor:
    return _conv_transpose("conv_transpose2d", x, weight, bias, stride, padding, output_padding,
                           groups, dilation)


def _conv_transpose(name: str, x, weight, bias, stride, padding, output_padding, groups: int,
                    dilation) -> Tensor:
    # torch's argument order: the kernel (torch's own) and its gradient (torch's, vjp) take it
    return apply(name, x, weight, bias, *map(_per_dim, (stride, padding, output_padding)),
                 groups, _per_dim(dilation))


Size = int | tuple[int, ...] | list[int]  # a pooling's sizes: one for every dim, or per dim


def max_pool1d(x: Tensor, kernel_size: Size, stride: Size | None = None, padding: Size = 0,
               dilation: Size = 1, ceil_mode: bool = False,
               return_indices: bool = False) -> Tensor:
    return _max_pool("max_pool1d", x, kernel_size, stride, padding, dilation, ceil_mode,
                     return_indices)


def max_pool2d(x: Tensor, kernel_size: Size, stride: Size | None = None, padding: Size = 0,
               dilation: Size = 1, ceil_mode: bool = False,
               return_indices: bool = False) -> Tensor:
    return _max_pool("max_pool2d", x, kernel_size, stride, padding, dilation, ceil_mode,
                     return_indices)


def _max_pool(name: str, x: Tensor, kernel_size, stride, padding, dilation, ceil_mode: bool,
              return_indices: bool) -> Tensor:
    if return_indices:
        raise NotImplementedError("gtmpi's max pooling: return_indices=True (the indices for "
                                  "max_unpool) is not supported")
    return apply(name, x, *map(_per_dim, (kernel_size, stride, padding, dilation)),
                 bool(ceil_mode))


def avg_pool1d(x: Tensor, kernel_size: Size, stride: Size | None = None, padding: Size = 0,
               ceil_mode: bool = False,
               count_include_pad: bool = True) -> Tensor:
    return apply("avg_pool1d", x, *map(_per_dim, (kernel_size, stride, padding)),
                 bool(ceil_mode), bool(count_include_pad))


def avg_pool2d(x: Tensor, kernel_size: Size, stride: Size | None = None, padding: Size = 0,
               ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: int | None = None) -> Tensor:
    return apply("avg_pool2d", x, *map(_per_dim, (kernel_size, stride, padding)),
                 bool(ceil_mode), bool(count_include_pad), divisor_override)


def adaptive_avg_pool1d(x: Tensor, output_size: Size) -> Tensor:
    return apply("adaptive_avg_pool1d", x, _per_dim(output_size))


def adaptive_avg_pool2d(x: Tensor, output_size: Size | tuple[int | None, ...]) -> Tensor:
    return apply("adaptive_avg_pool2d", x, _per_dim(output_size))


def batch_norm(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
               weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """torch's: in training, normalised by the batch's statistics, and the running ones (if
    given) updated in place on the workers."""
    if training and running_mean is not None:
        with no_grad():
            apply("batch_norm_update_", running_mean, running_var, x, float(momentum))
    return apply("batch_norm", x, running_mean, running_var, weight, bias, bool(training),
                 float(eps))


def _per_dim(v):
    """torch takes an int, a tuple or a list (or 'same'/'valid' for padding)."""
    return tuple(v) if isinstance(v, list) else v


def leaky_relu(x: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    out = apply("leaky_relu", x, negative_slope)
    return x.copy_(out) if inplace else out


# torch's other activations, each composed of the table's ops by torch's formula (their
# gradients follow from the ops'); ``inplace`` writes the result into the input, as leaky_relu's
def _written(x: Tensor, out: Tensor, inplace: bool) -> Tensor:
    return x.copy_(out) if inplace else out


def hardtanh(x: Tensor, min_val: float = -1.0, max_val: float = 1.0,
             inplace: bool = False) -> Tensor:
    return _written(x, x.clamp(min_val, max_val), inplace)


def relu6(x: Tensor, inplace: bool = False) -> Tensor:
    return hardtanh(x, 0.0, 6.0, inplace)


def elu(x: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:
    return _written(x, where(x > 0, x, alpha * x.expm1()), inplace)


def celu(x: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:
    return _written(x, where(x > 0, x, alpha * (x / alpha).expm1()), inplace)


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def selu(x: Tensor, inplace: bool = False) -> Tensor:
    return _written(x, _SELU_SCALE * where(x > 0, x, _SELU_ALPHA * x.expm1()), inplace)


def softplus(x: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    return where(x * beta > threshold, x, (x * beta).exp().log1p() / beta)


def mish(x: Tensor, inplace: bool = False) -> Tensor:
    return _written(x, x * softplus(x).tanh(), inplace)


def hardsigmoid(x: Tensor, inplace: bool = False) -> Tensor:
    return _written(x, (x + 3.0).clamp(0.0, 6.0) / 6.0, inplace)


def hardswish(x: Tensor, inplace: bool = False) -> Tensor:
    return _written(x, x * (x + 3.0).clamp(0.0, 6.0) / 6.0, inplace)


def softsign(x: Tensor) -> Tensor:
    return x / (x.abs() + 1.0)


def tanhshrink(x: Tensor) -> Tensor:
    return x - x.tanh()


def logsigmoid(x: Tensor) -> Tensor:
    # torch's stable form: no exp of a large positive number
    return x.clamp(max=0.0) - (-x.abs()).exp().log1p()


def softmin(x: Tensor, dim: int, dtype: torch.dtype | None = None) -> Tensor:
    return softmax(-x, dim, dtype=dtype)


def glu(x: Tensor, dim: int = -1) -> Tensor:
    if x.shape[dim] % 2:
        raise RuntimeError(f"Halving dimension must be even, but dimension {dim % x.dim()} is "
                           f"size {x.shape[dim]}")
    a, b = x.chunk(2, dim)
    return a * b.sigmoid()


def threshold(x: Tensor, threshold: float, value: float, inplace: bool = False) -> Tensor:
    return _written(x, where(x > threshold, x, value), inplace)


def prelu(x: Tensor, weight: Tensor) -> Tensor:
    # one slope, or one per channel (dimension 1)
    slope = weight if weight.numel() == 1 or x.dim() < 2 else \
        weight.reshape(-1, *[1] * (x.dim() - 2))
    return where(x >= 0, x, slope * x)


def _channel_dropout(x: Tensor, p: float, training: bool, inplace: bool, dims: int) -> Tensor:
    """dropout1d/2d/3d: whole channels dropped (one draw per sample and channel, the kept
    scaled by 1 / (1 - p)); ``dims`` the spatial dimensions of a batched input."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if x.dim() not in (dims + 1, dims + 2):
        raise RuntimeError(f"dropout{dims}d: Expected {dims + 1}D or {dims + 2}D input, but "
                           f"received a {x.dim()}D input")
    if not training or p == 0.0:
        return x
    keep = dropout(x.new_ones(*x.shape[:x.dim() - dims], *(1,) * dims), p)
    return _written(x, x * keep, inplace)


def dropout1d(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    return _channel_dropout(x, p, training, inplace, 1)


def dropout2d(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    return _channel_dropout(x, p, training, inplace, 2)


def pixel_shuffle(x: Tensor, upscale_factor: int) -> Tensor:
    r = upscale_factor
    *batch, c, h, w = x.shape
    out = x.reshape(*batch, c // (r * r), r, r, h, w)
    lead = len(batch)
    out = out.permute(*range(lead), lead, lead + 3, lead + 1, lead + 4, lead + 2)
    return out.reshape(*batch, c // (r * r), h * r, w * r)


def pixel_unshuffle(x: Tensor, downscale_factor: int) -> Tensor:
    r = downscale_factor
    *batch, c, h, w = x.shape
    out = x.reshape(*batch, c, h // r, r, w // r, r)
    lead = len(batch)
    out = out.permute(*range(lead), lead, lead + 2, lead + 4, lead + 1, lead + 3)
    return out.reshape(*batch, c * r * r, h // r, w // r)


def interpolate(x: Tensor, size: int | Sequence[int] | None = None,
                scale_factor: float | Sequence[float] | None = None, mode: str = "nearest",
                align_corners: bool | None = None,
                recompute_scale_factor: bool | None = None) -> Tensor:
    """torch's resampling of the last 1 or 2 dimensions: 'nearest' (torch's floor rule),
    'linear' and 'bilinear' (each dimension in turn, align_corners as torch's), by gathering
    rows and mixing them: the table's ops, so their gradients follow."""
    dims = x.dim() - 2
    if mode not in ("nearest", "linear", "bilinear") or dims not in (1, 2) or \
            (mode == "linear") != (dims == 1) and mode != "nearest":
        raise NotImplementedError(f"gtmpi's interpolate: mode '{mode}' on a {x.dim()}D input "
                                  "(nearest, linear on 3D, bilinear on 4D so far)")
    if mode == "nearest" and align_corners is not None:
        raise ValueError("align_corners option can only be set with the interpolating modes: "
                         "linear | bilinear | bicubic | trilinear")
    sizes_in = list(x.shape[2:])
    if size is not None:
        out = [size] * dims if isinstance(size, int) else list(size)
        scales = [None] * dims
    else:
        factors = [scale_factor] * dims if isinstance(scale_factor, (int, float)) else \
            list(scale_factor)
        out = [int(math.floor(n * f)) for n, f in zip(sizes_in, factors)]
        # torch's kernels use the given factor unless told to recompute it from the sizes
        scales = [None if recompute_scale_factor else 1.0 / f for f in factors]
    for d, (n_in, n_out, scale) in enumerate(zip(sizes_in, out, scales)):
        dim = 2 + d
        ratio = scale if scale is not None else n_in / n_out
        if mode == "nearest":
            at = torch.clamp((torch.arange(n_out, dtype=torch.float64) * ratio).floor().long(),
                             max=n_in - 1)
            x = x.index_select(dim, _index(x, at))
            continue
        if align_corners:
            source = torch.arange(n_out, dtype=torch.float64) * \
                ((n_in - 1) / (n_out - 1) if n_out > 1 else 0.0)
        else:
            source = ((torch.arange(n_out, dtype=torch.float64) + 0.5) * ratio - 0.5).clamp(
                min=0.0)
        low = source.floor().long().clamp(max=n_in - 1)
        high = (low + 1).clamp(max=n_in - 1)
        weight = (source - low).to(torch.get_default_dtype() if not x.dtype.is_floating_point
                                   else x.dtype)
        shape = [1] * x.dim()
        shape[dim] = n_out
        w = _index(x, weight.reshape(shape))
        below, above = x.index_select(dim, _index(x, low)), x.index_select(dim, _index(x, high))
        x = below + (above - below) * w
    return x


def _index(x: Tensor, values: torch.Tensor) -> Tensor:
    """A host constant beside ``x`` (its indices or weights)."""
    with beside(x):
        return tensor(values)


def one_hot(indices: Tensor, num_classes: int = -1) -> Tensor:
    """int64 one-hot rows; num_classes=-1 reads the largest index (a wait, as in torch)."""
    if num_classes == -1:
        num_classes = int(indices.max().item()) + 1
    elif num_classes < 0:
        raise RuntimeError("Class values must be smaller than num_classes.")
    return apply("one_hot", indices, num_classes)


def pad(x: Tensor, pad: tuple, mode: str = "constant", value: float | None = None) -> Tensor:
    return apply("pad", x, tuple(pad), mode, value)


def normalize(x: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12) -> Tensor:
    return apply("normalize", x, dim, p, eps)


def dropout(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        out = x * 0.0
    else:
        # as torch's fused dropout on a GPU: the mask drawn (one kernel, laid out like x), then
        # applied and scaled (one more); the gradient applies the same mask, the one tensor saved
        if x._host is not None:  # held by the client: from torch's CPU generator, as torch's
            mask = rand_like(x) >= p
        else:
            with beside(x):
                mask = apply("dropout_mask", tuple(x.shape), float(p), worker_seed())
        out = apply("masked_scale", x, mask, 1.0 / (1.0 - p))
    return x.copy_(out) if inplace else out


def normalized(shape: int | Sequence[int]) -> tuple[int, ...]:
    """A normalized_shape as a tuple (torch accepts an int for one dim)."""
    return (shape,) if isinstance(shape, int) else tuple(shape)


def layer_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    return apply("layer_norm", x, normalized(normalized_shape), weight, bias, eps)


def rms_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
             eps: float | None = None) -> Tensor:
    return apply("rms_norm", x, normalized(normalized_shape), weight, eps)


def embedding(indices: Tensor, weight: Tensor, padding_idx: int | None = None) -> Tensor:
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return apply("embedding", indices, weight, padding_idx)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """softmax(q kᵀ · scale + mask) v over the last two dims as torch's fused kernel (flash or
    memory-efficient attention on GPUs: the scores are never materialised); ``is_causal``
    masks the future without a mask tensor; ``enable_gqa``: k and v of fewer heads than q,
    each serving a group of q's heads in turn (their heads repeated, as torch's math path)."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    if dropout_p:
        from ..client.runtime import runtime
        return apply("scaled_dot_product_attention", q, k, v, attn_mask, dropout_p, is_causal,
                     scale, seed=runtime().next_seed())
    return apply("scaled_dot_product_attention", q, k, v, attn_mask, dropout_p, is_causal, scale)


def _reduce(loss: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"{reduction} is not a valid value for reduction")


def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    d = input - target
    return _reduce(d * d, reduction)


def nll_loss(log_probs: Tensor, target: Tensor, ignore_index: int = -100,
             reduction: str = "mean") -> Tensor:
    """log_probs (N, C), target (N,) class indices."""
    keep = target != ignore_index
    safe = where(keep, target, 0)
    # a gather along the classes, row by row: a batch split over workers stays split
    picked = log_probs.gather(1, safe.unsqueeze(1)).squeeze(1)
    loss = -(picked * keep)
    if reduction == "mean":
        return loss.sum() / keep.sum()
    return _reduce(loss, reduction)


def cross_entropy(input: Tensor, target: Tensor, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """input (N, C) logits; target (N,) class indices. One instruction forward, one backward."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    from ..client.runtime import runtime
    rt = runtime()
    region = rt.autocast
    extra = {}
    if region is not None and region.composite_cross_entropy and not label_smoothing and \
            input.dtype in (torch.bfloat16, torch.float16) and not _split_along(input, 1):
        # torch's CUDA autocast has no rule for cross_entropy: its composite takes log_softmax
        # in the logits' own dtype and nll_loss in float32; the same kernels here, in one
        # instruction, so that the loss is torch's
        extra["nll_float32"] = True
    if reduction == "mean" and _split_along(input, 0):
        # each worker sums its rows' losses; the mean divides by all the rows that count
        total = apply("cross_entropy", input, target, ignore_index, "sum", label_smoothing,
                      **extra)
        return _per_counted(total, target, ignore_index)
    return apply("cross_entropy", input, target, ignore_index, reduction, label_smoothing,
                 **extra)


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyOptions:
    """torch.nn.LinearCrossEntropyOptions (torch 2.13), for torch versions without it: passed
    as ``options``, linear_cross_entropy takes the rows in chunks and never holds the whole
    logits. ``batch_chunk_size``: rows per chunk; else ``chunking_method`` sizes them, as
    torch's does: "aspect_ratio" makes a chunk's logits as large as the input,
    "aspect_ratio:N" N times smaller, "auto" is "aspect_ratio:2" ("aspect_ratio" for
    half-precision rows on CPUs). ``acc_policy``: "compact" sums a half-precision weight's
    gradient over the chunks in its own dtype, the others in float32; "auto" is "compact",
    "accurate" for half-precision rows on CPUs. gtmpi's chunked loss may be run backward
    again whatever ``allow_retain_graph`` says."""
    allow_retain_graph: bool = False
    batch_chunk_size: int | None = None
    chunking_method: str | None = "auto"
    acc_policy: str = "auto"


def linear_cross_entropy(input: Tensor, linear_weight: Tensor, target: Tensor, *,
                         linear_bias: Tensor | None = None, weight: Tensor | None = None,
                         reduction: str = "mean", ignore_index: int | None = None,
                         label_smoothing: float = 0.0, options: Any = None) -> Tensor:
    """torch.nn.functional.linear_cross_entropy (torch 2.13):
    cross_entropy(linear(input, linear_weight, linear_bias), target). With ``options`` (a
    LinearCrossEntropyOptions, torch's or gtmpi's) the (N, C) rows go in chunks and the whole
    (N, classes) logits are never held: a language model's logits are most of its step's
    activation memory.

    A chunked mean or sum is one instruction: each chunk's logits are reduced to its losses
    and, when gradients are recorded, at once to the input's and the weight's gradients (kept
    until backward, which only scales them), so the step runs the head's three matmuls as the
    whole-logits loss does. Per-row losses, label smoothing and a head split over workers
    (tensor parallelism) take a composition instead: each chunk's loss checkpointed and made
    again in its backward (one more matmul of the head). There a chunk is every k-th row (rows
    j, j + k, ...), so a batch split over data-parallel workers stays split."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if weight is not None:
        raise NotImplementedError("gtmpi's cross_entropy takes no class weights")
    ignore_index = -100 if ignore_index is None else ignore_index
    if options is None:  # torch's reference path
        return cross_entropy(linear(input, linear_weight, linear_bias), target, ignore_index,
                             reduction, label_smoothing)
    rows = _chunk_rows(options, input, linear_weight)
    if reduction != "none" and not label_smoothing and not _split_along(input, 1) and \
            not _split_along(linear_weight, 0) and not _split_along(linear_weight, 1):
        from ..client.runtime import runtime
        region = runtime().autocast
        # autocast: the loss in float32, as torch's lists make it (CPU: cross_entropy in
        # float32; CUDA: its composite's nll_loss in float32, after log_softmax rounded the
        # log-probabilities to the logits' dtype)
        kw = {} if region is None else \
            {"float32": True, "rounded": True} if region.composite_cross_entropy else \
            {"float32": True}
        if _compact(options, input, linear_weight):
            kw["compact"] = True
        if reduction == "mean" and _split_along(input, 0):
            total = apply("linear_cross_entropy", input, linear_weight, target, linear_bias,
                          ignore_index, "sum", rows, **kw)
            return _per_counted(total, target, ignore_index)
        return apply("linear_cross_entropy", input, linear_weight, target, linear_bias,
                     ignore_index, reduction, rows, **kw)
    from ..utils.checkpoint import checkpoint
    (n, c), k = input.shape, _chunks(input.shape[0], rows)
    parts, targets = input.view(n // k, k, c), target.view(n // k, k)
    each = "none" if reduction == "none" else "sum"

    def piece(x: Tensor, t: Tensor) -> Tensor:
        return cross_entropy(linear(x, linear_weight, linear_bias), t, ignore_index, each,
                             label_smoothing)

    losses = [checkpoint(piece, parts[:, j], targets[:, j], use_reentrant=False)
              for j in range(k)]
    if reduction == "none":
        return stack(losses, 1).view(n)
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    if reduction == "sum":
        return total
    return _per_counted(total, target, ignore_index)


def _per_counted(total: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """A mean of the rows' losses from their sum: divided by the count of the rows that count
    (every worker's, where the rows are split over workers)."""
    return total / (target != ignore_index).sum().to(total.dtype)


def _compact(options: Any, input: Tensor, weight: Tensor) -> bool:
    """Whether a half-precision weight's gradient is summed over the chunks in its own dtype
    (torch's acc_policy "compact", its "auto" pick on GPUs) rather than in float32."""
    policy = getattr(options, "acc_policy", "auto")
    half = (torch.bfloat16, torch.float16)
    if policy == "auto":
        policy = "accurate" if input.device.type == "cpu" and input.dtype in half else "compact"
    return policy == "compact" and weight.dtype in half


def _chunk_rows(options: Any, input: Tensor, weight: Tensor) -> int:
    """Rows per chunk, as torch's LinearCrossEntropyOptions sizes them."""
    rows = getattr(options, "batch_chunk_size", None)
    method = getattr(options, "chunking_method", "auto")
    if rows is not None:
        if method not in (None, "auto"):
            raise ValueError("LinearCrossEntropyOptions: batch_chunk_size and chunking_method "
                             "both set")
        if rows < 1:
            raise ValueError(f"LinearCrossEntropyOptions: batch_chunk_size {rows} < 1")
        return rows
    if method is None:  # no heuristic and no size: one chunk
        return max(input.shape[0], 1)
    if method == "auto":
        half = input.dtype in (torch.bfloat16, torch.float16)
        method = "aspect_ratio" if half and input.device.type == "cpu" else "aspect_ratio:2"
    name, _, by = method.partition(":")
    if name != "aspect_ratio" or not (by or "1").isdigit() or int(by or 1) < 1:
        raise ValueError(f"LinearCrossEntropyOptions: unknown chunking_method {method!r}")
    n, features = max(input.shape[0], 1), input.shape[-1]
    per = -(-n // -(-weight.shape[0] // features))  # a chunk's logits as large as the input
    return max(1 << (per - 1).bit_length(), int(by or 1)) // int(by or 1)


def _chunks(n: int, size: int) -> int:
    """The fewest pieces of at most about ``size`` rows that divide n rows evenly."""
    k = max(1, -(-n // max(size, 1)))
    while n % k:
        k += 1
    return k


def _split_along(t: Tensor, dim: int) -> bool:
    """Whether t lies in pieces along ``dim`` on some mesh axis (where a fused op would need
    its operands whole)."""
    from ..client.runtime import runtime
    return ("S", dim) in runtime().dispatcher.placer.placement(t.id).per_axis()


def l1_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    return _reduce((input - target).abs(), reduction)


def smooth_l1_loss(input: Tensor, target: Tensor, reduction: str = "mean",
                   beta: float = 1.0) -> Tensor:
    d = (input - target).abs()
    if beta == 0.0:
        return _reduce(d, reduction)
    return _reduce(where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta), reduction)


def huber_loss(input: Tensor, target: Tensor, reduction: str = "mean",
               delta: float = 1.0) -> Tensor:
    d = (input - target).abs()
    return _reduce(where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta)), reduction)


def kl_div(input: Tensor, target: Tensor, reduction: str = "mean",
           log_target: bool = False) -> Tensor:
    """input: log-probabilities; target: probabilities (log-probabilities if log_target).
    'batchmean' divides the sum by the batch size, as the KL divergence's definition asks."""
    if log_target:
        loss = target.exp() * (target - input)
    else:  # 0 where the target is 0 (torch's xlogy)
        loss = where(target > 0, target * (target.clamp(min=1e-45).log() - input), 0.0)
    if reduction == "batchmean":
        return loss.sum() / input.shape[0]
    return _reduce(loss, reduction)


def cosine_similarity(x1: Tensor, x2: Tensor, dim: int = 1, eps: float = 1e-8) -> Tensor:
    # torch's: the dot product over the product of the norms, each norm at least eps
    n1 = (x1 * x1).sum(dim).sqrt().clamp(min=eps)
    n2 = (x2 * x2).sum(dim).sqrt().clamp(min=eps)
    return (x1 * x2).sum(dim) / (n1 * n2)


def pairwise_distance(x1: Tensor, x2: Tensor, p: float = 2.0, eps: float = 1e-6,
                      keepdim: bool = False) -> Tensor:
    d = (x1 - x2 + eps).abs()
    return (d ** p).sum(-1, keepdim=keepdim) ** (1.0 / p)


def group_norm(x: Tensor, num_groups: int, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Each sample's channels in ``num_groups`` groups, each group normalized over its
    channels and positions (biased variance), then the per-channel affine."""
    n, c = x.shape[0], x.shape[1]
    if c % num_groups:
        raise RuntimeError(f"Expected number of channels in input to be divisible by "
                           f"num_groups, but got input of shape {tuple(x.shape)} and "
                           f"num_groups={num_groups}")
    grouped = x.reshape(n, num_groups, -1)
    mean = grouped.mean(-1, keepdim=True)
    var = grouped.var(-1, unbiased=False, keepdim=True)
    out = ((grouped - mean) * (var + eps).rsqrt()).reshape(*x.shape)
    along = (1, c) + (1,) * (x.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(*along)
    if bias is not None:
        out = out + bias.reshape(*along)
    return out


def instance_norm(x: Tensor, running_mean: Tensor | None = None,
                  running_var: Tensor | None = None, weight: Tensor | None = None,
                  bias: Tensor | None = None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """Each sample's each channel normalized over its positions (group norm, a group per
    channel); running statistics are not kept (torch's default, track_running_stats=False)."""
    if running_mean is not None or running_var is not None or not use_input_stats:
        raise NotImplementedError("gtmpi's instance_norm: running statistics "
                                  "(track_running_stats=True) are not supported yet")
    return group_norm(x, x.shape[1], weight, bias, eps)


def binary_cross_entropy(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    log_p = input.log().clamp(min=-100.0)
    log_q = (1 - input).log().clamp(min=-100.0)
    return _reduce(-(target * log_p + (1 - target) * log_q), reduction)


def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    # max(x, 0) - x t + log(1 + exp(-|x|)): never overflows
    loss = input.clamp(min=0.0) - input * target + (1 + (-abs(input)).exp()).log()
    return _reduce(loss, reduction)
