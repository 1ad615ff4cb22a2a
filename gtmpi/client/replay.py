"""Replayable functions: a step's instructions recorded once, then run again by the workers
on one word each per call.

    @gtmpi.replayable
    def step(x, y):
        loss = model(x, y)
        loss.backward()
        return loss

    loss = step(x, y)      # gradients land in .grad as usual; loss is read later, as usual

Rank 0 spends tens of microseconds on every op (shape inference, autograd, placement,
batching); a GPT step issues hundreds, a pipeline's micro-batches many more, and that cost, not
the GPUs, set the pace of parallel runs. A replayable function's first call runs as written
(warm-up: lazily made state, communicator groups, placement caches); the second is recorded:
everything its workers are sent for it, inserted collectives and transfers included, is kept
on each worker (dispatcher/programs.py); later calls of the same signature bind their inputs
and run it, one instruction per worker.

What a replay repeats is the instructions. Like a CUDA graph, the function's Python does not
run again, so what it reads from outside belongs to its signature: the grad mode and autocast
region, its arguments (modules and objects of the program's classes by what they hold), and
outside(): what its code reaches by name, up to 4 steps from the function and 1,024 items of a
container. Modules are followed to any depth (training flags, parameters and buffers by
identity and requires_grad, public and private attributes); functions by their code and the
globals it reads; objects of the program's classes by their attributes and their class's
(every class of the MRO); tuples whole; lists and dicts for the code, modules, objects and
tensors they hold, dicts for their numbers and strings too; gtmpi's own objects (a Pipeline,
an optimizer) for the same but not their numbers, so keep the optimizer step outside (AdamW's
bias correction and a schedule's rate change every step). Its tensor arguments are bound by
position; the tensors it returns and the gradients it accumulates into leaves made before it
are new tensors on every call. A call is recorded afresh when its arguments differ in shape,
dtype, placement or constants, when what it reads by name differs, when its leaves' gradients
are present where they were absent (or the reverse), or when a tensor it reads was freed or
placed anew. Recording fails with a ReplayError naming what a replay could not follow or
repeat: a tensor from before the call read where no call's signature looks (a set, a
functools.partial, a library's object, past those bounds), a read or an upload inside, a
tensor made inside that outlives the call unreturned. Random ops draw on each call what they
would draw as written (their seeds are derived again per call).
On GPU workers, programs become CUDA graphs from their second replay (worker/graphs.py).
GTMPI_REPLAY=0 runs every call as written.
"""
from __future__ import annotations

import functools
import itertools
import operator
import os
import types
import warnings
import weakref
from collections import Counter
from typing import Any, Callable

import numpy as np

from . import gradmode
from ..errors import ReplayError
from ..ops.table import Knob
from .runtime import Runtime, runtime
from .tensor import Tensor

RECORDINGS_MAX = 4  # per signature: beyond, calls run as written (something differs each call)
SIGNATURES_MAX = 16  # signatures recorded per function; calls of new ones then run as written


class Replayable:
    def __init__(self, fn: Callable, warmup: int = 1) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.warmup = warmup
        self._calls: dict[Any, int] = {}  # signature -> calls run as written or recorded
        self._kept: dict[Any, list[_Recorded]] = {}
        self._said = False
        self._named: tuple = ()  # outside(fn, named=True) at the last recording
        self.guard = Guard(fn)
        self.replays = 0
        self.compile = ""  # 'auto' once given to gtmpi.compile: its programs compiled (compile_mode)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # every call's tensors are made by the workers, as a replay makes them: the same
        # draws whether a call runs as written, is recorded or is replayed (client/host.py)
        d = runtime().dispatcher
        d.in_replayable += 1
        try:
            return self._call(args, kwargs)
        finally:
            d.in_replayable -= 1

    def _call(self, args: tuple, kwargs: dict) -> Any:
        rt = runtime()
        if os.environ.get("GTMPI_REPLAY", "1") == "0" or rt.dispatcher.recording is not None:
            return self.fn(*args, **kwargs)  # inside another's recording: part of it
        inputs: list[Tensor] = []
        key = (_signature(rt, (args, kwargs), inputs), self.guard.key())
        if key not in self._kept and len(self._kept) >= SIGNATURES_MAX:
            self._differ(key)
            return self.fn(*args, **kwargs)
        kept = self._kept.setdefault(key, [])
        for rec in list(kept):
            if not rt.dispatcher.fits(rec.program):
                rt.dispatcher.drop(rec.program)
                kept.remove(rec)
            elif rec.fits():
                self.replays += 1
                return rec.replay(rt, inputs)
        calls = self._calls[key] = self._calls.get(key, 0) + 1
        if calls <= self.warmup or calls > self.warmup + RECORDINGS_MAX:
            return self.fn(*args, **kwargs)
        self._named = outside(self.fn, named=True)  # to say what changed, should it
        result, rec = _record(rt, self.fn, args, kwargs, inputs, _tensor_ids(key[0]) | self.guard.tensor_ids())
        rec.program.compile = self.compile
        kept.append(rec)
        return result

    def _differ(self, key: Any) -> None:
        """Calls keep differing in what a recording depends on: say once what differs, then
        run them as written."""
        if self._said:
            return
        self._said = True
        before = next(reversed(self._kept))
        what = "its arguments' shapes, placements or constants" if key[0] != before[0] else \
            "what it reads from outside (" + ", ".join(_changed(self._named, outside(
                self.fn, named=True))) + ")"
        warnings.warn(f"gtmpi.replayable({self.fn.__qualname__}): {SIGNATURES_MAX} calls "
                      f"differed in {what}; from now on such calls run as written, unreplayed",
                      stacklevel=3)


def replayable(fn: Callable | None = None, *, warmup: int = 1) -> Any:
    """``fn`` (a decorator too, with or without ``warmup=``) as a Replayable: calls after the
    first ``warmup`` replay what the workers were sent for the first one after them."""
    if fn is None:
        return lambda f: Replayable(f, warmup)
    return Replayable(fn, warmup)


class _Recorded:
    def __init__(self, program: Any, structure: Any, sigs: list[tuple], inputs: list[int],
                 grads: list[tuple[Tensor, int, int | None]]) -> None:
        self.program = program
        self.structure = structure  # the result's shape, its tensors as indices into sigs
        self.sigs = sigs  # of the tensors that outlive a call: results, then gradients
        self.inputs = inputs  # the recorded ids of the arguments' tensors
        # the leaves given gradients: (leaf, index of its gradient, the recorded id of the
        # gradient it had before, which a replay binds, or None)
        self.grads = [(weakref.ref(leaf), out, before) for leaf, out, before in grads]

    def fits(self) -> bool:
        for ref, _, before in self.grads:
            leaf = ref()
            if leaf is None or (leaf.grad is None) != (before is None):
                return False
        return True

    def replay(self, rt: Runtime, inputs: list[Tensor]) -> Any:
        binds = [(t.id, rec) for t, rec in zip(inputs, self.inputs)]
        leaves = [ref() for ref, _, _ in self.grads]
        binds += [(leaf.grad.id, before) for leaf, (_, _, before) in zip(leaves, self.grads)
                  if before is not None]
        fresh = [rt.new_id() for _ in self.sigs]
        rt.dispatcher.replay(self.program, tuple(binds), fresh,
                             rt.seeds_for(self.program.random_ops))
        made = [Tensor(tid, sig) for tid, sig in zip(fresh, self.sigs)]
        for leaf, (_, out, _) in zip(leaves, self.grads):
            leaf.grad = made[out]
        return _build(self.structure, made)


def capture_enabled(rt: Runtime) -> bool:
    """Whether module calls (nn/capture.py) and gtmpi's own steps (Repeated) are captured:
    GTMPI_CAPTURE=1 always, 0 never, auto (the default) where the session has one worker,
    the case run on GPUs so far (nanoGPT's train.py and sample.py on one H100); a job of
    several workers captures with GTMPI_CAPTURE=1 (CPU-checked: the whole suite)."""
    value = os.environ.get("GTMPI_CAPTURE", "auto")
    if value == "auto":
        return len(rt.workers) == 1
    return value == "1"


class Repeated:
    """One of gtmpi's own calls that sends the same instructions every time its caller's key
    is the same, but for a few numbers: an optimizer's step (its rate, its count), a clip of
    gradients, a gradient scaler's unscale. Its Python is a loop over every parameter, some
    apply() per tensor, which on GPT-2 small costs rank 0 milliseconds a step; a key's second
    call is recorded as a replayable function's is, and later calls send one word per worker,
    binding the call's tensors by position and giving its numbers (ops/table.py: Knob).

    The caller's key must hold everything that decides the instructions (which tensors, their
    shapes, the constants), and ``followed`` the tensors from before that it names by id: a
    recording that read another is refused, as one that keeps a tensor it made unreturned.
    ``gtmpi.debug.captures()`` says per call site how its calls ran."""

    def __init__(self, rt: Runtime, name: str) -> None:
        self.name = f"{name} (called at {rt.current_site()})"
        same = sum(known.startswith(self.name) for known in rt.capture_notes)
        if same:  # another optimizer stepped at the same line: each says its own
            self.name += f" #{same + 1}"
        self.calls: dict[Any, int] = {}
        self.kept: dict[Any, _Repeat] = {}
        self.refused: dict[Any, str] = {}
        self.notes: Counter = rt.capture_notes.setdefault(self.name, Counter())

    def __call__(self, rt: Runtime, key: Any, inputs: list[Tensor], followed: set[int],
                 run: Callable[[Callable[[float, Any], float]], Any],
                 value_of: Callable[[Any], float] | None = None,
                 advance: Callable[[], None] | None = None) -> Any:
        """The call: ``run(knob)`` as written, where ``knob(value, source)`` stands for each
        number a replay gives anew (``value_of(source)`` then, after ``advance()``, which
        does to the caller's state what ``run`` does besides its instructions)."""
        d = rt.dispatcher
        if d.recording is not None:  # inside a replayable function's recording: part of it
            return run(as_is)
        if d.placer.table or d.placer.signals:
            # placed tensors: each call agrees on their faults across workers, and the
            # placer's books move
            return self.as_written("its tensors are placed", run)
        kept = self.kept.get(key)
        if kept is not None:
            if d.fits(kept.program):
                self.notes["replayed"] += 1
                if advance is not None:
                    advance()
                return kept.replay(rt, inputs, value_of)
            d.drop(kept.program)
            del self.kept[key]
        why = self.refused.get(key)
        if why is None and key not in self.calls and len(self.calls) >= SIGNATURES_MAX:
            why = f"more than {SIGNATURES_MAX} keys (its tensors or constants differ call to call)"
        if why is not None:
            return self.as_written(why, run)
        calls = self.calls[key] = self.calls.get(key, 0) + 1
        if calls <= 1:
            return self.as_written("warm-up", run)
        if calls > 1 + RECORDINGS_MAX:
            return self.as_written(f"{RECORDINGS_MAX} recordings of one key never replayed", run)
        self.notes["as written: recorded"] += 1
        result, why = self._record(rt, key, inputs, followed, run)
        if why is not None:
            self.refused[key] = why
            self.notes[f"as written: {why}"] += 1
        return result

    def as_written(self, why: str, run: Callable) -> Any:
        self.notes[f"as written: {why}"] += 1
        return run(as_is)

    def _record(self, rt: Runtime, key: Any, inputs: list[Tensor], followed: set[int],
                run: Callable) -> tuple[Any, str | None]:
        d = rt.dispatcher
        first = rt.new_id()
        d.start_recording(first)
        sources: list[Any] = []

        def knob(value: float, source: Any) -> Knob:
            sources.append(source)
            return Knob(value, len(sources) - 1)
        result, outs, structure, why = run_recorded(d, first, lambda: run(knob))
        if why is not None:
            return result, why
        program, kept = d.install([t.id for t in outs], [t.id for t in inputs], self.name,
                                  knobbed=bool(sources))
        if kept or program.reads - followed:
            d.drop(program)
            return result, f"it kept {len(kept)} tensor(s) it made unreturned" if kept else \
                "it read a tensor from before that its key does not name"
        pairs = [(t.id, rt.new_id()) for t in outs]
        d.rename(pairs)
        for t, (_, new) in zip(outs, pairs):
            t.id = new
        self.kept[key] = _Repeat(program, structure, [t._sig for t in outs],
                                 [t.id for t in inputs], sources)
        return result, None


def run_recorded(d: Any, first: int, run: Callable[[], Any]
                 ) -> tuple[Any, list[Tensor], Any, str | None]:
    """``run()`` while the dispatcher records (from client id ``first``): its result, the
    tensors in it and its shape (_template), or why a replay could not hand it back (the
    recording abandoned then)."""
    try:
        result = run()
    except BaseException:
        d.abandon_recording()
        raise
    outs: list[Tensor] = []
    try:
        structure = _template(result, outs, first)
    except ReplayError as e:
        d.abandon_recording()
        return result, outs, None, str(e).split(":")[0].replace("a replayable function", "it")
    return result, outs, structure, None


def as_is(value: float, source: Any) -> float:
    """A Repeated call's numbers as written."""
    return value


def repeated_at(rt: Runtime, name: str, table: dict[str, Repeated] | None = None
                ) -> Repeated:
    """The Repeated of ``name`` called at the program's line running now, from ``table`` (by
    default the runtime's for ``name``)."""
    if table is None:
        table = rt.repeated.setdefault(name, {})
    site = rt.current_site()
    found = table.get(site)
    if found is None:
        found = table[site] = Repeated(rt, name)
    return found


class _Repeat:
    """A Repeated call's recording: its program, its result's shape, what its tensors are
    recorded as, and where each of its Knobs' values comes from."""

    def __init__(self, program: Any, structure: Any, sigs: list[tuple], inputs: list[int],
                 sources: list[Any]) -> None:
        self.program = program
        self.structure = structure
        self.sigs = sigs
        self.inputs = inputs
        self.sources = sources

    def replay(self, rt: Runtime, inputs: list[Tensor],
               value_of: Callable[[Any], float] | None) -> Any:
        binds = tuple((t.id, rec) for t, rec in zip(inputs, self.inputs))
        fresh = [rt.new_id() for _ in self.sigs]
        knobs = tuple(value_of(s) for s in self.sources) if self.sources else None
        rt.dispatcher.replay(self.program, binds, fresh, rt.seeds_for(self.program.random_ops),
                             None, knobs)
        return _build(self.structure, [Tensor(tid, sig) for tid, sig in zip(fresh, self.sigs)])


def _record(rt: Runtime, fn: Callable, args: tuple, kwargs: dict, inputs: list[Tensor],
            followed: set[int]) -> tuple[Any, _Recorded]:
    """Run ``fn`` once as written while its instructions are recorded, and install them.
    ``followed``: the tensors from before the call that each call's signature names; one it
    read that is not among them could be replaced unseen, so the recording is refused."""
    d = rt.dispatcher
    first = rt.new_id()
    d.start_recording(first)
    rt.leaves = {}
    try:
        result = fn(*args, **kwargs)
        leaves, rt.leaves = rt.leaves, None
        outs: list[Tensor] = []
        structure = _template(result, outs, first)
        grads = []
        for leaf, before in leaves.values():
            if leaf.id < first and leaf.grad is not None and leaf.grad.id >= first:
                grads.append((leaf, _index(leaf.grad, outs), before.id if before is not None
                              else None))
        leaves = leaf = before = None  # leaves made inside (a pipeline stage's inputs) go now
    except BaseException:
        rt.leaves = None
        d.abandon_recording()
        raise
    program, kept = d.install([t.id for t in outs], [t.id for t in inputs] +
                              [before for _, _, before in grads if before is not None],
                              f"{fn.__qualname__} (recorded at {rt.current_site()})")
    if kept and any(t._node is not None and not t._node.freed for t in outs):
        d.drop(program)
        raise ReplayError("a replayable function returned a tensor with an autograd graph behind "
                          "it (it requires grad, and no backward ran inside): a replay hands "
                          "back tensors without a graph. Call backward inside, return it "
                          "detached, or run the call under gtmpi.no_grad()")
    if kept:
        d.drop(program)
        sites = ", ".join(sorted({rt.site(tid) or f"tensor {tid}" for tid in kept[:8]}))
        raise ReplayError(f"a replayable function made {len(kept)} tensor(s) that outlive it "
                          f"without being returned (made at {sites}): a replay would not make "
                          "them again. Return them, or keep them out of the function")
    unfollowed = sorted(program.reads - followed)
    if unfollowed:
        d.drop(program)
        raise ReplayError(_unfollowed(rt, fn, unfollowed))
    # the tensors handed out now move off the ids the program makes, which replays reuse
    pairs = [(t.id, rt.new_id()) for t in outs]
    d.rename(pairs)
    for t, (_, new) in zip(outs, pairs):
        t.id = new
    rec = _Recorded(program, structure, [t._sig for t in outs], [t.id for t in inputs], grads)
    return result, rec


def _tensor_ids(key: Any) -> set[int]:
    """The ids of the tensors a call's key names by identity (outside()'s entries)."""
    ids, stack = set(), [key]
    while stack:
        value = stack.pop()
        if isinstance(value, tuple):
            if len(value) == 3 and value[0] == "tensor" and type(value[1]) is int:
                ids.add(value[1])
            else:
                stack.extend(value)
    return ids


def _unfollowed(rt: Runtime, fn: Callable, ids: list[int]) -> str:
    """Why a recording that read tensors its calls' signature does not name is refused, and
    where each was found (by a walk past the per-call bounds), or that it was not."""
    where = {what[1]: path for path, what in outside(fn, named=True, full=True)
             if isinstance(what, tuple) and what[:1] == ("tensor",)}
    said = []
    for tid in ids[:4]:
        made = rt.site(tid) or "an unknown line"
        said.append(f"made at {made}, found as {where[tid]} (past the {_BOUNDS[1]} items of a "
                    f"container or {_DEPTH} steps from the function that each call compares)"
                    if tid in where else f"made at {made}, held where no call looks (a set, a "
                    "functools.partial, an object of a library's class)")
    return (f"gtmpi.replayable({fn.__qualname__}): it read {len(ids)} tensor(s) from before "
            "the call that replays could not tell replaced: " + "; ".join(said) +
            ". Pass them as arguments, or keep them in a module, a tuple or a dict it reads")


def _signature(rt: Runtime, value: Any, inputs: list[Tensor]) -> Any:
    """A call's signature: its tensors' shapes, dtypes, grad flags and placements, its other
    arguments by value (modules and other objects by what they hold, as outside() walks
    them), the grad mode, the autocast region and the signal scopes open (tensors collected
    in ``inputs``, in order)."""
    placer = rt.dispatcher.placer
    region = rt.autocast
    return (gradmode.is_grad_enabled(), tuple(p for p, _ in placer.signals),
            None if region is None else (region.device_type, region.dtype),
            _shape_of(value, inputs, placer))


def outside(fn: Callable, named: bool = False, full: bool = False) -> tuple:
    """What a replay of ``fn`` silently depends on besides its arguments, as it stands now:
    the tensors its code reaches by name (globals, closures, the functions and modules those
    hold, their parameters and buffers, the tensors in their lists and dicts) by id and
    requires_grad, modules' training flags, and the Python numbers and strings found on the
    way (a dict's, not a list's). A replay repeats instructions, not Python: if any of these
    differs from the recording's, the call is recorded afresh (a rebound tensor, model.eval(),
    a changed loss scale) rather than replayed stale. ``named``: each as (where it was found,
    value); ``full``: past the bounds each call's walk keeps to (twice as deep, every item of
    a container), to say where a tensor that a recording read was found."""
    walk = _Walk(named, *(_FULL if full else _BOUNDS))
    walk.reach(fn, "" if named else None, 0)
    return tuple(walk.found)


_DEPTH = 4  # how far from the function the walk goes (functions, objects, containers)
_BOUNDS = (_DEPTH, 1024)  # each call's walk: its depth, and the items of a container it reads
_FULL = (2 * _DEPTH, None)  # a recording's walk for the tensors it read
_PLAIN = (bool, int, float, complex, str, bytes, type(None), np.generic)
_LEAVES = (Tensor, *_PLAIN)
_TABLES = ("_parameters", "_buffers", "_modules")
_HOOKS = ("_forward_hooks", "_forward_pre_hooks")
_MODULE_INTERNALS = frozenset({*_TABLES, *_HOOKS, "_non_persistent", "_capture",
                               "_parameters_at", "_compile_asked"})
# a Guard's checks, by kind (first item)
_TENSOR, _GLOBAL, _CELL, _CLASS, _LOOSE = range(5)
_ABSENT = object()  # a global not bound (a builtin read by name)
# classes whose attributes are the library's own, not a program's state: not walked
_LIBRARIES = ("builtins", "gtmpi", "torch", "numpy", "collections", "typing", "abc",
              "functools", "enum")


def _users(cls: type) -> bool:
    """Whether ``cls`` is the program's own class (not the library's or Python's)."""
    return cls.__module__.split(".")[0] not in _LIBRARIES


def _walked(value: Any) -> bool:
    """Whether an argument is followed by what it holds (a module, an object of the
    program's own class) rather than compared as a value."""
    return "_modules" in getattr(value, "__dict__", ()) or (
        hasattr(value, "__dict__") and not isinstance(value, (type, types.ModuleType,
                                                              types.FunctionType))
        and _users(type(value)))


class _Walk:
    """One walk from a function (or an argument) over what a replay depends on: ``found``
    in order, each thing once (``seen``), at most ``depth`` steps away and ``items`` items of
    each container (None: all); ``named``: with where each was found. ``checks`` (a Guard's
    walk) collects what tells the answer unchanged later without walking again."""

    def __init__(self, named: bool, depth: int, items: int | None,
                 checks: list | None = None, lists: bool = False) -> None:
        self.named, self.depth, self.items = named, depth, items
        self.found: list = []
        self.seen: set = set()
        self.checks = checks
        self.lists = lists  # a list's numbers and strings count too (a module's capture)

    def note(self, where: str | None, what: Any) -> None:
        self.found.append((where, what) if self.named else what)

    def reach(self, value: Any, path: str | None, depth: int,
              inside_library: bool = False) -> None:
        """What ``value`` (found at ``path``; None in a walk that names nothing) holds.
        ``inside_library``: reached through gtmpi's own objects, whose numbers are no reason
        to record again (an optimizer's per-step counts: keep its step outside)."""
        if isinstance(value, _PLAIN):
            self.note(path, value)
            return
        if id(value) in self.seen or depth > self.depth or isinstance(value, types.ModuleType):
            return
        self.seen.add(id(value))
        checks = self.checks
        if checks is not None and _loose(value):
            # what it holds can change unseen (a list appended to, a config's field set): its
            # own walk is compared on every call; its insides need no checks of their own
            checks.append((_LOOSE, value, depth, inside_library,
                           _content(value, depth, inside_library, self.depth, self.items,
                                    self.lists)))
            self.checks = None
            try:
                self.reach_inside(value, path, depth, inside_library)
            finally:
                self.checks = checks
            return
        self.reach_inside(value, path, depth, inside_library)

    def reach_inside(self, value: Any, path: str | None, depth: int,
                     inside_library: bool) -> None:
        checks = self.checks
        if isinstance(value, Tensor):
            # which tensor, and whether it takes gradients (a layer frozen after the recording)
            self.note(path, ("tensor", value.id, value.requires_grad))
            if checks is not None:
                checks.append((_TENSOR, weakref.ref(value), value.id, value.requires_grad))
        elif "_modules" in getattr(value, "__dict__", ()):  # an nn.Module
            # its class (a ReLU swapped for a Tanh holds nothing else that differs)
            self.note(path and f"{path}.__class__", type(value))
            self.note(path and f"{path}.training", value.training)
            for name, item in value.__dict__.items():
                if name in _TABLES:
                    # a model's own tree is followed to any depth: a weight replaced or a layer
                    # set to eval() deep inside it must be seen
                    for key, sub in item.items():
                        self.reach(sub, path and f"{path}.{key}", depth)
                elif name in _HOOKS:  # what a hook reads changes the call's result too
                    for key, hook in item.items():
                        self.reach(hook, path and f"{path}.{name}[{key}]", depth + 1)
                elif name not in _MODULE_INTERNALS:
                    self.reach(item, path and f"{path}.{name}", depth + 1)
            self.class_state(type(value), path, depth)
        elif isinstance(value, types.MethodType):
            self.reach(value.__self__, path, depth)
            self.reach(value.__func__, path, depth)
        elif isinstance(value, (types.FunctionType, Replayable)):
            fn = value.fn if isinstance(value, Replayable) else value
            if depth:
                self.note(path, fn.__code__)  # a name rebound to another function
            if (fn.__module__ or "").startswith("gtmpi."):
                # gtmpi's own function: what it reads by name is the session's state (the
                # random draws so far, made anew each call), none of the program's
                return
            names = fn.__globals__
            for name in _global_names(fn.__code__):
                found = names.get(name, _ABSENT)
                if checks is not None:  # a global rebound (or bound where a builtin was read)
                    checks.append((_GLOBAL, names, name, found))
                if found is not _ABSENT:
                    self.reach(found, self.named and name or None, depth + 1)
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                try:
                    contents = cell.cell_contents
                except ValueError:  # a cell not yet filled
                    contents = _ABSENT
                if checks is not None:
                    checks.append((_CELL, cell, contents))
                if contents is not _ABSENT:
                    self.reach(contents, self.named and name or None, depth + 1)
        elif isinstance(value, tuple):  # made whole, never appended to: all it holds counts
            for key, item in enumerate(value[:self.items]):
                self.reach(item, path and f"{path}[{key}]", depth + 1)
        elif isinstance(value, (list, dict)):
            # a list is walked for the code, modules and tensors it holds (a pipeline's
            # stages), not for its numbers unless ``lists``: a list of numbers a replayable step
            # appends to is no reason to record again; a dict's numbers and strings count (a
            # config's)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in list(items)[:self.items]:
                if not isinstance(item, _PLAIN) or ((self.lists or isinstance(value, dict)) and
                                                    not inside_library):
                    self.reach(item, path and f"{path}[{key!r}]", depth + 1, inside_library)
        elif isinstance(value, type):
            if _users(value):
                self.note(path, value)  # a name rebound to another class
                self.class_state(value, path, depth)
        elif hasattr(value, "__dict__") and (_users(type(value)) or
                                             type(value).__module__.startswith("gtmpi.")):
            self.note(path and f"{path}.__class__", type(value))
            library = inside_library or not _users(type(value))
            for name, item in vars(value).items():  # a program's object, a Pipeline, an optimizer
                self.reach(item, path and f"{path}.{name}", depth + 1, library)
            if _users(type(value)):
                self.class_state(type(value), path, depth)

    def class_state(self, cls: type, path: str | None, depth: int) -> None:
        """The numbers, strings and tensors a program's class holds (read as self.x or
        Cls.x)."""
        for klass in cls.__mro__:
            # keyed by the class, never by id(klass.__dict__): that is a new proxy each time,
            # freed at once, whose address the next class's proxy takes (which skipped every
            # class but the first, or not, as the allocator had it)
            if not _users(klass) or ("class", id(klass)) in self.seen:
                continue
            self.seen.add(("class", id(klass)))
            for name, item in vars(klass).items():
                # its numbers, and its methods: what they read by name (forward's globals)
                if isinstance(item, (*_LEAVES, types.FunctionType)) and not name.startswith("__"):
                    if self.checks is not None:  # a class attribute set anew (self.X, Cls.X)
                        self.checks.append((_CLASS, klass, name, item))
                    self.reach(item, path and f"{path}.{name}", depth + 1)


def _loose(value: Any) -> bool:
    """Whether what ``value`` holds can change without a module's change (which bumps
    STATE): a container, or an object that is neither a module, a tensor, a function nor a
    class."""
    if isinstance(value, (tuple, list, dict)):
        return True
    return hasattr(value, "__dict__") and "_modules" not in value.__dict__ and not isinstance(
        value, (Tensor, type, types.FunctionType, types.MethodType, Replayable))


def _content(value: Any, depth: int, inside_library: bool, most: int, items: int | None,
             lists: bool) -> tuple:
    """What a walk finds in ``value`` alone (a loose check's answer)."""
    walk = _Walk(False, most, items, lists=lists)
    walk.reach(value, None, depth, inside_library)
    return tuple(walk.found)


class StateVersion:
    """A count that every change which can change what a module's Python does bumps: an
    attribute, submodule, parameter or buffer set, registered or deleted, train()/eval(), a
    hook added or removed (nn/module.py). A Guard walks the modules again only when it moved;
    what a module's change does not bump (a list appended to, a global rebound, a tensor's
    requires_grad or id) its checks see."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1


STATE = StateVersion()
_answers = itertools.count()  # numbers for a Guard's distinct answers, never reused


class Guard:
    """outside(root), at the cost of checks when nothing changed: the answer's number (equal
    numbers, equal answers), walked again only when STATE moved or a check fails (a tensor
    whose id or requires_grad changed, a global, closure cell or class attribute rebound, a
    container's or plain object's content changed)."""

    NUMBERS_MAX = 64  # distinct answers remembered (a forgotten one gets a new number)

    def __init__(self, root: Any, lists: bool = False) -> None:
        # weakly: a module keeps its Guard (nn/capture.py), and a strong reference back would
        # make a cycle that only the garbage collector frees, so that a model deleted would
        # keep its workers' memory until it ran
        self.root = weakref.ref(root)
        self.lists = lists  # whether a list's numbers count (_Walk)
        self.version = -1
        self.checks: list = []
        self.found: tuple = ()
        self.number = -1
        self._numbers: dict[tuple, int] = {}
        self.walks = 0  # full walks done (the rest were checks)

    def key(self) -> int:
        if self.version != STATE.value or not self._holds():
            self._walk()
        return self.number

    def tensor_ids(self) -> set[int]:
        """The ids of the tensors the answer names (each call's key follows them)."""
        return _tensor_ids(self.found)

    def _walk(self) -> None:
        self.walks += 1
        self.version = STATE.value
        walk = _Walk(False, *_BOUNDS, [], self.lists)
        walk.reach(self.root(), None, 0)
        self.checks, self.found = _Checks(walk.checks, self.lists), tuple(walk.found)
        if len(self._numbers) >= self.NUMBERS_MAX:
            self._numbers.clear()
        self.number = self._numbers.setdefault(self.found, next(_answers))

    def _holds(self) -> bool:
        return self.checks.hold()


_ID_AND_GRAD = operator.attrgetter("_id", "requires_grad")


def _plain_object(value: Any) -> list[tuple[type, str, Any]] | None:
    """Where all ``value`` (a config object) holds is numbers and strings and its program's
    classes hold no code or tensors of their own but dunders (a dataclass), what a walk finds
    in it besides its attributes: its classes' numbers, (class, name, number) each; else
    None."""
    attrs = getattr(value, "__dict__", None)
    if type(attrs) is not dict or not all(isinstance(v, _PLAIN) for v in attrs.values()):
        return None
    # (a walk reads no class of the library's objects: class_state)
    classes = [klass for klass in type(value).__mro__ if _users(klass)] \
        if _users(type(value)) else []
    numbers = []
    for klass in classes:
        for key, item in vars(klass).items():
            if key.startswith("__"):
                continue
            if isinstance(item, (Tensor, types.FunctionType)):
                return None
            if isinstance(item, _PLAIN):
                numbers.append((klass, key, item))
    return numbers


class _Checks:
    """A walk's checks, arranged to cost little on every call (a GPT-2's are 280: each
    parameter, each global its code reads): the tensors' ids and requires_grad compared as
    one list, the globals (once each) and class attributes by the identity of what each
    name holds, per namespace, and a plain object's attributes (a config) as its dict."""

    __slots__ = ("tensors", "expected", "names", "cells", "plain", "loose", "lists")

    def __init__(self, checks: list, lists: bool) -> None:
        self.lists = lists
        self.tensors = [c[1] for c in checks if c[0] == _TENSOR]
        self.expected = [(c[2], c[3]) for c in checks if c[0] == _TENSOR]
        spaces: dict[int, tuple] = {}

        def name(owner: Any, kind: int, key: str, held: Any) -> None:
            spaces.setdefault(id(owner), (owner, kind, {}))[2].setdefault(key, held)

        for c in checks:
            if c[0] in (_GLOBAL, _CLASS):
                name(c[1], c[0], c[2], c[3])
        self.cells = [(c[1], c[2]) for c in checks if c[0] == _CELL]
        self.plain, self.loose = [], []
        for c in checks:
            if c[0] != _LOOSE:
                continue
            value = c[1]
            numbers = _plain_object(value)
            if numbers is None:
                self.loose.append(c[1:])
                continue
            # its walk's answer: its class, these values in this order, and its class's
            # numbers (each checked by identity, as a class attribute is)
            attrs = value.__dict__
            self.plain.append((value, type(value), dict(attrs), tuple(attrs)))
            for klass, key, item in numbers:
                name(klass, _CLASS, key, item)
        # (namespace, its names, the ids of what they held): what they held is kept alive
        # here, so no other object can take one of those ids meanwhile
        self.names = [(owner, kind, tuple(held), [id(v) for v in held.values()],
                       list(held.values())) for owner, kind, held in spaces.values()]

    def hold(self) -> bool:
        try:  # a tensor gone reads as None, which has no _id
            if list(map(_ID_AND_GRAD, map(operator.call, self.tensors))) != self.expected:
                return False
        except AttributeError:
            return False
        for owner, kind, names, ids, _ in self.names:
            space = owner if kind == _GLOBAL else owner.__dict__
            if list(map(id, map(space.get, names, itertools.repeat(_ABSENT)))) != ids:
                return False
        for cell, contents in self.cells:
            try:
                now = cell.cell_contents
            except ValueError:
                now = _ABSENT
            if now is not contents:
                return False
        for value, cls, attrs, order in self.plain:
            now = value.__dict__
            if type(value) is not cls or now != attrs or tuple(now) != order:
                return False
        for value, depth, inside_library, content in self.loose:
            if _content(value, depth, inside_library, _DEPTH, _BOUNDS[1],
                        self.lists) != content:
                return False
        return True


@functools.lru_cache(maxsize=256)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names a code object (and the functions and comprehensions nested in it) may look up
    as globals."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return tuple(dict.fromkeys(names))


def _changed(before: tuple, now: tuple) -> list[str]:
    """Where two of ``outside(fn, named=True)``'s answers differ."""
    old, new = dict(before), dict(now)
    return [path or "?" for path in dict.fromkeys([*old, *new]) if old.get(path) != new.get(path)][:4]


def _shape_of(value: Any, inputs: list[Tensor], placer: Any) -> Any:
    if isinstance(value, Tensor):
        if value._node is not None and value.requires_grad:
            raise ReplayError("a replayable function was given a tensor with an autograd graph "
                              "behind it: its backward could not reach that graph on a replay. "
                              "Pass a leaf (detach() it, or compute it inside)")
        inputs.append(value)
        return ("tensor", value._sig, value.requires_grad, placer.placement(value.id))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_shape_of(v, inputs, placer) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _shape_of(v, inputs, placer)) for k, v in sorted(value.items())))
    if _walked(value):  # a module or an object given as an argument: what it holds now
        walk = _Walk(False, *_BOUNDS)
        walk.reach(value, None, 0)
        return (type(value), tuple(walk.found))
    try:
        hash(value)
    except TypeError:
        raise ReplayError(f"a replayable function was given a {type(value).__name__}, which "
                          "cannot be compared between calls: pass tensors, numbers, strings or "
                          "tuples of them") from None
    return (type(value), value)


def _template(result: Any, outs: list[Tensor], first: int) -> Any:
    """``result`` with each tensor replaced by its index in ``outs``."""
    if result is None:
        return None
    if isinstance(result, Tensor):
        if result.id < first:
            raise ReplayError("a replayable function returned a tensor it did not make (one of "
                              "its arguments, or a tensor from before the call)")
        return ("tensor", _index(result, outs))
    if isinstance(result, (tuple, list)):
        return (type(result), [_template(r, outs, first) for r in result])
    raise ReplayError(f"a replayable function returned a {type(result).__name__}: a replay "
                      "can hand back only tensors (in tuples or lists) or None")


def _index(t: Tensor, outs: list[Tensor]) -> int:
    for i, o in enumerate(outs):
        if o is t:
            return i
    outs.append(t)
    return len(outs) - 1


def _build(structure: Any, made: list[Tensor]) -> Any:
    if structure is None:
        return None
    kind, inner = structure
    if kind == "tensor":
        return made[inner]
    return kind(_build(s, made) for s in inner)
