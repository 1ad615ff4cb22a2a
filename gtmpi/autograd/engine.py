"""The graph and its backward pass.

Every op on tensors that require grad records a Node holding its operands (the graph is the
Nodes' links, so each forward pass has its own graph: interleaved micro-batches keep separate
graphs until their own backward). backward() walks one graph in reverse topological order,
calling each op's rule from grads.py with autograd off, and accumulates into the leaves' .grad.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import nullcontext
from typing import Any, Iterable, Sequence

import torch

from ..client.creation import ones_like, tensor, zeros_like
from ..client.gradmode import Autograd, no_grad, set_autograd
from ..client.runtime import current, runtime
from ..client.tensor import Tensor, apply
from ..ops import OPS, Kind
from .grads import GRADS, MASKED, kept
from .node import Node

_state = threading.local()  # the graph recorded last in this thread (for printing)
_INPLACE = frozenset(name for name, op in OPS.items() if op.kind is Kind.INPLACE)


def zero_grads(params: Iterable[Any], set_to_none: bool = True) -> None:
    """Module.zero_grad and Optimizer.zero_grad: drop each .grad, or zero them on the workers
    with one instruction per placement (torch's foreach zero). After a failed op was raised,
    gradients it poisoned cannot be zeroed in place (zeroing in place is an in-place op, which
    the fault rule skips), so that once they are made afresh as zeros instead."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    if set_to_none:
        for p in params:
            p.grad = None
        return
    rt = runtime()
    with no_grad():
        if rt.faults_raised != rt.faults_at_zero_grad:
            rt.faults_at_zero_grad = rt.faults_raised
            for p in params:
                if p.grad is not None:
                    p.grad = zeros_like(p.grad)
            return
        for group in rt.alike([g.id for g in grads], [None] * len(grads)):
            apply("zero_foreach", *(grads[i] for i in group))


class Ghost:
    """An operand whose data its gradient rule never reads: its id, shape, dtype and place in
    the graph, without the handle that keeps the worker's tensor alive (torch likewise saves
    only what each backward formula needs)."""

    __slots__ = ("id", "_sig", "requires_grad", "_node", "_slot")

    def __init__(self, t: Any):
        self.id, self._sig, self.requires_grad = t.id, t._sig, t.requires_grad
        self._node, self._slot = t._node, t._slot

    @property
    def shape(self) -> torch.Size:
        return self._sig[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._sig[1]

    @property
    def ndim(self) -> int:
        return len(self._sig[0])


def record(op: str, operands: Sequence, kw: dict | None, result: Any, graph: Any = None) -> None:
    """Called by every op that has an operand requiring grad while grad mode is on (apply
    checks): link the result into the graph. ``graph``: a fused op's handle to torch's record
    of it on the worker, which its rule reads."""
    if op in _INPLACE:
        target = operands[0]
        if target.requires_grad and target._node is None:
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                               "operation.")
        raise RuntimeError(f"gtmpi: in-place '{op}' on a tensor that requires grad is not "
                           "supported; use an out-of-place op or gtmpi.no_grad()")
    if op not in GRADS:
        return  # not differentiable (comparisons, argmax, ...): results do not require grad
    outs = result if isinstance(result, tuple) else (result,)
    keep, uses_output = kept(op, len(operands))
    saved = (graph,) if graph is not None else None
    if uses_output:
        with no_grad():
            saved = tuple(o.detach() for o in outs)
    # a leaf that requires grad stays itself: backward accumulates into it
    kept_operands = []
    for i, a in enumerate(operands):
        if isinstance(a, Tensor):
            if a._node is not None:
                a._node.uses[a._slot] += 1
                if i not in keep:
                    a = Ghost(a)
            elif i not in keep and not a.requires_grad:
                a = Ghost(a)
        kept_operands.append(a)
    node = Node(op, tuple(kept_operands), kw, len(outs), saved)
    node.results = tuple((o._id, o._sig) for o in outs)
    book = runtime().signals
    if book.open:
        node.backward = book.backward()
    _state.last = weakref.ref(node)  # weak: printing must not keep a dropped graph alive
    for slot, o in enumerate(outs):
        dtype = o._sig[1]
        if dtype.is_floating_point or dtype.is_complex:
            o.requires_grad = True
            o._node = node
            o._slot = slot


def function(operands: Sequence, outputs: tuple, backward_fn: Any) -> None:
    """Link ``outputs``, made where the graph did not see it, to ``operands``: the gradients
    of the operands are ``backward_fn(gradients of the outputs)``, one each (None where there
    is none), as a torch.autograd.Function's backward gives them."""
    record("function", tuple(operands), {"backward": backward_fn}, outputs)


def backward(root: Any, gradient: Any = None, retain_graph: bool = False) -> None:
    """torch's Tensor.backward: the gradients of ``root`` accumulated into the leaves."""
    rt = runtime()
    if not rt.signals.checked:
        rt.signals.check_used()
    with no_grad(), rt.sites_here():
        _run([(root, _seed(root, gradient, 0))], retain_graph)


def grad(outputs: Any, inputs: Any, grad_outputs: Any = None, retain_graph: bool | None = None,
         create_graph: bool = False, allow_unused: bool | None = None) -> tuple:
    """torch.autograd.grad: the gradients of ``outputs`` (a tensor or a sequence, weighted by
    ``grad_outputs``) with respect to ``inputs``, returned, not accumulated into any .grad."""
    if create_graph:
        raise NotImplementedError("gtmpi.autograd.grad(create_graph=True): gradients of "
                                  "gradients are not recorded")
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    given = [None] * len(outputs) if grad_outputs is None else \
        ([grad_outputs] if isinstance(grad_outputs, Tensor) else list(grad_outputs))
    with no_grad(), runtime().sites_here():
        roots = [(o, _seed(o, g, i)) for i, (o, g) in enumerate(zip(outputs, given))]
        got = _run(roots, bool(retain_graph), inputs)
    for i, g in enumerate(got):
        if g is None and not allow_unused:
            raise RuntimeError(f"One of the differentiated Tensors (input {i}) appears to not "
                               "have been used in the graph. Set allow_unused=True if this is "
                               "the desired behavior.")
    return tuple(got)


def _seed(root: Any, gradient: Any, i: int) -> Any:
    """The gradient a backward starts ``root`` with (ones for a scalar), checked as torch
    checks it."""
    if not root.requires_grad:
        raise RuntimeError(f"element {i} of tensors does not require grad and does not have a "
                           "grad_fn")
    if gradient is None:
        if root.numel() != 1:
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
        return ones_like(root)
    if not isinstance(gradient, Tensor):
        gradient = tensor(gradient, dtype=root.dtype)
    if gradient.shape != root.shape:
        raise RuntimeError(f"Mismatch in shape: grad_output[{i}] has a shape of "
                           f"{gradient.shape} and output[{i}] has a shape of {root.shape}.")
    return gradient


class _Roots:
    """The nodes a backward starts from, as the one node the walk starts at."""

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes

    def parents(self):
        return iter(self.nodes)


class Later:
    """The weights' half of a backward split in two (a zero-bubble pipeline's B and W): the
    gradients of every leaf but those in ``now`` (a stage's input) are left for run(), with
    each node that feeds them and its incoming gradient, kept until then."""

    def __init__(self, now: Sequence[Any]) -> None:
        self.now = {id(t) for t in now}
        # (node, its incoming gradients, or its weights' gradients already made)
        self.stash: list[tuple[Node, Any, tuple | None]] = []

    def deferred(self, node: Node) -> set[int]:
        """The operands of ``node`` whose gradients wait for run()."""
        return {id(a) for a in node.operands if isinstance(a, Tensor) and a._node is None
                and a.requires_grad and id(a) not in self.now}

    def run(self) -> None:
        """The weights' gradients, accumulated into them."""
        rt = runtime()
        with no_grad(), rt.sites_here():
            for node, grads, made in self.stash:
                wanted = self.deferred(node)
                results = made if made is not None else _rule(
                    node, grads, {id(a) for a in node.operands if id(a) not in wanted},
                    rt.signals)
                for operand, g in zip(node.operands, results):
                    if id(operand) in wanted and g is not None:
                        _accumulate(operand, g)
                _free(node)
            self.stash = []
            rt.dispatcher.backward_done()


def backward_inputs(root: Any, gradient: Any, now: Sequence[Any]) -> Later:
    """The first half of ``root.backward(gradient)``: the gradients of what precedes the
    graph's leaves, and of the leaves in ``now``, computed now; the others' (the weights') by
    the returned Later's run()."""
    later = Later(now)
    with no_grad(), runtime().sites_here():
        _run([(root, _seed(root, gradient, 0))], False, later=later)
    return later


def _rule(node: Node, grads: Any, masked: Any, book: Any) -> tuple:
    """``node``'s gradient rule on its incoming ``grads``, not asked for the gradients of the
    operands in ``masked`` (ids), under the signal its forward named for its backward."""
    for a, version in zip(node.operands, node.versions):
        if version is not None and a._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{a.dtype} {list(a.shape)}], which {node.name()} saved, "
                f"is at version {a._version}; expected version {version} instead.")
    MASKED.update(masked)
    try:
        with nullcontext() if node.backward is None else book.scope(node.backward):
            return GRADS[node.op](node, grads)
    finally:
        MASKED.clear()


def _free(node: Node) -> None:
    """What a node's rule read, dropped once its gradients are made, as torch does."""
    node.freed = True
    node.saved = None
    node.operands = tuple(Ghost(a) if isinstance(a, Tensor) else a for a in node.operands)
    if node.op == "function":  # its backward's closure holds what it runs again
        node.kw = None


def _run(roots: list[tuple[Any, Any]], retain_graph: bool, inputs: list | None = None,
         later: Later | None = None):
    """Backward from each (root, its gradient). With ``inputs`` (leaves), their gradients are
    collected and returned, and no leaf's .grad changes (torch.autograd.grad); else every leaf
    reached accumulates its gradient, and each completed one is handed to the dispatcher (its
    sum across data-parallel replicas starts while backward goes on). With ``later``, the
    leaves' gradients but those it wants now are left to it."""
    rt = runtime()
    collected = None if inputs is None else {id(t): None for t in inputs}
    pending: dict[int, list] = {}
    for root, gradient in roots:
        if root._node is None:
            if collected is None:
                _accumulate(root, gradient)
            elif id(root) in collected:
                prev = collected[id(root)]
                collected[id(root)] = gradient if prev is None else prev + gradient
            continue
        slots = pending.setdefault(id(root._node), [None] * root._node.outputs)
        prev = slots[root._slot]
        slots[root._slot] = gradient if prev is None else prev + gradient
    nodes = list({id(r._node): r._node for r, _ in roots if r._node is not None}.values())
    order = [] if not nodes else _topological(nodes[0]) if len(nodes) == 1 else \
        _topological(_Roots(nodes))[1:]
    book = rt.signals
    # how many gradients each leaf still waits for: once none, its gradient is complete,
    # and its sum across data-parallel replicas can start while backward goes on
    waiting: dict[int, int] = {}
    if collected is None:
        for node in order:
            for a in node.operands:
                if isinstance(a, Tensor) and a._node is None and a.requires_grad:
                    waiting[id(a)] = waiting.get(id(a), 0) + 1
    # gradients for leaves that already have one (the micro-batches after a pipeline's
    # first): added at the end, one instruction per placement instead of one add each
    deferred: dict[int, tuple] = {}
    for node in order:
        grads = pending.pop(id(node), None)
        if grads is None:
            continue
        if node.freed:
            raise RuntimeError("Trying to backward through the graph a second time (or directly "
                               "access saved tensors after they have already been freed). "
                               "Specify retain_graph=True if you need to backward a second time.")
        grads = grads if node.outputs > 1 else grads[0]
        weights = later.deferred(node) if later is not None else ()
        made = None  # every gradient of the node, made now for its weights' later pass
        if weights:
            feeds_inputs = any(getattr(a, "requires_grad", False) and id(a) not in weights
                               for a in node.operands)
            if feeds_inputs and OPS[node.op].kind is Kind.FUSED:
                # torch's one backward kernel makes every gradient (a layer norm's input's and
                # its weights'): asked twice, it would run twice, so the weights' are kept from
                # this call (measured: 7% more GPU time per ZB-V stage without)
                made = _rule(node, grads, (), book)
                node.saved = None  # the worker's record of the forward, read by then
            later.stash.append((node, grads if made is None else None, made))
            if not feeds_inputs:
                continue  # it feeds weights alone: all of it later
        results = made if made is not None else _rule(node, grads, weights, book)
        for operand, g in zip(node.operands, results):
            if not getattr(operand, "requires_grad", False) or id(operand) in weights:
                continue
            if g is not None and g.dtype != operand.dtype:
                # an operand promoted by the op (bf16 + float32 under autocast) gets its
                # gradient in its own dtype, as torch's engine casts it
                g = g.to(operand.dtype)
            if operand._node is None and collected is not None:
                if g is not None and id(operand) in collected:
                    prev = collected[id(operand)]
                    collected[id(operand)] = g if prev is None else prev + g
            elif operand._node is None:
                if g is not None:
                    if operand.grad is not None and id(operand) not in deferred:
                        deferred[id(operand)] = (operand, _as_grad(operand, g))
                    else:  # a second gradient this pass (a weight used twice): in order
                        if id(operand) in deferred:
                            _accumulate(*deferred.pop(id(operand)))
                        _accumulate(operand, g)
                waiting[id(operand)] -= 1
                if not waiting[id(operand)] and operand.grad is not None and \
                        id(operand) not in deferred:
                    rt.dispatcher.gradient_ready(operand.grad.id, operand.grad._sig)
            elif g is None:
                continue
            else:
                slots = pending.setdefault(id(operand._node), [None] * operand._node.outputs)
                prev = slots[operand._slot]
                slots[operand._slot] = g if prev is None else prev + g
        grads = results = g = prev = None  # gradients of non-leaves die once passed on
        if not retain_graph and not weights:
            _free(node)
    if collected is not None:
        return [None if collected[id(t)] is None else _as_grad(t, collected[id(t)])
                for t in inputs]
    _accumulate_all(rt, list(deferred.values()))
    for leaf, _ in deferred.values():
        rt.dispatcher.gradient_ready(leaf.grad.id, leaf.grad._sig)
    rt.dispatcher.backward_done()
    return None


def _as_grad(leaf: Any, g: Any) -> Any:
    return g.to(leaf.dtype) if g.dtype != leaf.dtype else g


def _accumulate(leaf: Any, g: Any) -> None:
    g = _as_grad(leaf, g)
    _set_grad(leaf, g if leaf.grad is None else leaf.grad + g)


def _accumulate_all(rt: Any, pairs: list[tuple[Any, Any]]) -> None:
    """Each (leaf, g): g added to the leaf's gradient, with one instruction (torch's foreach
    add) for all whose gradients and g's are placed alike. Where they are not, one add each:
    the add's own rule converts them."""
    placer = rt.dispatcher.placer
    olds = [leaf.grad for leaf, _ in pairs]
    where = [(placer.placement(old.id), placer.placement(g.id)) if placer.active else None
             for old, (_, g) in zip(olds, pairs)]
    keys = [(w, g.dtype) for w, (_, g) in zip(where, pairs)]
    for group in rt.alike([old.id for old in olds], keys):
        if len(group) == 1 or (where[group[0]] is not None and len(set(where[group[0]])) > 1):
            for i in group:
                _accumulate(*pairs[i])
            continue
        sums = apply("add_foreach", *(olds[i] for i in group), *(pairs[i][1] for i in group))
        for i, total in zip(group, sums):
            _set_grad(pairs[i][0], total)


def _set_grad(leaf: Any, g: Any) -> None:
    leaves = current().leaves
    if leaves is not None and id(leaf) not in leaves:  # a replayable call is recorded
        leaves[id(leaf)] = (leaf, leaf.grad)
    leaf.grad = g


def tape(root: Node | None = None) -> list[Node]:
    """The graph ending at ``root`` (by default the one recorded last), in forward order."""
    if root is None:
        last = getattr(_state, "last", None)
        root = last() if last is not None else None
        if root is None:
            return []
    return _topological(root)[::-1]


def _topological(root: Node) -> list[Node]:
    """Nodes reachable from root, each after every node that consumes its results."""
    order: list[Node] = []
    seen = {id(root)}
    stack = [(root, iter(list(root.parents())))]
    while stack:
        node, parents = stack[-1]
        for parent in parents:
            if id(parent) not in seen:
                seen.add(id(parent))
                stack.append((parent, iter(list(parent.parents()))))
                break
        else:
            stack.pop()
            order.append(node)
    order.reverse()
    return order


set_autograd(Autograd(record, backward))
