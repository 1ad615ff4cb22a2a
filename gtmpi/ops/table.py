"""The op vocabulary: every tensor op gtmpi knows, one row each.

Each layer reads this one table. The client infers shapes by running a row's kernel on meta
tensors (ops/shapes.py); the worker runs the same kernel on real tensors (worker/executor.py).
Gradient and placement rules join the table as further columns, keyed by the same names.

A kernel takes torch tensors and plain constants positionally (plus keyword constants) and
returns a tensor or a tuple of tensors. Kernels of kind CREATE also get ``device=``, kernels of
kind COMM the worker's data plane as ``plane=``.

Rows of kind FUSED are torch's fused kernels (layer norm, flash/efficient attention, embedding,
cross-entropy). Each runs under torch's own autograd on the worker and returns its result and a
Graph: the record holding what torch's backward kernel needs (mean and rstd, log-sum-exp and
RNG state, log-probabilities). Its gradient row, NAME_grad, runs that backward kernel, so
gtmpi saves exactly what torch saves and computes gradients with torch's kernels.
"""
from __future__ import annotations

import contextlib

import math
import operator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from . import files, fused_rows


class Kind(Enum):
    CREATE = "create"            # no tensor inputs; needs the worker's device
    ELEMENTWISE = "elementwise"  # broadcasting pointwise math
    REDUCE = "reduce"            # reduces or normalises along dims
    MATMUL = "matmul"
    SHAPE = "shape"              # moves or views data without arithmetic
    INDEX = "index"
    INPLACE = "inplace"          # writes into its first operand; result id is that operand's
    FUSED = "fused"              # one of torch's fused kernels, with a Graph for its gradient
    GENERAL = "general"          # mixes elements along dims in ways no placement rule covers
    COMM = "comm"                # between workers (worker.dataplane); inserted by placement

    # members are singletons: hashed by identity in C, not by Enum's Python __hash__ of the
    # name (a worker looks its kind up once per instruction it runs)
    __hash__ = object.__hash__


@dataclass(frozen=True)
class Op:
    name: str
    kind: Kind
    kernel: Callable[..., Any]
    # Python scalar operands change only the result dtype, never its shape, so the shape cache
    # may key them by type rather than value (x * 2.0 and x * 3.0 share one entry).
    scalar_by_type: bool = False
    # Evaluated on meta tensors instead of the kernel, where the kernel cannot run on meta.
    meta: Callable[..., Any] | None = None
    # Result (shape, dtype)s straight from the operands' (no meta tensors): for ops of many
    # operands, such as the multi-tensor optimizer steps, whose result is their first operand.
    sigs: Callable[[tuple], tuple] | None = None
    # The operands that index another's dims, from (operands, keywords): on a GPU an index out
    # of range is a device-side assert that ends the worker's CUDA context, so a server's worker
    # checks them first (worker/bounds.py).
    indices: Callable[[tuple, dict], list["IndexArg"]] | None = None
    # Reads or writes a file at a path its instruction names: a server's client may not send
    # it (the path would be on the server's host, another user's files among them).
    host_files: bool = False


class IndexArg(NamedTuple):
    """Operand ``pos`` holds indices into a dim of size ``size``: each one must be in
    [0, size), or [-size, size) with ``negative``, or equal ``also`` (an ignore_index)."""
    pos: int
    size: int
    also: int | None = None
    negative: bool = False


def _along(pos: int) -> Callable[[tuple, dict], list[IndexArg]]:
    """gather, scatter, index_select: operand ``pos`` indexes operand 0 along operand 1 (dim)."""
    return lambda a, kw: [IndexArg(pos, a[0].shape[a[1]])]


def _keyed(first: int, shape: Callable[[tuple, dict], tuple]) -> Callable[[tuple, dict], list[IndexArg]]:
    """getitem and friends: the key's tensors are the operands from ``first`` on, indexing a
    tensor of ``shape``; an integer tensor indexes the dim its place in the key names."""
    def indices(a: tuple, kw: dict) -> list[IndexArg]:
        tensors = iter(a[first:])
        items = [next(tensors) if item == "T" else item for item in kw["key"]]
        dims = shape(a, kw)

        def width(item: Any) -> int:
            if item is None or item is Ellipsis:
                return 0
            return item.ndim if isinstance(item, torch.Tensor) and item.dtype == torch.bool else 1
        rest = len(dims) - sum(width(item) for item in items)
        found, dim, k = [], 0, first
        for item in items:
            if item is Ellipsis:
                dim += rest
                continue
            if isinstance(item, torch.Tensor):
                if item.dtype != torch.bool and not item.is_floating_point():
                    found.append(IndexArg(k, dims[dim], negative=True))
                k += 1
            dim += width(item)
        return found
    return indices


def _class_targets(a: tuple, kw: dict) -> list[IndexArg]:
    """cross_entropy's targets: class indices (not probabilities), unless the classes are split
    over a group (its kernel keeps each member's inside its piece)."""
    x, target = a[0], a[1]
    if kw.get("offset") is not None or target.is_floating_point():
        return []
    return [IndexArg(1, x.shape[1] if x.ndim > 1 else x.shape[0], also=a[2])]


SEED_MIX = 0x9E3779B97F4A7C15


def derive_seed(session_seed: int, count: int) -> int:
    """The seed of the session's ``count``-th random op (counting from 1)."""
    return (session_seed * SEED_MIX + count) % (1 << 63)


class Seed(int):
    """A random op's seed made inside a replayable call: its value there, and ``offset``, its
    place among the call's random ops, so that each replay can give the op the seed it would get
    if the call ran as written (worker: Executor._replay)."""

    def __new__(cls, value: int, offset: int) -> "Seed":
        seed = super().__new__(cls, value)
        seed.offset = offset
        return seed

    def __reduce__(self):
        return Seed, (int(self), self.offset)


class Dim(int):
    """A size inside a program recorded for calls whose arguments grow in one dimension (a
    sequence a token longer each call, nn/capture.py): its value there, and ``a * n + b``,
    what it is for a call whose growing size is ``n`` (worker: graphs.with_sizes)."""

    def __new__(cls, value: int, a: int, b: int) -> "Dim":
        dim = super().__new__(cls, value)
        dim.a, dim.b = a, b
        return dim

    def at(self, n: int) -> int:
        return self.a * n + self.b

    def __reduce__(self):
        return Dim, (int(self), self.a, self.b)


class Knob(float):
    """A number inside a program that its calls give anew each time (an optimizer's learning
    rate and step count, a gradient scaler's inverse scale): its value there, and ``index``,
    its place in the values each replay sends (worker: Executor._replay). A program holding
    one runs op by op: a CUDA graph would keep the captured value."""

    def __new__(cls, value: float, index: int) -> "Knob":
        knob = super().__new__(cls, value)
        knob.index = index
        return knob

    def __reduce__(self):
        return Knob, (float(self), self.index)


def _generator(seed: int | torch.Generator, device: torch.device) -> torch.Generator:
    """A generator seeded for one op; inside a CUDA graph, the graph's own (seeded again
    before each launch), which the caller passes instead of a seed."""
    if isinstance(seed, torch.Generator):
        return seed
    if torch.device(device).type == "meta":  # a dry run's worker: shapes only
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _seeded(sample: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A random op whose values depend only on (seed, shape, dtype): the same on every run,
    whatever the number of workers, because each op carries its own seed."""
    def kernel(shape, dtype, seed, device):
        return sample(shape, dtype=dtype, device=device, generator=_generator(seed, device))
    return kernel


def _dropout_mask(shape, p, seed, device):
    """Dropout's mask: each element kept (True) with probability 1 - p, drawn from the op's
    seed as rand's numbers are (the same on every run, whatever the number of workers)."""
    return torch.empty(shape, dtype=torch.bool, device=device).bernoulli_(
        1.0 - p, generator=_generator(seed, device))


def _meta_empty(shape, dtype, seed, device):
    return torch.empty(shape, dtype=dtype, device=device)


def _randint(low, high, shape, dtype, seed, device):
    return torch.randint(low, high, shape, dtype=dtype, device=device,
                         generator=_generator(seed, device))


def _multinomial(probs, num_samples, replacement, seed):
    return torch.multinomial(probs, num_samples, replacement,
                             generator=_generator(seed, probs.device))


def _multinomial_meta(probs, num_samples, replacement, seed):
    return torch.empty((*probs.shape[:-1], num_samples), dtype=torch.int64, device=probs.device)


def _normal_(x, mean, std, seed, whole=None, piece=()):
    return _drawn_into(x, whole, piece,
                       lambda t: t.normal_(mean, std, generator=_generator(seed, x.device)))


def _uniform_(x, low, high, seed, whole=None, piece=()):
    return _drawn_into(x, whole, piece,
                       lambda t: t.uniform_(low, high, generator=_generator(seed, x.device)))


def _drawn_into(x, whole, piece, draw):
    """``draw`` into x; with ``whole``, x is one piece ((dim, start, length) per cut) of a tensor
    of that shape: the whole is drawn and x takes its piece, the numbers of one worker."""
    if whole is None:
        return draw(x)
    full = draw(x.new_empty(whole))
    for dim, start, length in piece:
        full = full.narrow(dim, start, length)
    return x.copy_(full)


def index_key(template: tuple, tensors: tuple) -> tuple:
    """Rebuild an index key: the string "T" stands for the next index tensor, in order."""
    it = iter(tensors)
    return tuple(next(it) if item == "T" else item for item in template)


def _pieces(*xs: torch.Tensor, spans: tuple) -> tuple[torch.Tensor, ...]:
    """Rows ``spans[i]`` (start, length) of each ``xs[i]``, copied by one kernel into one flat
    buffer laid out in order, each piece a view of it: a copy per tensor cost the worker's
    host 10-25 us each (GPT-2 small: 148 a bucket, twice a step at ZeRO-1), and the updated
    pieces then go to the all-gather as that buffer, uncopied (DataPlane.gather_pieces)."""
    rows = [x.narrow(0, start, length) for x, (start, length) in zip(xs, spans)]
    if len({(r.dtype, r.device) for r in rows}) > 1:
        return tuple(r.clone() for r in rows)
    return views_of(torch.cat([r.reshape(-1) for r in rows]), [r.shape for r in rows])


def views_of(flat: torch.Tensor, shapes: list) -> tuple[torch.Tensor, ...]:
    """``flat``'s first elements as tensors of ``shapes``, laid end to end (one buffer's
    parts: a bucket's sums, a bucket's pieces)."""
    numels = [math.prod(s) for s in shapes]
    return tuple(v.view(s) for v, s in
                 zip(flat.narrow(0, 0, sum(numels)).split(numels), shapes))


def _getitem(x, *tensors, key):
    return x[index_key(key, tensors)]


def _setitem(x, value, *tensors, key):
    x[index_key(key, tensors)] = value
    return x


def _copy(x, src):
    return x.copy_(src)


def _sgd_foreach(*args):
    """torch.optim.SGD's multi-tensor update (foreach) of all parameters of a group, in place.
    args: params, grads, momentum buffers (only with momentum), then lr, momentum, dampening,
    weight_decay, nesterov and first (the buffers start as the gradients)."""
    lr, momentum, dampening, weight_decay, nesterov, first = args[-6:]
    tensors = args[:-6]
    n = len(tensors) // (3 if momentum else 2)
    params, grads = list(tensors[:n]), list(tensors[n:2 * n])
    if weight_decay:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if momentum:
        bufs = list(tensors[2 * n:])
        if first:
            torch._foreach_copy_(bufs, grads)
        else:
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, grads, alpha=1 - dampening)
        grads = torch._foreach_add(grads, bufs, alpha=momentum) if nesterov else bufs
    torch._foreach_add_(params, grads, alpha=-lr)
    return tensors[0]


def _adam_foreach(*args):
    """torch.optim.Adam's (decoupled: AdamW's) multi-tensor update of all parameters of a group,
    in place. args: params, grads, exp_avgs, exp_avg_sqs, then lr, beta1, beta2, eps,
    weight_decay, decoupled, step, fused.

    fused (torch's ``fused=``): True runs torch's fused kernel, False torch's foreach
    arithmetic, None the fused kernel on GPUs (and in a dry run, which stands for them) and
    foreach elsewhere. The fused kernel reads each element once and keeps its arithmetic in
    float32 registers: on an H100, GPT-2 small's update took 87 foreach launches and 2.85 ms
    (benchmarks/RESULTS.md), and foreach's square root makes a copy of every exp_avg_sq. Its
    results equal torch's ``fused=True``, not its foreach to the bit.

    Each parameter's step count lives on its exp_avg (as torch keeps ``state['step']`` with the
    state), counted only by updates that ran: an update skipped for a failed batch (the fault
    rule) leaves it, and the bias corrections, where they were. ``step``, the client's count,
    stands in where a state tensor has none yet."""
    lr, beta1, beta2, eps, weight_decay, decoupled, step, fused = args[-8:]
    tensors = args[:-8]
    n = len(tensors) // 4
    params, grads, avgs, sqs = (list(tensors[i * n:(i + 1) * n]) for i in range(4))
    steps = [getattr(a, "_gtmpi_step", step - 1) + 1 for a in avgs]
    if fused is None:
        fused = params[0].device.type in ("cuda", "meta")
    update = _adam_fused if fused else _adam_arithmetic
    for group in _alike_groups(params, grads, avgs, sqs) if fused else [range(n)]:
        update([params[i] for i in group], [grads[i] for i in group], [avgs[i] for i in group],
               [sqs[i] for i in group], [steps[i] for i in group],
               lr, beta1, beta2, eps, weight_decay, decoupled)
    for a, t in zip(avgs, steps):
        a._gtmpi_step = t
    return tensors[0]


def _alike_groups(*lists: list) -> list[list[int]]:
    """Positions of the parameters one fused launch can take: torch's fused kernel asks one
    device and one dtype of each list (parameters, gradients, exp_avgs, exp_avg_sqs)."""
    groups: dict[tuple, list[int]] = {}
    for i, (p, g, a, s) in enumerate(zip(*lists)):
        groups.setdefault((p.device, p.dtype, g.dtype, a.dtype, s.dtype), []).append(i)
    return list(groups.values())


def _adam_fused(params, grads, avgs, sqs, steps, lr, beta1, beta2, eps, weight_decay,
                decoupled) -> None:
    p, g = params[0], grads[0]
    if not (p.dtype == g.dtype == avgs[0].dtype == sqs[0].dtype):
        _adam_arithmetic(params, grads, avgs, sqs, steps, lr, beta1, beta2, eps, weight_decay,
                         decoupled)
        return
    # the kernel reads each count from a tensor on the parameters' device: one per distinct
    # count (a fill, not an upload, which would wait for the GPU's queue to drain)
    counts = {t: torch.full((), float(t), dtype=torch.float32, device=p.device)
              for t in set(steps)}
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(params, grads, avgs, sqs, [], [counts[t] for t in steps], lr=lr, beta1=beta1,
           beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def _adam_arithmetic(params, grads, avgs, sqs, steps, lr, beta1, beta2, eps, weight_decay,
                     decoupled) -> None:
    """torch's foreach Adam(W), op for op."""
    if weight_decay and decoupled:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    elif weight_decay:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(avgs, grads, 1 - beta1)
    torch._foreach_mul_(sqs, beta2)
    torch._foreach_addcmul_(sqs, grads, grads, 1 - beta2)
    denom = torch._foreach_sqrt(sqs)
    torch._foreach_div_(denom, [math.sqrt(1 - beta2 ** t) for t in steps])
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, avgs, denom, [-lr / (1 - beta1 ** t) for t in steps])


def _adam_steps(*avgs) -> torch.Tensor:
    """The update counts _adam_foreach keeps on each exp_avg (updates skipped for a failed
    batch not counted), as one int64 vector: what a checkpoint of the optimizer must hold;
    -1 for a state no update has touched here (just loaded: the client's count stands)."""
    return torch.tensor([getattr(a, "_gtmpi_step", -1) for a in avgs], dtype=torch.int64,
                        device=avgs[0].device)


def _batch_norm_update_(running_mean, running_var, x, momentum):
    """torch's BatchNorm running statistics from a training batch, in place: the mean and the
    unbiased variance over every dim but the channels (dim 1)."""
    dims = [d for d in range(x.ndim) if d != 1]
    var, mean = torch.var_mean(x.detach(), dims, correction=1)
    running_mean.lerp_(mean.to(running_mean.dtype), momentum)
    running_var.lerp_(var.to(running_var.dtype), momentum)
    return running_mean


def _batch_norm(x, running_mean, running_var, weight, bias, training, eps):
    """Normalised by the batch's statistics (training: the running ones are updated by
    batch_norm_update_, a separate in-place instruction) or by the running ones."""
    return F.batch_norm(x, None if training else running_mean,
                        None if training else running_var, weight, bias, training, 0.0, eps)


def _zero_foreach(*tensors):
    torch._foreach_zero_(list(tensors))
    return tensors[0]


def _norm_foreach(*tensors, norm_type: float) -> torch.Tensor:
    """Several tensors' norms (torch's foreach kernel) taken together, in float32 (float64 for
    float64 tensors): the sum of their p-th powers, or for the inf-norm their largest. A sum,
    so that the pieces of split tensors add up (its placement rule); the p-th root is taken by
    the caller."""
    norms = torch.stack(torch._foreach_norm(list(tensors), norm_type)).to(_accumulating(
        tensors[0].dtype))
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()


def _mul_foreach(*args):
    """Every tensor but the last, times the last (a 0-d tensor), in place."""
    torch._foreach_mul_(list(args[:-1]), args[-1])
    return args[0]


def _first_operand(sigs: tuple) -> tuple:
    return (sigs[0],)


def _add_foreach(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor of the first half plus its partner in the second (torch's foreach add):
    backward adds a micro-batch's gradients to those the leaves have in one instruction."""
    n = len(tensors) // 2
    return tuple(torch._foreach_add(list(tensors[:n]), list(tensors[n:])))


def _first_half(sigs: tuple) -> tuple:
    return sigs[:len(sigs) // 2]


def _accumulating(dtype: torch.dtype) -> torch.dtype:
    """float32 for sums of lower precision, float64 kept (torch keeps it too)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _float_scalar(sigs: tuple) -> tuple:
    return ((torch.Size([]), _accumulating(sigs[0][1])),)


def _pullback(fn, operands, wanted: tuple, outs: tuple, gs: tuple) -> tuple:
    """Gradients ``gs`` of fn's results at positions ``outs`` pulled back to its operands at
    positions ``wanted``, by torch's own autograd on the worker: one instruction for gradients
    torch computes better than a chain of ours (zeros where an operand is unused)."""
    operands = list(operands)
    with torch.enable_grad():
        for i in wanted:
            operands[i] = operands[i].detach().requires_grad_()
        result = fn(*operands)
        results = result if isinstance(result, tuple) else (result,)
        got = torch.autograd.grad([results[j] for j in outs], [operands[i] for i in wanted], gs,
                                  allow_unused=True)
    return tuple(torch.zeros_like(operands[i]) if g is None else g.detach()
                 for g, i in zip(got, wanted))


class Graph:
    """torch's autograd record of one fused op on a worker, kept under the op's second result
    id until the client drops it (after backward): the tensors torch's backward kernel reads
    live in it, exactly those torch itself would save."""

    __slots__ = ("output", "leaves", "slots", "finish")

    def __init__(self, output: torch.Tensor, leaves: list[torch.Tensor],
                 finish: Callable[[torch.Tensor], torch.Tensor] | None = None):
        # finish: the last backward step, outside the record (it maps the one leaf's gradient)
        self.output, self.leaves, self.finish = output, leaves, finish
        # One backward node straight onto the leaves (layer norm, attention, embedding): it is
        # called directly, which skips the autograd engine's set-up (a third of the cost). A
        # composition (a node feeding others) goes through the engine.
        nexts = output.grad_fn.next_functions
        variables = [getattr(node, "variable", None) for node, _ in nexts]
        slots = [next((j for j, v in enumerate(variables) if v is leaf), None) for leaf in leaves]
        direct = all(node is None or v is not None for (node, _), v in zip(nexts, variables))
        self.slots = slots if direct and None not in slots else None

    def backward(self, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        got = None
        if self.slots is not None:
            try:
                with torch.no_grad():  # else results computed from the saved leaves record a graph
                    got = self.output.grad_fn(grad)
            except TypeError:  # a node of several outputs (CUDA's fused RMS norm) wants each
                self.slots = None
        if got is not None:
            got = got if isinstance(got, tuple) else (got,)
            grads = [got[j] for j in self.slots]
        else:
            grads = torch.autograd.grad(self.output, self.leaves, grad, retain_graph=True,
                                        allow_unused=True)
        grads = tuple(torch.zeros_like(leaf) if g is None else g
                      for g, leaf in zip(grads, self.leaves))
        if self.finish is None:
            return grads
        with torch.no_grad():
            return (self.finish(grads[0]),)


class Redo(Graph):
    """A fused op's record under compiled replay (worker/compiled.py): its operands, and where
    the op has a form that keeps what its backward kernel reads (SAVED_FORMS: attention's
    log-sum-exp, as torch's own record keeps), those tensors. Without one, its backward runs
    the op again under torch's autograd. Either way a compiled program traces it with the rest
    of the backward (a torch record holds its saved tensors in autograd nodes no trace can
    read), so Inductor fuses the recomputation (a layer norm's statistics, a loss's softmax)
    into the backward's kernels."""

    __slots__ = ("fn", "args", "kw", "grads", "saved", "back")

    def __init__(self, fn: Callable[..., torch.Tensor], args: tuple, kw: dict,
                 grads: tuple[int, ...], saved: tuple = (),
                 back: Callable[..., tuple] | None = None) -> None:
        self.fn, self.args, self.kw, self.grads = fn, tuple(args), kw, tuple(grads)
        self.saved, self.back = tuple(saved), back
        self.output, self.finish, self.slots = None, None, None
        # a keyword's tensor too: a counted dropout's seed (worker/compiled.py)
        self.leaves = [a for a in self.args + self.saved + tuple(kw.values())
                       if isinstance(a, torch.Tensor)]

    def with_tensors(self, tensors: list[torch.Tensor]) -> "Redo":
        """The same record over other tensors, in the order of ``leaves``."""
        it = iter(tensors)
        args, saved, values = (tuple(next(it) if isinstance(a, torch.Tensor) else a for a in part)
                               for part in (self.args, self.saved, tuple(self.kw.values())))
        return Redo(self.fn, args, dict(zip(self.kw, values)), self.grads, saved, self.back)

    def backward(self, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.back is not None:
            return self.back(grad, self.args, self.saved, self.grads)
        return _pullback(lambda *a: self.fn(*a, **self.kw), self.args, self.grads, (0,),
                         (grad,))


def _recorded(fn: Callable[..., torch.Tensor]) -> Callable[..., tuple]:
    """The kernel of a FUSED row: ``fn`` on the operands, recorded by torch's autograd for the
    operands at positions ``grads`` (none: nothing is recorded, the Graph is None)."""
    def kernel(*args, grads=(), **kw):
        if not grads:
            return fn(*args, **kw), None
        leaves = list(args)
        with torch.enable_grad():
            for i in grads:
                leaves[i] = args[i].detach().requires_grad_()
            out = fn(*leaves, **kw)
        return out.detach(), Graph(out, [leaves[i] for i in grads])
    return kernel


def _recorded_meta(fn: Callable[..., torch.Tensor]) -> Callable[..., tuple]:
    def meta(*args, grads=(), **kw):
        return fn(*args, **kw), torch.empty(0, dtype=torch.uint8, device="meta")
    return meta


def _graph_backward(graph: Graph, g: torch.Tensor, grads: tuple, like: tuple) -> tuple:
    return graph.backward(g)


def _graph_backward_meta(graph, g, grads: tuple, like: tuple) -> tuple:
    return tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in like)


def _attention(q, k, v, mask, dropout_p, is_causal, scale, seed=None):
    if q.is_meta and q.dim() == 4:
        # a dry run stands for GPUs, whose fused kernels keep the log-sum-exp for backward;
        # torch's composition for meta tensors would keep the whole attention matrix
        bias = mask if mask is None or mask.is_floating_point() else \
            torch.empty(mask.shape, dtype=q.dtype, device=q.device)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, q.requires_grad, dropout_p, is_causal, scale=scale)[0]
    if seed is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale)
    # dropout: the same mask from the same gtmpi seed, on any worker. torch's kernel draws from
    # the device's default generator, so that generator is lent this op's state for the call
    # (graph-safe on a GPU, where a captured graph passes its own generator). On the CPU it is
    # the process's own: an embedded worker shares it with the program, whose draws (a batch's
    # indices) must go on as if no attention ran, so its state is put back after
    if q.device.type != "cuda":
        kept = torch.default_generator.get_state()
        torch.default_generator.manual_seed(seed)
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale)
        finally:
            torch.default_generator.set_state(kept)
    default = torch.cuda.default_generators[q.device.index or 0]
    kept = default.graphsafe_get_state()
    default.graphsafe_set_state(_generator(seed, q.device))
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale)
    finally:
        default.graphsafe_set_state(kept)


def _cross_entropy(x, target, ignore_index, reduction, label_smoothing, nll_float32=False):
    """torch's cross-entropy. ``nll_float32``: what torch runs under CUDA autocast, which has no
    rule for it: log_softmax in the logits' dtype, then nll_loss in float32."""
    if nll_float32:
        return _picked_nll(torch.log_softmax(x, 1), target, ignore_index, reduction,
                           torch.float32)[0]
    return F.cross_entropy(x, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)


def _picked_nll(log_probs, target, ignore_index, reduction, dtype, record=False):
    """nll_loss in ``dtype`` over the targets' log-probabilities alone: torch's nll_loss kernel
    sums the same values in the same order (by row, whatever the classes), without a copy of
    every log-probability in ``dtype``. Returns (loss, the picked values it was recorded from or
    None, the targets' column)."""
    column = 1 if ignore_index == 0 else 0  # the picked value's class, never the ignored one
    valid = target != ignore_index
    index = torch.where(valid, target, 0).unsqueeze(1)
    try:
        picked = log_probs.gather(1, index).to(dtype)
    except RuntimeError:  # a target out of range: torch's own error for it
        F.nll_loss(log_probs, target, ignore_index=ignore_index, reduction=reduction)
        raise
    if column:
        picked = torch.cat([torch.zeros_like(picked), picked], 1)
    if record:
        picked = picked.requires_grad_()
    with torch.enable_grad() if record else contextlib.nullcontext():
        loss = F.nll_loss(picked, torch.where(valid, column, ignore_index),
                          ignore_index=ignore_index, reduction=reduction)
    return loss, (picked if record else None), (index, column)

def _embedding(indices, weight, padding_idx, offset=None, group=None, plane=None):
    """torch's embedding; with ``offset``, Megatron's vocabulary-parallel one: ``weight`` is the
    rows from ``offset`` on, and indices outside them look up zeros (the members' results sum
    to the whole lookup, and so do their gradients' rows)."""
    if offset is None:
        return F.embedding(indices, weight, padding_idx)
    rows = weight.shape[0]
    local = indices - offset
    inside = (local >= 0) & (local < rows)
    if padding_idx is not None and not 0 <= padding_idx - offset < rows:
        padding_idx = None
    return F.embedding(local.clamp(0, rows - 1), weight,
                       None if padding_idx is None else padding_idx - offset) * \
        inside.unsqueeze(-1).to(weight.dtype)


def _vocab_loss(logits, target, offset, ignore_index, reduction, plane, group) -> tuple:
    """Megatron's parallel cross-entropy: logits split along the classes, each member holding
    the classes from ``offset`` on. Three all-reduces of one number per row (the largest of
    the pieces' log-sum-exps, the sum of their exponentials, the target's logit) give every
    member the whole loss. Returns (the loss, what its gradient is made from: the logits and
    the log-sum-exp, as torch keeps the log-probabilities)."""
    width = logits.shape[1]
    lse = _row_lse(logits)
    top = lse.clone()
    _all_reduce(top, "max", plane, group)
    total = torch.exp(lse - top)
    _all_reduce(total, "sum", plane, group)
    lse = top + total.log()
    local = (target - offset).clamp(0, width - 1)
    valid = target != ignore_index
    hit = (target - offset >= 0) & (target - offset < width) & valid
    picked = logits.gather(1, local[:, None])[:, 0].float() * hit
    _all_reduce(picked, "sum", plane, group)
    losses = (lse - picked) * valid
    count = valid.sum()
    loss = losses.sum() / count if reduction == "mean" else \
        losses.sum() if reduction == "sum" else losses
    return loss.to(logits.dtype), (logits, lse, local, hit, valid, count)


def _vocab_grad(g, saved: tuple, reduction: str) -> torch.Tensor:
    """The parallel cross-entropy's gradient: each member's piece of softmax minus one-hot,
    made again from the logits and the log-sum-exp, with no communication."""
    logits, lse, local, hit, valid, count = saved
    scale = g.float() / count if reduction == "mean" else g.float()
    return _softmax_minus_onehot(logits, lse, torch.where(hit, local, -1),
                                 (valid * scale).expand(valid.shape))


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, offset, ignore_index, reduction, plane, group):
        loss, saved = _vocab_loss(logits, target, offset, ignore_index, reduction, plane, group)
        ctx.save_for_backward(*saved)
        ctx.reduction = reduction
        return loss

    @staticmethod
    def backward(ctx, g):
        return _vocab_grad(g, ctx.saved_tensors, ctx.reduction), None, None, None, None, None, \
            None


def _row_lse(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-sum-exp of each row: one pass on GPUs, not a float copy and four."""
    if fused_rows.available(logits):
        return fused_rows.row_lse(logits)
    return torch.logsumexp(logits.float(), 1)


def _softmax_minus_onehot(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor,
                          coef: torch.Tensor) -> torch.Tensor:
    """(exp(logits - lse) - onehot(target)) * coef, row by row, in the logits' dtype; a target
    of -1 has no one in these logits (one pass on GPUs)."""
    if fused_rows.available(logits):
        return fused_rows.softmax_minus_onehot(logits, lse, target, coef)
    grad = (logits.float() - lse[:, None]).exp_()
    grad.scatter_add_(1, target.clamp(min=0)[:, None], -(target >= 0).float()[:, None])
    grad *= coef[:, None]
    return grad.to(logits.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """cross_entropy(linear(x, weight, bias), target), summed or averaged over the rows, that
    never holds the whole logits (Liger's fused linear cross-entropy): the rows in chunks, each
    chunk's logits made, reduced to its losses and, where gradients are wanted, at once to its
    gradient (softmax minus one-hot) and through the head's two matmuls to the input's and the
    weight's gradients, then dropped. Backward only scales what forward made, so the step runs
    the head's three matmuls as the whole-logits loss does, with no recompute. Kept until
    backward: gradients the size of x and of the weight, not the logits. The weight's is
    summed over the chunks in float32, or with ``compact`` in the weight's own dtype (torch's
    acc_policy "compact": half the memory traffic of each chunk's sum where the weights are
    half-precision; cuBLAS sums each chunk's product in float32 either way)."""

    @staticmethod
    def forward(ctx, x, weight, target, bias, ignore_index, reduction, chunk, cast=None,
                float32=False, rounded=False, compact=False):
        dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        x, weight, bias = autocast_operands(x, weight, bias, cast)
        wants = ctx.needs_input_grad
        valid = target != ignore_index
        coef = valid.float()
        if reduction == "mean":
            coef = coef / valid.sum()
        losses = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        dx = torch.empty_like(x) if wants[0] else None
        dw = None  # made by the first chunk's product
        db = torch.zeros(bias.shape, dtype=torch.float32, device=x.device) \
            if bias is not None and wants[3] else None
        for rows in row_pieces(x.shape[0], -(-x.shape[0] // chunk)):
            logits = F.linear(x[rows], weight, bias)
            lse = _row_lse(logits)
            hit = valid[rows]
            t = torch.where(hit, target[rows], 0)
            log_p = logits.gather(1, t[:, None])[:, 0].float() - lse
            if rounded:  # torch's log_softmax hands nll_loss log-probabilities in this dtype
                log_p = log_p.to(logits.dtype).float()
            losses[rows] = -log_p * hit
            if not any(wants):
                continue
            g = _softmax_minus_onehot(logits, lse, torch.where(hit, t, -1), coef[rows])
            del logits
            if dx is not None:
                torch.mm(g, weight, out=dx[rows])
            if wants[1]:
                dw = _accumulate_mm(dw, g.t(), x[rows], dtypes[1] if compact else torch.float32)
            if db is not None:
                db += g.float().sum(0)
        loss = losses.sum() / valid.sum() if reduction == "mean" else losses.sum()
        ctx.save_for_backward(dx, dw, db)
        ctx.dtypes = dtypes
        return loss if float32 else loss.to(dtypes[0])

    @staticmethod
    def backward(ctx, g):
        made = tuple(None if d is None else (d * g).to(dtype)
                     for d, dtype in zip(ctx.saved_tensors, ctx.dtypes))
        return made[0], made[1], None, made[2], None, None, None, None, None, None, None


def _accumulate_mm(out: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """out + a @ b in ``dtype`` (a @ b where out is None), summed into out by the matmul itself
    (cuBLAS's beta): a GPU's half-precision product goes to float32 with no half-precision copy
    of it made."""
    if dtype == a.dtype:
        return a @ b if out is None else out.addmm_(a, b)
    if a.is_cuda or a.is_meta:
        if out is None:
            return torch.ops.aten.mm.dtype(a, b, dtype)
        return torch.ops.aten.addmm.dtype_out(out, a, b, dtype, out=out)
    return (a @ b).to(dtype) if out is None else out.add_(a @ b)


def _linear_cross_entropy(x, weight, target, bias, ignore_index, reduction, chunk, cast=None,
                          float32=False, rounded=False, compact=False):
    return _LinearCrossEntropy.apply(x, weight, target, bias, ignore_index, reduction, chunk,
                                     cast, float32, rounded, compact)


def _all_reduce(t: torch.Tensor, op: str, plane: Any, group: int) -> None:
    """In place over the plane's group (``op``: sum, max); a dry run's meta tensors have no
    values to sum."""
    if t.device.type != "meta":
        plane.wait(plane.start_all_reduce(t, group, op))


_cross_entropy_from_logits = _recorded(_cross_entropy)


def _cross_entropy_recorded(x, target, ignore_index, reduction, label_smoothing, grads=(),
                            offset=None, group=None, plane=None, nll_float32=False):
    """torch's cross-entropy is log_softmax then nll_loss; torch's record of it keeps the
    log-probabilities (and under autocast a float32 copy of them for nll_loss). Ours keeps the
    log-probabilities and the targets' values alone; its backward writes nll_loss's gradient
    straight in the logits' dtype (torch's values: one per row, rounded as torch's cast
    rounds them) before log_softmax's backward kernel. With ``offset``, the classes are split
    over the members of ``group`` (_VocabCrossEntropy)."""
    if offset is not None:
        return _recorded(lambda x, t: _VocabCrossEntropy.apply(x, t, offset, ignore_index,
                                                               reduction, plane, group))(
            x, target, grads=grads)
    if label_smoothing or not grads:
        return _cross_entropy_from_logits(x, target, ignore_index, reduction, label_smoothing,
                                          nll_float32, grads=grads)
    log_probs = torch.log_softmax(x, 1)
    loss, picked, (index, column) = _picked_nll(
        log_probs, target, ignore_index, reduction, torch.float32 if nll_float32 else x.dtype,
        record=True)
    dtype = x.dtype  # the closure below must not hold x itself

    def finish(g: torch.Tensor) -> torch.Tensor:
        full = torch.zeros_like(log_probs).scatter_(1, index, g[:, column:column + 1].to(dtype))
        return torch._log_softmax_backward_data(full, log_probs, 1, dtype)
    return loss.detach(), Graph(loss, [picked], finish)


# torch's fused kernels, each with its gradient row NAME_grad (Graph.backward)
FUSED_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "layer_norm": lambda x, shape, weight, bias, eps: F.layer_norm(x, shape, weight, bias, eps),
    "rms_norm": lambda x, shape, weight, eps: F.rms_norm(x, shape, weight, eps),
    "scaled_dot_product_attention": _attention,
    "embedding": _embedding,
    "cross_entropy": _cross_entropy,
    "linear_cross_entropy": _linear_cross_entropy,
}
_KERNELS = {"cross_entropy": _cross_entropy_recorded}


def _attention_saving(q, k, v, mask, dropout_p, is_causal, scale, seed=None):
    """Attention under compiled replay: (its result, what its backward kernel reads) from the
    flash kernel eager sdpa runs for the case, or None where another kernel would (a mask,
    dropout, heads shared, a float32 GPU): its Redo then recomputes it."""
    if mask is not None or dropout_p or seed is not None or q.dim() != 4 or \
            not q.shape[1] == k.shape[1] == v.shape[1] or \
            not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        return None
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, scale=scale)
        return out, (out, lse)
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        if _cudnn_attention(q, k, v, is_causal, scale):
            made = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, is_causal, False, scale=scale)
        else:
            made = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal,
                                                                      scale=scale)
        return made[0], tuple(made[:8])
    return None


def _cudnn_attention(q, k, v, is_causal, scale) -> bool:
    """Whether eager sdpa runs cuDNN's kernel for the case (an H100's choice for bf16), which
    the compiled form then runs too: flash's took 0.9 ms more of nanoGPT's step."""
    return torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale) == \
        SDPBackend.CUDNN_ATTENTION.value


def _attention_saved_backward(g, args: tuple, saved: tuple, grads: tuple) -> tuple:
    q, k, v, _, _, is_causal, scale = args[:7]
    if q.device.type == "cpu":
        out, lse = saved
        got = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, out, lse, 0.0, is_causal, scale=scale)
    elif _cudnn_attention(q, k, v, is_causal, scale):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset = saved
        got = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            g, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0,
            is_causal, scale=scale)
    else:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset = saved
        got = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, is_causal, seed, offset,
            scale=scale)
    return tuple(got[i] for i in grads)


# fused rows with a form for compiled replay that keeps what their backward kernel reads:
# NAME -> (forward: (result, saved) or None, backward(g, operands, saved, grads))
def _loss_saving(x, target, ignore_index, reduction, label_smoothing, offset=None, group=None,
                 plane=None, nll_float32=False):
    """The cross-entropy under compiled replay: (its loss, what its gradient reads). The
    vocabulary-parallel one keeps its log-sum-exp (no collective runs again backward); for
    whole classes, nothing but how its nll is summed: its backward (_loss_saved_backward)
    recomputes the log-probabilities, which Inductor fuses. None with label smoothing (its Redo
    recomputes torch's)."""
    if offset is not None:
        loss, saved = _vocab_loss(x, target, offset, ignore_index, reduction, plane, group)
        return loss, saved + (reduction,)
    if label_smoothing:
        return None
    return _cross_entropy(x, target, ignore_index, reduction, 0.0, nll_float32), (nll_float32,)


def _loss_saved_backward(g, args, saved: tuple, grads: tuple) -> tuple:
    """The cross-entropy's gradient: eager replay's (_cross_entropy_recorded's finish), with
    its one-hot written as a comparison with the classes' indices instead of a scatter into
    zeros: the same values, but elementwise, so that Inductor makes it inside log_softmax's
    backward kernel instead of writing and reading a (rows, classes) tensor (0.25 ms of
    nanoGPT's GPT-2 step, and its backward kernel 1.24 ms against torch.compile's 0.86)."""
    if len(saved) != 1:  # the vocabulary-parallel one's: its tensors and its reduction
        return (_vocab_grad(g, saved[:-1], saved[-1]),)
    x, target, ignore_index, reduction = args[:4]
    (nll_float32,) = saved
    dtype = x.dtype
    log_probs = torch.log_softmax(x, 1)
    column = 1 if ignore_index == 0 else 0
    valid = target != ignore_index
    index = torch.where(valid, target, 0).unsqueeze(1)
    # nll_loss's gradient per row, which its input's values do not change
    picked = torch.zeros(x.shape[0], column + 1, dtype=torch.float32 if nll_float32 else dtype,
                         device=x.device, requires_grad=True)
    with torch.enable_grad():
        loss = F.nll_loss(picked, torch.where(valid, column, ignore_index),
                          ignore_index=ignore_index, reduction=reduction)
        (per_row,) = torch.autograd.grad(loss, picked, g)
    classes = torch.arange(x.shape[1], device=x.device)
    full = torch.where(classes == index, per_row[:, column:column + 1].to(dtype),
                       torch.zeros((), dtype=dtype, device=x.device))
    return (torch._log_softmax_backward_data(full, log_probs, 1, dtype),)


SAVED_FORMS = {
    "scaled_dot_product_attention": (_attention_saving, _attention_saved_backward),
    "cross_entropy": (_loss_saving, _loss_saved_backward),
}
_FUSED_INDICES = {
    # the vocabulary-parallel embedding keeps each member's indices inside its rows itself
    "embedding": lambda a, kw: [] if kw.get("offset") is not None else [IndexArg(0, a[1].shape[0])],
    "cross_entropy": _class_targets,
    "linear_cross_entropy": lambda a, kw: [IndexArg(2, a[1].shape[0], also=a[4])],
}


def row_pieces(rows: int, chunks: int) -> list[slice]:
    """The rows of a partial sum in ``chunks`` pieces, each summed by an all-reduce of its own
    (the kernel's and a stand-in's pieces must be the same)."""
    step = -(-rows // max(chunks, 1)) or 1
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def autocast_operands(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                      cast: torch.dtype | None) -> tuple:
    """A linear's operands in autocast's dtype ``cast`` (unchanged where None)."""
    if cast is None:
        return x, w, b
    return x.to(cast), w.to(cast), None if b is None else b.to(cast)


def _linear(x, w, b=None, group=None, partial=None, chunks=1, plane=None, cast=None):
    """torch's linear. With ``group``, a row-parallel layer's partial sum that the dispatcher
    wants whole, summed by the kernel as it goes (the seed's overlap): its rows are multiplied
    in ``chunks`` pieces, and each piece's all-reduce starts as soon as it is computed, running
    beside the next piece's matmul; the worker waits for them where the result is first read.
    ``partial``: the result's (shape, dtype), for a member that must take part without it.
    ``cast``: autocast's dtype, which the operands are cast to first (gtmpi/amp.py)."""
    x, w, b = autocast_operands(x, w, b, cast)
    if group is None:
        return F.linear(x, w, b)
    y = x.new_empty(*x.shape[:-1], w.shape[0])
    rows, flat = x.reshape(-1, x.shape[-1]), y.view(-1, w.shape[0])
    for piece in row_pieces(rows.shape[0], chunks):
        if b is None:
            torch.mm(rows[piece], w.t(), out=flat[piece])
        else:
            torch.addmm(b, rows[piece], w.t(), out=flat[piece])
        plane.all_reduce_async(flat[piece], group)
    return y


def _linear_grad(g, x, w, b, grads, sole=False, group=None, partial=None, plane=None,
                 cast=None, dtypes=None):
    """The gradients of linear(x, w, b) wanted (``grads``: operand positions), each one matmul
    or sum, as torch's linear backward computes them. With ``group``, the input's gradient is
    a partial sum the dispatcher wants whole (tensor parallelism): its all-reduce starts as
    soon as it is computed and runs beside the weight's gradient (Megatron's asynchronous
    gradient all-reduce); the worker waits for it where the input's gradient is first read.
    ``partial``: that gradient's (shape, dtype), for a member that must take part without it.
    ``cast``: the forward cast its operands to this dtype; each gradient goes back to its
    operand's dtype, as the casts' own gradients would take it. ``dtypes``: those of x, w
    and b where the dispatcher gave the kernel their casts already (ZeRO-3's weights gathered
    in the cast dtype)."""
    dtypes = (x.dtype, w.dtype, b.dtype if b is not None else g.dtype) if dtypes is None \
        else tuple(d or g.dtype for d in dtypes)
    x, w, _ = autocast_operands(x, w, None, cast)
    out = []
    if 0 in grads:
        dx = (g @ w).to(dtypes[0])
        if group is not None:
            plane.all_reduce_async(dx, group)
        out.append(dx)
    if 1 in grads or 2 in grads:
        g2 = g.reshape(-1, g.shape[-1])
        if 1 in grads:
            out.append((g2.t() @ x.reshape(-1, x.shape[-1])).to(dtypes[1]))
        if 2 in grads:
            out.append(g2.sum(0).to(dtypes[2]))
    return tuple(out)


def _vjp(*args, op, grads, outs, kw):
    """The gradient of any row ``op``: its kernel run again on the operands (args after the
    len(outs) incoming gradients, which belong to its results at positions ``outs``) and pulled
    back to the operands at positions ``grads``. One instruction and torch's numbers, for ops
    whose rule is not worth writing in our ops."""
    n = len(outs)
    return _pullback(lambda *xs: OPS[op].kernel(*xs, **dict(kw)), args[n:], grads, outs, args[:n])


def _vjp_meta(*args, op, grads, outs, kw):
    return tuple(torch.empty_like(args[len(outs) + i]) for i in grads)


def _getitem_grad(g, *tensors, key, shape):
    """The gradient of x[key] for x of ``shape``: g scattered back, repeated indices summed."""
    base = torch.zeros(shape, dtype=g.dtype, device=g.device)
    return _pullback(lambda x: x[index_key(key, tensors)], (base,), (0,), (0,), (g,))[0]


def _mean(x, dim, keepdim, count=None):
    """torch's mean; with ``count``, the mean of a whole tensor of which x is one piece: x's sum
    over the whole count (placement/rules.py: each member's part of a partial sum)."""
    if count is None:
        return x.mean(dim=dim, keepdim=keepdim)
    return x.sum(dim=dim, keepdim=keepdim) / count


_ops = [
    # creation
    Op("zeros", Kind.CREATE, lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device)),
    Op("ones", Kind.CREATE, lambda shape, dtype, device: torch.ones(shape, dtype=dtype, device=device)),
    Op("full", Kind.CREATE, lambda shape, value, dtype, device: torch.full(shape, value, dtype=dtype, device=device)),
    Op("arange", Kind.CREATE,
       lambda start, end, step, dtype, device: torch.arange(start, end, step, dtype=dtype, device=device)),
    Op("eye", Kind.CREATE, lambda n, m, dtype, device: torch.eye(n, m, dtype=dtype, device=device)),
    Op("randn", Kind.CREATE, _seeded(torch.randn), meta=_meta_empty),
    Op("randint", Kind.CREATE, _randint,
       meta=lambda low, high, shape, dtype, seed, device: torch.empty(shape, dtype=dtype, device=device)),
    Op("rand", Kind.CREATE, _seeded(torch.rand), meta=_meta_empty),
    Op("dropout_mask", Kind.CREATE, _dropout_mask,
       meta=lambda shape, p, seed, device: torch.empty(shape, dtype=torch.bool, device=device)),
    Op("randperm", Kind.CREATE,
       lambda n, dtype, seed, device: torch.randperm(n, dtype=dtype, device=device,
                                                     generator=_generator(seed, device)),
       meta=lambda n, dtype, seed, device: torch.empty(n, dtype=dtype, device=device)),
    # elementwise: Python operators so that a scalar may stand on either side (2.0 - x)
    *(Op(name, Kind.ELEMENTWISE, fn, scalar_by_type=True) for name, fn in [
        ("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
        ("truediv", operator.truediv), ("floordiv", operator.floordiv), ("mod", operator.mod),
        ("pow", operator.pow), ("lt", operator.lt), ("le", operator.le), ("gt", operator.gt),
        ("ge", operator.ge), ("eq", operator.eq), ("ne", operator.ne), ("and", operator.and_),
        ("or", operator.or_), ("xor", operator.xor), ("invert", operator.invert),
        ("neg", operator.neg), ("abs", torch.abs), ("exp", torch.exp), ("log", torch.log),
        ("sqrt", torch.sqrt), ("rsqrt", torch.rsqrt), ("sin", torch.sin), ("cos", torch.cos),
        ("tanh", torch.tanh), ("sigmoid", torch.sigmoid), ("relu", torch.relu),
        ("gelu", F.gelu), ("silu", F.silu), ("where", torch.where), ("clamp", torch.clamp),
        ("maximum", torch.maximum), ("minimum", torch.minimum), ("sign", torch.sign),
        ("floor", torch.floor), ("ceil", torch.ceil), ("round", torch.round),
        ("trunc", torch.trunc), ("erf", torch.erf), ("erfinv", torch.erfinv), ("log1p", torch.log1p),
        ("expm1", torch.expm1), ("reciprocal", torch.reciprocal), ("square", torch.square),
        ("logical_not", torch.logical_not), ("logical_and", torch.logical_and),
        ("logical_or", torch.logical_or), ("isnan", torch.isnan), ("isinf", torch.isinf),
        ("isfinite", torch.isfinite), ("leaky_relu", F.leaky_relu),
        ("tan", torch.tan), ("asin", torch.asin), ("acos", torch.acos), ("atan", torch.atan),
        ("lgamma", torch.lgamma), ("digamma", torch.digamma), ("atan2", torch.atan2),
        ("hypot", torch.hypot),
        ("masked_fill", torch.masked_fill),
    ]),
    Op("gelu_grad", Kind.ELEMENTWISE,
       lambda g, x, approximate="none": torch.ops.aten.gelu_backward(g, x, approximate=approximate)),
    Op("silu_grad", Kind.ELEMENTWISE, torch.ops.aten.silu_backward),
    Op("to", Kind.ELEMENTWISE, lambda x, dtype: x.to(dtype)),
    # x * mask * scale in one pass, as torch's fused dropout applies its mask (and its
    # gradient: the same op on the output's gradient)
    Op("masked_scale", Kind.ELEMENTWISE, torch.ops.aten.native_dropout_backward,
       scalar_by_type=True),
    Op("matmul", Kind.MATMUL, operator.matmul),
    Op("linear", Kind.MATMUL, _linear),
    Op("linear_grad", Kind.MATMUL, _linear_grad),
    *(Op(name, Kind.FUSED, _KERNELS.get(name) or _recorded(fn), meta=_recorded_meta(fn),
         indices=_FUSED_INDICES.get(name))
      for name, fn in FUSED_FNS.items()),
    *(Op(f"{name}_grad", Kind.FUSED, _graph_backward, meta=_graph_backward_meta)
      for name in FUSED_FNS),
    # reductions over all elements (dim=None) or over dims
    Op("sum", Kind.REDUCE, lambda x, dim, keepdim: x.sum(dim=dim, keepdim=keepdim)),
    Op("mean", Kind.REDUCE, _mean),
    Op("amax", Kind.REDUCE, lambda x, dim, keepdim: x.amax(dim=() if dim is None else dim, keepdim=keepdim)),
    Op("amin", Kind.REDUCE, lambda x, dim, keepdim: x.amin(dim=() if dim is None else dim, keepdim=keepdim)),
    Op("max_dim", Kind.REDUCE, lambda x, dim, keepdim: tuple(torch.max(x, dim, keepdim))),
    Op("min_dim", Kind.REDUCE, lambda x, dim, keepdim: tuple(torch.min(x, dim, keepdim))),
    Op("argmax", Kind.REDUCE, lambda x, dim, keepdim: torch.argmax(x, dim, keepdim)),
    Op("argmin", Kind.REDUCE, lambda x, dim, keepdim: torch.argmin(x, dim, keepdim)),
    Op("var", Kind.REDUCE,
       lambda x, dim, correction, keepdim: torch.var(x, dim, correction=correction, keepdim=keepdim)),
    Op("std", Kind.REDUCE,
       lambda x, dim, correction, keepdim: torch.std(x, dim, correction=correction, keepdim=keepdim)),
    Op("norm_foreach", Kind.REDUCE, _norm_foreach, sigs=_float_scalar),
    Op("softmax", Kind.REDUCE, lambda x, dim: torch.softmax(x, dim)),
    Op("log_softmax", Kind.REDUCE, lambda x, dim: torch.log_softmax(x, dim)),
    # along dims, placed on whole tensors (dims first after the tensor, where they have one)
    Op("cumsum", Kind.GENERAL, lambda x, dim: torch.cumsum(x, dim)),
    Op("cumprod", Kind.GENERAL, lambda x, dim: torch.cumprod(x, dim)),
    Op("cummax", Kind.GENERAL, lambda x, dim: tuple(torch.cummax(x, dim))),
    Op("cummin", Kind.GENERAL, lambda x, dim: tuple(torch.cummin(x, dim))),
    # positions in a sorted sequence: no gradient (integers), torch's kernel
    Op("searchsorted", Kind.GENERAL, lambda seq, x, out_int32, right:
       torch.searchsorted(seq, x, out_int32=out_int32, right=right)),
    Op("prod", Kind.GENERAL,
       lambda x, dim, keepdim: x.prod() if dim is None else x.prod(dim, keepdim)),
    Op("logsumexp", Kind.GENERAL, torch.logsumexp),
    Op("vector_norm", Kind.GENERAL,
       lambda x, dim, keepdim, p: torch.linalg.vector_norm(x, p, dim, keepdim)),
    Op("normalize", Kind.GENERAL, lambda x, dim, p, eps: F.normalize(x, p, dim, eps)),
    Op("any", Kind.GENERAL, lambda x, dim, keepdim: x.any() if dim is None else x.any(dim, keepdim)),
    Op("all", Kind.GENERAL, lambda x, dim, keepdim: x.all() if dim is None else x.all(dim, keepdim)),
    Op("topk", Kind.GENERAL, lambda x, dim, k, largest, sorted:
       tuple(torch.topk(x, k, dim, largest, sorted))),
    Op("sort", Kind.GENERAL, lambda x, dim, descending, stable:
       tuple(torch.sort(x, dim=dim, descending=descending, stable=stable))),
    Op("gather", Kind.GENERAL, torch.gather, indices=_along(2)),
    Op("scatter", Kind.GENERAL, torch.scatter, indices=_along(2)),
    Op("scatter_add", Kind.GENERAL, torch.scatter_add, indices=_along(2)),
    Op("index_select", Kind.GENERAL, torch.index_select, indices=_along(2)),
    Op("tril", Kind.GENERAL, torch.tril),
    Op("triu", Kind.GENERAL, torch.triu),
    Op("repeat", Kind.GENERAL, lambda x, sizes: x.repeat(sizes)),
    Op("flip", Kind.GENERAL, torch.flip),
    Op("roll", Kind.GENERAL, torch.roll),
    Op("pad", Kind.GENERAL, lambda x, pad, mode, value: F.pad(x, pad, mode, value)),
    Op("one_hot", Kind.GENERAL, F.one_hot,
       indices=lambda a, kw: [IndexArg(0, a[1])] if len(a) > 1 and a[1] >= 0 else []),
    Op("einsum", Kind.GENERAL, lambda *xs, equation: torch.einsum(equation, *xs)),
    Op("batch_norm", Kind.GENERAL, _batch_norm),
    Op("conv1d", Kind.GENERAL, F.conv1d),
    Op("conv2d", Kind.GENERAL, F.conv2d),
    Op("conv_transpose1d", Kind.GENERAL, F.conv_transpose1d),
    Op("conv_transpose2d", Kind.GENERAL, F.conv_transpose2d),
    # pooling, torch's arguments in its order (nn/functional.py)
    Op("max_pool1d", Kind.GENERAL, F.max_pool1d),
    Op("max_pool2d", Kind.GENERAL, F.max_pool2d),
    Op("avg_pool1d", Kind.GENERAL, F.avg_pool1d),
    Op("avg_pool2d", Kind.GENERAL, F.avg_pool2d),
    Op("adaptive_avg_pool1d", Kind.GENERAL, F.adaptive_avg_pool1d),
    Op("adaptive_avg_pool2d", Kind.GENERAL, F.adaptive_avg_pool2d),
    Op("multinomial", Kind.GENERAL, _multinomial, meta=_multinomial_meta),
    Op("vjp", Kind.GENERAL, _vjp, meta=_vjp_meta),
    # shape
    Op("reshape", Kind.SHAPE, torch.reshape),
    Op("view", Kind.SHAPE, lambda x, shape: x.view(shape)),
    Op("permute", Kind.SHAPE, torch.permute),
    Op("transpose", Kind.SHAPE, torch.transpose),
    Op("squeeze", Kind.SHAPE, lambda x, dim: x.squeeze() if dim is None else x.squeeze(dim)),
    Op("unsqueeze", Kind.SHAPE, torch.unsqueeze),
    Op("flatten", Kind.SHAPE, torch.flatten),
    Op("expand", Kind.SHAPE, lambda x, shape: x.expand(shape)),
    Op("contiguous", Kind.SHAPE, lambda x: x.contiguous()),
    Op("clone", Kind.SHAPE, torch.clone),
    # a second id for the same worker tensor (detach: shares storage, as in torch)
    Op("alias", Kind.SHAPE, lambda x: x),
    Op("cat", Kind.SHAPE, lambda *xs, dim: torch.cat(xs, dim)),
    Op("stack", Kind.SHAPE, lambda *xs, dim: torch.stack(xs, dim)),
    Op("split", Kind.SHAPE, lambda x, sections, dim: tuple(torch.split(x, sections, dim))),
    Op("chunk", Kind.SHAPE, lambda x, chunks, dim: tuple(torch.chunk(x, chunks, dim))),
    Op("narrow", Kind.SHAPE, lambda x, dim, start, length: x.narrow(dim, start, length).contiguous()),
    # each member's rows of a bucket of whole tensors (ZeRO's pieces to update), in one
    # instruction; their own memory, not the wholes' (as "piece" below)
    Op("pieces", Kind.SHAPE, _pieces),
    # a shard cut from a whole tensor by placement: its own memory, never a view of the whole
    Op("piece", Kind.SHAPE, lambda x, dim, start, length:
       x.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)),
    # indexing
    Op("getitem", Kind.INDEX, _getitem, indices=_keyed(1, lambda a, kw: a[0].shape)),
    Op("getitem_grad", Kind.INDEX, _getitem_grad,
       meta=lambda g, *tensors, key, shape: torch.empty(shape, dtype=g.dtype, device=g.device),
       indices=_keyed(1, lambda a, kw: kw["shape"])),
    # in place: the result is the first operand, mutated (views on a worker alias as in torch)
    Op("setitem", Kind.INPLACE, _setitem, indices=_keyed(2, lambda a, kw: a[0].shape)),
    Op("iadd", Kind.INPLACE, operator.iadd, scalar_by_type=True),
    Op("isub", Kind.INPLACE, operator.isub, scalar_by_type=True),
    Op("imul", Kind.INPLACE, operator.imul, scalar_by_type=True),
    Op("itruediv", Kind.INPLACE, operator.itruediv, scalar_by_type=True),
    Op("zero_", Kind.INPLACE, torch.Tensor.zero_),
    Op("fill_", Kind.INPLACE, torch.Tensor.fill_, scalar_by_type=True),
    Op("copy_", Kind.INPLACE, _copy),
    Op("clamp_", Kind.INPLACE, torch.Tensor.clamp_, scalar_by_type=True),
    Op("masked_fill_", Kind.INPLACE, torch.Tensor.masked_fill_, scalar_by_type=True),
    Op("normal_", Kind.INPLACE, _normal_, scalar_by_type=True, sigs=_first_operand),
    Op("batch_norm_update_", Kind.INPLACE, _batch_norm_update_, scalar_by_type=True,
       sigs=_first_operand),
    Op("uniform_", Kind.INPLACE, _uniform_, scalar_by_type=True, sigs=_first_operand),
    # multi-tensor updates: one instruction for all parameters of a group (torch's foreach);
    # hyper-parameters and the step count change every step, so the shape cache keys them by type
    Op("sgd_foreach", Kind.INPLACE, _sgd_foreach, scalar_by_type=True, sigs=_first_operand),
    Op("adam_foreach", Kind.INPLACE, _adam_foreach, scalar_by_type=True, sigs=_first_operand),
    Op("adam_steps", Kind.GENERAL, _adam_steps,
       sigs=lambda sigs: ((torch.Size([len(sigs)]), torch.int64),)),
    Op("zero_foreach", Kind.INPLACE, _zero_foreach, sigs=_first_operand),
    # a sharded checkpoint (gtmpi/sharded.py, ops/files.py): each worker its own file
    Op("save_pieces", Kind.GENERAL, files.save_pieces,
       sigs=lambda sigs: ((torch.Size([1]), torch.int64),), host_files=True),
    Op("load_piece_", Kind.INPLACE, files.load_piece_, sigs=_first_operand, host_files=True),
    Op("mul_foreach", Kind.INPLACE, _mul_foreach, sigs=_first_operand),
    Op("add_foreach", Kind.ELEMENTWISE, _add_foreach, sigs=_first_half),
]

# between workers: inserted by the dispatcher where placements need them, never by the client
# (shape and dtype, of the whole tensor, let a worker whose operand failed still take part)
_ops += [
    Op("all_reduce", Kind.COMM, lambda x, group, shape, dtype, plane: plane.all_reduce(x, group)),
    Op("all_reduce_", Kind.COMM,
       lambda x, group, shape, dtype, plane: plane.all_reduce(x, group, inplace=True)),
    # partial sums (gradients) summed as one flat buffer, without waiting: the worker's stream
    # goes on (the rest of backward) while it runs, and whatever reads a result waits for it
    Op("all_reduce_bucket", Kind.COMM,
       lambda *xs, group, shapes, shape, dtype, plane: plane.reduce_bucket(xs, group)),
    # ahead: ZeRO-3's gather of the next op's weight, not waited for (what reads it waits)
    Op("all_gather", Kind.COMM, lambda x, group, dim, sizes, shape, dtype, plane, ahead=False:
       plane.all_gather(x, group, dim, sizes, ahead)),
    # ZeRO-3's weights gathered ahead for one op, in one coalesced collective (not waited for)
    Op("all_gather_many", Kind.COMM, lambda *xs, group, members, shapes, shape, dtype, plane:
       plane.all_gather_many(xs, group, members)),
    # ZeRO's updated pieces (the second half of the operands) gathered into their parameters
    # (the first half) in place, as one flat buffer: one collective for a bucket of parameters
    Op("gather_pieces_", Kind.COMM, lambda *xs, group, sizes, shapes, shape, dtype, plane:
       plane.gather_pieces(xs, group, sizes)),
    # partial sums (ZeRO's gradients) reduce-scattered as one flat buffer, without waiting:
    # each comes back as this member's rows (S(0)), views of one buffer
    Op("reduce_scatter_bucket", Kind.COMM,
       lambda *xs, group, shapes, shape, dtype, sizes, index, plane:
       plane.reduce_scatter_bucket(xs, group, sizes, index)),
    Op("reduce_scatter", Kind.COMM, lambda x, group, dim, sizes, index, shape, dtype, plane:
       plane.reduce_scatter(x, group, dim, sizes, index)),
    Op("all_to_all", Kind.COMM,
       lambda x, group, src, dst, src_sizes, dst_sizes, index, shape, dtype, plane:
       plane.all_to_all(x, group, src, dst, src_sizes, dst_sizes, index)),
    Op("send", Kind.COMM, lambda x, dst, shape, dtype, plane: plane.send(x, dst)),
    Op("recv", Kind.COMM, lambda shape, dtype, src, plane: plane.recv(shape, dtype, src)),
]

OPS: dict[str, Op] = {op.name: op for op in _ops}
assert len(OPS) == len(_ops), "duplicate op name in the table"
# an optimizer's update: issued once a training step, so what marks a step in a trace (a
# replayed program that holds one, a captured step, is marked by its name) and what a kernel
# profile's window counts (worker/profiler.py)
STEP_OPS = ("adam_foreach", "sgd_foreach")
