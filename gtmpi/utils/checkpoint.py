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

import contextlib
import enum
from typing import Any, Callable

from ..amp import Region
from ..autograd.engine import function as _function
from ..autograd.engine import grad
from ..autograd.engine import record as _record
from ..client.gradmode import enable_grad, is_grad_enabled, no_grad
from ..client.runtime import runtime
from ..client.tensor import Tensor

__all__ = ["checkpoint", "checkpoint_sequential", "create_selective_checkpoint_contexts",
           "CheckpointPolicy"]


def checkpoint(function: Callable, *args: Any, use_reentrant: bool | None = None,
               context_fn: Callable | None = None, determinism_check: str = "default",
               debug: bool = False, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """torch.utils.checkpoint.checkpoint: ``function(*args, **kwargs)``, its activations
    recomputed in backward instead of kept. ``use_reentrant`` either way gives the same
    gradients here (no hooks are involved); ``preserve_rng_state=False`` lets the recompute
    draw anew, as torch's does. Its outputs: a tensor, or a tuple or list of them (and other
    values)."""
    if not is_grad_enabled():
        return function(*args, **kwargs)
    forward_ctx, recompute_ctx = context_fn() if context_fn is not None else \
        (contextlib.nullcontext(), contextlib.nullcontext())
    rt = runtime()
    drawn = rt.draws()
    # the recompute runs under the forward's autocast, as torch's does: backward is usually
    # outside the region, and recomputed there as written a float32 model's matmuls ran in
    # float32, with activations other than the forward's
    region = rt.autocast
    first = _inputs(args)
    with forward_ctx:
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
        placer = rt.dispatcher.placer
        with enable_grad():
            if preserve_rng_state:
                rt.draw_from(drawn)
            placer.recomputing += 1
            outer, rt.autocast = rt.autocast, \
                None if region is None else Region(region.device_type, region.dtype)
            try:
                inputs = _inputs(args)
                with recompute_ctx:
                    again = _tensors(function(*inputs, **kwargs))
            finally:
                placer.recomputing -= 1
                rt.autocast = outer
                rt.draw_from(now)
            roots = [(o, g) for o, g in zip(again, grads) if g is not None and o.requires_grad]
            wanted = [t for t in inputs if isinstance(t, Tensor)] + leaves
            asked = [t for t in wanted if t.requires_grad]
            got = dict(zip(map(id, asked), grad([o for o, _ in roots], asked,
                                                [g for _, g in roots], allow_unused=True)))
        return [got.get(id(t)) for t in wanted]

    _function([*given, *leaves], tuple(kept), backward_fn)
    return out


class CheckpointPolicy(enum.Enum):
    """torch's: what a selective checkpoint's policy says of an op's output (saved between
    forward and backward, or made again by the recompute)."""
    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3


class SelectiveCheckpointContext:
    """What a policy function is given first, as torch's: whether this is the recompute."""

    def __init__(self, is_recompute: bool) -> None:
        self.is_recompute = is_recompute


def create_selective_checkpoint_contexts(policy_fn_or_list: Any,
                                         allow_cache_entry_mutation: bool = False
                                         ) -> tuple[Any, Any]:
    """torch.utils.checkpoint.create_selective_checkpoint_contexts: the forward's and the
    recompute's contexts for one call of ``checkpoint`` (pass
    ``context_fn=functools.partial(create_selective_checkpoint_contexts, ops)``, as with torch),
    under which the outputs of the ops the policy saves are kept from the first run and handed
    back to the recompute instead of computed again, and every other op is recomputed.
    ``policy_fn_or_list``: op names of gtmpi's table (``"linear"``, ``"matmul"``,
    ``"scaled_dot_product_attention"``; or gtmpi's functions, by name), or
    ``policy(ctx, op_name, *args, **kwargs) -> CheckpointPolicy``. Megatron's selective
    recompute keeps the matmuls' outputs and recomputes norms, GELU and the like, which cost
    little to run again and as much memory to keep."""
    if callable(policy_fn_or_list):
        policy = policy_fn_or_list
    else:
        names = {getattr(op, "__name__", op) for op in policy_fn_or_list}
        unknown = [n for n in names if not isinstance(n, str)]
        if unknown:
            raise TypeError(f"gtmpi checkpoint: ops to save are names of gtmpi's ops or its "
                            f"functions, got {unknown[0]!r}")

        def policy(ctx: SelectiveCheckpointContext, op: str, *args: Any,
                   **kwargs: Any) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if op in names else \
                CheckpointPolicy.PREFER_RECOMPUTE

    kept: list[tuple[str, Any, Any]] = []
    return _Selective(policy, kept, False), _Selective(policy, kept, True)


class _Selective:
    """One checkpointed function's saved outputs, in the order its ops made them: kept by the
    first run, handed back in the same order by the recompute (runtime.selective, which apply
    asks of every op recorded on a graph while it is set)."""

    def __init__(self, policy: Callable, kept: list, recompute: bool) -> None:
        self.policy, self.kept, self.recompute = policy, kept, recompute
        self.ctx = SelectiveCheckpointContext(recompute)
        self.taken = 0
        self.outer = None

    def __enter__(self) -> "_Selective":
        rt = runtime()
        self.outer, rt.selective = rt.selective, self
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        runtime().selective = self.outer
        if kind is None and self.recompute and self.taken < len(self.kept):
            self._differs(None)

    def saves(self, name: str) -> bool:
        return self.policy(self.ctx, name) in (CheckpointPolicy.MUST_SAVE,
                                                CheckpointPolicy.PREFER_SAVE)

    def keep(self, name: str, result: Any, graph: Any = None) -> None:
        with no_grad():  # the first run's graph is not kept with it: an alias outside it
            out = tuple(r.detach() for r in result) if isinstance(result, tuple) else \
                result.detach()
        self.kept.append((name, out, graph))

    def reuse(self, name: str, operands: list, kw: dict | None) -> Any:
        """The first run's output of this op, linked into the recompute's graph as if made
        here (the gradient reads the recomputed operands, and the kept output)."""
        if self.taken >= len(self.kept) or self.kept[self.taken][0] != name:
            self._differs(name)
        _, out, graph = self.kept[self.taken]
        self.kept[self.taken] = (name, None, None)  # handed over: held by the graph alone now
        self.taken += 1
        _record(name, operands, kw, out, graph)
        return out


    def _differs(self, ran: str | None) -> None:
        had = self.kept[self.taken][0] if self.taken < len(self.kept) else None
        def said(op: str | None) -> str:
            return repr(op) if op else "nothing more"
        raise RuntimeError(f"gtmpi checkpoint: the recompute ran {said(ran)} where the "
                           f"forward had run {said(had)} (an op the "
                           "policy saves): a checkpointed function must run the same ops again")


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
