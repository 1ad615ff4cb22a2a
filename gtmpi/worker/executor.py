"""Runs placed instructions with torch on one device.

An instruction is a 5-tuple ``(name, out, args, tmask, kw)``:
  name   an op of ops.table.OPS, or a control word (upload, read, free, sync, stats, program,
         replay, rename, ...)
  out    the result id, or a tuple of ids for ops that return several tensors
  args   positional operands; bit i of ``tmask`` set means args[i] is a tensor id
  kw     keyword constants or None
Plain ints and a bitmask keep a batch of thousands of instructions cheap to pickle.

A failing op poisons its result ids with a Fault instead of stopping the stream; every op
that consumes a poisoned id is skipped and passes the same Fault on, so the error surfaces
at the first read of any dependent tensor, and unrelated work carries on. An in-place op is
the exception: one with a poisoned operand (or one that fails) is skipped and leaves its target
as it was, so a bad batch never destroys the weights or the optimizer state; its Fault is
reported once, at the next read or sync, unless a read of a dependent tensor reported it first.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Protocol

import numpy as np
import torch

from .devicequery import DeviceQueries
from ..errors import Fault
from ..transport.mpi import ClientGone
from ..ops.table import OPS, Kind, row_pieces
from ..recording import events
from ..recording.recorder import Recorder
from . import bounds, compiled as compiling, graphs
from .control import WAITING, Control, cuda_event
from .profiler import KernelProfiler, MemoryHistory
from .programs import Programs
from .quota import Quota
from ..ops import settings


class HostLink(Protocol):
    """The worker's side of its conversation with rank 0 (MPI or in-process)."""

    def recv_upload(self, buf: np.ndarray) -> None: ...
    def send_read(self, data: np.ndarray) -> None: ...
    def send_read_fault(self, fault: Fault) -> None: ...
    def reply(self, tag: int, obj: Any) -> None: ...
    def reply_later(self, tag: int, obj: Any) -> None: ...
    def clock_pongs(self, rounds: int) -> None: ...


class Executor(Programs, Control, Quota):
    """Runs batches of instructions: the ops of the table here, control words in
    worker/control.py, recorded programs and their graphs in worker/programs.py, a server's
    client's quota in worker/quota.py."""

    def __init__(self, rank: int, device: torch.device, link: HostLink):
        self.rank = rank
        self.device = device
        self.link = link
        self.env: dict[int, torch.Tensor] = {}
        self.poison: dict[int, Fault] = {}
        self.skipped: Fault | None = None  # the first in-place op left undone, not yet reported
        # ops: instructions executed; control: those of them that are control words (frees,
        # reads, stats, ...), not ops of the table
        self.stats = {"ops": 0, "control": 0, "batches": 0, "faults": 0, "skipped": 0,
                      "bytes_received": 0, "bytes_sent": 0, "graph_launches": 0,
                      "graphed_ops": 0, "graph_fallbacks": 0, "graph_input_bytes": 0, "graph_copies": 0,
                      "graph_fallback_reasons": {}, "compiles": 0, "compile_refusals": 0,
                      "sized_compiled": 0, "sized_unfit": 0, "exec_ns": 0, "wait_ns": 0}
        # sized_compiled, sized_unfit: a growing program's replays run compiled, and run op
        # by op where the compiled program's guards did not hold; exec_ns: host time in
        # batches; wait_ns: the part of it in reads and syncs, which wait for the device;
        # graph_input_bytes: the buffers graphs copy their inputs into; graph_copies: outputs
        # of graphs still held, copied out of a launch's way (or aside)
        # pinned buffers a large upload passes through on its way to the GPU, and each one's
        # event of its last copy out (worker/control.py, made at the first such upload)
        self.staging: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._control = {"upload": self._upload, "read": self._read, "free": self._free,
                         "sync": self._sync, "stats": self._stats, "clock": self._clock,
                         "trace": self._trace, "dist_init": self._dist_init,
                         "new_group": self._new_group, "agree": self._agree,
                         "program": self._program, "replay": self._replay,
                         "commit": self._commit, "rename": self._rename,
                         "backend": lambda out, args: settings.apply(*args),
                         "warm_compile": self._warm_compile,
                         "serving": self._serving, "monitor": self._monitor,
                         "device": DeviceQueries(device, link.reply).run}
        # what a server's client may send: every op but those naming a file on the server's
        # host, and the control words but the server's
        self.client_words = frozenset(name for name, op in OPS.items() if not op.host_files) | \
            (frozenset(self._control) - {"serving", "monitor"})
        # what a monitor is sent: this worker's executors by slot (worker/loop.py sets it)
        self.executors: dict[int, "Executor"] = {0: self}
        self._pusher = None
        self.client_quota: int | None = None  # under a server: bytes each client may hold
        self.quota: int | None = None  # this executor's, if it is a client's under a quota
        self.slot = 0  # a server's client's slot (worker/loop.py), 0 for an ordinary session
        # a GPU worker's ops' indices checked on the device (worker/bounds.py)
        self.index_guard: bounds.IndexGuard | None = \
            bounds.IndexGuard(device) if bounds.everywhere(device) else None
        self.plane = None  # the worker's DataPlane (worker.dataplane), under MPI
        # what traces are stamped with: a dry run's worker keeps a modeled clock instead
        self.now: Callable[[], int] = time.perf_counter_ns
        self._inject = {Kind.CREATE: {"device": device}}  # keyword arguments by kind of op
        self.trace: Recorder | None = None  # while a trace runs
        self._gpu_every = 0  # while tracing on a GPU: time every this many ops with CUDA events
        self._gpu_countdown = 1
        # ids whose values an unfinished collective is still making: id -> (its work, all the
        # ids it makes); whatever reads one waits for it first (on a GPU: the stream waits)
        self.waits: dict[int, tuple[Any, tuple[int, ...]]] = {}
        # recorded instruction sequences (dispatcher/programs.py), run again on one word each,
        # where their random ops keep their seeds, and their CUDA graphs (worker/graphs.py)
        self.programs: dict[int, list[tuple]] = {}
        self.seeded: dict[int, list] = {}
        self.sized: dict[int, list[int]] = {}  # where a program's sizes follow its call's
        self.knobbed: dict[int, list] = {}  # where a program holds Knobs (ops/table.py)
        # a growing program's inputs' (sizes, strides) at its last replay run op by op, with
        # that size (worker/compiled.py: growth), and the program compiled for every size
        self.grown: dict[int, tuple[int, dict[int, tuple]]] = {}
        self.dynamic: dict[int, compiling.Compiled] = {}
        # a growing program's instructions at each size it ran at (a decoding loop's sizes
        # come again each sample): made once, not per call
        self.at_size: dict[tuple[int, int], list[tuple]] = {}
        self.graphs = graphs.Kept(os.environ.get("GTMPI_GRAPH_SAVED_ASIDE", "1") != "0")
        self._capture: tuple | None = None  # a capture waiting for the dispatcher's commit
        self._cuda_backend: graphs.CudaBackend | str | None = None  # made at the first capture
        self._warming = compiling.warm_up(device)  # GTMPI_COMPILE's first-use costs, meanwhile
        self._warm_started = self._warming is not None
        self.profiler = KernelProfiler.from_env(rank, device)  # GTMPI_PROFILE (worker/profiler.py)
        self.memory_history = MemoryHistory.from_env(rank, device)  # GTMPI_MEMORY_HISTORY
        # GPU: what a replayed call made -> (an event recorded after the call, the tensor). A
        # read of one (a loss read a step or two later) waits for that event on a stream of
        # its own rather than for all the GPU was given since: this host is then free to
        # launch the next step before the GPU runs dry. An in-place write drops the entry.
        self.ready: dict[int, tuple[Any, torch.Tensor]] = {}
        self._read_stream = None
        # when the batch running now started (the monitor counts it busy as it goes: counted
        # only at its end, a long batch read as more than 100% of the second it ended in)
        self.batch_start: int | None = None

    def run(self, batch: list[tuple]) -> None:
        start = self.batch_start = time.perf_counter_ns()
        if self.profiler is not None:
            self.profiler.saw(batch)
        try:
            if self.quota is None:
                self._execute(batch)
            else:
                self._execute_within(batch, self.quota)
        finally:
            self.stats["exec_ns"] += time.perf_counter_ns() - start
            self.batch_start = None
        rec = self.trace
        if rec is not None:
            rec.marks.append((self.now(), None, None))
            rec.compact()
        self.stats["batches"] += 1

    def _execute(self, batch: list[tuple]) -> None:
        env, poison, rec = self.env, self.poison, self.trace
        marks = rec.marks if rec is not None else None
        gpu_every = self._gpu_every if rec is not None else 0
        countdown = self._gpu_countdown
        stats, waits, ready, injects = self.stats, self.waits, self.ready, self._inject
        guard = self.index_guard
        now = self.now
        counted = 0  # ops run since stats["ops"] was brought up to date
        try:
            for ins in batch:
                counted += 1
                name, out, args, tmask, kw = ins
                if marks is not None:
                    marks.append((now(), name, out))
                op = OPS.get(name)
                if op is None:
                    stats["ops"] += counted  # a stats word in the batch sees every op before it
                    counted = 0
                    stats["control"] += 1
                    if name in WAITING:
                        began = time.perf_counter_ns()
                        self._control[name](out, args)
                        stats["wait_ns"] += time.perf_counter_ns() - began
                    else:
                        self._control[name](out, args)
                    continue
                if poison and tmask and self._propagate(name, op.kind, out, args, tmask):
                    if op.kind is Kind.COMM or (kw is not None and "partial" in kw):
                        self._stand_in(op, kw)
                    continue
                try:
                    if tmask:
                        if waits:
                            self._settle(args, tmask)
                        args = (env[args[0]],) + args[1:] if tmask == 1 else \
                            [env[a] if tmask >> i & 1 else a for i, a in enumerate(args)]
                    inject = injects.get(op.kind)
                    if inject is not None:
                        kw = {**kw, **inject} if kw else inject
                    elif kw is not None and "group" in kw:  # a vocabulary-parallel fused kernel
                        kw = {**kw, "plane": self.plane}
                    if guard is not None and op.indices is not None:
                        args = guard.check(op, args, kw or {},
                                           out if type(out) is int else (out or (-1,))[0])
                    start = None
                    if gpu_every:
                        countdown -= 1
                        if not countdown:
                            countdown = gpu_every
                            start = cuda_event()
                    res = op.kernel(*args, **kw) if kw else op.kernel(*args)
                    if start is not None:
                        rec.gpu_timed(start, cuda_event())
                except ClientGone:  # not the op's failure: its client's, which the server drops
                    raise
                except Exception as e:  # the op's own failure (bad index, out of memory, ...)
                    fault = self._fault(out if type(out) is int else (out or (-1,))[0], name, e)
                    if op.kind is Kind.INPLACE:
                        self._skip(name, fault)
                    else:
                        self._fail(out, fault)
                    continue
                if type(out) is int:
                    env[out] = res
                else:
                    env.update(zip(out, res))
                if ready and (op.kind is Kind.INPLACE or op.kind is Kind.COMM):
                    self._written(res)
                if kw is not None and "plane" in kw:  # a collective, or a kernel that ran one
                    work = self.plane.take_work()
                    if work is not None:
                        ids = (out,) if type(out) is int else out
                        waits.update((o, (work, ids)) for o in ids)
                    if rec is not None and op.kind is Kind.COMM:
                        self._note_comm(name, args, kw, res)
                    elif rec is not None and "partial" in kw:
                        shape, dtype = kw["partial"]
                        pieces = kw.get("chunks", 1)
                        rec.annotate(nbytes=math.prod(shape) * dtype.itemsize,
                                     detail=f"all_reduce in group {kw['group']} beside the kernel"
                                     + (f", in {pieces} pieces" if pieces > 1 else ""))
        finally:
            stats["ops"] += counted
        if marks is not None:
            self._gpu_countdown = countdown

    def _written(self, res) -> None:
        """An op wrote ``res`` in place: what shares its memory is no longer final where its
        event says."""
        written = {t.untyped_storage().data_ptr() for t in
                   (res if isinstance(res, (tuple, list)) else (res,))
                   if isinstance(t, torch.Tensor)}
        for i, (_, t) in list(self.ready.items()):
            if t.untyped_storage().data_ptr() in written:
                del self.ready[i]

    def _stand_in(self, op, kw: dict) -> None:
        """An operand of a collective failed here: take part with zeros all the same (the
        other members would wait forever), keeping the result poisoned."""
        if op.kind is not Kind.COMM:  # a kernel's own all-reduces of a partial sum's pieces
            shape, dtype = kw["partial"]
            zeros = torch.zeros(shape, dtype=dtype, device=self.device).view(-1, shape[-1])
            for piece in row_pieces(zeros.shape[0], kw.get("chunks", 1)):
                self.plane.all_reduce_async(zeros[piece], kw["group"])
        else:
            shapes = kw.get("shapes") or (kw["shape"],)  # this member's pieces
            zeros = [torch.zeros(list(s), dtype=kw["dtype"], device=self.device) for s in shapes]
            op.kernel(*zeros, **kw, plane=self.plane)
        work = self.plane.take_work()
        if work is not None:
            work.wait()

    def _settle(self, args: tuple, tmask: int) -> None:
        """Operands still being made by a collective: wait for it."""
        for i, a in enumerate(args):
            if tmask >> i & 1 and a in self.waits:
                work, ids = self.waits[a]
                work.wait()
                for o in ids:
                    self.waits.pop(o, None)

    def _settle_all(self) -> None:
        for work, _ in {id(w[0]): w for w in self.waits.values()}.values():
            work.wait()
        self.waits.clear()

    def _note_comm(self, name: str, args: list, kw: dict, res: Any) -> None:
        """A collective's bytes and group, a transfer's bytes and peer, for the trace. A
        collective's bytes are what this member puts in (an all-gather's piece, a
        reduce-scatter's whole operands), as the dispatcher counts them (comms)."""
        if name in ("send", "recv"):
            moved = (res,) if isinstance(res, torch.Tensor) else (args[0],)  # a send gives ()
        else:
            moved = [a for a in args if isinstance(a, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in moved)
        if name in ("send", "recv"):
            self.trace.annotate(nbytes=nbytes, peer=kw["dst" if name == "send" else "src"])
        else:
            self.trace.annotate(nbytes=nbytes, detail=f"group {kw['group']}")

    def _propagate(self, name: str, kind: Kind, out, args, tmask) -> bool:
        for i, a in enumerate(args):
            if tmask >> i & 1 and a in self.poison:
                if kind is Kind.INPLACE and out not in self.poison:
                    self._skip(name, self.poison[a])
                else:
                    self._fail(out, self.poison[a])
                return True
        return False

    def _skip(self, name: str, fault: Fault) -> None:
        """An in-place op is left undone: its target keeps its values, and the Fault waits for
        the next read or sync."""
        self.stats["skipped"] += 1
        if self.skipped is None:
            self.skipped = fault._replace(skipped=name)
        if self.trace is not None:
            self.trace.annotate(flags=events.Flag.FAULT, detail=f"skipped {name}: {fault.error}")

    def take_skipped(self, reported: Fault | None = None) -> Fault | None:
        """The skipped op's Fault, to report now, once. While another Fault is being reported
        (``reported``, a dependent tensor's), none: that one is dropped if it has the same
        origin, else kept for the next read or sync."""
        skipped = self.skipped
        if reported is None or (skipped is not None and reported[:3] == skipped[:3]):
            self.skipped = None
        return None if reported is not None else skipped

    def _fault(self, tensor_id: int, op: str, e: Exception) -> Fault:
        return Fault(tensor_id, op, self.rank, f"{type(e).__name__}: {e}")

    def _fail(self, out, fault: Fault) -> None:
        outs = (out,) if type(out) is int else out
        # counted where it failed: not again for each op that read what failed
        if fault.tensor_id in outs and fault.rank == self.rank:
            self.stats["faults"] += 1
        if self.trace is not None:
            self.trace.annotate(flags=events.Flag.FAULT, detail=f"{fault.op}: {fault.error}")
        for o in outs:
            self.env.pop(o, None)
            self.poison[o] = fault

    def close(self) -> None:
        """Graphs go before the process groups their collectives were captured on; the monitor's
        pushing thread before anything it reads."""
        if self._pusher is not None:
            self._pusher.stop()
            self._pusher = None
        if self.profiler is not None:
            self.profiler.close()
        self.graphs.clear()
        self._capture = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.memory_history is not None:
            self.memory_history.close()
            self.memory_history = None

