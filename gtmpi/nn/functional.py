"""Layers and losses as functions of gtmpi tensors. Where torch has a fused kernel (layer and
RMS norm, attention, embedding, cross-entropy, linear) the function is that one instruction,
with torch's backward kernel as its gradient; the rest are composed from the op vocabulary.
Semantics and defaults follow torch.nn.functional."""
from __future__ import annotations

import torch

from ..client.creation import rand_like
from ..client.functions import (gelu, log_softmax, relu, sigmoid, silu, softmax, stack, tanh,
                                where)
from ..autograd import no_grad
from ..client.tensor import Tensor, apply

__all__ = ["linear", "relu", "gelu", "silu", "tanh", "sigmoid", "leaky_relu", "softmax",
           "log_softmax", "dropout", "layer_norm", "rms_norm", "embedding",
           "scaled_dot_product_attention", "one_hot", "pad", "normalize", "conv1d", "conv2d",
           "batch_norm", "mse_loss", "nll_loss",
           "cross_entropy", "linear_cross_entropy", "binary_cross_entropy",
           "binary_cross_entropy_with_logits"]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x Wᵀ + b as one instruction (three as matmul, transpose and add)."""
    if bias is not None and _split_along(weight, 1):
        # row parallel: the products are partial sums; the bias is added once, after them
        return apply("linear", x, weight, None) + bias
    return apply("linear", x, weight, bias)


def conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0,
           dilation=1, groups: int = 1) -> Tensor:
    return _conv("conv1d", x, weight, bias, stride, padding, dilation, groups)


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0,
           dilation=1, groups: int = 1) -> Tensor:
    return _conv("conv2d", x, weight, bias, stride, padding, dilation, groups)


def _conv(name: str, x, weight, bias, stride, padding, dilation, groups: int) -> Tensor:
    return apply(name, x, weight, bias, *map(_per_dim, (stride, padding, dilation)), groups)


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
    return apply("leaky_relu", x, negative_slope)


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


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    keep = rand_like(x) >= p
    return x * keep * (1.0 / (1.0 - p))


def normalized(shape) -> tuple[int, ...]:
    """A normalized_shape as a tuple (torch accepts an int for one dim)."""
    return (shape,) if isinstance(shape, int) else tuple(shape)


def layer_norm(x: Tensor, normalized_shape, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    return apply("layer_norm", x, normalized(normalized_shape), weight, bias, eps)


def rms_norm(x: Tensor, normalized_shape, weight: Tensor | None = None,
             eps: float | None = None) -> Tensor:
    return apply("rms_norm", x, normalized(normalized_shape), weight, eps)


def embedding(indices: Tensor, weight: Tensor, padding_idx: int | None = None) -> Tensor:
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return apply("embedding", indices, weight, padding_idx)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None) -> Tensor:
    """softmax(q kᵀ · scale + mask) v over the last two dims as torch's fused kernel (flash or
    memory-efficient attention on GPUs: the scores are never materialised); ``is_causal``
    masks the future without a mask tensor."""
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
        return total / (target != ignore_index).sum().to(total.dtype)
    return apply("cross_entropy", input, target, ignore_index, reduction, label_smoothing,
                 **extra)


def linear_cross_entropy(input: Tensor, weight: Tensor, target: Tensor,
                         bias: Tensor | None = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         chunk_size: int = 1024) -> Tensor:
    """cross_entropy(linear(input, weight, bias), target) that never holds the whole logits:
    input (N, C) rows in chunks of about ``chunk_size``, each chunk's logits made, reduced to
    its losses and dropped, and made again in its backward (activation checkpointing per
    chunk: one more matmul of the head). A language model's (tokens, vocabulary) logits are
    most of its step's activation memory. A chunk is every k-th row (rows j, j + k, ...), so a
    batch split over data-parallel workers stays split."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    from ..utils.checkpoint import checkpoint
    (n, c), k = input.shape, _chunks(input.shape[0], chunk_size)
    rows, targets = input.view(n // k, k, c), target.view(n // k, k)
    each = "none" if reduction == "none" else "sum"

    def piece(x: Tensor, t: Tensor) -> Tensor:
        return cross_entropy(linear(x, weight, bias), t, ignore_index, each, label_smoothing)

    parts = [checkpoint(piece, rows[:, j], targets[:, j], use_reentrant=False) for j in range(k)]
    if reduction == "none":
        return stack(parts, 1).view(n)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().to(total.dtype)


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


def binary_cross_entropy(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    log_p = input.log().clamp(min=-100.0)
    log_q = (1 - input).log().clamp(min=-100.0)
    return _reduce(-(target * log_p + (1 - target) * log_q), reduction)


def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    # max(x, 0) - x t + log(1 + exp(-|x|)): never overflows
    loss = input.clamp(min=0.0) - input * target + (1 + (-abs(input)).exp()).log()
    return _reduce(loss, reduction)
