"""The dispatcher's placed path: where tensors live once any lives on several workers.

Until a signal places a tensor, every tensor lives whole on the home worker and the dispatcher
never comes here. Afterwards every instruction does: its operands are brought to one mesh and
to the placements its rule wants (placement.rules), by instructions inserted before it
(collectives and transfers run between workers, never through rank 0); the op then runs on
every member, each on its own piece, and its result's placement is recorded.

Converted copies of a tensor (a replicated weight cut into pieces, a tensor moved to other
workers) are kept while the tensor lives unchanged, so a weight used every step moves once. A
copy larger per worker than its source (pieces gathered or summed whole) is freed as soon as
the instruction that wanted it is sent: keeping it would hold the whole tensor on every member,
which is what sharding saves.
"""
from __future__ import annotations

import itertools
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from ..ops.shapes import signature_key
from ..ops.table import OPS, Kind as OpKind
from ..placement.rules import DUAL, Plan, PlacementError, dual, plan, written
from ..placement.rules import outs as outs_of
from ..placement.types import Placement, make
from ..signals.config import ConfigError
from ..recording.events import Flag, Kind, Lane

_COMM = {name for name, op in OPS.items() if op.kind is OpKind.COMM}
_SHAPED = {"view", "reshape", "expand"}  # ops whose argument is the result's (global) shape
_SHAPED_KW = {"getitem_grad": "shape"}  # ops whose keyword is the result's (global) shape
_RANKED = {"save_pieces", "load_piece_"}  # ops told their worker's rank (its own file)
# autocast's ops that cast their operands in the kernel: the position of the weight (the bias
# after it) among the operands, read as a cast under GTMPI_ZERO_CAST=1
_CASTING = {"linear": 1, "linear_grad": 2}
# ops that take a ZeRO-3 weight as the pieces it is: a checkpoint's files hold the pieces
_PIECEWISE = _RANKED
# per-member values that may be read another way, with no data moved
_RELABEL = {("R", "V"), ("I", "V"), ("P", "V"), ("V", "P")}


class Placer:
    def __init__(self, dispatcher: Any) -> None:
        self.d = dispatcher
        self.home = Placement((dispatcher.home,), "R")
        self.table: dict[int, tuple[tuple, Placement]] = {}  # id -> (sig, placement), off home
        self.copies: dict[int, dict[Placement, int]] = {}  # id -> placement -> converted copy
        self.signals: list[tuple[Placement, str]] = []  # open signal scopes: (placement, where
        # its axis came from, for errors), innermost last
        self.active = False
        self.placed = 0  # tensors ever given a placement off home: a recording that moved it
        # made a program of pieces, whose shapes no one size follows
        self._groups: dict[tuple[int, ...], int] = {}
        self._temp = itertools.count(-1, -1)  # ids of the dispatcher's own tensors
        self._touched: set[int] = set()  # ranks given a collective since the last flush
        self._plane_started = False
        # ids that ops may have viewed (shape and index ops, to): a partial sum seen through a
        # view must stay a piece, so it is summed into a copy rather than in place
        self.viewed: set[int] = set()
        # a fused op's Graph id -> the op's plan, from which its gradient op is placed
        self.forward: dict[int, Plan] = {}
        self._passing: list[tuple[int, tuple[int, ...]]] = []  # (copy, mesh) freed by release()
        # every collective and transfer inserted, by (where the program issued it, kind,
        # whether a signal or a read asked for it): [count, bytes]; see explain()
        self.inserted: dict[tuple[str, str, bool], list[int]] = {}
        # ZeRO level by mesh (signals' 'zero'): at 2 its gradients are reduce-scattered into
        # pieces as backward completes them, not all-reduced (optim/zero.py)
        self.zero: dict[tuple[int, ...], int] = {}
        # ZeRO-3's weights: each kept as its workers' pieces along dim 0 (S(0)), and placed as
        # whole (R) by every op that reads without writing it, so that each use gathers it
        # and frees the gathered copy once that op is sent (FSDP's gather per use, here per
        # op); in-place ops (the optimizer's step) and a sharded checkpoint see the pieces
        self.gathered: set[int] = set()
        # ZeRO-3's gathers one op ahead (GTMPI_ZERO_AHEAD=0: at use): the weights the next op
        # read the last time this op ran are gathered just before this op, not waited for, so
        # their all-gather runs beside this op's kernel (FSDP's prefetch); each is kept as a
        # copy until that next op takes it, and freed after it as any gathered copy
        self.gather_ahead = True
        # ZeRO-2's and -3's gradients reduce-scattered a bucket of BUCKET_BYTES at a time
        # (GTMPI_ZERO_BUCKETS=0: one collective per gradient)
        self.scatter_buckets = True
        # ZeRO-3 under autocast (GTMPI_ZERO_CAST=1; off until measured on GPUs): a linear
        # that casts a float32 weight to bf16 in its kernel reads instead a bf16 cast of the
        # weight's pieces, made at its first use after each update and gathered as any ZeRO-3
        # weight (FSDP2's param_dtype: half the bytes gathered, float32 masters in the pieces).
        # weight -> dtype -> its cast's id; cast -> (weight, sig, dtype), which is how the
        # gathers ahead know a cast from one update to the next
        self.cast_gathers = False
        # the weights gathered ahead for one op (a linear's weight and bias) in one coalesced
        # collective rather than one each (GTMPI_ZERO_COALESCE=1; off until measured on GPUs)
        self.coalesce_gathers = False
        self._casts: dict[int, dict[torch.dtype, int]] = {}
        self._cast_source: dict[int, tuple[int, tuple, torch.dtype]] = {}
        self._ahead: set[int] = set()  # ids with a gathered copy made ahead, not yet read
        self._read_next: dict[tuple, tuple[int, ...]] = {}  # (op, weights) -> the next's weights
        self._read_last: tuple | None = None
        # inside an activation checkpoint's recompute (utils/checkpoint.py): its ops read the
        # forward's weights in the forward's order but are followed by backward's, so they
        # foretell apart
        self.recomputing = 0
        self._ahead_now = False  # the gathers now emitted are ahead: not waited for
        self.strict = False  # raise rather than gather or move what no signal asked to
        # sum a column-parallel layer's input gradient inside its kernel, beside the weight's
        # gradient (GTMPI_OVERLAP=0: at its first use, after the kernel)
        self.overlap = True
        # sum a row-parallel layer's result inside its kernel, in this many pieces of rows,
        # each piece's all-reduce beside the next one's matmul (GTMPI_OVERLAP_CHUNKS; 0: at its
        # first use, after the kernel, as a sequence-parallel layout wants it)
        self.chunks = 0
        self.site: Callable[[], str] = lambda: "?"  # the program's file:line now (the client's)
        self._asked = 0  # > 0 while a signal or a read asks for the conversions made
        # while an op's plan says its conversions are the layout's own (Plan.intended): strict
        # placement lets them pass, and they are counted and made as any other
        self._intended = False
        # constants made on the home worker outside any signal (masks, arange, ones, and what
        # is computed from them alone): how to make them again, so that an op elsewhere makes
        # its own copy instead of having it sent. id -> (instruction, operands' recipes, depth)
        self.recipes: dict[int, tuple] = {}
        self._plans: dict[tuple, tuple] = {}
        # partial sums (gradients) waiting to be summed together, by (mesh, dtype): their
        # bytes so far, and (id, Sig) of each
        self._buckets: dict[tuple, tuple[list[int], list[tuple[int, tuple]]]] = {}
        # id -> the meshes whose members already agreed on it: whether a tensor failed is
        # settled once it is made, so one agreement per mesh serves every later in-place op
        # and read (an optimizer step after clipping agrees on nothing new)
        self._agreed: dict[int, set[tuple[int, ...]]] = {}
        # while a run is taped (dispatcher/foresight.py): the ids whose placement changed
        self.journal: list[int] | None = None

    # what the dispatcher asks -------------------------------------------------------------

    def placement(self, tid: int) -> Placement:
        entry = self.table.get(tid)
        return self.home if entry is None else entry[1]

    def enter(self, target: Placement, where: str) -> None:
        self.signals.append((target, where))
        self.active = True

    def check_open(self, sig: tuple) -> None:
        """Raise the ConfigError a tensor of ``sig`` made now would raise at its placing."""
        for target, where in self.signals:
            fit(target, sig, where)

    @contextmanager
    def beside(self, tid: int) -> Iterator[None]:
        """Tensors made inside are laid out like ``tid`` (a partial sum's like is whole)."""
        p = self.placement(tid)
        if not self.active or p == self.home:
            yield
            return
        self.enter(Placement(p.mesh, "R") if p.kind == "P" else p, "")
        try:
            yield
        finally:
            self.exit()

    @contextmanager
    def asking(self) -> Iterator[None]:
        """What is inserted inside is asked for (by a library routine whose math needs it: the
        global norm of gradients on several stages), never a fallback strict mode stops."""
        self._asked += 1
        try:
            yield
        finally:
            self._asked -= 1

    def place(self, tid: int, sig: tuple, target: Placement, where: str) -> None:
        """Give a tensor a signal's placement."""
        self.d.close_run()  # what it sends goes behind what made the tensor
        self.active = True
        self.replace(tid, sig, fit(target, sig, where))
        self._flush_touched()

    def exit(self) -> None:
        self.signals.pop()

    def submit(self, ins: tuple, sigs: list, outs: list, urgent: bool,
               host: torch.Tensor | None = None, key: tuple | None = None) -> int:
        """Place one client instruction (``host``: an upload's data; ``key``: its operands'
        signature_key, where the client made it); return the first rank it went to."""
        name, out, args, tmask, kw = ins
        if name == "upload":
            return self._upload(ins, host)
        op = OPS[name]
        if self.cast_gathers and name in _CASTING and kw and kw.get("cast") is not None:
            args, sigs, kw = self._cast_weights(name, args, tmask, sigs, kw)
            ins = (name, out, args, tmask, kw)
        if op.kind is OpKind.CREATE:
            target = self._signal_target(outs[0])
            self._create(ins, outs[0], target)
            if target == self.home:
                self.recipes[out] = (ins, (), 1)
            return target.mesh[0]
        table, home = self.table, self.home
        kinds = [None if not tmask >> i & 1 else
                 table[a][1] if a in table else home for i, a in enumerate(args)]
        seen = kinds
        if self.gathered and name not in _PIECEWISE:
            written_ = written(name, args, tmask) if op.kind is OpKind.INPLACE else ()
            seen = [p.whole if tmask >> i & 1 and args[i] in self.gathered and i not in written_
                    else p for i, p in enumerate(kinds)]
        forward = None
        if name in DUAL and name != "linear_grad":  # (graph, g): where the forward op ran
            forward = self.forward.get(args[0]) or \
                Plan((self.home,) * (max(kw["grads"]) + 1), self.home)  # made before placing
        # a training loop places the same ops alike every step: decisions are cached by the op,
        # its operands' shapes, dtypes and placements, its constants, the signal in force, the
        # forward plan and the overlap settings
        try:
            key = (key or signature_key(name, tuple(sigs), tmask, kw), tuple(kinds),
                   None if seen is kinds else tuple(seen),
                   self.signals[-1][0] if self.signals else None, forward, self.overlap,
                   self.chunks)
            d = self._plans.get(key)
        except TypeError:  # an unhashable constant
            key, d = None, None
        if d is None:
            d = self._decide(name, forward, args, tmask, kw, seen, sigs, outs, kinds)
            if key is not None:
                if len(self._plans) >= PLANS_CACHED:
                    self._plans.clear()
                self._plans[key] = d
        mesh, on_mesh, p, direct, shapes, local = d
        changed = written(name, args, tmask) if op.kind is OpKind.INPLACE else ()
        for i in changed:
            self.replace(args[i], sigs[i], on_mesh[i])
        for i in changed:
            self.replace(args[i], sigs[i], p.wants[i])
        wire = args
        # a set to test against: a multi-tensor update writes hundreds of its operands
        written_set = frozenset(changed)
        if not direct or changed:
            wire = list(args)
            self._intended = p.intended
            try:
                for i, want in enumerate(p.wants):
                    if want is not None and i not in written_set:
                        wire[i] = self._as(args[i], sigs[i], want)
            finally:
                self._intended = False
            wire = tuple(wire)
        if self.gather_ahead and seen is not kinds:
            read = {a: w for a, k, s, w in zip(args, kinds, seen, wire) if k is not s}
            if read:
                self._gather_ahead(name, read)
        if changed and len(mesh) > 1:  # replicas or pieces change together, or not at all
            self._agree(mesh, [w for i, w in enumerate(wire)
                               if tmask >> i & 1 and i not in written_set])
        placed = (name, out, wire, tmask, kw)
        for m, rank in enumerate(mesh):
            if shapes:  # each member makes its own piece's shape
                placed = (name, out, (wire[0], shapes[m]), tmask, kw)
            elif local:  # each member is told where its piece of the vocabulary starts
                placed = (name, out, wire, tmask, {**(kw or {}), **local[m]})
            self.d.enqueue(rank, placed, urgent)
        if local and "partial" in local[0]:  # the kernel runs a collective of its own
            self._touched.update(mesh)
            for rank in mesh:  # counted per member, as _emit counts a collective
                self._inserted(rank, "all_reduce", out if type(out) is int else out[0],
                               *local[0]["partial"])
        if op.kind in (OpKind.SHAPE, OpKind.INDEX) or name == "to":
            self.viewed.update(w for i, w in enumerate(wire) if tmask >> i & 1)
        for i in changed:
            self._changed(args[i])
        if not changed:
            ids = (out,) if type(out) is int else out
            for oid, sig, where in zip(ids, outs, outs_of(p.out, len(ids))):
                self._record(oid, sig, where)
            if type(out) is int and p.out == self.home and op.kind is not OpKind.FUSED:
                operands = [self.recipes.get(a) for i, a in enumerate(args) if tmask >> i & 1]
                if operands and all(r is not None for r in operands):
                    depth = 1 + max(r[2] for r in operands)
                    if depth <= RECIPE_DEPTH:
                        self.recipes[out] = (ins, tuple(operands), depth)
            if op.kind is OpKind.FUSED and kw and kw.get("grads") and name not in DUAL:
                self.forward[ids[1]] = p
        self.release()
        self._flush_touched()
        return mesh[0]

    def _decide(self, name: str, forward: Plan | None, args: tuple, tmask: int, kw: dict,
                kinds: list, sigs: list, outs: list, actual: list) -> tuple:
        """How an op is placed, given its operands' placements as planned (``kinds``: a
        ZeRO-3 weight as whole) and as they are (``actual``): (its mesh, each operand's
        placement counted on that mesh, the plan, whether every operand is already as the
        plan wants it, each member's result shape where members make their own pieces, and
        each member's keyword constants where a vocabulary-parallel kernel needs them)."""
        mesh, grid = (forward.out.mesh, forward.out.grid) if forward else self._mesh(kinds)
        # operands elsewhere, or laid out over other axes, count as whole here
        on_mesh = [None if p is None else
                   (p if p.mesh == mesh and (p.grid == grid or p.kind == "R") else
                    Placement(mesh, "R")) for p in kinds]
        if name in DUAL:
            p = self._dual(name, forward, args, tmask, kw, mesh, grid, on_mesh, sigs)
        else:
            p = plan(name, mesh, grid, args, tmask, kw, on_mesh, sigs)
        direct = all(w is None or w == k for w, k in zip(p.wants, actual))
        shapes = local = None
        if name in _SHAPED and p.out.kind != "R":
            shapes = [p.out.local_shape(tuple(outs[0][0]), m) for m in range(len(mesh))]
        if p.local is not None:
            local = list(p.local)
        elif p.vocab is not None:
            starts = p.wants[p.vocab].starts(tuple(sigs[p.vocab][0]))
            group = self._group(mesh)
            local = [{"offset": start, "group": group} for start in starts]
        elif p.kw:
            local = [p.kw] * len(mesh)
        elif p.drawn:
            whole = tuple(outs[0][0])
            local = [{"whole": whole, "piece": tuple(p.out.piece(whole, m))}
                     for m in range(len(mesh))]
        elif name in _RANKED:
            local = [{"rank": rank} for rank in mesh]
        elif name in _SHAPED_KW and p.out.kind != "R":
            local = [{_SHAPED_KW[name]: p.out.local_shape(tuple(outs[0][0]), m)}
                     for m in range(len(mesh))]
        elif name == "linear" and self.chunks and len(mesh) > 1 and p.out.kind == "P":
            partial = (tuple(outs[0][0]), outs[0][1])
            local = [{"group": self._group(mesh), "partial": partial,
                      "chunks": self.chunks}] * len(mesh)
            p = p._replace(out=p.out.whole)
        elif name == "linear_grad" and self.overlap and kw.get("sole") and len(mesh) > 1 \
                and kinds[1] is not None and kinds[1].kind == "R":
            # (an input that lies split, sequence parallelism's, wants its gradient in pieces:
            # a reduce-scatter where it is read, not an all-reduce here)
            grads = outs_of(p.out, len(kw["grads"]))
            if grads[0].kind == "P":  # the input's gradient: summed by the kernel, as it goes
                p = p._replace(out=(grads[0].whole, *grads[1:]))
                partial = (tuple(sigs[1][0]), sigs[0][1])
                local = [{"group": self._group(mesh), "partial": partial}] * len(mesh)
        return mesh, on_mesh, p, direct, shapes, local

    def _dual(self, name: str, forward: Plan | None, args: tuple, tmask: int, kw: dict,
              mesh: tuple[int, ...], grid: tuple[int, ...], on_mesh: list, sigs: list) -> Plan:
        """A gradient op's plan, the dual of its forward op's: linear_grad(g, x, w, b) from
        linear's plan on the same operands, a fused op's gradient(graph, g) from the plan its
        forward op was placed with."""
        if name == "linear_grad":
            forward = plan("linear", mesh, grid, args[1:], tmask >> 1, None, on_mesh[1:],
                           sigs[1:])
            grad, grads = dual(forward, kw["grads"], mesh, grid)
            # a split weight's gradient: gathering the incoming gradient or the input where they
            # lie split along the sequence is the dual of sequence parallelism's own collectives
            split = on_mesh[2] is not None and on_mesh[2].kind == "S"
            return Plan((grad, *forward.wants), grads, intended=forward.intended or split)
        grad, grads = dual(forward, kw["grads"], mesh, grid)
        # the incoming gradient is brought to the dual of where the forward result lay: the
        # signals that placed the forward op chose that (sequence parallelism's pieces of a
        # whole position table's gradient are gathered), not a fallback strict mode stops
        return Plan((outs_of(forward.out)[0], grad), grads, intended=True)

    def _upload(self, ins: tuple, host: torch.Tensor) -> int:
        """Each member of the signal's placement gets its own piece of the host data (the
        first member along a partial-sum axis the value, the others zeros)."""
        _, out, sig, _, _ = ins
        shape, dtype = sig
        target = self._signal_target(sig)
        for m, rank in enumerate(target.mesh):
            local = target.local_shape(tuple(shape), m)
            if any(k == "P" and c for (k, _), c in zip(target.per_axis(), target.coords(m))):
                self._emit(rank, ("zeros", out, (local, dtype), 0, None))
                continue
            piece = host
            for dim, start, length in target.piece(tuple(shape), m):
                piece = piece.narrow(dim, start, length)
            self.d.send_bytes(rank, out, piece)
            self.d.enqueue(rank, ("upload", out, (local, dtype), 0, None), True)
        self._record(out, sig, target)
        return target.mesh[0]

    def read_source(self, tid: int, sig: tuple) -> tuple[int, int]:
        """(rank, id) holding the whole tensor, gathering it there first if it is in pieces."""
        p = self.placement(tid)
        if any(k == "V" for k, _ in p.per_axis()):
            raise PlacementError(f"tensor {tid} is varying (V) across workers {list(p.mesh)}: it "
                                 "has no global value to read (place it as a partial sum first)")
        self._asked += 1
        try:
            rid = tid if p.kind in ("R", "I") else self._as(tid, sig, Placement(p.mesh, "R"))
        finally:
            self._asked -= 1
        if len(p.mesh) > 1:
            self._agree(p.mesh, [rid])
        self._flush_touched()
        return p.mesh[0], rid

    def reduce_soon(self, tid: int, sig: tuple) -> None:
        """``tid`` (a gradient) is complete: if it is a partial sum, it is summed with others
        complete by then, in one collective of about BUCKET_BYTES that runs while the workers
        go on (DDP's buckets). Summed now rather than when first read, so backward's remaining
        work hides the communication."""
        p = self.placement(tid)
        if p.kind != "P" or tid in self.viewed:
            return
        shape, dtype = sig
        key: tuple = (p.mesh, dtype)
        if self.zero.get(p.mesh, 0) >= 2 and len(shape) and shape[0] >= len(p.mesh):
            # ZeRO-2: reduce-scattered into each worker's piece, the whole partial sum freed
            # as backward goes on (optim/zero.py): a bucket at a time, as DDP's all-reduces
            # (GTMPI_ZERO_BUCKETS=0: each gradient alone, at once)
            if not self.scatter_buckets:
                self.replace(tid, sig, Placement(p.mesh, "S", 0))
                return
            key = (p.mesh, dtype, "S")
        size, bucket = self._buckets.setdefault(key, ([0], []))
        bucket.append((tid, sig))
        size[0] += _numel(shape) * dtype.itemsize
        if size[0] >= BUCKET_BYTES:
            self._reduce_bucket(key)

    def cut_rows(self, ids: list[int], sigs: list[tuple], outs: list[int]) -> None:
        """``outs[i]``: each member's rows of ``ids[i]``, a tensor replicated over the mesh
        of ``ids[0]`` (S(0) there): ZeRO's pieces of a bucket of parameters and gradients,
        cut by one instruction per member where one per tensor cost the host a round each."""
        self.d.close_run()  # what it sends goes behind what made the tensors
        mesh = self.placement(ids[0]).mesh
        rows = Placement(mesh, "S", 0)
        cuts = [(rows.starts(tuple(sig[0])), rows.sizes(tuple(sig[0]))) for sig in sigs]
        for m, rank in enumerate(mesh):
            spans = tuple((starts[m], sizes[m]) for starts, sizes in cuts)
            self._emit(rank, ("pieces", tuple(outs), tuple(ids), (1 << len(ids)) - 1,
                              {"spans": spans}))
        for tid, out, sig in zip(ids, outs, sigs):
            self._record(out, sig, rows)
            self._agreed_as(tid, out, mesh)

    def gather_rows(self, ids: list[int], pieces: list[int], sigs: list[tuple]) -> None:
        """Every member's rows ``pieces[i]`` (S(0)) written into ``ids[i]`` (replicated over
        the same mesh) in place: ZeRO's updated pieces into their parameters, one flat
        all-gather per dtype."""
        self.d.close_run()
        mesh = self.placement(ids[0]).mesh
        rows = Placement(mesh, "S", 0)
        group = self._group(mesh)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, sig in enumerate(sigs):
            by_dtype.setdefault(sig[1], []).append(i)
        for dtype, chosen in by_dtype.items():
            wholes, cut = [ids[i] for i in chosen], [pieces[i] for i in chosen]
            shapes = [tuple(sigs[i][0]) for i in chosen]
            sizes = tuple(rows.sizes(shape) for shape in shapes)
            for m, rank in enumerate(mesh):
                mine = tuple((n[m], *shape[1:]) for n, shape in zip(sizes, shapes))
                self._emit(rank, ("gather_pieces_", tuple(wholes), (*wholes, *cut),
                                  (1 << 2 * len(chosen)) - 1,
                                  {"group": group, "sizes": sizes, "shapes": (*shapes, *mine),
                                   "shape": (sum(_numel(s) for s in mine),), "dtype": dtype}))
            for whole, piece in zip(wholes, cut):
                self._changed(whole)  # its copies (a cast, a cut) hold the old values
                self._agreed_as(piece, whole, mesh)
        self._flush_touched()

    def reduce_now(self) -> None:
        """Sum what waits in buckets (backward has ended)."""
        for key in list(self._buckets):
            self._reduce_bucket(key)

    def _reduce_bucket(self, key: tuple) -> None:
        """Sum a bucket of partial sums (key: mesh, dtype) in one collective that the worker
        does not wait for: all-reduced whole, or (key: mesh, dtype, "S") reduce-scattered
        into each member's rows (S(0)), each gradient's pieces views of one buffer."""
        mesh, dtype = key[:2]
        partial = Placement(mesh, "P")
        bucket = [(tid, sig) for tid, sig in self._buckets.pop(key)[1]
                  if self.placement(tid) == partial]  # unchanged since
        if not bucket:
            return
        ids = tuple(tid for tid, _ in bucket)
        shapes = tuple(tuple(sig[0]) for _, sig in bucket)
        kw = {"group": self._group(mesh), "shapes": shapes,
              "shape": (sum(map(_numel, shapes)),), "dtype": dtype}
        target = Placement(mesh, "S", 0) if len(key) > 2 else Placement(mesh, "R")
        if target.kind == "R":
            for rank in mesh:
                self._emit(rank, ("all_reduce_bucket", ids, ids, (1 << len(ids)) - 1, kw))
        else:
            sizes = tuple(target.sizes(shape) for shape in shapes)
            for m, rank in enumerate(mesh):
                self._emit(rank, ("reduce_scatter_bucket", ids, ids, (1 << len(ids)) - 1,
                                  {**kw, "sizes": sizes, "index": m}))
        for tid, sig in bucket:
            self._record(tid, sig, target)
        self._flush_touched()

    def agree_on(self, ids: list[int]) -> None:
        """Agreements now on every id of ``ids`` that lives on several workers: one per mesh
        for all its ids, where each in-place op would agree on its own operands one op at a
        time (an optimizer's step: one per group of parameters that live alike)."""
        by_mesh: dict[tuple[int, ...], list[int]] = {}
        for tid in ids:
            mesh = self.placement(tid).mesh
            if len(mesh) > 1:
                by_mesh.setdefault(mesh, []).append(tid)
        for mesh, group in by_mesh.items():
            self._agree(mesh, group)
        self._flush_touched()

    def _agree(self, mesh: tuple[int, ...], ids: list[int]) -> None:
        """Every member of ``mesh`` poisons ``ids`` if any member has one of them poisoned."""
        agreed = self._agreed
        ids = [i for i in ids if mesh not in agreed.get(i, ())]
        for i in ids:
            agreed.setdefault(i, set()).add(mesh)
        if ids:
            word = ("agree", None, (tuple(ids), self._group(mesh)), 0, None)
            for rank in mesh:
                self.d.enqueue(rank, word, True)
                self._touched.add(rank)

    def free(self, ids: list[int]) -> dict[int, list[int]]:
        """The ids to free on each rank."""
        by_rank: dict[int, list[int]] = {}
        for tid in ids:
            for rank, gone in self._forget(tid):
                by_rank.setdefault(rank, []).append(gone)
        return by_rank

    def new_temp(self) -> int:
        """An id for a tensor of the dispatcher's own (negative: never a client's)."""
        return next(self._temp)

    def rename(self, old: int, new: int) -> None:
        """A tensor's books move to a new id (its worker tensors move by a rename word)."""
        for book in (self.table, self.copies, self.recipes, self.forward, self._agreed):
            if old in book:
                book[new] = book.pop(old)
        if old in self.viewed:
            self.viewed.discard(old)
            self.viewed.add(new)

    def replace(self, tid: int, sig: tuple, target: Placement) -> None:
        """Give ``tid`` itself a new placement (its value stays): for in-place ops, uploads and
        signal.tensor."""
        source = self.placement(tid)
        if source == target:
            return
        self._asked += 1
        try:
            moved = self._as(tid, sig, target)
        finally:
            self._asked -= 1
        for rank in target.mesh:
            self._emit(rank, ("alias", tid, (moved,), 1, None))
        for rank, gone in self._forget(tid):
            if gone != tid or rank not in target.mesh:
                self._emit(rank, ("free", None, (gone,), 0, None))
        self.release()
        self._record(tid, sig, target)

    # conversions --------------------------------------------------------------------------

    def _as(self, tid: int, sig: tuple, want: Placement) -> int:
        """The id of ``tid`` with placement ``want``: itself, a kept copy, or a new copy."""
        have = self.placement(tid)
        if have == want or (have.mesh == want.mesh and {have.kind, want.kind} == {"R", "I"}):
            return tid  # R and I: the same values
        if have.kind == "P" and want == have.whole and tid not in self.viewed:
            # summed where it lies, as DDP does with gradients: no copy
            shape, dtype = sig
            op = ("all_reduce_", tid, (tid,), 1, {"group": self._group(have.mesh),
                                                  "shape": tuple(shape), "dtype": dtype})
            for rank in have.mesh:
                self._emit(rank, op)
            self._record(tid, sig, want)
            return tid
        if tid in self._ahead and want == have.whole:  # gathered ahead for this op
            self._ahead.discard(tid)
            copy = self.copies[tid].pop(want)
            self._passing.append((copy, want.mesh))
            return copy
        copy = self.copies.get(tid, _NONE).get(want)
        if copy is None:
            # a constant made again where it is wanted (its recipe) moves no data
            remade = have.mesh != want.mesh and not self._asked and tid in self.recipes
            fallback = self.strict and not (self._asked or self._intended or remade or
                                            tid in self.gathered) and _fallback(have, want)
            if fallback:
                raise PlacementError(
                    f"strict placement: this op would {fallback} a tensor of shape "
                    f"{list(sig[0])} from {_name(have)} to {_name(want)}, which no signal asked "
                    "for (gtmpi.debug.explain() lists what was inserted where)")
            copy = self._convert(tid, sig, have, want)
            shape = tuple(sig[0])
            cut_to_partial = have.kind in ("R", "I") and want.kind == "P" and copy != tid
            if have.mesh == want.mesh and (cut_to_partial or _numel(want.local_shape(
                    shape, 0)) > _numel(have.local_shape(shape, 0))):
                # (a whole tensor taken as a partial sum is cut again at each use: its zeros
                # cost nothing to make, and kept they would outlive a replayed program)
                self._passing.append((copy, want.mesh))
            else:
                self.copies.setdefault(tid, {})[want] = copy
        return copy

    def _gather_ahead(self, name: str, read: dict[int, int]) -> None:
        """Op ``name`` reads the ZeRO-3 weights ``read`` whole (weight -> its gathered copy,
        emitted): gather ahead the weights that the op after it read last time (a training
        loop reads its weights in one order every step), keep this op's copy of any it reads
        too (the head's weight, read by its matmul and then by that matmul's gradient), and
        drop what was gathered ahead for this op but not read by it."""
        for tid in [t for t in self._ahead if t not in read]:
            self._ahead.discard(tid)
            where = self.placement(tid).whole
            self._free_on(where.mesh, self.copies[tid].pop(where))
        known = tuple(map(self._known, read))
        key = (name, known, self.recomputing > 0)
        if self._read_last is not None and self._read_last != key:
            self._read_next[self._read_last] = known
        self._read_last = key
        together: dict[tuple, list[tuple[int, tuple, Placement]]] = {}
        made: list[tuple[int, Placement, int]] = []  # (weight, its placement, its copy)
        for tid in self._read_next.get(key, ()):
            if type(tid) is tuple:  # a cast, made now if the weight changed since the last
                source = self.table.get(tid[0])
                if source is None:
                    continue
                tid = self._cast_of(tid[0], source[0], tid[1])
            entry = self.table.get(tid)
            if tid in self._ahead or tid not in self.gathered or entry is None:
                continue
            sig, have = entry
            if tid in read:  # kept: not freed once this op is sent
                copy = read[tid]
                self._passing.remove((copy, have.mesh))
            elif self.coalesce_gathers and have.kind == "S" and have.dim == 0 \
                    and len(set(have.sizes(tuple(sig[0])))) == 1:
                together.setdefault((have.mesh, sig[1]), []).append((tid, sig, have))
                continue
            else:
                copy = self._gather_ahead_one(tid, sig, have)
            made.append((tid, have, copy))
        for batch in together.values():
            copies = self._gather_many(batch) if len(batch) > 1 else \
                [self._gather_ahead_one(*batch[0])]
            made += [(tid, have, copy) for (tid, _, have), copy in zip(batch, copies)]
        for tid, have, copy in made:
            self.copies.setdefault(tid, {})[have.whole] = copy
            self._ahead.add(tid)

    def _gather_ahead_one(self, tid: int, sig: tuple, have: Placement) -> int:
        self._ahead_now = True
        try:
            return self._convert(tid, sig, have, have.whole)
        finally:
            self._ahead_now = False

    def _gather_many(self, batch: list[tuple[int, tuple, Placement]]) -> list[int]:
        """ZeRO-3 weights of one dtype, each in even pieces along dim 0 over one mesh,
        gathered whole ahead by one coalesced collective (not waited for: what reads a copy
        waits for it)."""
        mesh = batch[0][2].mesh
        tids = tuple(tid for tid, _, _ in batch)
        outs = tuple(self.new_temp() for _ in batch)
        pieces = tuple(have.local_shape(tuple(sig[0]), 0) for _, sig, have in batch)
        kw = {"group": self._group(mesh), "members": len(mesh), "shapes": pieces,
              "shape": (sum(map(_numel, pieces)),), "dtype": batch[0][1][1]}
        for rank in mesh:
            self._emit(rank, ("all_gather_many", outs, tids, (1 << len(tids)) - 1, kw))
        for tid, out in zip(tids, outs):
            self._agreed_as(tid, out, mesh)
        return list(outs)

    def _cast_weights(self, name: str, args: tuple, tmask: int, sigs: list,
                      kw: dict) -> tuple[tuple, list, dict]:
        """A linear's (or its gradient's) ZeRO-3 weight and bias read as their casts to the
        kernel's ``cast`` dtype (each made from the pieces where none is up to date), and the
        gradient kernel told the operands' own dtypes, which its gradients go back to."""
        to = kw["cast"]
        args, sigs = list(args), list(sigs)
        first = _CASTING[name]
        dtypes = tuple(sig[1] if tmask >> i & 1 else None for i, sig in
                       enumerate(sigs[first - 1:first + 2], first - 1))
        cast = False
        for i in (first, first + 1):
            if i < len(args) and tmask >> i & 1 and args[i] in self.gathered \
                    and sigs[i][1].is_floating_point and sigs[i][1].itemsize > to.itemsize:
                args[i] = self._cast_of(args[i], sigs[i], to)
                sigs[i] = (sigs[i][0], to)
                cast = True
        if cast and name == "linear_grad":
            kw = {**kw, "dtypes": dtypes}
        return tuple(args), sigs, kw

    def _cast_of(self, tid: int, sig: tuple, to: torch.dtype) -> int:
        """The id of ``tid``'s cast to ``to``: its pieces cast where they lie (no
        communication), itself a ZeRO-3 weight, made again after each update of ``tid``."""
        cid = self._casts.setdefault(tid, {}).get(to)
        if cid is None:
            cid = self._casts[tid][to] = self.new_temp()
            self._cast_source[cid] = (tid, sig, to)
            where = self.placement(tid)
            for rank in where.mesh:
                self._emit(rank, ("to", cid, (tid, to), 1, None))
            self._record(cid, (sig[0], to), where)
            self._agreed_as(tid, cid, where.mesh)
            self.gathered.add(cid)
        return cid

    def _drop_casts(self, tid: int) -> None:
        """``tid`` changed or is gone: its casts (and their gathered copies) are freed."""
        for cid in self._casts.pop(tid, {}).values():
            del self._cast_source[cid]
            for rank, gone in self._forget(cid):
                self._emit(rank, ("free", None, (gone,), 0, None))

    def _known(self, tid: int) -> Any:
        """How the gathers ahead name a weight from one step to the next: a cast as (its
        weight, its dtype), made anew after each update."""
        source = self._cast_source.get(tid)
        return tid if source is None else (source[0], source[2])

    def release(self) -> None:
        """Free the gathered copies made for the instructions sent so far."""
        for copy, mesh in self._passing:
            self._free_on(mesh, copy)
        self._passing.clear()

    def _free_on(self, mesh: tuple[int, ...], tid: int) -> None:
        """A copy the dispatcher made is no longer needed on any member of ``mesh``."""
        self._agreed.pop(tid, None)
        for rank in mesh:
            self._emit(rank, ("free", None, (tid,), 0, None))

    def _agreed_as(self, source: int, out: int, mesh: tuple[int, ...]) -> None:
        """``out``, a collective's result over ``mesh`` from ``source``, is agreed there if
        ``source`` was: its members failed all together or none did, so each member's result
        is poisoned alike (ZeRO's gathers of the updated pieces need no agreement each)."""
        if mesh in self._agreed.get(source, ()):
            self._agreed.setdefault(out, set()).add(mesh)

    def _convert(self, tid: int, sig: tuple, have: Placement, want: Placement) -> int:
        """A new id holding ``tid``'s value with placement ``want`` (instructions emitted)."""
        shape, dtype = sig
        recipe = self.recipes.get(tid)
        if have.mesh != want.mesh and recipe is not None and not self._asked:
            made = self._replay(recipe, want.mesh)  # made there: nothing is sent
            self.copies.setdefault(tid, {})[want.whole] = made
            return made if want == want.whole else self._convert(made, sig, want.whole, want)
        if have.mesh != want.mesh:
            whole = tid if have.kind == "R" else self._as(tid, sig, have.whole)
            self._start_plane()
            moved = self.new_temp()
            # the whole tensor is on every member of have.mesh: they share the sending
            receivers = [rank for rank in want.mesh if rank not in have.mesh]
            for rank in want.mesh:
                if rank in have.mesh:
                    self._emit(rank, ("alias", moved, (whole,), 1, None))
                    continue
                sender = have.mesh[receivers.index(rank) % len(have.mesh)]
                self._emit(sender, ("send", (), (whole,), 1,
                                    {"dst": rank, "shape": tuple(shape), "dtype": dtype}))
                self._emit(rank, ("recv", moved, (), 0,
                                  {"shape": tuple(shape), "dtype": dtype, "src": sender}))
            self.copies.setdefault(tid, {})[want.whole] = moved
            return moved if want == want.whole else self._convert(moved, sig, want.whole, want)
        if have.kind != "R" and want.kind != "R" and have.grid != want.grid:
            # laid out over other axes: whole first
            whole = self._as(tid, sig, have.whole)
            return whole if want == want.whole else self._convert(whole, sig, have.whole, want)
        grid = want.grid or have.grid
        axes = [_axis(have, a) for a in range(len(grid) or 1)]
        target = [_axis(want, a) for a in range(len(grid) or 1)]
        current = tid
        # gather and sum along axes first (while the other axes still hold their pieces), then cut
        for a in sorted(range(len(axes)), key=lambda a: axes[a][0] in "RI"):
            if axes[a] == target[a] or {axes[a][0], target[a][0]} == {"R", "I"}:
                axes[a] = target[a]
                continue
            if axes[a][0] == "V" or target[a][0] == "V":
                if (axes[a][0], target[a][0]) not in _RELABEL:
                    raise PlacementError("a varying (V) tensor has no global value: it can only "
                                         "be taken as a partial sum (P)")
                axes[a] = target[a]  # the same values per member, read another way
                continue
            free = all(axes[b] != ("S", target[a][1]) for b in range(len(axes)) if b != a)
            if axes[a][0] in "PS" and target[a][0] == "S" and free:
                # one step, the fewest bytes: reduce-scatter (P), all-to-all (S(i) -> S(j))
                before = make(want.mesh, grid, axes)
                axes[a] = target[a]
                current = self._step(tid, current, self._reshard_along(
                    current, sig, before, make(want.mesh, grid, axes), a), want.mesh)
            elif axes[a][0] not in "RI":
                current = self._step(tid, current, self._whole_along(
                    current, sig, make(want.mesh, grid, axes), a), want.mesh)
                axes[a] = ("R", 0)
        for a in range(len(axes)):
            if axes[a] != target[a]:
                axes[a] = target[a]
                current = self._step(tid, current, self._cut_along(
                    current, sig, make(want.mesh, grid, axes), a), want.mesh)
        return current

    def _step(self, source: int, before: int, after: int, mesh: tuple[int, ...]) -> int:
        """One step of a conversion done: the previous step's result, if made for it, is freed
        once the step that read it is sent."""
        if before != source:
            self._free_on(mesh, before)
        return after

    def _replay(self, recipe: tuple, mesh: tuple[int, ...]) -> int:
        """Each member of ``mesh`` makes a constant again from its recipe: the id it is under
        (what it was made from is freed once made)."""
        made: dict[int, int] = {}
        out = self._make(recipe, mesh, made)
        for tid in made.values():
            self._free_on(mesh, tid)
        return out

    def _make(self, recipe: tuple, mesh: tuple[int, ...], made: dict[int, int]) -> int:
        ins, operands, _ = recipe
        name, _, args, tmask, kw = ins
        wire = list(args)
        for i, r in zip([i for i in range(len(args)) if tmask >> i & 1], operands):
            if id(r) not in made:
                made[id(r)] = self._make(r, mesh, made)
            wire[i] = made[id(r)]
        out = self.new_temp()
        for rank in mesh:
            self._emit(rank, (name, out, tuple(wire), tmask, kw))
        return out

    def _whole_along(self, tid: int, sig: tuple, p: Placement, axis: int) -> int:
        """Sum (P) or gather (S) the pieces along one axis of the mesh, within each line."""
        shape, dtype = sig
        kind, dim = p.per_axis()[axis]
        out = self.new_temp()
        groups = self._groups_along(p, axis)
        sizes = p.sizes(tuple(shape), axis) if kind == "S" else ()
        # ahead: what reads it waits for it (pieces of one size along dim 0 gather into the
        # whole in place; others are cut out after, so they are waited for at once)
        ahead = {"ahead": True} if self._ahead_now and dim == 0 and len(set(sizes)) == 1 else {}
        for m, rank in enumerate(p.mesh):
            like = {"group": groups[m], "shape": p.local_shape(tuple(shape), m), "dtype": dtype}
            self._emit(rank, ("all_reduce", out, (tid,), 1, like) if kind == "P" else
                       ("all_gather", out, (tid,), 1, {**like, "dim": dim, "sizes": sizes,
                                                       **ahead}))
        self._agreed_as(tid, out, p.mesh)
        return out

    def _reshard_along(self, tid: int, sig: tuple, have: Placement, want: Placement,
                       axis: int) -> int:
        shape, dtype = sig
        (kind, dim), (_, to) = have.per_axis()[axis], want.per_axis()[axis]
        out = self.new_temp()
        groups = self._groups_along(have, axis)
        for m, rank in enumerate(have.mesh):
            like = {"group": groups[m], "index": have.coords(m)[axis],
                    "shape": have.local_shape(tuple(shape), m), "dtype": dtype}
            if kind == "P":
                op = ("reduce_scatter", out, (tid,), 1,
                      {**like, "dim": to, "sizes": want.sizes(tuple(shape), axis)})
            else:
                op = ("all_to_all", out, (tid,), 1,
                      {**like, "src": dim, "dst": to, "src_sizes": have.sizes(tuple(shape), axis),
                       "dst_sizes": want.sizes(tuple(shape), axis)})
            self._emit(rank, op)
        return out

    def _cut_along(self, tid: int, sig: tuple, p: Placement, axis: int) -> int:
        """Whole along ``axis`` -> its type in ``p``: each member keeps its piece (S), or the
        first member of each line keeps the value and the others zeros (P). No communication."""
        shape, dtype = sig
        kind, dim = p.per_axis()[axis]
        out = self.new_temp()
        for m, rank in enumerate(p.mesh):
            position = p.coords(m)[axis]
            if kind == "S":
                start, size = p.starts(tuple(shape), axis)[position], p.sizes(tuple(shape), axis)[position]
                self._emit(rank, ("piece", out, (tid, dim, start, size), 1, None))
            elif position == 0:
                self._emit(rank, ("alias", out, (tid,), 1, None))
            else:
                self._emit(rank, ("zeros", out, (p.local_shape(tuple(shape), m), dtype), 0, None))
        return out

    def _create(self, ins: tuple, sig: tuple, target: Placement) -> None:
        """Every member makes the whole tensor (random ones from the same seed, so the values
        are those of a one-worker run) and keeps its piece."""
        name, out, args, tmask, kw = ins
        varying = [a for a, (k, _) in enumerate(target.per_axis()) if k == "V"]
        for m, rank in enumerate(target.mesh):
            if varying and name in ("randn", "rand", "dropout_mask"):  # each its own draw
                position = sum(target.coords(m)[a] for a in varying) + 1
                ins = (name, out, (*args[:-1], (args[-1] * 1_000_003 + position) % (1 << 63)),
                       tmask, kw)
            self.d.enqueue(rank, ins, True)
        self._record(out, sig, target.whole)
        self.replace(out, sig, target)
        self._flush_touched()

    def _signal_target(self, sig: tuple) -> Placement:
        """Where a tensor made now goes: the innermost signal's placement, else home."""
        if not self.signals:
            return self.home
        target, where = self.signals[-1]
        return fit(target, sig, where)

    def _mesh(self, kinds: list[Placement | None]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Where an op runs (ranks, axis sizes): the active signal's mesh, else that of its
        widest operand."""
        if self.signals:
            p = self.signals[-1][0]
        else:
            # the widest; among those, one in pieces (a replicated operand fits any layout)
            p = max((p for p in kinds if p is not None),
                    key=lambda p: (len(p.mesh), p.kind != "R"), default=self.home)
        return p.mesh, p.grid

    def _record(self, tid: int, sig: tuple, p: Placement) -> None:
        if self.journal is not None:
            self.journal.append(tid)
        if p == self.home:
            self.table.pop(tid, None)
        else:
            self.table[tid] = (sig, p)
            self.active = True
            self.placed += 1

    def _changed(self, tid: int) -> None:
        """An in-place op changed ``tid``: its copies are stale, its recipe too."""
        self.recipes.pop(tid, None)
        self._ahead.discard(tid)
        self._drop_casts(tid)
        if tid in self.gathered and self._read_last is not None:
            # an update between two reads (the step between two passes): what was read before
            # it foretells nothing that would still hold after it
            self._read_next.pop(self._read_last, None)
            self._read_last = None
        for where, copy in self.copies.pop(tid, _NONE).items():
            self._free_on(where.mesh, copy)

    def _forget(self, tid: int) -> list[tuple[int, int]]:
        """(rank, id) of ``tid`` and its copies everywhere, dropped from the books."""
        if self.journal is not None:
            self.journal.append(tid)
        entry = self.table.pop(tid, None)
        self._drop_casts(tid)
        self.viewed.discard(tid)
        self.gathered.discard(tid)
        self._ahead.discard(tid)
        self._agreed.pop(tid, None)
        self.recipes.pop(tid, None)
        self.forward.pop(tid, None)
        mesh = entry[1].mesh if entry is not None else self.home.mesh
        held = [(rank, tid) for rank in mesh]
        for where, copy in self.copies.pop(tid, _NONE).items():
            held += [(rank, copy) for rank in where.mesh]
        return held

    # the books of one tensor, and of the placer, as a foreseen run reads and sets them
    # (dispatcher/foresight.py) ----------------------------------------------------------------

    def books(self, tid: int) -> tuple:
        """What the placer knows of ``tid``: (its table entry, its copies by placement, its
        recipe, whether it may be viewed, the meshes that agreed on it, its forward plan)."""
        copies = self.copies.get(tid)
        agreed = self._agreed.get(tid)
        return (self.table.get(tid), dict(copies) if copies else None, self.recipes.get(tid),
                tid in self.viewed, frozenset(agreed) if agreed else None, self.forward.get(tid))

    def set_book(self, field: int, tid: int, value: Any) -> None:
        """One of ``tid``'s books (``field``: its place in what ``books()`` gives) set to
        ``value`` (None: dropped)."""
        if field == 3:
            if value:
                self.viewed.add(tid)
            else:
                self.viewed.discard(tid)
            return
        book = (self.table, self.copies, self.recipes, None, self._agreed, self.forward)[field]
        if value is None:
            book.pop(tid, None)
        else:
            book[tid] = set(value) if field == 4 else value

    def bucket_state(self) -> list[tuple]:
        """The gradients waiting to be summed: (key, bytes, ((id, sig), ...)) per bucket."""
        return [(key, size[0], tuple(members)) for key, (size, members) in self._buckets.items()]

    def set_buckets(self, state: list[tuple]) -> None:
        self._buckets = {key: ([size], list(members)) for key, size, members in state}

    def settings(self) -> tuple:
        """What else places an instruction: the mode, the overlap settings, the groups made."""
        return (self.strict, self.overlap, self.chunks, len(self._groups), self._plane_started,
                len(self._passing))

    def _groups_along(self, p: Placement, axis: int) -> list[int]:
        """Each member's group along ``axis``, every one made before any member is given a
        collective in it. NCCL makes a group with all workers (it splits the world's
        communicator), and a communicator's first collective waits for all its members: a
        group made between one line's collectives would have each side wait for the other."""
        return [self._group(p.along(axis, m)) for m in range(len(p.mesh))]

    def _group(self, mesh: tuple[int, ...]) -> int:
        """The data-plane group of a mesh, made on every worker the first time."""
        gid = self._groups.get(mesh)
        if gid is not None:
            return gid
        self._start_plane()
        gid = len(self._groups) + 1
        self._groups[mesh] = gid
        self.d.post("new_group", (gid, mesh), sorted(self.d.links))
        return gid

    def _start_plane(self) -> None:
        """torch.distributed among the workers, once: NCCL where each has a GPU of its own."""
        if self._plane_started:
            return
        self._plane_started = True
        workers = sorted(self.d.links)
        devices = [self.d.devices[r] for r in workers]
        own_gpus = all(d.startswith("cuda") for d in devices) and len(set(devices)) == len(devices)
        self.d.post("dist_init", ("nccl" if own_gpus else "gloo",), workers)

    def _emit(self, rank: int, ins: tuple) -> None:
        """An instruction the program did not write (flagged so in traces). A receive waits
        in the dispatcher until an instruction uses it (Dispatcher.defer)."""
        if ins[0] == "recv":
            self.d.defer(rank, ins)
        else:
            self.d.enqueue(rank, ins, True)
        if ins[0] in _COMM and ins[0] != "recv":  # a transfer counts once, at its sender
            self._touched.add(rank)
            oid = ins[1] if type(ins[1]) is int else -1
            self._inserted(rank, ins[0], oid, ins[4]["shape"], ins[4]["dtype"])
        elif self.d.trace is not None:
            t = time.perf_counter_ns()
            self.d.trace.event(Kind.DISPATCH, Lane.DISPATCHER, t, t, ins[0],
                               ins[1] if type(ins[1]) is int else -1, rank, flags=Flag.INSERTED)

    def _inserted(self, rank: int, kind: str, oid: int, shape: tuple, dtype: torch.dtype) -> None:
        """A collective or transfer the program did not write, counted for explain() and
        traced with the program's line that caused it."""
        nbytes = _numel(shape) * dtype.itemsize
        entry = self.inserted.setdefault((self.site(), kind, self._asked > 0), [0, 0])
        entry[0] += 1
        entry[1] += nbytes
        rec = self.d.trace
        if rec is not None:
            t = time.perf_counter_ns()
            rec.event(Kind.DISPATCH, Lane.DISPATCHER, t, t, kind, oid, rank, nbytes,
                      flags=Flag.INSERTED,
                      detail=f"{'asked' if self._asked else 'inserted'} {self.site()}")

    def _flush_touched(self) -> None:
        """Every member of a collective gets it now: one of them waiting in it while another's
        copy sits in an unsent batch would wait forever."""
        for rank in sorted(self._touched):
            self.d.flush(rank)
        self._touched.clear()


def fit(target: Placement, sig: tuple, where: str) -> Placement:
    """A signal's placement for a tensor of this shape: each axis's dim counted from the end
    if negative, and within the tensor's dims. On one worker every kind is the whole tensor,
    but its axes are checked all the same: a config tried on one machine must fail there, not
    first on the cluster."""
    ndim = len(sig[0])
    axes = []
    for kind, dim in target.per_axis():
        if kind == "S":
            if not -ndim <= dim < ndim:
                raise ConfigError(f"{where}: axis {dim} is out of range for a tensor of shape "
                                  f"{list(sig[0])}")
            dim %= ndim
        axes.append((kind, dim))
    if len(target.mesh) == 1:
        return Placement(target.mesh, "R")
    return make(target.mesh, target.grid, axes)


def _fallback(have: Placement, want: Placement) -> str | None:
    """What a conversion does that only a signal should ask for: gather pieces, trade them
    (S(i) -> S(j)), or move a tensor to other workers. Summing partial sums and cutting
    pieces out of a whole are the math of a placement, never a fallback."""
    if have.mesh != want.mesh:
        return "move"
    for a in range(max(len(have.grid), len(want.grid), 1)):
        (hk, hd), (wk, wd) = _kind_along(have, a), _kind_along(want, a)
        if hk == "S" and wk in "RI":
            return "gather"
        if hk == "S" and wk == "S" and hd != wd:
            return "re-split"
    return None


def _kind_along(p: Placement, axis: int) -> tuple[str, int]:
    axes = p.per_axis() if p.grid or p.kind != "R" else []
    return axes[axis] if axis < len(axes) else (("R", 0) if not p.grid else axes[-1])


def _name(p: Placement) -> str:
    kinds = ",".join(f"S({d})" if k == "S" else k for k, d in p.per_axis())
    return f"{kinds} on workers {list(p.mesh)}"


PLANS_CACHED = 1 << 14
BUCKET_BYTES = 25 << 20  # DDP's default bucket size
_NONE: dict = {}  # no copies (never written)
RECIPE_DEPTH = 16  # the longest chain of ops made again rather than sent


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _axis(p: Placement, axis: int) -> tuple[str, int]:
    """One axis's (kind, dim); a replicated placement is R along every axis."""
    return p.per_axis()[axis] if p.grid or p.kind != "R" else ("R", 0)
