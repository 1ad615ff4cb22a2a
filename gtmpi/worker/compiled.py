"""Compiled replay (GTMPI_COMPILE): a recorded program traced whole into one graph of aten ops
and compiled by Inductor, then captured as a CUDA graph as any program is (worker/graphs.py).

Replayed as it is, a program runs one eager kernel per op, inside a CUDA graph: the pointwise
traffic around the matmuls (layer norms, GELU, residual adds, the loss's softmax) goes through
memory once per op, and every intermediate is kept. Known whole before it runs, the program is
what a compiler wants, forward, backward or optimizer step alike.

The trace (make_fx over fake tensors: nothing runs, nothing is written):
  inputs   the program's bound inputs and what it reads from before, a placeholder each; a
           fused op's record among them (a forward's, read by its backward) is its operands
  ops      each instruction's kernel from ops/table.py, as eager replay runs it, but a fused op
           with gradients keeps a Redo (its operands) instead of torch's autograd record: the
           backward recomputes the op under autograd, traced, so Inductor fuses the
           recomputation (a layer norm's statistics, a loss's softmax) into the backward
  writes   in-place ops on inputs (an optimizer's update, gradients accumulated) stay in the
           graph, which Inductor functionalizes and copies back to the inputs at the end
  outputs  what the program leaves that eager replay would leave: each tensor it makes and
           does not free, and the operands of the records it makes
  random   dropout's mask, attention's dropout and rand draw from a counter-based hash of their seed and each
           element's index (splitmix64), traced as integer arithmetic that Inductor fuses into
           their users; each op's seed is an input of the program, a buffer set before each
           launch to the seed it gets as written (ops/table.py derive_seed): the same seed
           draws the same numbers run after run, not torch's numbers
  collectives  the data parallel sums, tensor parallel sums and gathers, ZeRO's
           reduce-scatters and gathers: the worker's own kernels (worker/dataplane.py) over a
           TracedPlane, whose collectives are torch's functional ones (aten ops, waited for
           where they start); on gloo the compiled program runs on the plane's waiting
           thread, as a gloo wait does, while the worker takes what rank 0 sends
           (and the kernels that sum their own pieces: a vocabulary-parallel loss, whose
           Redo keeps its log-sum-exp, SAVED_FORMS, as no collective is run again backward)
growing  a program whose sizes follow its call's (a sequence a token longer each call,
           nn/capture.py) is traced once with that size as a symbol: the inputs that grew
           between two replays get sizes and strides a * n + b, read from one more input, a
           tensor of n bytes (its carrier); Inductor compiles it for every n, and each size is
           run if the trace's guards on n hold for it (else op by op): no CUDA graph, as a
           graph holds one size
Refused with the reason, and replayed as today: control words but frees, sends, receives and
all-to-alls, a server's client's collectives, other random ops (randn, randint, multinomial), a read of an autograd record of an uncompiled program, and whatever the
trace or Inductor raises.

Modes (GTMPI_COMPILE, read on rank 0 and sent with each capture): 0 (the default: off), 1
(Inductor), auto (Inductor on GPU workers, none on CPU workers, no attention with dropout),
asked (auto's rule for what gtmpi.compile was given, nothing else), fx (the traced graph run as it is: the translation checked against eager replay on
CPU workers, tests/test_compile.py). Inductor keeps what it compiled in its cache on disk
(TORCHINDUCTOR_CACHE_DIR), and the trace is kept beside it (worker/tracecache.py; not a
growing program's or one holding collectives), so a second run of the same program skips both.
"""
from __future__ import annotations

import functools
import math
import operator
import os
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple

import torch

from ..ops.table import (FUSED_FNS, OPS, SAVED_FORMS, Graph, Kind, Redo, Seed,
                         autocast_operands, derive_seed)
from . import graphs, tracecache
from .dataplane import DataPlane, TracedPlane

# the collectives a trace takes: each a kernel of the data plane over a TracedPlane
_TRACED_COMM = {"all_reduce", "all_reduce_", "all_reduce_bucket", "all_gather",
                "all_gather_many", "gather_pieces", "reduce_scatter", "reduce_scatter_bucket"}


def refusal(program: list[tuple], mode: str = "inductor") -> str | None:
    """Why ``program`` cannot be compiled, from its instructions alone, or None; under
    'auto', also why compiling it would not win."""
    for i, _, _ in graphs.seeded(program):
        if program[i][0] not in _COUNTED:
            return f"it draws random numbers by {program[i][0]}"
        if mode == "auto" and program[i][0] == "scaled_dot_product_attention":
            # measured on an H100 (nanoGPT's first run, dropout 0.2): as fast, 1.35x the memory
            return "GTMPI_COMPILE=auto leaves attention with dropout to its fused kernel " \
                "(composed to draw its mask by counting, it keeps its probabilities)"
    for name, _, _, _, kw in program:
        op = OPS.get(name)
        if op is None:
            if name != "free":
                return f"it holds the control word '{name}'"
        elif op.kind is Kind.COMM and name not in _TRACED_COMM:
            return f"it holds a {name}"
    return None


class Compiled:
    """One program compiled: run(env) does what running its instructions on ``env`` does."""

    def __init__(self, fn: Callable[..., Any], inputs: list[tuple[int, Any]],
                 outputs: list[tuple[int, Any]], freed: list[int], seconds: float,
                 mode: str, seeds: list[tuple[int, torch.Tensor]],
                 plane: DataPlane | None = None, comm: dict | None = None,
                 detail: str = "", fits: Callable[[int], bool] | None = None,
                 device: torch.device | None = None) -> None:
        self.fn = fn
        self.inputs = inputs  # (id, layout): what each input is (_flat)
        self.seeds = seeds  # each random op's (offset among the call's, its seed's buffer)
        self.outputs = outputs  # (id, layout) of what it leaves
        self.freed = freed  # inputs the program frees
        self.seconds = seconds  # tracing and compiling
        self.detail = detail  # where those seconds went
        self.mode = mode
        self.plane = plane  # the worker's, where the program holds collectives
        self.comm = comm or {}  # what one run moves: kind -> [count, bytes]
        self.fits = fits  # a growing program's: whether its guards hold at a size
        self.ops = 0  # the ops one run stands for
        self.device = device

    def seed(self, seeds: tuple[int, int] | None) -> None:
        """Before a launch: each random op's seed as written, from (session seed, count
        before the call)."""
        if self.seeds and seeds is not None:
            session, base = seeds
            for offset, buffer in self.seeds:
                buffer.fill_(derive_seed(session, base + offset))

    def run(self, env: dict[int, Any], size: int | None = None) -> None:
        """Run on the inputs ``env`` holds; a growing program at ``size``, which fits()."""
        flat: list[torch.Tensor] = []
        for tid, _ in self.inputs:
            _flat(env[tid], flat)
        flat += [buffer for _, buffer in self.seeds]
        if self.fits is not None:
            flat.append(torch.empty(size, dtype=torch.uint8, device=self.device))
        if self.plane is None:
            results = iter(self.fn(*flat))
        else:
            results = iter(self.plane.call(lambda: self.fn(*flat)))
            for kind, (count, nbytes) in self.comm.items():
                entry = self.plane.stats[kind]
                entry[0] += count
                entry[1] += nbytes
        for tid, layout in self.outputs:
            env[tid] = _unflat(layout, results)
        for tid in self.freed:
            env.pop(tid, None)

    def note(self) -> str:
        how = "Inductor" if self.mode == "inductor" else "its traced graph (GTMPI_COMPILE=fx)"
        return f"compiled by {how}{' for every size' if self.fits else ''} in " \
            f"{self.seconds:.1f} s" + \
            (f" ({self.detail})" if self.detail else "")


def warm_up(device: torch.device, asked: bool = False) -> threading.Thread | None:
    """Tracing's and Inductor's first use cost seconds that no later program pays again (their
    modules, caches and compile workers set up: a one-instruction program traced in 5.9 s and
    compiled in 10.9 s on an H100's host, 1.6 and 4.7 s on a CPU here, against 0.01 and 1.4 s
    the second time). Where GTMPI_COMPILE asks this worker to compile (read here as rank 0
    reads it: the launch gives every rank its environment), or where rank 0 says a program
    ``asked`` (gtmpi.compile under GTMPI_COMPILE=asked: auto's rule), a thread pays them on a
    tiny program while the first steps run as written; the worker joins it before its first
    capture (a compile is no thread's to share)."""
    mode = "auto" if asked else os.environ.get("GTMPI_COMPILE", "0")
    if device.type not in ("cuda", "cpu") or \
            mode != "1" and not (mode == "auto" and device.type == "cuda"):
        return None
    thread = threading.Thread(target=_warm, args=(device,), name="gtmpi-compile-warm-up",
                              daemon=True)
    thread.start()
    return thread


def _warm(device: torch.device) -> None:
    try:
        from torch._inductor import compile as inductor
        from torch.fx.experimental.proxy_tensor import make_fx
        one = torch.ones(8, device=device)
        traced = make_fx(lambda x: (x * 2 + 1).relu(), tracing_mode="fake")(one)
        inductor(traced, [n.meta["val"] for n in traced.graph.nodes if n.op == "placeholder"])(one)
    except Exception:  # a warm-up only: the first program pays what this could not
        pass


def compile_program(program: list[tuple], inputs: list[int], env: dict[int, Any],
                    mode: str, device: torch.device, plane: DataPlane | None = None,
                    growing: Growing | None = None) -> Compiled:
    """``program`` (its seeds given; its sizes too, unless ``growing``: then for every size)
    compiled for the values ``env`` holds now under ``inputs`` (the ids it binds and reads
    from before), its collectives over ``plane``. Raises with the reason where it cannot be."""
    why = refusal(program, mode)
    if why is not None:
        raise RuntimeError(why)
    mode = "inductor" if mode == "auto" else mode
    start = time.perf_counter()
    layouts, flat = [], []
    for tid in inputs:
        value = env[tid]
        if isinstance(value, Graph) and not isinstance(value, Redo):
            raise RuntimeError(f"it reads torch's autograd record {tid}, made by a program "
                               "replayed uncompiled")
        layouts.append((tid, _layout(value)))
        _flat(value, flat)
    seeds = [(seed.offset, torch.zeros((), dtype=torch.int64, device=device))
             for i, at, keys in graphs.seeded(program)
             for seed in [program[i][2][j] for j in at] + [program[i][4][k] for k in keys]]
    flat += [buffer for _, buffer in seeds]
    made: dict[str, Any] = {}
    tracing = TracedPlane(plane) if any(map(_talks, program)) else None
    fn = _function(program, layouts, made, device, len(seeds), tracing,
                   growing and growing.sized)
    from torch.fx.experimental.proxy_tensor import make_fx
    fits = None
    # a growing program's guards live in its trace's shape environment, and collectives name
    # the job's groups: those are traced every time
    kept = _trace_key(program, layouts, flat, len(seeds), device) \
        if growing is None and tracing is None and tracecache.enabled() else None
    found = kept and tracecache.load(kept)
    kept_now = False
    if found:
        graph, outputs, made["freed"] = found
        traced = tracecache.graph_module(graph)
        made["outputs"] = [(tid, _restored(layout)) for tid, layout in outputs]
    elif growing is None:
        traced = make_fx(fn, tracing_mode="fake")(*flat)
        portable = kept and _portable_trace(traced, made["outputs"])
        if portable:
            # compiled as read back, as later runs will read it: the same graph and inputs,
            # so that Inductor finds what it keeps now (the trace's own graph, its nodes'
            # metadata and all, is another key to it: the next run's backward missed)
            graph = tracecache.store(kept, (*portable, made["freed"]))[0]
            traced = tracecache.graph_module(graph)
            kept_now = True
    else:
        fakes, shape_env, n = _symbolic(layouts, flat, env, growing, device)
        traced = make_fx(fn, tracing_mode="fake")(*fakes)
        fits, assumed = _guards(shape_env, n)
        flat.append(torch.empty(growing.size, dtype=torch.uint8, device=device))
    detail = f"{'its trace read from disk' if found else 'traced'} in " \
        f"{time.perf_counter() - start:.1f} s" + \
        (f", assuming {assumed} of the growing size" if growing is not None else "")
    if mode == "inductor":
        from torch._dynamo.utils import counters
        from torch._inductor import compile as inductor
        before = dict(counters["inductor"])
        # the trace's own fake inputs (a trace read from disk has none: fakes alike): Inductor
        # keeps in its cache only a graph whose fake tensors have a shape environment (make_fx's
        # have; fresh ones for real tensors without one not)
        run = inductor(traced, _fakes(flat) if found or kept_now else
                       [n.meta["val"] for n in traced.graph.nodes if n.op == "placeholder"])
        cache = [k.rsplit("_", 1)[1] for k in _CACHE if counters["inductor"][k] > before.get(k, 0)]
        detail += f"; Inductor's cache on disk: {', '.join(cache) or 'not asked'}"
        if device.type == "cuda":  # its first call loads its kernels, which a capture cannot
            # on the inputs themselves but copies of those it writes (a copy of every input
            # held a backward's activations twice: the run's peak memory)
            written = _written(traced)
            run(*[t.clone() if i in written else t for i, t in enumerate(flat)])
            torch.cuda.synchronize(device)
    else:
        run = traced
    done = Compiled(run, layouts, made["outputs"], made["freed"],
                    time.perf_counter() - start, mode, seeds, tracing and plane,
                    tracing and dict(tracing.stats), detail, fits, device)
    done.ops = sum(ins[0] != "free" for ins in program)
    return done


class Growing(NamedTuple):
    """What a growing program's trace needs: the size ``size`` the values given are of, the
    instructions holding Dims (worker/graphs.py: sized), and each input that grows: its id ->
    the (a, b) of each of its sizes, then of each of its strides, as a * n + b."""
    size: int
    sized: list[int]
    inputs: dict[int, tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]]


def growth(before: tuple[int, dict[int, tuple]], size: int,
           shapes: dict[int, tuple]) -> dict[int, tuple] | str:
    """Which inputs grow, from their (sizes, strides) at two sizes of a growing program: the
    earlier call's (its size, id -> (sizes, strides)) and this one's; or why it cannot tell
    (a size that is no whole linear function of n)."""
    was, old = before
    if was == size or old.keys() != shapes.keys():
        return "its inputs were not seen at two sizes"
    found = {}
    for tid, now in shapes.items():
        if now == old[tid]:
            continue
        lines = []
        for then_dims, now_dims in zip(old[tid], now):
            if len(then_dims) != len(now_dims):
                return f"input {tid} changed its number of dimensions"
            line = []
            for x, y in zip(then_dims, now_dims):
                a, r = divmod(y - x, size - was)
                if r:
                    return f"a size or stride of input {tid} is no linear function of n"
                line.append((a, x - a * was))
            lines.append(tuple(line))
        found[tid] = tuple(lines)
    return found


def _symbolic(layouts: list[tuple[int, Any]], flat: list[torch.Tensor], env: dict[int, Any],
              growing: Growing, device: torch.device) -> tuple[list, Any, Any]:
    """Fake inputs for a growing program's trace: those that grow sized by one symbol n, the
    others as they are, and last the carrier, n long; their shape environment and n."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)
    shape_env = ShapeEnv()
    fake = FakeTensorMode(shape_env=shape_env)

    def as_is(t: torch.Tensor) -> torch.Tensor:
        return fake.from_tensor(t, symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.STATIC] * t.ndim))

    carrier = fake.from_tensor(
        torch.empty(growing.size, dtype=torch.uint8, device=device),
        symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC]))
    n = carrier.shape[0]
    grown = {}
    for tid, (sizes, strides) in growing.inputs.items():
        value = env[tid]
        if not isinstance(value, torch.Tensor):
            raise RuntimeError(f"its input {tid} grows and is no tensor")
        with fake:
            grown[id(value)] = torch.empty_strided([a * n + b for a, b in sizes],
                                                   [a * n + b for a, b in strides],
                                                   dtype=value.dtype, device=value.device)
    for tid, layout in layouts:
        if layout is not _TENSOR and layout is not _NONE and tid in growing.inputs:
            raise RuntimeError(f"its input {tid} grows and is an autograd record")
    return [grown.get(id(t)) if id(t) in grown else as_is(t) for t in flat] + [carrier], \
        shape_env, n


def _trace_key(program: list[tuple], layouts: list[tuple[int, Any]], flat: list[torch.Tensor],
               seeded: int, device: torch.device) -> str | None:
    """The key of a program's trace on disk (worker/tracecache.py): its instructions (a seed by
    its place, not its value, which is an input), its inputs' layouts and each flat input's
    shape, strides, offset, dtype, whether it needs gradients and which storage it shares."""
    storages: dict[int, int] = {}
    tensors = [(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.requires_grad,
                storages.setdefault(t.untyped_storage().data_ptr(), len(storages)))
               for t in flat]
    try:
        given = [(tid, _portable(layout)) for tid, layout in layouts]
    except KeyError:  # a record of a function no name gives: traced every time
        return None
    return tracecache.key((_canonical(program), given, tensors, seeded, str(device)))


def _canonical(value: Any) -> Any:
    """An instruction's parts with each Seed as its place among the call's random ops."""
    kind = type(value)
    if kind is Seed:
        return ("seed", value.offset)
    if kind is tuple or kind is list:
        return kind(map(_canonical, value))
    if kind is dict:
        return {k: _canonical(v) for k, v in value.items()}
    return value


@functools.cache
def _named() -> dict[Any, tuple[str, str]]:
    """The functions a Redo record may hold, each by its table and name."""
    named = {fn: ("fused", name) for name, fn in FUSED_FNS.items()}
    named.update({fn: ("counted", name) for name, fn in _COUNTED.items()})
    named.update({back: ("back", name) for name, (_, back) in SAVED_FORMS.items()})
    return named


def _portable(layout: Any) -> Any:
    """A layout (_layout) as pickle can keep it: a Redo's functions by name, its tensors' places
    marked. KeyError for a function of no table."""
    if layout is _TENSOR or layout is _NONE:
        return layout
    named = _named()

    def marked(part: tuple) -> tuple:
        return tuple(("t",) if isinstance(a, torch.Tensor) else ("v", a) for a in part)
    return ("redo", named[layout.fn], marked(layout.args), tuple(layout.kw),
            marked(tuple(layout.kw.values())), layout.grads, marked(layout.saved),
            None if layout.back is None else named[layout.back])


def _portable_trace(traced: torch.fx.GraphModule, outputs: list[tuple[int, Any]]
                    ) -> tuple[Any, list[tuple[int, Any]]] | None:
    """A trace's graph and output layouts as pickle can keep them, or None where they cannot
    be (traced every time)."""
    try:
        return tracecache.portable_graph(traced), [(tid, _portable(layout))
                                                    for tid, layout in outputs]
    except (KeyError, ValueError):
        return None


def _restored(portable: Any) -> Any:
    """The layout _portable was given."""
    if portable == _TENSOR:
        return _TENSOR
    if portable == _NONE:
        return _NONE
    _, fn, args, keys, values, grads, saved, back = portable
    functions = {where: fn for fn, where in _named().items()}

    def hollow(part: tuple) -> tuple:
        return tuple(_HOLLOW if mark[0] == "t" else mark[1] for mark in part)
    return Redo(functions[fn], hollow(args), dict(zip(keys, hollow(values))), grads,
                hollow(saved), None if back is None else functions[back])


def _fakes(flat: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fake tensors for ``flat``, as make_fx's fake tracing makes them (static sizes, in a
    shape environment, each named by its place), so that Inductor finds what it kept."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    fake = FakeTensorMode(allow_fallback_kernels=True, shape_env=ShapeEnv(), static_shapes=True)
    return [fake.from_tensor(t, source=ConstantSource(f"input{i}")) for i, t in enumerate(flat)]


def _guards(shape_env: Any, n: Any) -> tuple[Callable[[int], bool], str]:
    """Whether what a growing program's trace assumed of n (its range, its guards) holds for
    a size (each size asked once), and what that is, in words."""
    symbol = n.node.expr
    if not getattr(symbol, "is_Symbol", False):
        raise RuntimeError(f"its trace fixed the growing size at {symbol}")
    bounds = shape_env.var_to_range.get(symbol)
    guards = [g.expr for g in shape_env.guards]
    for expr in guards:
        if expr.free_symbols - {symbol}:
            raise RuntimeError(f"its trace assumed {expr} of sizes other than the growing one")
    answered: dict[int, bool] = {}

    def fits(size: int) -> bool:
        ok = answered.get(size)
        if ok is None:
            ok = answered[size] = (bounds is None or bounds.lower <= size <= bounds.upper) and \
                all(bool(expr.xreplace({symbol: size})) for expr in guards)
        return ok
    # sympy only here: imported with this module, it cost every worker's start ~0.5 s
    import sympy
    from torch.utils._sympy.numbers import int_oo
    named = sympy.Symbol("n")  # the growing size, as notes name it
    said = ([f"{bounds.lower} <= n" + (f" <= {bounds.upper}" if bounds.upper != int_oo else "")]
            if bounds is not None else []) + [str(expr.xreplace({symbol: named}))
                                              for expr in guards]
    return fits, ", ".join(said) or "nothing"


def _function(program: list[tuple], layouts: list[tuple[int, Any]], made: dict[str, Any],
              device: torch.device, seeded: int, plane: TracedPlane | None,
              sized: list[int] | None = None) -> Callable[..., list[torch.Tensor]]:
    """The program as a function of its flat inputs (the last ``seeded`` its random ops'
    seeds, in order; a growing program's after them its carrier, whose length its Dims
    follow, ``sized`` where they are), returning its flat outputs; what the outputs are
    (their ids and layouts) and which inputs it frees go into ``made``."""
    def run(*flat: torch.Tensor) -> list[torch.Tensor]:
        instructions = program
        if sized is not None:
            *flat, carrier = flat
            instructions = graphs.with_sizes(program, sized, carrier.shape[0])
        it = iter(flat[:len(flat) - seeded])
        seeds = iter(flat[len(flat) - seeded:])
        env = {tid: _unflat(layout, it) for tid, layout in layouts}
        given = dict(env)
        for ins in instructions:
            name, out, args, tmask, kw = ins
            if name == "free":
                for tid in args:
                    env.pop(tid, None)
                continue
            op = OPS[name]
            if tmask:
                args = [env[a] if tmask >> i & 1 else a for i, a in enumerate(args)]
            if op.kind is Kind.CREATE:
                kw = {**(kw or {}), "device": device}
            elif name in ("getitem", "setitem") and any(type(k) is list and k
                                                        for k in kw["key"]):
                # a list index (x[:, [-1]]) as a constant on the device: torch would make it
                # on the host, a CPU constant beside the program's GPU tensors
                kw = {**kw, "key": tuple(torch.tensor(k, device=device) if type(k) is list
                                         and k else k for k in kw["key"])}
            elif _talks(ins):
                kw = {**kw, "plane": plane}
            counted = _COUNTED.get(name) if _drawn(args, kw) else None
            if counted is not None:  # each Seed its buffer, in seeded()'s order
                args = [next(seeds) if type(a) is Seed else a for a in args]
                kw = kw and {k: next(seeds) if type(v) is Seed else v for k, v in kw.items()}
            if name in FUSED_FNS and kw and kw.get("grads"):
                res = _redone(counted or FUSED_FNS[name], name, args, kw)
            elif counted is not None:
                res = counted(*args, **kw) if kw else counted(*args)
            elif sized is not None and name == "linear" and not (kw and set(kw) - {"cast"}):
                res = _symbolic_linear(*args, **kw) if kw else _symbolic_linear(*args)
            else:
                res = op.kernel(*args, **kw) if kw else op.kernel(*args)
            if type(out) is int:
                env[out] = res
            else:
                env.update(zip(out, res))
        outputs, tensors = [], []
        for tid, value in env.items():
            if given.get(tid) is not value:
                outputs.append((tid, _layout(value)))
                _flat(value, tensors)
        made["outputs"] = outputs
        made["freed"] = [tid for tid in given if tid not in env]
        return tensors
    return run


def _symbolic_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                     cast: torch.dtype | None = None) -> torch.Tensor:
    """ops/table.py's linear (autocast's ``cast`` too) where sizes may be symbols: torch's C++
    linear asks a CUDA input's numel(), which a symbolic size has not (every growing program
    was refused on GPUs)."""
    x, w, b = autocast_operands(x, w, b, cast)
    # a plain mm between views, which fake tensors' meta kernels size symbolically (no C++
    # composite's checks in between)
    out = torch.mm(x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], w.shape[0])
    return out if b is None else out + b


# Inductor's counters of its graph cache on disk: found, made, passed by (a graph it cannot keep)
_CACHE = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")


def _written(traced: torch.fx.GraphModule) -> set[int]:
    """The positions of the inputs that a traced graph writes in place, directly or through
    a view (an op's schema says which arguments it writes and which results alias one)."""
    places = {n: i for i, n in enumerate(n for n in traced.graph.nodes if n.op == "placeholder")}

    def root(value: Any) -> int | None:
        while isinstance(value, torch.fx.Node) and value not in places:
            target = value.target
            if target is operator.getitem or isinstance(target, torch._ops.OpOverload) and \
                    target._schema.returns and target._schema.returns[0].alias_info is not None:
                value = value.args[0]  # a view (or a piece of a split) of its first argument
            else:
                return None
        return places.get(value)

    found = set()
    for node in traced.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for i, arg in enumerate(node.target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for v in value if isinstance(value, (list, tuple)) else (value,):
                at = root(v)
                if at is not None:
                    found.add(at)
    return found


def _drawn(args: tuple, kw: dict | None) -> bool:
    """Whether an instruction draws random numbers (a Seed among its arguments)."""
    return any(type(a) is Seed for a in args) or bool(kw) and any(type(v) is Seed
                                                                  for v in kw.values())


def _talks(ins: tuple) -> bool:
    """Whether an instruction runs collectives: one itself, or a kernel that sums its pieces
    over its group (a vocabulary-parallel loss, a row-parallel layer's overlapped sums)."""
    op, kw = OPS.get(ins[0]), ins[4]
    return op is not None and (op.kind is Kind.COMM or bool(kw) and kw.get("group") is not None)


def _redone(fn: Callable[..., Any], name: str, args: list, kw: dict) -> tuple[Any, Redo]:
    """A fused op ``name`` with gradients, ``fn`` its forward: its result and its Redo record
    (ops/table.py)."""
    grads = kw["grads"]
    rest = {k: v for k, v in kw.items() if k != "grads"}
    forms = SAVED_FORMS.get(name)
    with torch.no_grad():
        made = forms[0](*args, **rest) if forms else None
        if made is not None:
            return made[0], Redo(fn, tuple(args), rest, grads, made[1], forms[1])
        return fn(*args, **rest), Redo(fn, tuple(args), rest, grads)


# splitmix64's constants as int64 (torch's integers are signed; products wrap)
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                 0x94D049BB133111EB))


def _shifted(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z >> bits as unsigned (torch shifts int64 arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _uniform(shape: tuple, seed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """float32 numbers in [0, 1), one per element of ``shape``, from splitmix64 of the
    element's index xor the seed: elementwise integer arithmetic, fused by Inductor. (The
    index times the golden ratio first, as splitmix counts, Inductor took for an indexing
    expression and bounded with Python's integers, past int64: it refused the graph.)"""
    z = (torch.arange(math.prod(shape), dtype=torch.int64, device=device) ^ seed) * _GOLDEN
    z = (z ^ _shifted(z, 30)) * _MIX1
    z = (z ^ _shifted(z, 27)) * _MIX2
    z = z ^ _shifted(z, 31)
    return (_shifted(z, 40).to(torch.float32) * 2.0 ** -24).view(shape)


def _attention(q, k, v, mask, dropout_p, is_causal, scale, seed=None) -> torch.Tensor:
    """Attention with dropout, composed (torch's math form) so that its dropout can draw by
    counting: the probabilities of each query row, dropped where the hash says, times the
    values. Its Redo recomputes it in the backward (no flash kernel keeps a mask)."""
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        rows, cols = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(rows, cols, dtype=torch.bool, device=q.device)
                                    .tril().logical_not(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(mask.logical_not(), float("-inf")) if mask.dtype == \
            torch.bool else scores + mask
    probs = torch.softmax(scores, -1)
    if seed is not None and dropout_p:
        keep = _uniform(tuple(probs.shape), seed, q.device) >= dropout_p
        probs = probs * keep / (1 - dropout_p)
    return probs @ v


# the random ops a compiled program draws by counting: the kernels of their table rows with a
# seed tensor in place of the seed
_COUNTED = {
    "dropout_mask": lambda shape, p, seed, device: _uniform(shape, seed, device) >= p,
    "rand": lambda shape, dtype, seed, device: _uniform(shape, seed, device).to(dtype),
    "scaled_dot_product_attention": _attention,
}


_TENSOR, _NONE = "tensor", "none"
_HOLLOW = torch.empty(0, device="meta")


def _layout(value: Any) -> Any:
    """How a value is kept as flat tensors: a tensor itself, a Redo its operands, None none."""
    if isinstance(value, torch.Tensor):
        return _TENSOR
    if value is None:
        return _NONE
    if isinstance(value, Redo):  # its operands' places, not the tensors (kept alive)
        return value.with_tensors([_HOLLOW] * len(value.leaves))
    raise RuntimeError(f"it makes or reads a {type(value).__name__}, which a compiled program "
                       "cannot keep")


def _flat(value: Any, into: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        into.append(value)
    elif isinstance(value, Redo):
        into.extend(value.leaves)


def _unflat(layout: Any, it: Iterator[torch.Tensor]) -> Any:
    if layout is _TENSOR:
        return next(it)
    if layout is _NONE:
        return None
    return layout.with_tensors([next(it) for _ in layout.leaves])
