"""CUDA graphs of replayed programs: a program (dispatcher/programs.py) captured once on a warm
replay, then launched as one graph per call instead of one kernel launch of host work per
instruction (20-35 us each on the GPU hosts here, against about 1 us per op inside a graph).

A graph reads and writes fixed addresses, so around it:
  inputs    each call's bound tensors are copied into static buffers made at capture, and
            those it writes in place are copied back after it; a bound value that is not a
            tensor (a fused op's autograd record, made by another graph) is captured as the
            object it is, and a call that binds another object runs op by op;
  outputs   are handed out as they are and stay the graph's for good; one still held when the
            graph runs again (a loss read two steps later, a view of a gradient) is copied out
            first, so what a client holds never changes under it (an autograd record still held
            cannot be copied: that call runs op by op). An input that is another graph's output
            (the activations a backward reads) is read where that graph leaves it, not copied;
  memory    the graphs of a job's only worker share one pool, as torch's own graphs of a step
            do, so a graph's scratch memory is the next one's (a private pool each doubled a
            step's peak). A graph's launch rewrites the scratch it had at capture, which a later
            capture may have given to its outputs: Kept works out, from the allocator's blocks
            around each capture, which outputs of other graphs lie there, and copies any still
            held aside before the launch and back after it (an autograd record's saved tensors
            cannot be: a launch that would rewrite a held one runs op by op). With several
            workers each graph keeps a pool of its own: sharing is checked on one GPU only;
  reads     tensors from outside (weights, optimizer state) are read where they were at
            capture; the dispatcher re-records a program whose reads were freed or placed anew,
            and a read that is not the tensor captured (or an input that failed) makes the
            call's outputs fail with a Fault instead of using stale memory;
  random    each random op gets a generator of its own, registered with the graph and seeded
            before every launch with the seed the op would get as written (torch's graph-safe
            RNG: the seed and offset are read on the device at launch);
  host      control words that talk to other workers' hosts (agreements on faults) are left out:
            a launched graph never fails on the host, and the dispatcher agrees at the reads
            and in-place updates outside the program.
Collectives and sends between workers are captured with the rest (NCCL supports it); every
member captures together (the dispatcher's 'capture' word) and launches together, so they
meet in the graph as they would op by op.

Two backends share this path: CudaBackend captures with torch.cuda.graph; EmulatedBackend
(GTMPI_CUDA_GRAPHS=emulate on rank 0, for tests on CPUs) captures nothing and, at each launch, runs the
program and copies its results into the same static outputs, so the binding, hand-out,
copy-out and fault logic is tested where no GPU is.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..ops.table import OPS, Dim, Graph, Kind, Seed, derive_seed
from ..placement.rules import written

HOST_WORDS = frozenset({"agree"})  # control words a graph leaves out (see above)


def cuda_backend(device: torch.device, shared: bool) -> CudaBackend | str:
    """The capture backend of a worker on ``device``, or why it has none; ``shared``: its
    graphs share one memory pool."""
    if device.type != "cuda":
        return f"the worker runs on the {device.type}"
    return CudaBackend(device, shared)


class CudaBackend:
    emulated = False

    def __init__(self, device: torch.device, shared: bool) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle() if shared else None
        # cuBLAS makes a handle and workspace per stream on first use, which a capture must
        # not be the one to do
        with torch.cuda.stream(self.stream):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                a = torch.ones(16, 16, dtype=dtype, device=device)
                a @ a
        self.stream.synchronize()

    def capture(self, program: list[tuple], execute: Callable[[list[tuple]], None]) -> "_Graph":
        # a generator per random op, not per seed: two ops of one seed (a checkpointed
        # block's dropout and its recompute's) draw the same mask as written, where one
        # graph-safe generator would move on between them
        gens: list[tuple[int, torch.Generator]] = []

        def fresh(seed: Seed) -> torch.Generator:
            gens.append((seed.offset, torch.Generator(device=self.device)))
            return gens[-1][1]
        seeded_program = with_seeds(program, seeded(program), fresh)
        graph = torch.cuda.CUDAGraph()
        for _, gen in gens:
            graph.register_generator_state(gen)
        pool = self.pool or torch.cuda.graph_pool_handle()
        before = _blocks(pool)
        # thread_local: the process group's watchdog thread may query events meanwhile
        with torch.cuda.graph(graph, pool=pool, stream=self.stream,
                              capture_error_mode="thread_local"):
            execute(seeded_program)
        after = _blocks(pool)
        held = {block for block, active in before.items() if active}
        return _Graph(graph, gens, scratch=[b for b, active in after.items() if not active],
                      kept=[b for b, active in after.items() if active and b not in held])



def _blocks(pool: Any) -> dict[tuple[int, int], bool]:
    """A pool's blocks now: (start, end) -> whether a tensor holds it."""
    return {(b["address"], b["address"] + b["size"]): b["state"] != "inactive"
            for seg in torch.cuda.memory_snapshot()
            if tuple(seg["segment_pool_id"]) == tuple(pool) for b in seg["blocks"]}


class _Graph:
    def __init__(self, graph: Any, gens: list[tuple[int, torch.Generator]],
                 scratch: list[tuple[int, int]], kept: list[tuple[int, int]]) -> None:
        self.graph = graph
        self.gens = gens  # each random op's offset among the call's, and its generator
        # the pool's free blocks after capture, which its launches may write (a superset of
        # its scratch), and the blocks it holds from then on (outputs, saved tensors, inputs)
        self.scratch = scratch
        self.kept = kept

    def seed(self, seeds: tuple[int, int] | None) -> None:
        if seeds is not None:
            session, base = seeds
            for offset, gen in self.gens:
                gen.manual_seed(derive_seed(session, base + offset))

    def replay(self, env: dict[int, Any], outputs: tuple[int, ...]) -> None:
        self.graph.replay()


class EmulatedBackend:
    """Its graphs allocate afresh at each launch: no pool, so nothing in another's way."""
    emulated = True

    def capture(self, program: list[tuple], execute: Callable[[list[tuple]], None]) -> "_Emulated":
        return _Emulated(program, execute)


class _Emulated:
    """A stand-in graph: each launch runs the program, then copies what it made into the
    outputs of the first launch, so outputs keep their storage as a graph's do."""

    scratch: list[tuple[int, int]] = []
    kept: list[tuple[int, int]] = []

    def __init__(self, program: list[tuple], execute: Callable[[list[tuple]], None]) -> None:
        self.program = self.now = program
        self.where = seeded(program)
        self.execute = execute
        self.static: dict[int, torch.Tensor] | None = None

    def seed(self, seeds: tuple[int, int] | None) -> None:
        if self.where:
            session, base = seeds
            self.now = with_seeds(self.program, self.where,
                                  lambda s: derive_seed(session, base + s.offset))

    def replay(self, env: dict[int, Any], outputs: tuple[int, ...]) -> None:
        self.execute(self.now)
        if self.static is None:
            self.static = {o: env[o] for o in outputs if isinstance(env.get(o), torch.Tensor)}
            return
        for o, static in self.static.items():  # an autograd record is handed out as made
            if o in env:  # (not where its op failed: the launch fails its outputs)
                static.data.copy_(env[o])  # as a graph writes: no version change
                env[o] = static


# why a launch falls back to running its program op by op (Captured.unlaunchable, Kept)
NOT_CAPTURED = "an input is not the one captured"
RECORD_HELD = "its last autograd record is held"
RECORD_IN_SCRATCH = "another's autograd record in its scratch is held"


class Captured:
    """One program's graph and the fixed tensors around it."""

    def __init__(self, handle: Any, inputs: dict[int, Any], reads: list[tuple[int, Any]],
                 comm: dict[str, tuple[int, int]], size: int,
                 written: frozenset[int] = frozenset(), shared: frozenset[int] = frozenset(),
                 compiled: Any = None) -> None:
        self.handle = handle  # _Graph or _Emulated
        self.compiled = compiled  # the program compiled (worker/compiled.py), or None
        self.inputs = inputs  # recorded id -> the static buffer each call is copied into,
        # or the object captured, for what is not a tensor
        self.written = written  # recorded ids of inputs it writes in place: copied back
        # recorded ids of inputs bound by identity: what is not a tensor, and another graph's
        # outputs, read where that graph leaves them
        self.same = shared | {r for r, v in inputs.items() if not isinstance(v, torch.Tensor)}
        self.reads = reads  # (id, the tensor captured) of what it reads from outside
        self.comm = comm  # collectives per launch, by kind: (count, bytes)
        self.size = size  # instructions it stands for
        self.outputs: dict[int, torch.Tensor] = {}  # recorded id -> static output, once run
        self.handed: list[int] = []  # ids the last launch's outputs were handed out under
        self._storages: dict[int, torch.Tensor] = {}  # output storage -> an output on it
        self._uses: dict[int, int] = {}  # output storage -> references to it after a launch
        # what its launches must first move out of the way: (another graph, the storages of its
        # outputs in this one's scratch, those its autograd records saved there by start,
        # whether anything else of a graph with records lies there: unknown, so not movable)
        self.risks: list[tuple[Captured, frozenset[int], dict[int, Any], bool]] = []

    def set_outputs(self, env: dict[int, Any], recorded: tuple[int, ...]) -> None:
        self.outputs = {o: env[o] for o in recorded if o in env}
        self._storages = {t.untyped_storage().data_ptr(): t for t in self.outputs.values()
                          if isinstance(t, torch.Tensor)}
        self._uses = {ptr: _uses(t) for ptr, t in self._storages.items()}

    def unlaunchable(self, env: dict[int, Any], binds: tuple) -> str | None:
        """Why a launch cannot keep what the client holds, if it cannot: a value bound by
        identity that is not the one captured, an autograd record of the last launch still
        held, or one of another graph's that this launch would rewrite."""
        inputs, same = self.inputs, self.same
        for cur, recorded in binds:
            if recorded in same and env.get(cur) is not inputs[recorded]:
                return NOT_CAPTURED
        if self.holds_record(env):
            return RECORD_HELD
        if any(unknown and other.holds_record(env) for other, _, _, unknown in self.risks):
            return RECORD_IN_SCRATCH
        return None

    def holds_record(self, env: dict[int, Any]) -> bool:
        """Whether an autograd record the last launch handed out is still held."""
        records = {id(v) for v in self.outputs.values() if not isinstance(v, torch.Tensor)}
        return bool(records) and any(id(env.get(tid)) in records for tid in self.handed)

    def copy_out(self, env: dict[int, Any]) -> list[int]:
        """Before a launch: what still holds the last launch's outputs (the ids they were handed
        out under, or views made of them since) gets copies, since the launch rewrites them.
        Returns the ids copied. A copy keeps what a kernel noted on the tensor object (an
        exp_avg's step count, ops/table.py _adam_foreach); the static output handed out next is
        a new tensor to its taker and notes nothing (a second model's optimizer state took the
        first's step count with it, and its bias corrections were wrong)."""
        statics = {id(t) for t in self.outputs.values() if isinstance(t, torch.Tensor)}
        copied = []
        for tid in self.handed:
            t = env.get(tid)
            if t is not None and id(t) in statics:
                env[tid] = _copy(t)
                copied.append(tid)
        self.handed = []
        for t in self.outputs.values():
            if isinstance(t, torch.Tensor) and t.__dict__:
                t.__dict__.clear()
        grown = {ptr for ptr, t in self._storages.items() if _uses(t) > self._uses[ptr]}
        if not grown:
            return copied
        for tid, t in list(env.items()):
            if isinstance(t, torch.Tensor) and id(t) not in statics and \
                    t.untyped_storage().data_ptr() in grown:
                env[tid] = _copy(t)
                copied.append(tid)
        return copied

    def held(self, env: dict[int, Any], storages: frozenset[int]) -> list[torch.UntypedStorage]:
        """Which of ``storages`` (of its outputs) something still holds: an id the last launch
        handed one out under, or a view made of one since."""
        statics = {id(t): ptr for t in self.outputs.values() if isinstance(t, torch.Tensor)
                   and (ptr := t.untyped_storage().data_ptr()) in storages}
        ptrs = {statics[id(env.get(tid))] for tid in self.handed if id(env.get(tid)) in statics}
        ptrs.update(p for p in storages if p in self._uses and
                    _uses(self._storages[p]) > self._uses[p])
        return [self._storages[p].untyped_storage() for p in ptrs]

class Kept:
    """A worker's captured programs by key ((key, size) for a growing program's graph of one
    size), and what they are to each other: whose outputs
    another reads where they lie, and whose outputs lie in another's scratch."""

    def __init__(self, saved_aside: bool = False) -> None:
        self.by_key: dict[int | tuple[int, int], Captured] = {}
        # an autograd record's saved tensors in another's scratch set aside like outputs, not
        # a reason to run op by op (GTMPI_GRAPH_SAVED_ASIDE=0: run op by op, the way before)
        self.saved_aside = saved_aside
        self._made: dict[int, Captured] = {}  # id of an output tensor -> the graph it is of

    def __getitem__(self, key: int | tuple[int, int]) -> Captured:
        return self.by_key[key]

    def made(self, value: Any) -> bool:
        """Whether ``value`` is an output of a kept graph."""
        return id(value) in self._made

    def bind(self, value: Any) -> tuple[Any, bool]:
        """At capture: what an input is bound to, and whether by identity (another graph's
        output, read where it lies; an object that is not a tensor) rather than a copy."""
        if not isinstance(value, torch.Tensor) or id(value) in self._made:
            return value, True
        return value.clone(), False

    def add(self, key: int | tuple[int, int], captured: Captured) -> None:
        self.pop(key)
        self.by_key[key] = captured

    def launched(self, captured: Captured) -> None:
        """After a graph's first launch, with its outputs known: which graph's scratch holds
        them (only an earlier capture's can: a graph's own blocks are held from its capture
        on, so none captured later writes them)."""
        self._made.update((id(v), captured) for v in captured.outputs.values())
        kept = captured.handle.kept
        if not kept:
            return
        # a block of the allocator is one tensor's storage, which starts where it starts
        outputs = {t.untyped_storage().data_ptr() for t in captured.outputs.values()
                   if isinstance(t, torch.Tensor)}
        inputs = {t.untyped_storage().data_ptr() for t in captured.inputs.values()
                  if isinstance(t, torch.Tensor)}
        records = [v for v in captured.outputs.values() if isinstance(v, Graph)]
        saved = {}
        if self.saved_aside:
            for record in records:
                saved.update(saved_storages(record))
        for other in self.by_key.values():
            if other is captured or not other.handle.scratch:
                continue
            lying = [block for block in kept if overlaps(block, other.handle.scratch)]
            if not lying:
                continue
            storages = frozenset(start for start, _ in lying if start in outputs)
            aside = {start: saved[start] for start, _ in lying if start in saved}
            # neither an output, an input buffer nor a tensor a record is known to have saved
            unknown = any(start not in outputs and start not in inputs and start not in saved
                          for start, _ in lying)
            other.risks.append((captured, storages, aside, bool(records) and unknown))

    def clear_way(self, captured: Captured, env: dict[int, Any]) -> list[tuple[Any, Any]]:
        """Before ``captured`` launches: the storages of other graphs' outputs still held in its
        scratch, each with a copy to put back after the launch (Captured.unlaunchable has made
        sure no autograd record lies there). Put back, not handed out: a later graph of the
        step reads such an output where it lies."""
        kept = []
        for other, storages, saved, _ in captured.risks:
            if storages and other.outputs:
                kept += [(s, s.clone()) for s in other.held(env, storages)]
            if saved and other.holds_record(env):
                kept += [(s, s.clone()) for s in saved.values()]
        return kept

    def pop(self, key: int | tuple[int, int]) -> None:
        """A program's graph gone (a growing program's: of each size)."""
        gone = [self.by_key.pop(k) for k in list(self.by_key)
                if k == key or type(k) is tuple and k[0] == key]
        if not gone:
            return
        for captured in gone:
            for t in captured.outputs.values():
                self._made.pop(id(t), None)
        for other in self.by_key.values():
            other.risks = [r for r in other.risks if r[0] not in gone]

    def clear(self) -> None:
        self.by_key.clear()
        self._made.clear()


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A clone that keeps what kernels noted on the tensor object."""
    c = t.clone()
    if t.__dict__:
        c.__dict__.update(t.__dict__)
    return c


def saved_storages(record: Graph) -> dict[int, torch.UntypedStorage]:
    """The storages of what an autograd record holds for its backward, by start: its output,
    its leaves, and every tensor its backward nodes saved (torch's ``_saved_*`` of a built-in
    node, ``saved_tensors`` of a Python one), down to the leaves."""
    found = {}

    def note(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            found.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        elif isinstance(t, (tuple, list)):
            for item in t:
                note(item)

    note(record.output)
    note(record.leaves)
    todo, seen = [None if record.output is None else record.output.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or hasattr(node, "variable"):  # a leaf's
            continue
        seen.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_"):
                note(getattr(node, name))
        note(getattr(node, "saved_tensors", None))
        todo += [next_node for next_node, _ in node.next_functions]
    return found


def overlaps(block: tuple[int, int], within: list[tuple[int, int]]) -> bool:
    """Whether ``block`` (start, end) meets any of ``within``."""
    start, end = block
    return any(start < d and c < end for c, d in within)



def _uses(t: torch.Tensor) -> int:
    """References to ``t``'s storage (tensors and views on it, counted the same way each time)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def seeded(program: list[tuple], kind: type = Seed
           ) -> list[tuple[int, tuple[int, ...], tuple[str, ...]]]:
    """Where a program holds values its replays give anew: (instruction index, argument
    positions, keyword names) of each instruction with a ``kind`` (a random op's Seed, a
    Knob)."""
    found = []
    for i, (_, _, args, _, kw) in enumerate(program):
        at = tuple(j for j, a in enumerate(args) if type(a) is kind)
        keys = tuple(k for k, v in kw.items() if type(v) is kind) if kw else ()
        if at or keys:
            found.append((i, at, keys))
    return found


def with_seeds(program: list[tuple], where: list, value: Callable[[Any], Any]) -> list[tuple]:
    """``program`` with each marked value (seeded's) replaced by ``value(marked)``."""
    program = list(program)
    for i, at, keys in where:
        name, out, args, tmask, kw = program[i]
        if at:
            args = tuple(value(a) if j in at else a for j, a in enumerate(args))
        if keys:
            kw = {k: value(v) if k in keys else v for k, v in kw.items()}
        program[i] = (name, out, args, tmask, kw)
    return program


def sized(program: list[tuple]) -> list[int]:
    """Which instructions of ``program`` hold a Dim (a size following a growing argument)."""
    return [i for i, (_, _, args, _, kw) in enumerate(program)
            if _has_dim(args) or kw and _has_dim(tuple(kw.values()))]


def _has_dim(value: Any) -> bool:
    if type(value) is Dim:
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_dim(v) for v in value)
    if isinstance(value, slice):
        return _has_dim((value.start, value.stop, value.step))
    return False


def with_sizes(program: list[tuple], where: list[int], n: int) -> list[tuple]:
    """``program`` with each Dim in its instructions at ``where`` made its size for ``n``."""
    program = list(program)
    for i in where:
        name, out, args, tmask, kw = program[i]
        program[i] = (name, out, _at(args, n), tmask, kw and {k: _at(v, n) for k, v in kw.items()})
    return program


def _at(value: Any, n: int) -> Any:
    if type(value) is Dim:
        return value.at(n)
    if isinstance(value, (tuple, list)):
        items = [_at(v, n) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, slice):
        return slice(_at(value.start, n), _at(value.stop, n), _at(value.step, n))
    return value


def written_inputs(program: list[tuple], inputs: set[int]) -> frozenset[int]:
    """Which of ``inputs`` an in-place op of ``program`` writes (placement.rules.written: a
    multi-tensor update writes many)."""
    found = set()
    for name, _, args, tmask, _ in program:
        op = OPS.get(name)
        if op is not None and op.kind is Kind.INPLACE:
            found.update(args[i] for i in written(name, args, tmask) if args[i] in inputs)
    return frozenset(found)


def outside_reads(program: list[tuple], inputs: set[int]) -> list[int]:
    """Ids a program reads that it neither makes nor binds as inputs, in first-read order."""
    made: set[int] = set()
    reads: dict[int, None] = {}
    for name, out, args, tmask, _ in program:
        if name == "free":
            continue
        i = 0
        while tmask >> i:
            if tmask >> i & 1:
                a = args[i]
                if a not in made and a not in inputs:
                    reads[a] = None
            i += 1
        made.update((out,) if type(out) is int else out or ())
    return list(reads)
