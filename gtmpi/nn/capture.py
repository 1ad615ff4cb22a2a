"""Module calls captured: an unchanged program's steady loop runs no forward Python.

The outermost call of a module (``model(x, y)``; not one made inside another's forward) is
keyed by its arguments (client/replay.py's signature: shapes, dtypes, placements, constants,
grad mode, autocast, signal scopes) and by what its Python reads besides them (a Guard over
the module: its tree, training flags, parameters and buffers, hooks, the globals and class
attributes its code reads). Its first call of a key runs as written; the second runs as
written while the workers' instructions are recorded into a program (dispatcher/programs.py),
as ``gtmpi.replayable`` records; from the third on, a call whose key matches runs that program
on one word per worker and hands back its outputs without running the module's Python.

Autograd sees one node per captured call (engine.function), over the parameters it reaches:
its backward is the recorded backward program, one word per worker. That program is recorded
at the first backward through the recording call: its autograd graph, kept whole under the
one node, is run then with the dispatcher recording (torch.autograd.grad of the parameters).
The tensors that graph read (the forward's activations the rules keep) are the forward
program's outputs too, handed to the backward program per call; so are the call's own inputs
(an embedding's indices). The engine accumulates the parameters' gradients as for any node.

What would make a replay differ from running the Python is part of the key or checked: a
changed module (STATE's version; every attribute set, train()/eval(), hooks), a tensor whose
id or requires_grad changed, a global or class attribute rebound, a container's content. What
cannot be followed is refused with its reason, and the call runs as written
(``gtmpi.debug.explain()`` says per module and call site): an argument that requires grad, a
result that is not tensors, a tensor the forward kept outside its results, activation
checkpointing inside, a tensor read that no guard follows.

On by default where one worker runs the program (client/replay.py: capture_enabled);
GTMPI_CAPTURE=1 turns it on for several workers too (not yet run on several GPUs), 0 off.
"""
from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Callable, NamedTuple

from ..autograd import engine
from ..client import gradmode
from ..client.replay import (RECORDINGS_MAX, SIGNATURES_MAX, Guard, _build, _signature,
                             _tensor_ids, capture_enabled, run_recorded)
from ..client.creation import zeros, zeros_like
from ..client.runtime import Runtime, runtime
from ..client.tensor import Tensor
from ..dispatcher.dispatcher import compile_setting
from ..errors import ReplayError
from ..ops.table import Dim

WARMUP = 1  # calls of a key run as written before one is recorded (lazy state settles)
COMPILE_ASKED = "_compile_asked"  # a module's mark, given to gtmpi.compile


def ask_compile(module: Any) -> None:
    """``gtmpi.compile(module)``: under GTMPI_COMPILE=asked, the programs its captured calls
    record (forward and backward) are compiled where compiling wins (auto's rule: on GPU
    workers), and the workers pay compiling's first-use costs from now on; other settings
    decide for every program alike. A mark no guard reads: it changes no result."""
    object.__setattr__(module, COMPILE_ASKED, "auto")
    if compile_setting() == "asked":
        d = runtime().dispatcher
        d.post("warm_compile", (), sorted(d.links))


def call(module: Any, args: tuple, kwargs: dict, as_written: Callable) -> Any:
    """``module(*args, **kwargs)``: replayed where a recording fits, else ``as_written``."""
    rt = runtime()
    if not capture_enabled(rt):
        return as_written(*args, **kwargs)
    d = rt.dispatcher
    if rt.module_calls or d.in_replayable or d.recording is not None:
        return as_written(*args, **kwargs)
    captured = module.__dict__.get("_capture")
    if captured is None:
        captured = Captured(module, rt)
        object.__setattr__(module, "_capture", captured)  # no STATE bump: nothing it reads
    rt.module_calls += 1
    d.in_replayable += 1  # what it makes is made by the workers, as a replay makes it
    try:
        out = captured.call(rt, args, kwargs, as_written)
        if type(out) is _AsWritten:  # run here: a traceback from the forward stays short
            captured.notes[f"as written: {out.why}"] += 1
            out = as_written(*args, **kwargs)
        return out
    finally:
        rt.module_calls -= 1
        d.in_replayable -= 1


class _AsWritten(NamedTuple):
    """Captured.call's answer where the call runs as written, and why."""
    why: str


class Captured:
    """One module's recorded calls, by key."""

    def __init__(self, module: Any, rt: Runtime) -> None:
        self.guard = Guard(module, lists=True)  # never stale: a list's numbers count too
        self.name = f"{type(module).__name__} (called at {rt.current_site()})"
        self.calls: dict[Any, int] = {}
        self.kept: dict[Any, list[_Call]] = {}
        self.refused: dict[Any, str] = {}
        self.growing: dict[Any, _Growing] = {}  # by the key less its tensors' sizes
        same = sum(name.startswith(self.name) for name in rt.capture_notes)
        if same:  # another model called at the same line: each says its own
            self.name += f" #{same + 1}"
        self.notes: Counter = rt.capture_notes.setdefault(self.name, Counter())

    def _asked(self) -> str:
        """How the module asks its programs compiled: 'auto' if given to gtmpi.compile."""
        module = self.guard.root()
        return "" if module is None else module.__dict__.get(COMPILE_ASKED, "")

    def call(self, rt: Runtime, args: tuple, kwargs: dict, as_written: Callable) -> Any:
        inputs: list[Tensor] = []
        try:
            signature = _signature(rt, (args, kwargs), inputs)
        except ReplayError:
            return _AsWritten("an argument has an autograd graph or cannot be compared")
        if any(t.requires_grad for t in inputs):
            return _AsWritten("an argument requires grad")
        key = (signature, self.guard.key())
        kept = self.kept.get(key)
        if kept:
            for rec in list(kept):
                if not rec.fits(rt):
                    rec.drop(rt)
                    kept.remove(rec)
                elif rec.ready():
                    self.notes["replayed"] += 1
                    return rec.replay(rt, inputs)
        grow, n = self._growing(rt, signature, key, inputs)
        if grow is not None:
            if grow.call is not None and grow.fresh(key) and grow.call.fits(rt):
                self.notes["replayed (a growing size)"] += 1
                return grow.call.replay(rt, inputs, n)
            if key not in self.calls and self.calls and grow.sampling(n):
                self.notes["as written: recorded (a growing size)"] += 1
                followed = _tensor_ids(signature) | self.guard.tensor_ids()
                result, rec, why = _record(rt, self.name, args, kwargs, inputs, as_written,
                                           followed, self._asked(), (grow, n))
                if why is not None:
                    grow.refused = why
                    self.notes[f"as written: a growing size: {why}"] += 1
                return result
            if grow.call is not None:  # one size over and over (a crop): recorded as it is
                self.calls.setdefault(key, WARMUP)
        why = self.refused.get(key)
        if why is not None:
            return _AsWritten(why)
        if key not in self.calls and len(self.calls) >= SIGNATURES_MAX:
            return _AsWritten(f"more than {SIGNATURES_MAX} keys (shapes, constants or what it "
                              "reads differ call to call)")
        calls = self.calls[key] = self.calls.get(key, 0) + 1
        if calls <= WARMUP:
            return _AsWritten("warm-up")
        if calls > WARMUP + RECORDINGS_MAX:
            return _AsWritten(f"{RECORDINGS_MAX} recordings of one key never replayed")
        self.notes["as written: recorded"] += 1
        followed = _tensor_ids(signature) | self.guard.tensor_ids()
        result, rec, why = _record(rt, self.name, args, kwargs, inputs, as_written, followed,
                                   self._asked())
        if rec is not None:
            self.kept.setdefault(key, []).append(rec)
        elif why is not None:
            self.refused[key] = why
            self.notes[f"as written: {why}"] += 1
        return result

    def _growing(self, rt: Runtime, signature: Any, key: Any,
                 inputs: list[Tensor]) -> tuple[_Growing | None, int | None]:
        """The calls alike but for their tensors' sizes that this one belongs to, and its
        growing size; (None, None) where no one size tells its sizes from the first call's."""
        placer = rt.dispatcher.placer
        if placer.table or placer.signals:  # placed programs hold their pieces' shapes
            return None, None
        shapes = tuple(tuple(t.shape) for t in inputs)
        family = (_sizeless(signature), key[1])
        grow = self.growing.get(family)
        if grow is None:
            if len(self.growing) < SIGNATURES_MAX:
                self.growing[family] = _Growing(shapes)
            return None, None
        if grow.refused is not None:
            return None, None
        n = grow.size(shapes)
        return (grow, n) if n is not None else (None, None)

class _Root:
    """An output of a recording call as the engine's backward starts from it: where it
    stands in the call's own autograd graph."""

    __slots__ = ("_node", "_slot", "_sig", "requires_grad")

    def __init__(self, t: Tensor) -> None:
        self._node, self._slot, self._sig, self.requires_grad = t._node, t._slot, t._sig, True

    @property
    def shape(self) -> Any:
        return self._sig[0]

    @property
    def dtype(self) -> Any:
        return self._sig[1]


class _Backward:
    """A recorded backward program: which output gradients it takes, and which parameter
    each of its outputs is the gradient of."""

    def __init__(self, program: Any, grads_in: list[int], params_out: list[int | None],
                 sigs: list[tuple]) -> None:
        self.program = program
        self.grads_in = grads_in  # the recorded ids of the output gradients it binds
        self.params_out = params_out  # per parameter: its index among the outputs, or None
        self.sigs = sigs


class _Call:
    """One recorded call: its forward program, and its backward program per set of outputs
    a backward starts from."""

    def __init__(self, name: str, program: Any, structure: Any, made: list[Tensor],
                 inputs: list[int], outputs: int, grad_outs: list[int], held: list[int],
                 params: list[Tensor], followed: set[int]) -> None:
        self.name = name
        self.program = program
        self.structure = structure
        # what the forward makes: results first, then the activations the backward reads
        self.sigs = [t._sig for t in made]
        self.made = [t.id for t in made]  # their recorded ids
        self.inputs = inputs  # recorded ids of the arguments' tensors
        self.outputs = outputs
        self.grad_outs = grad_outs  # results that require grad: the node's outputs
        self.held = held  # what the backward reads of what the forward made: indices in sigs
        self.params = [weakref.ref(p) for p in params]
        self.followed = followed  # the tensors from before that the key follows
        self.backwards: dict[tuple[bool, ...], _Backward] = {}
        self.shapes: list[tuple] | None = None  # a growing call's: its results' sizes in n

    def ready(self) -> bool:
        """Whether a replay can be given a backward: none is needed, or one was recorded."""
        return not self.grad_outs or bool(self.backwards)

    def fits(self, rt: Runtime) -> bool:
        d = rt.dispatcher
        return d.fits(self.program) and all(d.fits(b.program) for b in self.backwards.values()) \
            and all(ref() is not None for ref in self.params)

    def drop(self, rt: Runtime) -> None:
        for program in [self.program, *(b.program for b in self.backwards.values())]:
            if not program.stale:
                rt.dispatcher.drop(program)

    def replay(self, rt: Runtime, inputs: list[Tensor], n: int | None = None) -> Any:
        """The recorded call on ``inputs`` (a growing call's: of growing size ``n``)."""
        binds = tuple((t.id, rec) for t, rec in zip(inputs, self.inputs))
        fresh = [rt.new_id() for _ in self.sigs]
        rt.dispatcher.replay(self.program, binds, fresh, rt.seeds_for(self.program.random_ops),
                             n)
        sigs = self.sigs if n is None else \
            [(type(sig[0])(_at(shape, n)), sig[1]) for sig, shape in zip(self.sigs, self.shapes)]
        made = [Tensor(tid, sig) for tid, sig in zip(fresh, sigs)]
        outs = made[:self.outputs]
        if self.grad_outs:  # grad mode is part of the key
            self.link(rt, [outs[i] for i in self.grad_outs], [made[i] for i in self.held],
                      inputs, None)
        return _build(self.structure, outs)

    def link(self, rt: Runtime, outs: list[Tensor], held: list[Tensor], inputs: list[Tensor],
             graph: list[_Root] | None) -> None:
        """One autograd node for the call: its outputs ``outs``, its operands the parameters
        that require grad; its backward the recorded program (recorded from ``graph``, the
        recording call's own, the first time). ``held``: what that program reads of what the
        forward made."""
        params = [ref() for ref in self.params]
        like = [weakref.ref(o) for o in outs]  # for a gradient missing where one was recorded

        def backward(grads: Any) -> tuple:
            grads = grads if len(outs) > 1 else (grads,)
            return self._backward(runtime(), grads, held, inputs, params, graph, like)

        engine.function(params, tuple(outs), backward)

    def _backward(self, rt: Runtime, grads: tuple, held: list[Tensor], inputs: list[Tensor],
                  params: list[Tensor], graph: list[_Root] | None, like: list) -> tuple:
        mask = tuple(g is not None for g in grads)
        rec = self.backwards.get(mask)
        if rec is None:
            wider = [m for m in self.backwards if all(a or not b for a, b in zip(m, mask))]
            if wider:  # a gradient the recording had is absent now: zeros in its place
                mask = wider[0]
                rec = self.backwards[mask]
                grads = tuple(g if g is not None or not m else _zeros(like[i](), self.sigs[o])
                              for i, (g, m, o) in enumerate(zip(grads, mask, self.grad_outs)))
            elif graph is None:
                raise RuntimeError(
                    f"gtmpi: a captured call of {self.name} was differentiated from outputs "
                    "that its recording's backward was not: run with GTMPI_CAPTURE=0")
            else:
                return self._record_backward(rt, mask, grads, held, inputs, params, graph)
        if not rt.dispatcher.fits(rec.program):
            raise RuntimeError(
                f"gtmpi: a tensor that the captured backward of {self.name} reads was replaced "
                "or freed between its forward and this backward (a parameter's .data set): "
                "change it before the forward, or run with GTMPI_CAPTURE=0")
        given = [g for g in grads if g is not None]
        binds = tuple((g.id, rid) for g, rid in zip(given, rec.grads_in)) + \
            tuple((t.id, self.made[i]) for i, t in zip(self.held, held)) + \
            tuple((t.id, rid) for t, rid in zip(inputs, self.inputs))
        fresh = [rt.new_id() for _ in rec.sigs]
        rt.dispatcher.replay(rec.program, binds, fresh, rt.seeds_for(rec.program.random_ops))
        made = [Tensor(tid, sig) for tid, sig in zip(fresh, rec.sigs)]
        return tuple(None if i is None else made[i] for i in rec.params_out)

    def _record_backward(self, rt: Runtime, mask: tuple, grads: tuple, held: list[Tensor],
                         inputs: list[Tensor], params: list[Tensor], graph: list[_Root]) -> tuple:
        """The recording call's backward, run through its own graph as written while the
        workers' instructions are recorded; installed as this mask's backward program."""
        d = rt.dispatcher
        given = [g for g in grads if g is not None]
        roots = [r for r, m in zip(graph, mask) if m]
        first = rt.new_id()
        d.start_recording(first)
        try:
            # retained: a backward with retain_graph=True runs this node again (then replayed);
            # the graph goes with the node when the engine frees it
            got = engine.grad(roots, params, given, retain_graph=True, allow_unused=True)
        except BaseException:
            d.abandon_recording()
            raise
        made = [g for g in got if g is not None]
        program, kept = d.install([g.id for g in made], [g.id for g in given] +
                                  [t.id for t in held] + [t.id for t in inputs],
                                  f"{self.name} backward")
        program.compile = self.program.compile
        if kept or program.reads - self.followed:
            # this backward's gradients stand; the key's later calls run as written
            d.drop(program)
            d.drop(self.program)
            return tuple(got)
        pairs = [(g.id, rt.new_id()) for g in made]
        d.rename(pairs)
        for g, (_, new) in zip(made, pairs):
            g.id = new
        index = {id(g): i for i, g in enumerate(made)}
        self.backwards[mask] = _Backward(program, [g.id for g in given],
                                         [None if g is None else index[id(g)] for g in got],
                                         [g._sig for g in made])
        return tuple(got)


def _zeros(out: Tensor | None, sig: tuple) -> Tensor:
    return zeros_like(out) if out is not None else zeros(*sig[0], dtype=sig[1], device="cuda")


def _record(rt: Runtime, name: str, args: tuple, kwargs: dict, inputs: list[Tensor],
            as_written: Callable, followed: set[int], asked: str,
            growing: tuple[_Growing, int] | None = None) -> tuple[Any, _Call | None, str | None]:
    """Run the call as written while its instructions are recorded and install them: (its
    result, the recording or None, why not). ``asked``: how its programs are asked compiled
    (ask_compile). ``growing``: a call of growing size n, kept as a sample of its calls (no
    recording yet, no reason) until the samples tell its sizes."""
    d = rt.dispatcher
    first, placed = rt.new_id(), d.placer.placed
    d.start_recording(first)
    result, outs, structure, why = run_recorded(d, first, lambda: as_written(*args, **kwargs))
    if why is not None:
        return result, None, why
    grad_outs = [i for i, o in enumerate(outs) if o.requires_grad and o._node is not None] \
        if gradmode.is_grad_enabled() else []
    read, params, why = _graph(outs, grad_outs, first)
    if why is not None:
        d.abandon_recording()
        return result, None, why
    position = {id(o): i for i, o in enumerate(outs)}
    saved = [t for t in read if id(t) not in position]
    made = outs + saved
    position.update((id(t), len(outs) + i) for i, t in enumerate(saved))
    held = [position[id(t)] for t in read]
    sized = shapes = None
    if growing is not None:
        grow, n = growing
        if grad_outs:
            d.abandon_recording()
            return result, None, "its results require grad"
        if d.placer.placed != placed:
            d.abandon_recording()
            return result, None, "it places tensors (a placed program holds its pieces' shapes)"
        try:
            got = grow.sample(n, d.recording, [t.id for t in inputs], outs, structure)
        except _Differs as e:
            d.abandon_recording()
            return result, None, str(e)
        if got is None:  # a sample: the call ran as written
            d.abandon_recording()
            return result, None, None
        sized, shapes = got
    program, kept = d.install([t.id for t in made], [t.id for t in inputs],
                              f"{name}{' for every size' if sized else ''} (recorded at "
                              f"{rt.current_site()})", sized)
    program.compile = asked
    if kept:
        d.drop(program)
        sites = ", ".join(sorted({rt.site(tid) or f"tensor {tid}" for tid in kept[:4]}))
        return result, None, f"its forward kept {len(kept)} tensor(s) outside its results " \
            f"(made at {sites})"
    if program.reads - followed:
        d.drop(program)
        return result, None, "it read a tensor from before that no guard follows (held " \
            "where no walk looks: a set, a library's object)"
    pairs = [(t.id, rt.new_id()) for t in made]
    d.rename(pairs)
    for t, (_, new) in zip(made, pairs):
        t.id = new
    rec = _Call(name, program, structure, made, [t.id for t in inputs], len(outs), grad_outs,
                held, params, followed)
    if growing is not None:
        rec.shapes = shapes
        growing[0].call = rec
    if grad_outs:
        rec.link(rt, [outs[i] for i in grad_outs], [made[i] for i in held], inputs,
                 [_Root(outs[i]) for i in grad_outs])
    return result, rec, None


def _graph(outs: list[Tensor], grad_outs: list[int], first: int) -> tuple[list, list, str | None]:
    """The call's autograd graph: the tensors made inside that its rules read (the forward
    program's further outputs, or its results), the parameters it reaches that require grad,
    or why it cannot be captured."""
    seen: set[int] = set()
    stack = [outs[i]._node for i in grad_outs]
    read: dict[int, Tensor] = {}
    params: dict[int, Tensor] = {}
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == "function":
            return [], [], "activation checkpointing (or a custom Function) inside"
        for a in node.parents():  # through Ghosts too: what a rule does not read
            stack.append(a)
        for a in [*node.operands, *(node.saved or ())]:
            if not isinstance(a, Tensor):  # a Ghost: its data is not read
                continue
            if a._node is None and a.requires_grad:
                params[id(a)] = a
            if a._id is not None and a._id >= first and a._host is None:
                read[id(a)] = a
    return list(read.values()), list(params.values()), None


# calls that grow --------------------------------------------------------------------------------

class _Differs(Exception):
    """Two samples of a growing call differ otherwise than in sizes that follow n."""


class _Lin(NamedTuple):
    """A size that is ``a * n + b`` for a call of growing size n."""
    a: int
    b: int


SAMPLES = 3  # calls of distinct sizes recorded before a growing program: two fit, one checks


class _Growing:
    """A module's calls alike but for their tensors' sizes, where one size n tells them apart
    (a decoder's sequence, a token longer each call): sampled as written at SAMPLES sizes; if
    every instruction is the same but for integers that are a * n + b (a view's shape, an
    arange's end, a slice's bound), one program whose sizes follow n (ops/table.py: Dim),
    replayed op by op on any n. A size called again and again (a crop at the model's length)
    is recorded as it is after two calls (a CUDA graph)."""

    def __init__(self, shapes: tuple) -> None:
        self.first = shapes  # the first call's tensors' sizes
        self.where: list[tuple[int, int]] | None = None  # (tensor, dim) of the growing size
        # (n, each worker's instructions, its results' sizes, their structure)
        self.samples: list[tuple[int, dict, list, Any]] = []
        self.call: _Call | None = None
        self.refused: str | None = None
        self.last: Any = None
        self.streak = 0

    def size(self, shapes: tuple) -> int | None:
        """The growing size of a call whose tensors have ``shapes``, or None: not this
        family's (other sizes differ, or several at once)."""
        if len(shapes) != len(self.first) or any(len(a) != len(b)
                                                 for a, b in zip(shapes, self.first)):
            return None
        if self.where is None:
            differ = [(i, j) for i, (a, b) in enumerate(zip(shapes, self.first))
                      for j in range(len(a)) if a[j] != b[j]]
            if not differ or len({shapes[i][j] for i, j in differ}) > 1 or \
                    len({self.first[i][j] for i, j in differ}) > 1:
                return None
            self.where = differ
        n = shapes[self.where[0][0]][self.where[0][1]]
        grows = set(self.where)
        for i, (a, b) in enumerate(zip(shapes, self.first)):
            for j in range(len(a)):
                if a[j] != (n if (i, j) in grows else b[j]):
                    return None
        return n

    def fresh(self, key: Any) -> bool:
        """Whether a call of ``key`` replays the growing program: not once its key came
        three times in a row (then it is recorded as it is)."""
        self.streak = self.streak + 1 if key == self.last else 1
        self.last = key
        return self.streak <= 2

    def sampling(self, n: int) -> bool:
        """Whether a call of size ``n`` is recorded as a sample (a size not sampled yet)."""
        return self.call is None and self.refused is None and \
            all(m != n for m, *_ in self.samples)

    def sample(self, n: int, recording: Any, inputs: list[int], outs: list[Tensor],
               structure: Any) -> tuple[Callable, list[tuple]] | None:
        """One more call of size ``n``, its instructions in ``recording``: None while more
        samples are wanted; then (what makes a worker's recorded instructions the growing
        program's, its results' sizes in n). Raises _Differs."""
        code = {rank: _normal(program, recording, inputs)
                for rank, program in recording.per_rank.items()}
        sizes = [tuple(o.shape) for o in outs]
        if len(self.samples) < SAMPLES - 1:
            self.samples.append((n, code, sizes, structure))
            return None
        (n1, code1, sizes1, structure1), (n2, code2, sizes2, structure2) = self.samples
        if structure1 != structure or structure2 != structure:
            raise _Differs("its results differ in kind call to call")
        try:
            fitted = _fit(code1, code2, n1, n2)
            shapes = _fit(sizes1, sizes2, n1, n2)
        except _Differs as e:
            raise _Differs(f"its instructions differ otherwise than in sizes ({e})") from None
        if _at(fitted, n) != code or _at(shapes, n) != sizes:
            raise _Differs("its sizes are no linear function of the growing one")
        by_rank = iter([fitted[rank] for rank in recording.per_rank])

        def sized(program: list[tuple]) -> list[tuple]:
            template = iter(next(by_rank))
            return [ins if ins[0] == "free" else _dims(ins, next(template))
                    for ins in program]

        return sized, shapes


def _sizeless(signature: Any) -> Any:
    """A call's signature with its tensors' sizes left out (their number of dimensions kept)."""
    grad, signals, autocast, tree = signature
    return grad, signals, autocast, _strip(tree)


def _strip(node: Any) -> Any:
    if type(node) is tuple and len(node) == 4 and node[0] == "tensor":
        sig = node[1]
        return ("tensor", (len(sig[0]), sig[1]), *node[2:])
    if type(node) is tuple and len(node) == 2 and node[0] in (tuple, list):
        return node[0], tuple(_strip(v) for v in node[1])
    if type(node) is tuple and len(node) == 2 and node[0] is dict:
        return dict, tuple((k, _strip(v)) for k, v in node[1])
    return node


def _normal(program: list[tuple], recording: Any, inputs: list[int]) -> list[tuple]:
    """A worker's recorded instructions, frees left out, with the ids made inside numbered in
    the order they are first named and the inputs by their place: alike calls compare equal."""
    slots: dict[int, tuple] = {tid: ("input", i) for i, tid in enumerate(inputs)}

    def name(tid: int) -> Any:
        if tid not in slots and recording.inside(tid):
            slots[tid] = ("made", len(slots))
        return slots.get(tid, tid)

    code = []
    for op, out, args, tmask, kw in program:
        if op == "free":
            continue
        args = tuple(name(a) if tmask >> i & 1 else a for i, a in enumerate(args))
        out = name(out) if type(out) is int else tuple(map(name, out)) if out else out
        code.append((op, out, args, tmask, kw))
    return code


def _fit(x: Any, y: Any, nx: int, ny: int) -> Any:
    """``x`` (of a call of size nx) with each integer that differs in ``y`` (of size ny) a
    _Lin; _Differs where anything else differs."""
    if type(x) is int and type(y) is int:
        if x == y:
            return x
        a, r = divmod(y - x, ny - nx)
        if r:
            raise _Differs(f"{x} and {y}")
        return _Lin(a, x - a * nx)
    if type(x) is not type(y):
        raise _Differs(f"{type(x).__name__} and {type(y).__name__}")
    if isinstance(x, (tuple, list)):
        if len(x) != len(y):
            raise _Differs(f"{len(x)} and {len(y)} items")
        items = [_fit(a, b, nx, ny) for a, b in zip(x, y)]
        return items if type(x) is list else tuple(items)
    if isinstance(x, dict):
        if x.keys() != y.keys():
            raise _Differs(f"keywords {sorted(x)} and {sorted(y)}")
        return {k: _fit(x[k], y[k], nx, ny) for k in x}
    if isinstance(x, slice):
        return slice(*(_fit(a, b, nx, ny) for a, b in ((x.start, y.start), (x.stop, y.stop),
                                                        (x.step, y.step))))
    if x != y:
        raise _Differs(f"{x!r} and {y!r}")
    return x


def _at(template: Any, n: int) -> Any:
    """``template`` (of _fit) for a call of size n."""
    if type(template) is _Lin:
        return template.a * n + template.b
    if type(template) in (tuple, list):
        items = [_at(v, n) for v in template]
        return items if type(template) is list else tuple(items)
    if type(template) is dict:
        return {k: _at(v, n) for k, v in template.items()}
    if type(template) is slice:
        return slice(_at(template.start, n), _at(template.stop, n), _at(template.step, n))
    return template


def _dims(ins: tuple, template: tuple) -> tuple:
    """A recorded instruction with each integer that ``template`` has as a _Lin made a Dim."""
    op, out, args, tmask, kw = ins
    args = tuple(a if tmask >> i & 1 else _dim(a, t)
                 for i, (a, t) in enumerate(zip(args, template[2])))
    return op, out, args, tmask, kw and {k: _dim(v, template[4][k]) for k, v in kw.items()}


def _dim(value: Any, template: Any) -> Any:
    if type(template) is _Lin:
        return Dim(value, *template)
    if type(template) in (tuple, list):
        items = [_dim(v, t) for v, t in zip(value, template)]
        return items if type(value) is list else type(value)(items) \
            if not hasattr(value, "_fields") else type(value)(*items)
    if type(template) is dict:
        return {k: _dim(v, template[k]) for k, v in value.items()}
    if type(template) is slice:
        return slice(_dim(value.start, template.start), _dim(value.stop, template.stop),
                     _dim(value.step, template.step))
    return value
