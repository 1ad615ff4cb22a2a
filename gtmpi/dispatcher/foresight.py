"""Placed runs foreseen: a repeated run's placing skipped (with GTMPI_AUTO_REPLAY_PLACED=1).

Once tensors lie on several workers, placing (dispatcher/placer.py) is most of what rank 0
does per instruction, and a data-parallel loop places the same instructions alike every
iteration. So what the client sent for a placed run that was replayed (dispatcher/repeats.py)
is kept as a Foresight, with every id as a ref (its order of first use): each instruction,
free and completed gradient, with how placing it changed where tensors lie; what the
placer's books said of each tensor from before the run; and what the run left in its other
books. After the run that came before it, the same run is expected next (Ahead): each thing
the client sends is compared with the kept one and, where they are alike, not placed. Its
changes to where tensors lie are made at once under the new ids, so that what the client asks
meanwhile (where a tensor lies) gets placing's answer; once the run is whole, the other books
take what the kept run left them and its program is replayed. The first difference undoes
those changes and places everything that came so far after all, in order: the run goes on as
if nothing had been expected.
"""
from __future__ import annotations

from typing import Any

from ..ops.shapes import freeze
from ..ops.table import Seed

OP, FREE, READY, DONE = range(4)
COPIES = 1  # Placer.books(): (table entry, copies, recipe, viewed, agreed, forward)
MISSES_MAX = 3  # a run expected wrongly this often after the same one is no longer expected
SEED = ("seed",)  # a random op's seed: the session's next ones, compared as a run closes
_GONE = object()
_NO_BOOKS = (None, None, None, False, None, None)


def footprint(books: tuple) -> tuple:
    """What placing reads of a tensor's books, comparable between runs (its copies' ids
    aside)."""
    entry, copies, recipe, viewed, agreed, forward = books
    return (entry, tuple(copies) if copies else None, recipe and _recipe_shape(recipe), viewed,
            agreed, forward)


def _recipe_shape(recipe: tuple) -> tuple:
    # a recipe's ids are never read again (its operands' recipes stand for them)
    (name, _, args, tmask, kw), operands, _ = recipe
    return (name, tuple(freeze(a) for i, a in enumerate(args) if not tmask >> i & 1),
            kw and tuple((k, freeze(v)) for k, v in kw.items()),
            tuple(_recipe_shape(r) for r in operands))


class Tape:
    """One placed run as the client sent it and the placer placed it: its items (kind,
    payload, changes of placement as (id, table entry), first rank), and the books of each
    tensor from before it at its first use."""

    __slots__ = ("token", "items", "firsts", "made", "buckets", "inserted", "settings", "floor")

    def __init__(self, placer: Any, token: Any) -> None:
        self.token = token  # what came before the run
        self.floor = placer.new_temp()  # the dispatcher's tensors made by the run lie below
        self.items: list[tuple] = []
        self.firsts: dict[int, tuple] = {}
        self.made: set[int] = set()
        self.buckets = placer.bucket_state()
        for _, _, members in self.buckets:
            for tid, _ in members:
                self.see(placer, tid)
        self.inserted = {k: tuple(v) for k, v in placer.inserted.items()}
        self.settings = placer.settings()
        placer.journal = []

    def see(self, placer: Any, tid: int) -> None:
        """``tid`` is used: its books (and its copies') if it is from before the run."""
        if tid not in self.firsts and tid not in self.made:
            books = self.firsts[tid] = placer.books(tid)
            for copy in (books[1] or {}).values():
                if copy not in self.firsts:
                    self.firsts[copy] = placer.books(copy)

    def add(self, placer: Any, kind: int, payload: tuple, rank: int = -1) -> None:
        """An item placed: the placements it changed, as they are now."""
        table = placer.table
        effects = tuple((tid, table.get(tid)) for tid in dict.fromkeys(placer.journal))
        placer.journal.clear()
        self.items.append((kind, payload, effects, rank))
        if kind == OP:
            out = payload[0][1]
            self.made.update(o for o in ((out,) if type(out) is int else out or ())
                             if o not in self.firsts)


class Foresight:
    """A placed run kept in refs: refs [0, clients) are the client's ids in their order of
    first use (the gradients waiting in buckets at its start first), then the dispatcher's own
    tensors it made (``temps``), then copies from before it read (``derived``: the ref of the
    tensor they copy, their placement, their footprint)."""

    __slots__ = ("token", "items", "befores", "clients", "temps", "derived", "slots", "changes",
                 "buckets", "buckets_after", "inserted", "settings", "run", "variant", "count",
                 "seeds", "misses")

    def apply(self, placer: Any, ids: list[int]) -> None:
        """The books but where tensors lie (set as each item came): as the kept run left them."""
        set_book = placer.set_book
        for ref, field, value in self.changes:
            if field == COPIES and value is not None:
                value = {where: ids[r] for where, r in value.items()}
            set_book(field, ids[ref], value)
        placer.set_buckets([(key, size, tuple((ids[r], sig) for r, sig in members))
                            for key, size, members in self.buckets_after])
        for key, (n, nbytes) in self.inserted:
            entry = placer.inserted.setdefault(key, [0, 0])
            entry[0] += n
            entry[1] += nbytes


def learn(tape: Tape, run: Any, variant: Any, placer: Any, count: int) -> Foresight | str:
    """The Foresight of a placed run just replayed (its books as the run left them), or why it
    cannot be kept."""
    if placer.settings() != tape.settings:
        return "made a group of workers"
    refs: dict[int, int] = {}
    order: list[int] = []

    def ref(tid: int) -> int:
        r = refs.get(tid)
        if r is None:
            r = refs[tid] = len(order)
            order.append(tid)
        return r

    for _, _, members in tape.buckets:
        for tid, _ in members:
            ref(tid)
    items = []
    for kind, payload, effects, rank in tape.items:
        if kind == OP:
            ins, key, _, _, _, _, top, asked = payload
            name, out, args, tmask, _ = ins
            kept = tuple(ref(a) if tmask >> i & 1 else SEED if type(a) is Seed else a
                         for i, a in enumerate(args))
            outs = tuple(ref(o) for o in ((out,) if type(out) is int else out or ()))
            payload = (name, key, tmask, kept, outs, top, asked)
        elif kind == READY:
            payload = (ref(payload[0]), payload[1])
        else:
            payload = tuple(ref(tid) for tid in payload)
        if any(tid not in refs for tid, _ in effects):
            return "placed anew a tensor the client did not name"
        items.append((kind, payload, tuple((refs[tid], e) for tid, e in effects), rank))
    clients = len(order)
    befores = [footprint(tape.firsts[tid]) if tid in tape.firsts else None for tid in order]
    copy_of = {copy: (tid, where) for tid in order[:clients] if tid in tape.firsts
               for where, copy in (tape.firsts[tid][1] or {}).items()}
    derived = []
    for tid in run.ids:
        if tid in refs or tape.floor > tid:  # (below the floor: a temp the run made)
            continue
        if tid not in copy_of:
            return "reads a tensor of the dispatcher's own from before that copies none it names"
    temps = [tid for tid in dict.fromkeys(run.ids) if tid not in refs and tape.floor > tid]
    for tid in temps:
        ref(tid)
    for tid in dict.fromkeys(run.ids):
        if tid not in refs:
            parent, where = copy_of[tid]
            ref(tid)
            derived.append((refs[parent], where, footprint(tape.firsts[tid])))
    changes = []  # (ref, book, its value there), where the run changed it
    for r, tid in enumerate(order):
        after = placer.books(tid)
        before = tape.firsts.get(tid, _NO_BOOKS)
        for field in range(COPIES, len(after)):
            value = after[field]
            if value == before[field]:
                continue
            if field == COPIES and value is not None:
                if any(c not in refs for c in value.values()):
                    return "keeps a copy it does not read"
                value = {where: refs[c] for where, c in value.items()}
            changes.append((r, field, value))
    buckets_after = []
    for key, size, members in placer.bucket_state():
        if any(tid not in refs for tid, _ in members):
            return "leaves a gradient it does not name waiting"
        buckets_after.append((key, size, tuple((refs[tid], sig) for tid, sig in members)))
    inserted = []
    for key, (n, nbytes) in placer.inserted.items():
        n0, b0 = tape.inserted.get(key, (0, 0))
        if n != n0:
            inserted.append((key, (n - n0, nbytes - b0)))
    f = Foresight()
    f.token, f.items, f.befores, f.clients = tape.token, items, befores, clients
    f.temps, f.derived, f.slots = len(temps), derived, tuple(refs[tid] for tid in run.ids)
    f.changes, f.inserted, f.settings = changes, inserted, tape.settings
    f.buckets = [(key, size, tuple(sig for _, sig in members))
                 for key, size, members in tape.buckets]
    f.buckets_after, f.run, f.variant, f.count = buckets_after, run, variant, count
    f.seeds, f.misses = len(run.seeds), 0
    return f


class Ahead:
    """A run expected: each item the client sends is compared with the Foresight's, its
    changes of placement made as it comes; ``raw`` keeps the items to place if one differs."""

    __slots__ = ("plan", "placer", "j", "ids", "refs", "raw", "undo", "seeds")

    def __init__(self, plan: Foresight, placer: Any) -> None:
        self.plan = plan
        self.placer = placer
        self.j = 0
        self.ids: list[int] = []  # by ref, as they come
        self.refs: dict[int, int] = {}
        self.raw: list[tuple] = []
        self.undo: dict[int, Any] = {}  # id -> its table entry before the run
        self.seeds: list[Seed] = []

    def start(self) -> bool:
        """Whether the placer stands as it stood at the kept run's start."""
        placer, plan = self.placer, self.plan
        if placer.settings() != plan.settings:
            return False
        now = placer.bucket_state()
        if len(now) != len(plan.buckets):
            return False
        for (key, size, members), (k, s, sigs) in zip(now, plan.buckets):
            if key != k or size != s or tuple(sig for _, sig in members) != sigs:
                return False
            for tid, _ in members:
                if self._new(tid) is None:
                    return False
        return True

    def _new(self, tid: int) -> int | None:
        """The next ref for ``tid``, first used now: None where the kept run's tensor there was
        from before it and the books say other things of this one."""
        r = len(self.ids)
        if r >= self.plan.clients:
            return None
        before = self.plan.befores[r]
        if before is not None and footprint(self.placer.books(tid)) != before:
            return None
        self.ids.append(tid)
        self.refs[tid] = r
        return r

    def _ref(self, tid: int, want: int) -> bool:
        r = self.refs.get(tid)
        if r is None:
            return want == len(self.ids) and self._new(tid) is not None
        return r == want

    def _next(self, kind: int) -> tuple | None:
        items = self.plan.items
        if self.j >= len(items) or items[self.j][0] != kind:
            return None
        return items[self.j]

    def _took(self, effects: tuple, raw: tuple) -> None:
        table, undo, ids = self.placer.table, self.undo, self.ids
        for r, entry in effects:
            tid = ids[r]
            if tid not in undo:
                undo[tid] = table.get(tid, _GONE)
            if entry is None:
                table.pop(tid, None)
            else:
                table[tid] = entry
        self.raw.append(raw)
        self.j += 1

    def op(self, ins: tuple, key: tuple, raw: tuple) -> int | None:
        """A client's instruction as expected: the rank placing it would name; else None."""
        item = self._next(OP)
        if item is None:
            return None
        _, (name, pkey, ptmask, kept, outs, top, asked), effects, rank = item
        iname, out, args, tmask, kw = ins
        if iname != name or tmask != ptmask or key != pkey:
            return None
        seeds, refs = self.seeds, self.refs
        for i, a in enumerate(args):
            want = kept[i]
            if tmask >> i & 1:
                r = refs.get(a)
                if r != want and (r is not None or not self._ref(a, want)):
                    return None
            elif type(a) is Seed:
                seeds.append(a)
            elif a is not want:
                try:
                    if type(a) is not type(want) or not a == want:
                        return None
                except Exception:
                    return None
        if kw:
            seeds += [v for v in kw.values() if type(v) is Seed]
        for o, want in zip((out,) if type(out) is int else out or (), outs):
            if not self._ref(o, want):
                return None
        placer = self.placer
        if (placer.signals[-1][0] if placer.signals else None) != top or \
                (placer._asked > 0) != asked:
            return None
        self._took(effects, (OP, raw))
        return rank

    def other(self, kind: int, payload: tuple) -> bool:
        """A free, a completed gradient or backward's end, as expected."""
        item = self._next(kind)
        if item is None:
            return False
        want = item[1]
        if kind == READY:
            if payload[1] != want[1] or not self._ref(payload[0], want[0]):
                return False
        elif len(payload) != len(want) or not all(map(self._ref, payload, want)):
            return False
        self._took(item[2], (kind, payload))
        return True

    def finish(self) -> list[int] | None:
        """Every ref's id, once the run is whole and the copies it reads are as expected."""
        plan, placer = self.plan, self.placer
        if self.j != len(plan.items) or len(self.ids) != plan.clients or \
                len(self.seeds) != plan.seeds:
            return None
        derived = []
        for parent, where, print_ in plan.derived:
            copy = (placer.copies.get(self.ids[parent]) or {}).get(where)
            if copy is None or footprint(placer.books(copy)) != print_:
                return None
            derived.append(copy)
        return self.ids + [placer.new_temp() for _ in range(plan.temps)] + derived

    def undo_placements(self) -> None:
        """Where tensors lie, as at the run's start."""
        table = self.placer.table
        for tid, entry in self.undo.items():
            if entry is _GONE:
                table.pop(tid, None)
            else:
                table[tid] = entry
