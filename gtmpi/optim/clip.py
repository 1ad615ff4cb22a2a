"""Gradient clipping by global norm, computed and applied on the workers (no read), with
torch's arithmetic: the norm of each gradient's norm (foreach), times min(1, max/(norm+eps))."""
from __future__ import annotations

import functools
from typing import Callable, Iterable

from ..autograd import no_grad
from ..client.creation import zeros
from ..client.replay import as_is, capture_enabled, repeated_at
from ..client.runtime import Runtime, runtime
from ..client.tensor import Tensor, apply


@no_grad()
def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                    eps: float = 1e-6) -> Tensor:
    """Scale every gradient by min(1, max_norm / total_norm); return total_norm (a tensor)."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:  # nothing to scale, and the norm of nothing is 0, as torch returns it
        return zeros(())
    rt = runtime()
    run = functools.partial(_clip, rt, grads, max_norm, norm_type, eps)
    if not capture_enabled(rt):
        return run(as_is)
    # a step's gradients are new tensors each time: bound, never followed
    key = (tuple(g._sig for g in grads), float(max_norm), float(norm_type), eps)
    return repeated_at(rt, "clip_grad_norm_")(rt, key, grads, set(), run)


def _clip(rt: Runtime, grads: list[Tensor], max_norm: float, norm_type: float, eps: float,
          knob: Callable) -> Tensor:
    # one norm instruction and one scaling per group of gradients that live alike, as torch
    # groups them by device; gradients on several meshes (pipeline stages): each part of the
    # norm is made where its gradients are, and only those scalars and the scale travel
    groups = [[grads[i] for i in group]
              for group in rt.alike([g.id for g in grads], [g.dtype for g in grads])]
    with rt.dispatcher.placer.asking():
        parts = [apply("norm_foreach", *group, norm_type=float(norm_type)) for group in groups]
        # the parts are sums of p-th powers (those of split gradients partial sums), or maxima
        inf = norm_type == float("inf")
        total = parts[0]
        for part in parts[1:]:
            total = total.maximum(part) if inf else total + part
        if not inf:
            total = total ** (1.0 / norm_type)
        scale = (max_norm / (total + eps)).clamp(max=1.0)
        # one agreement on the scale and on every gradient (each mesh's): the optimizer's
        # step that follows finds its gradients agreed, so a step holds a single host barrier
        rt.agree([g.id for g in grads] + [scale.id])
        for group in groups:
            apply("mul_foreach", *group, scale)
    return total


@no_grad()
def clip_grad_value_(parameters: Iterable[Tensor] | Tensor, clip_value: float) -> None:
    """Clamp every gradient into [-clip_value, clip_value], in place."""
    params = [parameters] if isinstance(parameters, Tensor) else parameters
    for p in params:
        if p.grad is not None:
            p.grad.clamp_(-clip_value, clip_value)
