"""torch.utils.checkpoint on gtmpi: activation checkpointing.

``checkpoint(fn, *args)`` runs ``fn`` and keeps none of its activations: its outputs are
linked to its tensor arguments and to the leaves it used (the weights) by one autograd node
(autograd.engine.function), whose backward runs ``fn`` again, from the same arguments and with
the same random draws (dropout's masks), and takes the gradients of that second run. So a
model keeps only each checkpointed block's inputs between forward and backward, at the cost
of one more forward per block; the gradients are those of the model without it. Like
everything else, the recompute is ordinary instructions: inside a replayable step it is
recorded and replayed (and captured in CUDA graphs) with the rest.
"""
from __future__ import annotations

from typing import Any, Callable

from ..autograd.engine import function as _function
from ..autograd.engine import grad
from ..client.gradmode import enable_grad, is_grad_enabled
from ..client.runtime import runtime
from ..client.tensor import Tensor

__all__ = ["checkpoint", "checkpoint_sequential"]


def checkpoint(function: Callable, *args: Any, use_reentrant: bool | None = None,
               context_fn: Callable | None = None, determinism_check: str = "default",
               debug: bool = False, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """torch.utils.checkpoint.checkpoint: ``function(*args, **kwargs)``, its activations
    recomputed in backward instead of kept. ``use_reentrant`` either way gives the same
    gradients here (no hooks are involved); ``preserve_rng_state=False`` lets the recompute
    draw anew, as torch's does. Its outputs: a tensor, or a tuple or list of them (and other
    values)."""
    if context_fn is not None:
        raise NotImplementedError("gtmpi checkpoint: context_fn (selective checkpointing "
                                  "policies) is not supported")
    if not is_grad_enabled():
        return function(*args, **kwargs)
    rt = runtime()
    drawn = rt.draws()
    first = _inputs(args)
    out = function(*first, **kwargs)
    outs = _tensors(out)
    if not any(o.requires_grad for o in outs):
        return out
    given = [a for a in args if isinstance(a, Tensor)]
    leaves = _leaves(outs, first)
    first = None
    kept = [o.detach() for o in outs]
    out = _replaced(out, iter(kept))
    outs = None  # the first run's graph, and with it its activations, goes now

    def backward_fn(grads: Any) -> list:
        grads = grads if isinstance(grads, list) else [grads]
        now = rt.draws()
        with enable_grad():
            if preserve_rng_state:
                rt.draw_from(drawn)
            try:
                inputs = _inputs(args)
                again = _tensors(function(*inputs, **kwargs))
            finally:
                rt.draw_from(now)
            roots = [(o, g) for o, g in zip(again, grads) if g is not None and o.requires_grad]
            wanted = [t for t in inputs if isinstance(t, Tensor)] + leaves
            asked = [t for t in wanted if t.requires_grad]
            got = dict(zip(map(id, asked), grad([o for o, _ in roots], asked,
                                                [g for _, g in roots], allow_unused=True)))
        return [got.get(id(t)) for t in wanted]

    _function([*given, *leaves], tuple(kept), backward_fn)
    return out


def checkpoint_sequential(functions: Any, segments: int, input: Any,
                          use_reentrant: bool | None = None, **kwargs: Any) -> Any:
    """torch.utils.checkpoint.checkpoint_sequential: ``functions`` (a Sequential or a list of
    modules) in ``segments`` runs of consecutive ones, each checkpointed but the last, which
    runs as written (its activations are needed at once by backward)."""
    functions = list(functions.children()) if hasattr(functions, "children") else \
        list(functions)
    size = -(-len(functions) // max(segments, 1)) if functions else 0

    def run(part: list) -> Callable:
        def forward(x):
            for f in part:
                x = f(x)
            return x
        return forward

    parts = [functions[i:i + size] for i in range(0, len(functions), size)] if size else []
    for part in parts[:-1]:
        input = checkpoint(run(part), input, use_reentrant=use_reentrant, **kwargs)
    return run(parts[-1])(input) if parts else input


def _inputs(args: tuple) -> list:
    """The arguments a run of the function takes: its tensors as leaves of their own (the
    graph stops at them), each taking gradients if the caller's did."""
    return [a.detach().requires_grad_(a.requires_grad) if isinstance(a, Tensor) else a
            for a in args]


def _tensors(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, Tensor)]
    raise TypeError(f"gtmpi checkpoint: the function returned a {type(out).__name__}: a tensor, "
                    "or a tuple or list of tensors (and other values), is what it can return")


def _replaced(out: Any, kept: Any) -> Any:
    """``out`` with each of its tensors replaced by the next of ``kept``."""
    if isinstance(out, Tensor):
        return next(kept)
    return type(out)(next(kept) if isinstance(o, Tensor) else o for o in out)


def _leaves(outs: list[Tensor], inputs: list) -> list[Tensor]:
    """The leaves that take gradients (the weights) that the graph behind ``outs`` reached,
    but the function's own ``inputs`` (leaves of their own here)."""
    found, stack = {}, [o._node for o in outs if o._node is not None]
    seen = {id(t) for t in inputs if isinstance(t, Tensor)}
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for a in node.operands:
            if getattr(a, "_node", None) is not None:
                stack.append(a._node)
            elif isinstance(a, Tensor) and a.requires_grad and id(a) not in seen:
                found[id(a)] = a
    return list(found.values())
