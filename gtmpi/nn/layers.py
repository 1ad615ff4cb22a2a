"""Layers with torch's parameter names, shapes and default initialisations."""
from __future__ import annotations

import math

from ..client.creation import ones, rand, randn, zeros
from ..client.tensor import Tensor
from . import functional as F
from .module import Module
from .parameter import Parameter


def _uniform(shape, bound: float) -> Tensor:
    return rand(*shape) * (2 * bound) - bound


class Linear(Module):
    """y = x Wᵀ + b; W and b ~ U(-1/√in, 1/√in), torch's default (kaiming_uniform, a=√5)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
        self.weight = Parameter(_uniform((out_features, in_features), bound))
        self.bias = Parameter(_uniform((out_features,), bound)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx = padding_idx
        weight = randn(num_embeddings, embedding_dim)
        if padding_idx is not None:
            weight[padding_idx] = 0.0
        self.weight = Parameter(weight)

    def forward(self, indices: Tensor) -> Tensor:
        return F.embedding(indices, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


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


class RMSNorm(Module):
    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.normalized_shape = F.normalized(normalized_shape)
        self.eps = eps
        self.weight = Parameter(ones(self.normalized_shape)) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class Dropout(Module):
    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training)


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class GELU(Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate=self.approximate)


class SiLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.silu(x)


class Softmax(Module):
    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return F.softmax(x, self.dim)


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
