"""Gradient clipping by global norm, computed and applied on the workers (no read)."""
from __future__ import annotations

from typing import Iterable

from ..autograd import no_grad
from ..client.runtime import runtime
from ..client.tensor import Tensor


@no_grad()
def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                    eps: float = 1e-6) -> Tensor:
    """Scale every gradient by min(1, max_norm / total_norm); return total_norm (a tensor)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        raise ValueError("clip_grad_norm_ found no gradients")
    # gradients on several meshes (pipeline stages): each part of the norm is made where its
    # gradients are; only those scalars, and the scale, travel
    with runtime().dispatcher.placer.asking():
        if norm_type == float("inf"):
            total = grads[0].abs().max()
            for g in grads[1:]:
                total = total.maximum(g.abs().max())
        else:
            total = sum((g.abs() ** norm_type).sum() for g in grads) ** (1.0 / norm_type)
        scale = (max_norm / (total + eps)).clamp(max=1.0)
        for g in grads:
            g *= scale
    return total
