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

Placed runs (GTMPI_AUTO_REPLAY_PLACED=1; off by default): once tensors lie on
several workers (data parallel by a config), the placer still places each instruction as it
comes, so its books (where tensors lie, kept copies, the collectives it inserted) stay what they
would be, and what it sends each worker is held instead. Such a run is every worker's placed
instructions; its shape, their instructions with ids as slots (inserted collectives included),
with the client's signature keys and where the tensors it reads from before lay: local shapes
follow from those. It becomes a program on each of its workers, replayed on all of them at once
(the collectives inside meet as they would op by op). A tensor from before that an op makes anew
under its id (a bucket of gradients summed) is a version of the program's own from there on,
handed out under the run's id; runs with transfers between workers, or that bind a copy the
placer made before them, run as written. Once a placed run was replayed, its placing is skipped
where it comes again after the run it followed (dispatcher/foresight.py).

Replays keep what the instructions say: a run's tensors get the same values, under the same
ids, that running it as written would give; what the run frees of older tensors is freed before
it where it never reads them, else after it. Its graphs keep their outputs' memory (nanoGPT's
GPT-2 small on one H200: 1.15x torch's peak, 0.83x as written).
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Any

from ..ops.shapes import freeze, signature_key
from ..ops.table import OPS, Kind as OpKind, Seed
from ..recording.events import Kind, Lane
from .foresight import FREE, MISSES_MAX, OP, READY, Ahead, Foresight, Tape, learn
from .programs import Program

RUN_LEN = 64  # instructions per run: the worker starts on a run once it is whole
UNREPEATABLE = frozenset({"upload", "adam_foreach", "sgd_foreach", "adam_steps"})
EARLIER_MAX = 32  # earlier runs of a shape kept to compare with (a model's blocks share one)
VARIANTS_MAX = 32  # programs per shape
SHAPES_MAX = 2048  # shapes remembered, least recently seen forgotten first
PROGRAMS_MAX = 512  # programs installed at once (each CUDA graph keeps its memory)
TRANSFERS = frozenset({"send", "recv"})
INPLACE = frozenset(name for name, op in OPS.items() if op.kind is OpKind.INPLACE)
OWN_REASONS = frozenset({"a tensor from before placed anew", "no signature key"})
# a copy the placer made before the run (a converted operand) bound per replay: its local
# shape is known to no key
BINDS_COPIES = "reads a copy the dispatcher made since an earlier run of its shape"


class _Run:
    """One run's shape and ids: ``key`` (its instructions as one flat tuple, each worker's in
    turn: each one's signature key, its operands with ids as slots, its results' slots; a
    free's slots after "free"), ``ids`` by slot, which slots it makes, and which each worker
    reads, makes and frees. Placed runs (``keys`` None) key each instruction by its own
    constants, and add ``extra`` (the client's instructions' signature keys and where the
    tensors they read from before lay): local shapes follow from those."""

    __slots__ = ("key", "ids", "made", "reads", "makes", "frees", "seeds", "floor", "top")

    def __init__(self, streams: dict[int, list[tuple]], keys: list[tuple | None] | None,
                 seeds: list[Seed] | None = None, extra: tuple = (), floor: int = 0) -> None:
        slots: dict[int, int] = {}
        ids: list[int] = []
        made: list[bool] = []
        own = seeds is None
        seeds = [] if own else seeds  # in the order drawn
        flat: list = []
        put = flat.append
        self.reads: dict[int, set[int]] = {}  # rank -> slots an op reads (made ones included)
        self.makes: dict[int, set[int]] = {}
        self.frees: dict[int, set[int]] = {}

        for rank, stream in streams.items():
            put(rank)
            read, makes, freed = self.reads[rank], self.makes[rank], self.frees[rank] = \
                set(), set(), set()

            def slot(tid: int, out: bool) -> int:
                s = slots.get(tid)
                if s is None:
                    s = slots[tid] = len(ids)
                    ids.append(tid)
                    made.append(out)
                if out:
                    if not made[s] and s not in read:  # not an in-place write: made anew here
                        raise TypeError("a tensor from before placed anew")
                    makes.add(s)
                elif made[s] and s not in makes and s not in read and s not in freed:
                    raise TypeError("a tensor from before placed anew")  # made on another
                return s

            for j, (name, out, args, tmask, kw) in enumerate(stream):
                if name == "free":
                    put("free")
                    for tid in args:
                        s = slot(tid, False)
                        freed.add(s)
                        put(s)
                    continue
                if keys is None:
                    put((name, tmask, kw and tuple((k, freeze(v)) for k, v in kw.items())))
                elif keys[j] is None:
                    raise TypeError("no signature key")
                else:
                    put(keys[j])
                if name == "agree":  # its ids ride in a constant
                    put(tuple(slot(tid, False) for tid in args[0]))
                    read.update(flat[-1])
                    put(args[1])
                    continue
                i = 1
                for a in args:
                    if tmask & i:
                        s = slot(a, False)
                        read.add(s)
                        put(s)
                    elif type(a) is Seed:
                        if own:
                            seeds.append(a)
                        put("seed")
                    else:
                        put(a if keys is not None else freeze(a))
                    i <<= 1
                if kw and own:  # the signature key holds a keyword seed as "seed" already
                    seeds += [v for v in kw.values() if type(v) is Seed]
                for o in ((out,) if type(out) is int else out or ()):
                    put(slot(o, True))
        flat.extend(extra)
        self.key = tuple(flat)
        hash(self.key)  # a TypeError: a constant that cannot be compared
        self.ids = ids
        self.made = made
        self.seeds = seeds
        self.floor = floor  # every dispatcher's id above it existed when this run was sent
        self.top = max(ids)  # and every client id up to it

    def renamed(self, ids: list[int], seeds: list[Seed]) -> "_Run":
        """The same run under other ids and seeds (a foreseen run's, never placed)."""
        run = object.__new__(_Run)
        for name in _Run.__slots__:
            setattr(run, name, getattr(self, name))
        run.ids, run.seeds, run.top = ids, seeds, max(ids)
        return run

    def existed(self, tid: int) -> bool:
        """Whether ``tid`` existed when this run was sent."""
        return tid <= self.top if tid >= 0 else tid > self.floor

    def inputs(self) -> list[int]:
        """Slots of tensors from before the run that its ops read."""
        return sorted({s for read in self.reads.values() for s in read if not self.made[s]})

    def drawn_in_a_row(self) -> bool:
        """Whether its random ops took the session's seeds one after another."""
        first = self.seeds[0].offset if self.seeds else 0
        return all(s.offset == first + i for i, s in enumerate(self.seeds))


class _Variant:
    """A program standing for the runs of one shape that read ``fixed`` (slot -> id)."""

    __slots__ = ("fixed", "program", "slots", "bound", "kept")

    def __init__(self, fixed: dict[int, int], program: Program, slots: list[int],
                 bound: dict[int, list[int]], kept: dict[int, tuple[tuple[int, int], ...]]) -> None:
        self.fixed = fixed
        self.program = program
        self.slots = slots  # the program's id for each slot
        self.bound = bound  # per worker: slots bound per replay (read, not fixed)
        self.kept = kept  # per worker: (program's id, slot) of what it makes and keeps, handed
        # out under the run's ids

    def fits(self, ids: list[int]) -> bool:
        for s, tid in self.fixed.items():
            if ids[s] != tid:
                return False
        return True


class _Shape:
    __slots__ = ("earlier", "variants", "refused")

    def __init__(self) -> None:
        self.earlier: list[_Run] = []
        self.variants: list[_Variant] = []
        self.refused = False  # makes a tensor it reads as it is anew: never a program


class Repeats:
    """Instructions held in runs and replayed where they repeat: the home worker's as the
    client wrote them, or, once tensors are placed over several workers (with
    GTMPI_AUTO_REPLAY_PLACED=1), every worker's as the placer placed them."""

    def __init__(self, dispatcher: Any) -> None:
        self.d = dispatcher
        self.pending: list[tuple] = []  # the home worker's instructions, as the client wrote them
        self._keys: list[tuple | None] = []  # the client's signature key of each, or None
        # placed: (rank, instruction) in the order the placer sent them, None after each of the
        # client's; the client's signature key of each of its instructions, with where the
        # tensors from before that it reads first lay; and the seeds it drew
        self.placed: list[tuple[int, tuple] | None] = []
        self._client: list[tuple] = []
        self._seen: set[int] = set()
        self._seeds: list[Seed] = []
        self._ops = 0  # the client's instructions held, frees aside
        self._urgent = False
        self.shapes: OrderedDict[tuple, _Shape] = OrderedDict()
        self.installed = 0
        self.stale: list[Program] = []  # programs whose fixed tensors were freed: to drop
        self.counts: Counter = Counter()  # instructions: replayed, or as written by why
        # placed runs foreseen (dispatcher/foresight.py): the run being taped or expected; the
        # Foresight kept after each (the last run's program, the uploads and optimizer steps
        # since); runs whose placing was skipped, expected wrongly, or not kept, by why
        self.tape: Tape | None = None
        self.ahead: Ahead | None = None
        self.plans: dict[tuple, Foresight] = {}
        # what a run is expected after: the last run's program, what was sent between (uploads,
        # steps, agreements), and that, as it stood at the first run after such things (which
        # of a gradient accumulation's steps this is: each one's runs follow alike programs)
        self._last: int | None = None
        self._since: tuple[str, ...] = ()
        self._segment: tuple[str, ...] = ()
        self.foreseen: Counter = Counter()
        self._placing = False  # while the placer places an item
        self._context: tuple = ()  # the signal open and whether it asked, as an op was placed

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

    # placed runs: the dispatcher's entry points -------------------------------------------

    def op(self, ins: tuple, urgent: bool, key: tuple | None, sigs: list, outs: list,
           host: Any) -> int:
        """One of the client's instructions, once tensors are placed: held in the run as the
        placer places it, or, where the run is foreseen, compared with the expected one (not
        placed). An upload or an optimizer's step sends the run and goes as written. Returns
        the first rank it goes to."""
        name, _, _, tmask, kw = ins
        if name in UNREPEATABLE:
            self.interrupt(name)
            self.counts["as written: an upload or an optimizer's step"] += 1
            return self.d.placer.submit(ins, sigs, outs, urgent, host, key)
        if key is None:
            key = signature_key(name, tuple(sigs), tmask, kw)
        raw = (ins, key, sigs, outs, urgent, host)
        self._ops += 1
        self._urgent |= urgent
        if self._expecting(OP):
            rank = self.ahead.op(ins, key, raw)
            if rank is not None:
                if self._ops >= RUN_LEN:
                    self.close()
                return rank
            self._unforeseen()
        rank = self._place(OP, raw)
        if self._ops >= RUN_LEN:
            self.close()
        return rank

    def interrupt(self, name: str) -> None:
        """What cannot be held (``name``: an upload, an optimizer's step, an agreement) goes
        next: the run so far goes first."""
        self.close()
        self._since = (*self._since[-7:], name)

    def item(self, kind: int, payload: tuple) -> None:
        """Ids the client freed (FREE), a completed gradient (READY: id, sig) or backward's
        end (DONE), in a placed run."""
        if self._expecting(kind):
            if self.ahead.other(kind, payload):
                return
            self._unforeseen()
        self._place(kind, payload)

    def _expecting(self, kind: int) -> bool:
        """Whether a run is expected now: at a run's first item (of ``kind``), the Foresight
        kept after the run before, if it starts alike and the placer stands as it stood then
        (frees that go out before an upload start no run of their own)."""
        if self.ahead is not None:
            return True
        if self.tape is not None:
            return False
        token = (self._last, self._since, self._segment)
        plan = self.plans.get(token) if self._last is not None else None
        if plan is not None and plan.items[0][0] == kind:
            ahead = Ahead(plan, self.d.placer)
            if ahead.start():
                self.ahead = ahead
                return True
            self._missed(plan, "the placer's books at its start")
        self.tape = Tape(self.d.placer, token)
        return False

    def _missed(self, plan: Foresight, why: str) -> None:
        self.foreseen[f"expected wrongly: {why}"] += 1
        plan.misses += 1
        if plan.misses >= MISSES_MAX and self.plans.get(plan.token) is plan:
            del self.plans[plan.token]

    def _unforeseen(self, why: str = "an item differed") -> None:
        """The run differs from the one expected: what came so far is placed after all."""
        ahead, self.ahead = self.ahead, None
        ahead.undo_placements()
        self._missed(ahead.plan, why)
        self.tape = Tape(self.d.placer, ahead.plan.token)
        for kind, payload in ahead.raw:
            self._place(kind, payload)

    def _place(self, kind: int, payload: tuple) -> int:
        """An item placed and held, and taped."""
        placer, tape = self.d.placer, self.tape
        self._placing = True
        try:
            rank = self._placed(kind, payload, tape)
        except BaseException:  # refused (a config's axis out of range): the run is no Foresight
            tape.token = None
            raise
        finally:
            self._placing = False
        if self.tape is tape:
            tape.add(placer, kind, payload if kind != OP else (*payload, *self._context), rank)
        else:  # the run went out while this was placed (a group of workers made): what it
            # held of this item, and the next run, are no Foresight's
            self.tape = Tape(placer, None)
        return rank

    def _placed(self, kind: int, payload: tuple, tape: Tape) -> int:
        d, placer = self.d, self.d.placer
        rank = -1
        if kind == OP:
            ins, key, sigs, outs, urgent, host = payload
            self._context = (placer.signals[-1][0] if placer.signals else None, placer._asked > 0)
            self.client(ins, key)
            name, out, args, tmask, kw = ins
            for i, a in enumerate(args):
                if tmask >> i & 1:
                    tape.see(placer, a)
            with d._diverting():
                rank = placer.submit(ins, sigs, outs, urgent, host, key)
            self.placed.append(None)
        elif kind == FREE:
            for tid in payload:
                tape.see(placer, tid)
            for r, ids in placer.free(list(payload)).items():
                self.hold(r, ("free", None, tuple(ids), 0, None))
        else:
            if kind == READY:
                tape.see(placer, payload[0])
            with d._diverting():
                if kind == READY:
                    placer.reduce_soon(*payload)
                else:
                    placer.reduce_now()
        return rank

    def client(self, ins: tuple, key: tuple) -> None:
        """Before the placer places one of the client's instructions (``key``: its signature
        key), which it sends to ``hold``: its key, where what it reads from before lay."""
        name, out, args, tmask, kw = ins
        seen, table = self._seen, self.d.placer.table
        lay = []
        i = 1
        for a in args:
            if tmask & i and a not in seen:
                seen.add(a)
                lay.append(table.get(a))
            elif type(a) is Seed:
                self._seeds.append(a)
            i <<= 1
        if kw:
            self._seeds += [v for v in kw.values() if type(v) is Seed]
        seen.update((out,) if type(out) is int else out or ())
        self._client.append((key, tuple(lay)))

    def hold(self, rank: int, ins: tuple) -> None:
        """A placed instruction for ``rank``, held in the run."""
        self.placed.append((rank, ins))

    def close(self) -> None:
        """The run held so far goes out: replayed if it repeats, else as written."""
        # a trace's snapshot word sent from a flush in the middle would send the frees owed
        # since ahead of the run's remaining instructions, which may read them
        d = self.d
        tick, d.trace_tick = d.trace_tick, None
        try:
            self._close()
        finally:
            d.trace_tick = tick

    def _close(self) -> None:
        if self.stale:
            self._drop_stale()
        if self.ahead is not None and self._close_ahead():
            return
        if self.placed or self._client or self.tape is not None:
            return self._close_placed()
        instructions, keys, urgent, ops = self.pending, self._keys, self._urgent, self._ops
        self.pending, self._keys, self._ops, self._urgent = [], [], 0, False
        if not ops:  # frees alone
            if instructions:
                self.d._put(self.d.home, instructions[-1] if len(instructions) == 1 else
                            ("free", None, sum((i[2] for i in instructions), ()), 0, None),
                            False)
            return
        count = len(instructions)

        def as_written(why: str) -> None:
            self._counted(why, count)
            put, home = self.d._put, self.d.home
            for ins in instructions[:-1]:
                put(home, ins, False)
            put(home, instructions[-1], urgent)

        try:
            run = _Run({self.d.home: instructions}, keys)
        except TypeError:
            return as_written("a constant that cannot be compared")
        if min(run.ids) < 0:  # the dispatcher's own tensors: a placed program, not repeated
            return as_written("the dispatcher's own tensors")
        self._decide(run, {self.d.home: instructions}, as_written, count)

    def _close_ahead(self) -> bool:
        """The expected run is whole: replayed with no placing, and True; else it is placed
        after all (False)."""
        ahead = self.ahead
        plan = ahead.plan
        ids = ahead.finish()
        variant = plan.variant
        run = None
        if ids is not None and not variant.program.stale:
            run = plan.run.renamed([ids[r] for r in plan.slots], ahead.seeds)
            if not variant.fits(run.ids) or _binds_copies(run, variant.bound) or \
                    not run.drawn_in_a_row():
                run = None
        if run is None:
            self._unforeseen("the run ended, or read other tensors, or other copies")
            return False
        self.ahead = None
        self._ops, self._urgent = 0, False
        self._ran()
        plan.apply(self.d.placer, ids)
        if plan.run.key in self.shapes:
            self.shapes.move_to_end(plan.run.key)
        self.foreseen["placing skipped"] += 1
        self.d.trace_inserted(plan.inserted, variant.program.key)
        self._replay(variant, run, plan.count)
        self._last = variant.program.key
        return True

    def _ran(self) -> None:
        """A run with instructions of the client's goes."""
        if self._since:
            self._segment, self._since = self._since, ()

    def _close_placed(self) -> None:
        held, client, seeds = self.placed, self._client, self._seeds
        self.placed, self._client, self._seeds, self._seen = [], [], [], set()
        ops, self._ops, self._urgent = self._ops, 0, False
        tape, self.tape = self.tape, None
        self.d.placer.journal = None
        if ops:
            self._last = None
            self._ran()
        streams: dict[int, list[tuple]] = {}
        for item in held:
            if item is not None:
                streams.setdefault(item[0], []).append(item[1])
        count = sum(map(len, streams.values()))

        def as_written(why: str | None) -> None:
            if why is not None:
                self._counted(why, count)
            d, touched = self.d, set()
            for item in held:  # flushed where the placer flushed: after each placed instruction
                if item is None:
                    for rank in touched:
                        d.flush(rank)
                    touched.clear()
                    continue
                d._put(*item, False)
                touched.add(item[0])
            for rank in touched:
                d.flush(rank)

        if not ops or not streams:  # frees alone, or an op the placer refused
            return as_written(None)
        # data parallelism sends every worker the same: one stream then stands for all
        ranks = sorted(streams)
        first = streams[ranks[0]]
        if len(ranks) > 1 and all(streams[r] == first for r in ranks[1:]):
            streams, client = {ranks[0]: first}, [*client, ("every worker alike", tuple(ranks))]
        if any(ins[0] in TRANSFERS for stream in streams.values() for ins in stream):
            return as_written("a transfer between workers")
        try:
            run = _Run(streams, None, seeds, tuple(client), self.d.placer.new_temp())
        except TypeError as e:
            why = str(e)
            return as_written(why if why in OWN_REASONS else "a constant that cannot be compared")
        for rank in ranks[1:]:
            run.reads.setdefault(rank, run.reads[ranks[0]])
            run.makes.setdefault(rank, run.makes[ranks[0]])
            run.frees.setdefault(rank, run.frees[ranks[0]])
        variant = self._decide(run, streams, as_written, count)
        self._last = variant.program.key if variant else None
        if variant is not None and tape is not None and tape.token is not None and \
                not self._placing:
            plan = learn(tape, run, variant, self.d.placer, count)
            if isinstance(plan, Foresight):
                self.plans[tape.token] = plan
            else:
                self.foreseen[f"not kept: {plan}"] += 1

    def _decide(self, run: _Run, streams: dict[int, list[tuple]], as_written,
                count: int) -> _Variant | None:
        """Sends ``run``: the program it was replayed as, or None (as written)."""
        if not run.drawn_in_a_row():
            return as_written("random ops with seeds not the session's next in a row")
        shape = self.shapes.get(run.key)
        if shape is None:
            if len(self.shapes) >= SHAPES_MAX:
                self._forget(self.shapes.popitem(last=False)[1])
            self.shapes[run.key] = shape = _Shape()
            shape.earlier.append(run)
            return as_written("not seen before")
        self.shapes.move_to_end(run.key)
        if shape.refused:
            return as_written(REMAKES)
        for variant in shape.variants:
            if variant.fits(run.ids) and not variant.program.stale:
                if _binds_copies(run, variant.bound):
                    return as_written(BINDS_COPIES)
                self._replay(variant, run, count)
                return variant
        earlier = _fitting(shape.earlier, run)
        if earlier is None or len(shape.variants) >= VARIANTS_MAX or \
                self.installed >= PROGRAMS_MAX:
            shape.earlier.append(run)
            del shape.earlier[:-EARLIER_MAX]
            why = "no earlier run of its shape reads the same tensors" if earlier is None \
                else "too many programs"
            return as_written(why)
        variant = self._install(streams, run, earlier)
        if variant is None:
            shape.refused = True
            return as_written(REMAKES)
        if _binds_copies(run, variant.bound):  # kept: a later run may bind none
            shape.variants.append(variant)
            return as_written(BINDS_COPIES)
        shape.variants.append(variant)
        self._replay(variant, run, count)
        return variant

    def _counted(self, why: str, count: int) -> None:
        self.counts[f"as written: {why}"] += count
        self._note("as written", -1, count, why)

    def _install(self, streams: dict[int, list[tuple]], run: _Run,
                 earlier: _Run) -> _Variant | None:
        """A program for ``run``: tensors that ``earlier`` read too are read as they are, the
        rest of what it reads is bound per replay; what it makes gets ids of its own. None
        where it makes one of the former anew."""
        d = self.d
        fixed = {s: run.ids[s] for s in run.inputs() if earlier.existed(run.ids[s])}
        slots = [run.ids[s] if s in fixed else d.placer.new_temp() for s in range(len(run.ids))]
        at = {tid: s for s, tid in enumerate(run.ids)}.__getitem__
        # each seed as its place among the run's random ops (1, 2, ...), which a replay's
        # seeds are derived from
        before = run.seeds[0].offset - 1 if run.seeds else 0

        def relative(v: Any) -> Any:
            return Seed(v, v.offset - before) if type(v) is Seed else v

        programs, renamed = {}, {}
        for rank, stream in streams.items():
            programs[rank] = program = []
            # a tensor from before that an op makes anew under its id (a bucket of gradients
            # summed, a tensor placed anew): a version of the program's own from there on,
            # handed out under the run's id after it
            now = renamed[rank] = {}

            def ref(tid: int) -> int:
                s = at(tid)
                return now.get(s, slots[s])

            for name, out, args, tmask, kw in stream:
                if name == "free":  # the run's own tensors and versions; those from before go
                    # after it
                    mine = tuple(ref(a) for a in args if run.made[at(a)] or at(a) in now)
                    if mine:
                        program.append(("free", None, mine, 0, None))
                    continue
                if name == "agree":
                    args = (tuple(ref(a) for a in args[0]), *args[1:])
                else:
                    args = tuple(ref(a) if tmask >> j & 1 else relative(a)
                                 for j, a in enumerate(args))
                if kw and run.seeds:
                    kw = {k: relative(v) for k, v in kw.items()}
                outs = (out,) if type(out) is int else out or ()
                if name not in INPLACE:
                    for o in outs:
                        s = at(o)
                        if not run.made[s]:
                            if s in fixed:  # a graph reads it where it was captured
                                return None
                            now[s] = d.placer.new_temp()
                outs = tuple(map(ref, outs))
                program.append((name, outs[0] if type(out) is int else outs or out, args, tmask,
                                kw))
        alike = next(iter(streams))
        for rank in run.reads:  # workers sent the same as the first
            programs.setdefault(rank, programs[alike])
            renamed.setdefault(rank, renamed[alike])
        inputs = set(run.inputs()) - set(fixed)
        bound = {rank: sorted(inputs & read) for rank, read in run.reads.items()}
        kept = {rank: sorted(s for s in made if (run.made[s] or s in renamed[rank]) and
                             s not in run.frees[rank])
                for rank, made in run.makes.items()}
        hand = {rank: tuple((renamed[rank].get(s, slots[s]), s) for s in slots_)
                for rank, slots_ in kept.items()}
        d._programs += 1
        listed = [ins[0] for rank in sorted(programs) for ins in programs[rank]] or ["nothing"]
        made = Program(d._programs, f"repeated run {d._programs} ({len(listed)} instructions, "
                       f"{listed[0]} ... {listed[-1]})", tuple(sorted(programs)),
                       frozenset(fixed.values()), (), (),
                       tuple((tid, None, False) for tid in
                             sorted({p for pairs in hand.values() for p, _ in pairs})),
                       len(run.seeds), auto=True)
        for rank, program in programs.items():
            d._put(rank, ("program", None, (made.key, program), 0, None), False)
        for tid in fixed.values():
            d.watched.setdefault(tid, []).append(made)
        self.installed += 1
        return _Variant(fixed, made, slots, bound, hand)

    def _replay(self, variant: _Variant, run: _Run, count: int) -> None:
        ids, slots = run.ids, variant.slots
        binds = {rank: tuple((ids[s], slots[s]) for s in bound)
                 for rank, bound in variant.bound.items()}
        renames = {rank: tuple((tid, ids[s]) for tid, s in kept)
                   for rank, kept in variant.kept.items()}
        self.counts["replayed"] += count
        self._note("replayed", variant.program.key, count, variant.program.name)
        # derive_seed(0, n) is n: the worker's seed for the run's i-th random op is then the
        # seed before this run's first, plus i (the session's seeds go up by one per op)
        seeds = (0, int(run.seeds[0]) - 1) if run.seeds else None
        # tensors from before the run that it frees: those it never reads go before it (no value
        # changes, and last step's autograd records, freed at the start of this one, would
        # otherwise still be held at its launch and make its graph run op by op); those it
        # reads go after it
        put, after = self.d._put, {}
        for rank, freed in run.frees.items():
            gone = [s for s in sorted(freed) if not run.made[s]]
            first = tuple(ids[s] for s in gone if s not in run.reads[rank])
            if first:
                put(rank, ("free", None, first, 0, None), False)
            after[rank] = tuple(ids[s] for s in gone if s in run.reads[rank])
        self.d.run_program(variant.program, binds, renames, seeds)
        for rank, ids_after in after.items():
            if ids_after:
                put(rank, ("free", None, ids_after, 0, None), False)

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
        self.plans.clear()
        for shape in self.shapes.values():
            self._forget(shape)
        self.shapes.clear()
        self._drop_stale()

    def _drop_stale(self) -> None:
        stale, self.stale = self.stale, []
        for program in stale:
            self.installed -= 1
            for rank in program.ranks:
                self.d._put(rank, ("program", None, (program.key, None), 0, None), False)
        for shape in self.shapes.values():
            if shape.variants:
                shape.variants = [v for v in shape.variants if not v.program.stale]

    def report(self) -> str:
        """How many of the instructions went out replayed, and why the others did not."""
        total = sum(self.counts.values())
        if not total:
            return "repeated runs: none sent yet"
        parts = [f"{n:,} {why}" for why, n in self.counts.most_common()]
        foreseen = "; ".join(f"{n:,} {why}" for why, n in self.foreseen.most_common())
        return (f"repeated runs ({self.installed} programs): of {total:,} instructions, "
                + "; ".join(parts) + (f". Placed runs foreseen: {foreseen}" if foreseen else ""))


REMAKES = "makes a tensor it reads from before anew (a graph reads those where it captured them)"


def _binds_copies(run: _Run, bound: dict[int, list[int]]) -> bool:
    return any(run.ids[s] < 0 for slots in bound.values() for s in slots)


def _fitting(earlier: list[_Run], run: _Run) -> _Run | None:
    """The latest earlier run that read, wherever ``run`` reads a tensor that existed when it
    ran, that same tensor."""
    inputs = run.inputs()
    ids = run.ids
    for before in reversed(earlier):
        old = before.ids
        if all(ids[s] == old[s] or not before.existed(ids[s]) for s in inputs):
            return before
    return None

