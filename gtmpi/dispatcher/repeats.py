"""Repeated runs of instructions, replayed without ``gtmpi.replayable``.

A training loop sends its worker the same instructions every iteration, under new ids, and
each one costs the worker's host 20-35 us however small its kernel: an unchanged script's
loop is bound by that, not by its GPU. So, with one worker (unless GTMPI_AUTO_REPLAY=0), the
dispatcher holds what it sends in runs of RUN_LEN instructions, counted from the last point
where the client waited (a read, a control word) or sent something that cannot repeat (an
upload, an optimizer's step, whose rate changes): the runs of one iteration then line up with
the next one's. A run's shape is its instructions with every id replaced by its order of first
use, and the shapes and dtypes of what they read (the client's signature keys): a CUDA graph
holds buffers of one shape.

A shape seen before is compared with the earlier runs of that shape. An earlier run fits if
every tensor the new one reads that already existed when the earlier one ran (a weight, an
optimizer state) is the one the earlier run read in that place; tensors made since (this
iteration's activations, the new batch) may differ. That tells the 12 blocks of a model apart:
their runs have one shape but read different weights. From a fitting earlier run the new one
becomes a program (dispatcher/programs.py) with those old tensors read as they are, the new
ones bound per run, and every tensor it makes the program's own, handed out under the run's
ids; it is replayed from then on whenever a run of its shape reads those same old tensors, and
on a GPU it is a CUDA graph from its second replay (worker/graphs.py). Anything else runs as
written, counted by why (``explain()``) and marked on the dispatcher's lane of the trace: a
shape not seen before, no earlier run fitting, a constant that cannot be compared, random ops
whose seeds are not the session's next ones in a row (a generator of the program's own).

A random op's seed is no part of a run's shape: the session's seeds are consecutive numbers
(ops/table.py: derive_seed), so a replay gives the run's k random ops the k seeds that follow
the one before its first, which is what they draw as written.

Replays keep what the instructions say: a run's tensors get the same values, under the same
ids, that running it as written would give; what the run frees of older tensors is freed before
it where it never reads them, else after it. Its graphs keep their outputs' memory (nanoGPT's
GPT-2 small on one H200: 1.15x torch's peak, 0.83x as written).
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Any

from ..ops.table import Seed
from ..recording.events import Kind, Lane
from .programs import Program

RUN_LEN = 64  # instructions per run: the worker starts on a run once it is whole
UNREPEATABLE = frozenset({"upload", "adam_foreach", "sgd_foreach", "adam_steps"})
EARLIER_MAX = 32  # earlier runs of a shape kept to compare with (a model's blocks share one)
VARIANTS_MAX = 32  # programs per shape
SHAPES_MAX = 2048  # shapes remembered, least recently seen forgotten first
PROGRAMS_MAX = 512  # programs installed at once (each CUDA graph keeps its memory)


class _Run:
    """One run's shape and ids: ``key`` (its instructions as one flat tuple: each one's
    signature key, its operands with ids as slots, its results' slots; a free's slots after
    "free"), ``ids`` by slot, and which slots it makes, reads and frees."""

    __slots__ = ("key", "ids", "made", "read", "freed", "seeds")

    def __init__(self, instructions: list[tuple], keys: list[tuple | None]) -> None:
        slots: dict[int, int] = {}
        ids: list[int] = []
        made: list[bool] = []
        read: set[int] = set()
        freed: set[int] = set()
        seeds: list[Seed] = []  # in the order drawn
        flat: list = []
        put = flat.append

        def slot(tid: int, out: bool) -> int:
            s = slots.get(tid)
            if s is None:
                s = slots[tid] = len(ids)
                ids.append(tid)
                made.append(out)
            return s

        for (name, out, args, tmask, kw), key in zip(instructions, keys):
            if name == "free":
                put("free")
                for tid in args:
                    s = slot(tid, False)
                    freed.add(s)
                    put(s)
                continue
            if key is None:
                raise TypeError("no signature key")
            put(key)
            j = 1
            for a in args:
                if tmask & j:
                    s = slot(a, False)
                    read.add(s)
                    put(s)
                elif type(a) is Seed:
                    seeds.append(a)
                    put("seed")
                else:
                    put(a)
                j <<= 1
            if kw:  # the signature key holds a keyword seed as "seed" already
                seeds += [v for v in kw.values() if type(v) is Seed]
            for o in ((out,) if type(out) is int else out or ()):
                put(slot(o, True))
        self.key = tuple(flat)
        hash(self.key)  # a TypeError: a constant that cannot be compared
        self.ids = ids
        self.made = made
        self.read = read  # slots an op reads (made ones included)
        self.freed = freed
        self.seeds = seeds

    @property
    def top(self) -> int:
        """Every id up to it existed when this run was sent."""
        return max(self.ids)

    def inputs(self) -> list[int]:
        """Slots of tensors from before the run that its ops read."""
        return [s for s in sorted(self.read) if not self.made[s]]

    def drawn_in_a_row(self) -> bool:
        """Whether its random ops took the session's seeds one after another."""
        first = self.seeds[0].offset if self.seeds else 0
        return all(s.offset == first + i for i, s in enumerate(self.seeds))


class _Variant:
    """A program standing for the runs of one shape that read ``fixed`` (slot -> id)."""

    __slots__ = ("fixed", "program", "slots", "bound", "kept")

    def __init__(self, fixed: dict[int, int], program: Program, slots: list[int],
                 bound: list[int], kept: list[int]) -> None:
        self.fixed = fixed
        self.program = program
        self.slots = slots  # the program's id for each slot
        self.bound = bound  # slots bound per replay (read, not fixed)
        self.kept = kept  # slots made and not freed inside: handed out under the run's ids

    def fits(self, ids: list[int]) -> bool:
        for s, tid in self.fixed.items():
            if ids[s] != tid:
                return False
        return True


class _Shape:
    __slots__ = ("earlier", "variants")

    def __init__(self) -> None:
        self.earlier: list[_Run] = []
        self.variants: list[_Variant] = []


class Repeats:
    """The home worker's instructions, held in runs and replayed where they repeat."""

    def __init__(self, dispatcher: Any) -> None:
        self.d = dispatcher
        self.pending: list[tuple] = []
        self._keys: list[tuple | None] = []  # the client's signature key of each, or None
        self._ops = 0  # instructions in pending besides frees
        self._urgent = False
        self.shapes: OrderedDict[tuple, _Shape] = OrderedDict()
        self.installed = 0
        self.stale: list[Program] = []  # programs whose fixed tensors were freed: to drop
        self.counts: Counter = Counter()  # instructions: replayed, or as written by why

    def add(self, ins: tuple, urgent: bool, key: tuple | None = None) -> None:
        """An instruction for the home worker (``key``: its signature key, None for a free)."""
        if ins[0] in UNREPEATABLE:
            self.close()
            self.counts["as written: an upload or an optimizer's step"] += 1
            self.d._put(self.d.home, ins, urgent)
            return
        self.pending.append(ins)
        self._keys.append(key)
        self._urgent |= urgent
        if ins[0] != "free":
            self._ops += 1
            if self._ops >= RUN_LEN:
                self.close()

    def close(self) -> None:
        """The run held so far goes out: replayed if it repeats, else as written."""
        instructions, keys, urgent, ops = self.pending, self._keys, self._urgent, self._ops
        self.pending, self._keys, self._ops, self._urgent = [], [], 0, False
        if self.stale:
            self._drop_stale()
        if not ops:  # frees alone
            if instructions:
                self.d._put(self.d.home, instructions[-1] if len(instructions) == 1 else
                            ("free", None, sum((i[2] for i in instructions), ()), 0, None),
                            False)
            return
        try:
            run = _Run(instructions, keys)
        except TypeError:
            return self._as_written(instructions, urgent, "a constant that cannot be compared")
        if min(run.ids) < 0:  # the dispatcher's own tensors: a placed program, not repeated
            return self._as_written(instructions, urgent, "the dispatcher's own tensors")
        if not run.drawn_in_a_row():
            return self._as_written(instructions, urgent,
                                    "random ops with seeds not the session's next in a row")
        shape = self.shapes.get(run.key)
        if shape is None:
            if len(self.shapes) >= SHAPES_MAX:
                self._forget(self.shapes.popitem(last=False)[1])
            self.shapes[run.key] = shape = _Shape()
            shape.earlier.append(run)
            return self._as_written(instructions, urgent, "not seen before")
        self.shapes.move_to_end(run.key)
        for variant in shape.variants:
            if variant.fits(run.ids) and not variant.program.stale:
                return self._replay(variant, run, len(instructions))
        earlier = _fitting(shape.earlier, run)
        if earlier is None or len(shape.variants) >= VARIANTS_MAX or \
                self.installed >= PROGRAMS_MAX:
            shape.earlier.append(run)
            del shape.earlier[:-EARLIER_MAX]
            why = "no earlier run of its shape reads the same tensors" if earlier is None \
                else "too many programs"
            return self._as_written(instructions, urgent, why)
        variant = self._install(instructions, run, earlier)
        shape.variants.append(variant)
        self._replay(variant, run, len(instructions))

    def _as_written(self, instructions: list[tuple], urgent: bool, why: str) -> None:
        self.counts[f"as written: {why}"] += len(instructions)
        self._note("as written", -1, len(instructions), why)
        put, home = self.d._put, self.d.home
        for ins in instructions[:-1]:
            put(home, ins, False)
        put(home, instructions[-1], urgent)

    def _install(self, instructions: list[tuple], run: _Run, earlier: _Run) -> _Variant:
        """A program for ``run``: tensors that ``earlier`` read too are read as they are, the
        rest of what it reads is bound per replay; what it makes gets ids of its own."""
        d = self.d
        top = earlier.top
        fixed = {s: run.ids[s] for s in run.inputs() if run.ids[s] <= top}
        slots = [run.ids[s] if s in fixed else d.placer.new_temp() for s in range(len(run.ids))]
        at = {tid: s for s, tid in enumerate(run.ids)}.__getitem__
        # each seed as its place among the run's random ops (1, 2, ...), which a replay's
        # seeds are derived from
        before = run.seeds[0].offset - 1 if run.seeds else 0

        def relative(v: Any) -> Any:
            return Seed(v, v.offset - before) if type(v) is Seed else v

        program = []
        for name, out, args, tmask, kw in instructions:
            if name == "free":  # the run's own tensors; those from before go after it
                mine = tuple(slots[s] for s in map(at, args) if run.made[s])
                if mine:
                    program.append(("free", None, mine, 0, None))
                continue
            args = tuple(slots[at(a)] if tmask >> j & 1 else relative(a)
                         for j, a in enumerate(args))
            if kw and run.seeds:
                kw = {k: relative(v) for k, v in kw.items()}
            if type(out) is int:
                out = slots[at(out)]
            elif out:
                out = tuple(slots[at(o)] for o in out)
            program.append((name, out, args, tmask, kw))
        bound = [s for s in run.inputs() if s not in fixed]
        kept = [s for s in range(len(run.ids)) if run.made[s] and s not in run.freed]
        d._programs += 1
        made = Program(d._programs, f"repeated run {d._programs} ({len(program)} instructions,"
                       f" {program[0][0]} ... {program[-1][0]})", (d.home,),
                       frozenset(fixed.values()), (), (),
                       tuple((slots[s], None, False) for s in kept), len(run.seeds), auto=True)
        d._put(d.home, ("program", None, (made.key, program), 0, None), False)
        for tid in fixed.values():
            d.watched.setdefault(tid, []).append(made)
        self.installed += 1
        return _Variant(fixed, made, slots, bound, kept)

    def _replay(self, variant: _Variant, run: _Run, count: int) -> None:
        ids, slots = run.ids, variant.slots
        binds = tuple((ids[s], slots[s]) for s in variant.bound)
        renames = tuple((slots[s], ids[s]) for s in variant.kept)
        self.counts["replayed"] += count
        self._note("replayed", variant.program.key, count, variant.program.name)
        # derive_seed(0, n) is n: the worker's seed for the run's i-th random op is then the
        # seed before this run's first, plus i (the session's seeds go up by one per op)
        seeds = (0, int(run.seeds[0]) - 1) if run.seeds else None
        # tensors from before the run that it frees: those it never reads go before it (no value
        # changes, and last step's autograd records, freed at the start of this one, would
        # otherwise still be held at its launch and make its graph run op by op); those it
        # reads go after it
        gone = [s for s in sorted(run.freed) if not run.made[s]]
        first = tuple(ids[s] for s in gone if s not in run.read)
        if first:
            self.d._put(self.d.home, ("free", None, first, 0, None), False)
        self.d.run_program(variant.program, binds, renames, seeds)
        after = tuple(ids[s] for s in gone if s in run.read)
        if after:
            self.d._put(self.d.home, ("free", None, after, 0, None), False)

    def _forget(self, shape: _Shape) -> None:
        for variant in shape.variants:
            if not variant.program.stale:
                variant.program.stale = True
                self.stale.append(variant.program)

    def _note(self, what: str, key: int, count: int, detail: str) -> None:
        """A run's fate on the dispatcher's lane of the trace, when one is recording."""
        rec = self.d.trace
        if rec is not None:
            t = time.perf_counter_ns()
            rec.event(Kind.REPLAY, Lane.DISPATCHER, t, t, what, key, count=count, detail=detail)

    def forget(self) -> None:
        """Every program goes: the workers drop them (and their graphs' memory)."""
        for shape in self.shapes.values():
            self._forget(shape)
        self.shapes.clear()
        self._drop_stale()

    def _drop_stale(self) -> None:
        stale, self.stale = self.stale, []
        for program in stale:
            self.installed -= 1
            self.d._put(self.d.home, ("program", None, (program.key, None), 0, None), False)
        for shape in self.shapes.values():
            if shape.variants:
                shape.variants = [v for v in shape.variants if not v.program.stale]

    def report(self) -> str:
        """How many of the instructions went out replayed, and why the others did not."""
        total = sum(self.counts.values())
        if not total:
            return "repeated runs: none sent yet"
        parts = [f"{n:,} {why}" for why, n in self.counts.most_common()]
        return (f"repeated runs ({self.installed} programs): of {total:,} instructions, "
                + "; ".join(parts))


def _fitting(earlier: list[_Run], run: _Run) -> _Run | None:
    """The latest earlier run that read, wherever ``run`` reads a tensor that existed when it
    ran, that same tensor."""
    inputs = run.inputs()
    ids = run.ids
    for before in reversed(earlier):
        old, top = before.ids, before.top
        if all(ids[s] > top or ids[s] == old[s] for s in inputs):
            return before
    return None

