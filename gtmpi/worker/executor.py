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
import resource
import sys
import time
from typing import Any, Callable, Protocol

import numpy as np
import torch

from .devicequery import DeviceQueries
from ..errors import Fault
from ..transport.buffers import as_bytes
from ..transport.mpi import ClientGone
from ..ops.table import OPS, Graph, Kind, derive_seed, row_pieces
from ..recording import events
from ..recording.recorder import Recorder
from ..transport.tags import GRAPH_LATER, Tag
from . import bounds, graphs
from .profiler import KernelProfiler, MemoryHistory
from ..ops import settings

_ABSENT = object()


def _cuda_event() -> torch.cuda.Event:
    """A timing event recorded now on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class HostLink(Protocol):
    """The worker's side of its conversation with rank 0 (MPI or in-process)."""

    def recv_upload(self, buf: np.ndarray) -> None: ...
    def send_read(self, data: np.ndarray) -> None: ...
    def send_read_fault(self, fault: Fault) -> None: ...
    def reply(self, tag: int, obj: Any) -> None: ...
    def reply_later(self, tag: int, obj: Any) -> None: ...
    def clock_pongs(self, rounds: int) -> None: ...


class Executor:
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
                      "graph_fallback_reasons": {},
                      "exec_ns": 0, "wait_ns": 0}
        # exec_ns: host time in batches; wait_ns: the part of it in reads and syncs, which wait
        # for the device; graph_input_bytes: the buffers graphs copy their inputs into;
        # graph_copies: outputs of graphs still held, copied out of a launch's way (or aside)
        self._control = {"upload": self._upload, "read": self._read, "free": self._free,
                         "sync": self._sync, "stats": self._stats, "clock": self._clock,
                         "trace": self._trace, "dist_init": self._dist_init,
                         "new_group": self._new_group, "agree": self._agree,
                         "program": self._program, "replay": self._replay,
                         "commit": self._commit, "rename": self._rename,
                         "backend": lambda out, args: settings.apply(*args),
                         "serving": self._serving, "monitor": self._monitor,
                         "device": DeviceQueries(device, link.reply).run}
        # what a server's client may send: every op, and the control words but the server's
        self.client_words = frozenset(OPS) | (frozenset(self._control) - {"serving", "monitor"})
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
        self.graphs = graphs.Kept(os.environ.get("GTMPI_GRAPH_SAVED_ASIDE", "1") != "0")
        self._capture: tuple | None = None  # a capture waiting for the dispatcher's commit
        self._cuda_backend: graphs.CudaBackend | str | None = None  # made at the first capture
        self.profiler = KernelProfiler.from_env(rank, device)  # GTMPI_PROFILE (worker/profiler.py)
        self.memory_history = MemoryHistory.from_env(rank, device)  # GTMPI_MEMORY_HISTORY
        # GPU: what a replayed call made -> (an event recorded after the call, the tensor). A
        # read of one (a loss read a step or two later) waits for that event on a stream of
        # its own rather than for all the GPU was given since: this host is then free to
        # launch the next step before the GPU runs dry. An in-place write drops the entry.
        self.ready: dict[int, tuple[Any, torch.Tensor]] = {}
        self._read_stream = None

    def run(self, batch: list[tuple]) -> None:
        start = time.perf_counter_ns()
        if self.quota is None:
            self._execute(batch)
        else:
            self._execute_within(batch, self.quota)
        self.stats["exec_ns"] += time.perf_counter_ns() - start
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
                    if name in _WAITING:
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
                            start = _cuda_event()
                    res = op.kernel(*args, **kw) if kw else op.kernel(*args)
                    if start is not None:
                        rec.gpu_timed(start, _cuda_event())
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
        """A collective's bytes and group, a transfer's bytes and peer, for the trace."""
        moved = (res,) if isinstance(res, torch.Tensor) else res or (args[0],)  # a send: ()
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
        self.stats["faults"] += 1
        if self.trace is not None:
            self.trace.annotate(flags=events.Flag.FAULT, detail=f"{fault.op}: {fault.error}")
        for o in ((out,) if type(out) is int else out):
            self.env.pop(o, None)
            self.poison[o] = fault

    # control words ------------------------------------------------------------------------

    def _upload(self, out: int, args: tuple) -> None:
        shape, dtype = args
        gpu = self.device.type == "cuda"
        # pinned, so that the copy joins the stream without waiting for it: a copy from
        # pageable memory holds this host until the GPU has finished all it was given, and
        # the next step's graph is launched only after it (the GPU idles meanwhile). torch's
        # pinned-memory cache keeps the buffer until the copy is done.
        host = torch.empty(shape, dtype=dtype, pin_memory=gpu)
        self.link.recv_upload(as_bytes(host))
        self.stats["bytes_received"] += host.nbytes
        if self.trace is not None:
            self.trace.annotate(nbytes=host.nbytes, peer=0)
        self.env[out] = host if self.device.type == "cpu" else \
            host.to(self.device, non_blocking=gpu)

    def _read(self, out, args: tuple) -> None:
        (tid,) = args
        if self.waits:
            self._settle(args, 1)
        # on a GPU, what the value waits for (the point it was made at, not the whole queue)
        made = self.ready.get(tid)
        event = made[0] if made is not None and made[1] is self.env.get(tid) else None
        fault = self.poison.get(tid) or self._index_fault(tid, event)
        skipped = self.take_skipped(fault)
        if fault is not None or skipped is not None:
            self.link.send_read_fault(fault or skipped)
            return
        try:  # on a GPU this waits for the work, so asynchronous device errors surface here
            t = self.env[tid]
            if t.device.type == "meta":  # a dry run: no values anywhere
                _say_once("gtmpi: dry run: a value was read; it is zeros (the workers are "
                          "simulated, no data exists)")
                t = torch.zeros(t.shape, dtype=t.dtype)
            host = self._read_after(t, event) if event is not None else t.contiguous().cpu()
        except Exception as e:
            self.link.send_read_fault(self._fault(tid, "read", e))
            return
        self.stats["bytes_sent"] += host.nbytes
        self.link.send_read(as_bytes(host))
        if self.trace is not None:
            self.trace.annotate(nbytes=host.nbytes, peer=0, id=tid)

    def _reader(self) -> Any:
        """The stream reads copy on, beside the work still queued."""
        if self._read_stream is None:
            self._read_stream = torch.cuda.Stream(self.device)
        return self._read_stream

    def _read_after(self, t: torch.Tensor, event: Any) -> torch.Tensor:
        """``t`` copied to the host once ``event`` has passed, on a stream of its own."""
        stream = self._reader()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            host.copy_(t, non_blocking=True)
        stream.synchronize()
        return host

    def _note_ready(self, ids) -> None:
        """What ``ids`` hold now is final once the GPU gets past this point."""
        event = torch.cuda.Event()
        event.record()
        env = self.env
        for i in ids:
            t = env.get(i)
            if isinstance(t, torch.Tensor):  # not an autograd record a replay handed out
                self.ready[i] = (event, t)

    def _free(self, out, ids: tuple) -> None:
        env, poison = self.env, self.poison
        for i in ids:
            if env.pop(i, None) is None:
                poison.pop(i, None)
            self.waits.pop(i, None)  # what the collective writes is kept alive by its work
            if self.ready:
                self.ready.pop(i, None)
        if self.trace is not None:
            self.trace.annotate(count=len(ids))

    def _program(self, out, args: tuple) -> None:
        """(key, instructions): keep a recorded sequence; (key, None): drop it."""
        key, instructions = args
        self.graphs.pop(key)
        if instructions is None:
            self.programs.pop(key, None)
            self.seeded.pop(key, None)
        else:
            self.programs[key] = instructions
            self.seeded[key] = graphs.seeded(instructions)

    def _replay(self, out, args: tuple) -> None:
        """(key, binds, renames, mode, seeds): run a kept sequence again. Its inputs are bound
        to the ids it was recorded with, (current, recorded) in ``binds``, for the run only;
        every tensor it makes keeps its recorded id, and those that outlive it move to fresh
        ids (``renames``), so that the next run cannot overwrite what the program still holds.
        Its random ops take seeds derived from ``seeds`` (session seed, count before the call).
        ``mode``: 'plain', op by op; 'capture', capture it as a CUDA graph and say whether that
        worked (the dispatcher's 'commit' then runs it); 'emulate', the same with the stand-in
        backend (tests); 'graph', launch the graph."""
        key, binds, renames, mode, seeds = args
        if self.profiler is not None:
            self.profiler.replay()
        start = self.now()
        if mode == "graph":
            if self._launch(self.graphs[key], binds, renames, seeds) is not None:
                self._run_program(self._instructions(key, seeds), binds, renames)
        elif mode == "emulate":
            self._try_capture(key, binds, renames, seeds, graphs.EmulatedBackend())
        elif mode == "capture":
            if self._cuda_backend is None:
                alone = self.plane is None or self.plane.workers == 1
                self._cuda_backend = graphs.cuda_backend(self.device, shared=alone)
            self._try_capture(key, binds, renames, seeds, self._cuda_backend)
        else:
            self._run_program(self._instructions(key, seeds), binds, renames)
        if self.device.type == "cuda" and mode != "capture":
            self._note_ready(new for _, new in renames)
        if self.trace is not None:
            self.trace.event(events.Kind.REPLAY, events.Lane.WORKER, start, self.now(), mode,
                             key, count=len(self.programs[key]))

    def _instructions(self, key: int, seeds: tuple[int, int] | None) -> list[tuple]:
        program, where = self.programs[key], self.seeded[key]
        if not where:
            return program
        session, base = seeds
        return graphs.with_seeds(program, where, lambda s: derive_seed(session, base + s.offset))

    def _run_program(self, program: list[tuple], binds: tuple, renames: tuple) -> None:
        # a recorded input may still be alive (a batch used again): it is itself again after
        saved = self._saved(recorded for _, recorded in binds)
        self._move(binds, keep=True)
        self._execute(program)
        self._restore(saved)
        self._move(renames, keep=False)

    def _by_id(self) -> tuple[dict, ...]:
        """Every table that says what an id is here: its value, its fault, the collective still
        making it, the GPU event it is final at. Moving, saving and restoring an id touch them
        all (a run that restored the value but not the event kept a bound input alive through
        its event: an iteration's activations, for good)."""
        return self.env, self.poison, self.waits, self.ready

    def _saved(self, ids) -> list:
        """What ``ids`` are now, for _restore."""
        tables = self._by_id()
        return [(i, [t.get(i, _ABSENT) for t in tables]) for i in ids]

    def _restore(self, saved: list) -> None:
        tables = self._by_id()
        for recorded, values in saved:
            for table, value in zip(tables, values):
                if value is _ABSENT:
                    table.pop(recorded, None)
                else:
                    table[recorded] = value

    def _try_capture(self, key: int, binds: tuple, renames: tuple, seeds, backend) -> None:
        """Capture a program as a graph (nothing runs yet) and tell rank 0 whether it worked
        (None) or why not; the capture waits for the dispatcher's commit."""
        captured, why = None, backend if isinstance(backend, str) else None
        if why is None:
            try:
                captured = self._capture_graph(key, binds, renames, backend)
            except Exception as e:  # what cannot be captured: a host sync, a data-dependent shape
                why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        self._capture = (key, binds, renames, seeds, captured)
        self.link.reply(Tag.GRAPH, why)

    def _capture_graph(self, key: int, binds: tuple, renames: tuple,
                       backend: graphs.CudaBackend | graphs.EmulatedBackend) -> graphs.Captured:
        program = [ins for ins in self.programs[key] if ins[0] not in graphs.HOST_WORDS]
        for i, ins in enumerate(program):
            if ins[0] in ("upload", "read", "sync"):
                raise RuntimeError(f"instruction {i} ({ins[0]}) waits for the host")
        env, poison = self.env, self.poison
        # one list of inputs serves every worker: a pipeline stage holds only its own
        binds = tuple((cur, recorded) for cur, recorded in binds if cur in env or cur in poison)
        reads = graphs.outside_reads(program, {recorded for _, recorded in binds})
        for tid in [cur for cur, _ in binds] + reads:
            if tid in poison:
                raise RuntimeError(f"tensor {tid} it reads failed: {poison[tid].error}")
            if tid not in env:
                raise RuntimeError(f"tensor {tid} it reads is not here")
        if self.waits:
            self._settle_all()
        if self.plane is not None:
            self.plane.settle_sends()
        if not backend.emulated and any(  # tags.GRAPH_LATER (the stand-in makes records afresh)
                isinstance(env[cur], Graph) and not self.graphs.made(env[cur]) for cur, _ in binds):
            raise RuntimeError(f"an autograd record it reads is made outside a graph {GRAPH_LATER}")
        inputs, shared = {}, set()
        for cur, recorded in binds:
            inputs[recorded], same = self.graphs.bind(env[cur])
            if same and isinstance(inputs[recorded], torch.Tensor):
                shared.add(recorded)
            elif not same:
                self.stats["graph_input_bytes"] += inputs[recorded].nbytes
        saved = self._saved(inputs)

        def execute(instructions: list[tuple]) -> None:
            env.update(inputs)
            try:
                if backend.emulated:  # as a graph's end joins them, every collective is waited
                    self._execute(instructions)
                    self._settle_all()
                else:
                    self._captured(instructions)
            finally:
                self._restore(saved)

        held, poisoned = set(env), set(poison)
        counts = self._comm_counts()
        skipped, pending = self.stats["skipped"], self.skipped
        try:
            handle = backend.capture(program, execute)
            failed = [poison[t] for t in set(poison) - poisoned]
            if failed or self.stats["skipped"] != skipped:
                bad = failed[0] if failed else self.skipped
                raise RuntimeError(f"op '{bad.op}' failed while captured: {bad.error}")
        except BaseException:
            # what the capture made, or failed to make: none of it ran, nor is it reported
            for tid in (set(env) - held) | (set(poison) - poisoned):
                env.pop(tid, None)
                poison.pop(tid, None)
                self.waits.pop(tid, None)
            self.skipped = pending
            self._count_as(counts)
            raise
        after = self._comm_counts()
        comm = {} if backend.emulated else {  # an emulated launch runs (and counts) them itself
            k: (v[0] - counts.get(k, (0, 0))[0], v[1] - counts.get(k, (0, 0))[1])
            for k, v in after.items() if v != counts.get(k)}
        self._count_as(counts)  # captured, not run: each launch counts them
        return graphs.Captured(handle, inputs, [(tid, env[tid]) for tid in reads], comm,
                               len(program), graphs.written_inputs(program, set(inputs)),
                               frozenset(shared))

    def _captured(self, program: list[tuple]) -> None:
        """The program's instructions inside a capture: no GPU timing events, and every
        collective and send joined back before the capture ends."""
        gpu_every, self._gpu_every = self._gpu_every, 0
        self._plane_capture(True)
        try:
            self._execute(program)
            self._settle_all()
        finally:
            self._plane_capture(False)
            self._gpu_every = gpu_every

    def _plane_capture(self, on: bool) -> None:
        if self.plane is not None and self.plane.started:
            if on:
                self.plane.begin_capture()
            else:
                self.plane.end_capture()

    def _comm_counts(self) -> dict[str, tuple[int, int]]:
        return {k: tuple(v) for k, v in self.plane.stats.items()} if self.plane else {}

    def _count_as(self, counts: dict[str, tuple[int, int]]) -> None:
        """The collectives counted as ``counts`` says (what a capture recorded never ran)."""
        if self.plane is not None:
            stats = self.plane.stats
            for k in list(stats):
                if k in counts:
                    stats[k][:] = counts[k]
                else:
                    del stats[k]

    def _commit(self, out, args: tuple) -> None:
        """(key, ok): every worker of the program captured it (launch the graph, and from now
        on every replay), or one could not (run it op by op; the graph is dropped)."""
        key, ok = args
        _, binds, renames, seeds, captured = self._capture
        self._capture = None
        if ok:
            self.graphs.add(key, captured)
        if not ok or self._launch(captured, binds, renames, seeds) is not None:
            self._run_program(self._instructions(key, seeds), binds, renames)
        if self.device.type == "cuda":
            self._note_ready(new for _, new in renames)

    def _launch(self, captured: graphs.Captured, binds: tuple, renames: tuple,
                seeds) -> str | None:
        """One call of a captured program: inputs into its static buffers, the graph launched,
        its outputs handed out under the call's ids. An input or read that failed (or is not
        what was captured) fails the outputs with it, but the graph still runs: the other
        members' collectives inside it wait for this one's. Where the graph cannot keep what
        the client holds, it launches nothing and says why (Captured.unlaunchable): run it op by
        op."""
        env, poison = self.env, self.poison
        if self.waits:
            self._settle_all()
        why = captured.unlaunchable(env, binds)
        if why is not None:
            self.stats["graph_fallbacks"] += 1
            reasons = self.stats["graph_fallback_reasons"]
            reasons[why] = reasons.get(why, 0) + 1
            return why
        outputs = tuple(recorded for recorded, _ in renames)
        aside = self.graphs.clear_way(captured, env)
        # before the inputs are copied in: an output may view one
        copied = captured.copy_out(env) if captured.outputs else []
        self.stats["graph_copies"] += len(copied) + len(aside)
        if copied and self.ready:
            self._note_ready(i for i in copied if i in self.ready)
        fault = None
        inputs = captured.inputs
        for cur, recorded in binds:
            static = inputs.get(recorded)
            if static is None:
                continue
            t = env.get(cur)
            if t is not None:
                # through .data: an autograd record may have saved the buffer, and a graph
                # rewrites what it saved without a version change, as this copy must too
                if t is not static:  # an autograd record is the captured one (unlaunchable)
                    static.data.copy_(t)
            elif fault is None:
                fault = poison.get(cur) or Fault(cur, "replay", self.rank, "an input is not here")
        for tid, t in captured.reads:
            if env.get(tid) is not t and fault is None:
                fault = poison.get(tid) or Fault(tid, "replay", self.rank,
                                                 f"tensor {tid} is not the one captured")
        captured.handle.seed(seeds)
        captured.handle.replay(env, outputs)
        for storage, saved in aside:
            storage.copy_(saved)
        if captured.written and fault is None:
            for cur, recorded in binds:
                if recorded in captured.written and env[cur] is not inputs[recorded]:
                    env[cur].copy_(inputs[recorded])
        if not captured.outputs:  # the first launch: its outputs are the graph's for good
            captured.set_outputs(env, outputs)
            self.graphs.launched(captured)
        # an op of the stand-in's program failed (a real graph's kernels never fail on the
        # host): every output fails with it, as with a failed input
        failed = [poison.pop(recorded) for recorded in outputs if recorded in poison]
        fault = fault or (failed[0] if failed else None)
        # a graph leaves its outputs where they were captured; the stand-in puts them (and
        # the autograd records it made afresh) under the recorded ids
        made = {recorded: env.pop(recorded) for recorded in outputs if recorded in env}
        if fault is None:
            statics = captured.outputs
            env.update((new, made.get(recorded, statics.get(recorded))) for recorded, new in
                       renames if recorded in made or recorded in statics)
            captured.handed = [new for _, new in renames]
        else:
            self._fail(tuple(new for _, new in renames), fault)
        self.stats["graph_launches"] += 1
        self.stats["graphed_ops"] += captured.size
        if self.plane is not None:
            for k, (count, nbytes) in captured.comm.items():
                entry = self.plane.stats[k]
                entry[0] += count
                entry[1] += nbytes
        return None

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

    def _rename(self, out, pairs: tuple) -> None:
        self._move(pairs, keep=False)

    def _move(self, pairs: tuple, keep: bool) -> None:
        """Each (a, b) of ``pairs``: b becomes what a is (Executor._by_id); a keeps it too if
        ``keep``. Ids not held here are skipped: one list serves every worker."""
        tables = self._by_id()
        for a, b in pairs:
            for table in tables:
                if a in table:
                    table[b] = table[a] if keep else table.pop(a)

    def _sync(self, out, args) -> None:
        self._settle_all()
        if self.plane is not None:  # what synchronize() leaves held is the program's alone
            self.plane.settle_sends()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        fault = self._index_fault(-1)
        self.link.reply(Tag.SYNC, fault if fault is not None else self.take_skipped())

    def _index_fault(self, tid: int, event: Any = None) -> Fault | None:
        """The fault of every read and sync once an index of this client was out of range (in
        an op issued before ``event`` where given: a read waits for no more than its value)."""
        if self.index_guard is None or not self.index_guard.raised(
                event, self._reader() if event is not None else None):
            return None
        if self.slot:
            return Fault(tid, "index", self.rank, bounds.MESSAGE)
        first, name = self.index_guard.culprit()  # the program's line that asked for it
        return Fault(first, name, self.rank, bounds.ORDINARY)

    def _stats(self, out, args: tuple) -> None:
        """(reset,): after replying, start the peaks afresh."""
        comm = {k: tuple(v) for k, v in self.plane.stats.items()} if self.plane else {}
        held = self.plane.held() if self.plane else {}
        self.link.reply(Tag.STATS, {**self.stats, "rank": self.rank, "device": str(self.device),
                                    "tensors": len(self.env), **self.memory(), **held,
                                    "collectives": comm,
                                    "settings": {n: settings.current(n) for n in settings.NAMES}})
        if args and args[0] and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _clock(self, out, args: tuple) -> None:
        self.link.clock_pongs(*args)

    def _trace(self, out, args: tuple) -> None:
        """("start", gpu_every): record from the next instruction on; ("part",): send what was
        recorded so far to rank 0 and go on (snapshots); ("collect",): send the rest and stop."""
        if args[0] == "start":
            self.trace = Recorder(self.rank)
            self._gpu_every = args[1] if self.device.type == "cuda" else 0
            self._gpu_countdown = self._gpu_every
            if self._gpu_every:
                torch.cuda.synchronize(self.device)
                ref = _cuda_event()
                ref.synchronize()
                self.trace.gpu_reference(ref, self.now())
            return
        rec = self.trace
        if args[0] == "collect":
            self.trace, self._gpu_every = None, 0
        if rec is None:
            self.link.reply(Tag.TRACE, None)
            return
        rec.marks.append((self.now(), None, None))  # this instruction ends the part
        self.link.reply_later(Tag.TRACE, rec.take())

    def received(self, start: int, seq: int, nbytes: int, count: int) -> None:
        """A batch arrived (traces only): from when it was noticed until it was unpickled."""
        self.trace.event(events.Kind.RECV, events.Lane.WORKER, start, self.now(), "batch", seq, 0, nbytes, count)

    def _serving(self, out, args: tuple) -> None:
        """(quota,): this worker serves a server's clients (the server's own word, slot 0)."""
        (self.client_quota,) = args

    def _monitor(self, out, args: tuple) -> None:
        """(address, token): push this worker's figures to rank 0's monitor hub from now on."""
        if self._pusher is None:
            from ..monitor import push
            executors = self.executors
            self._pusher = push.Pusher(tuple(args[0]), args[1], self.rank,
                                       lambda: push.figures(executors))

    def _dist_init(self, out, args: tuple) -> None:
        self.plane.init(*args)
        self._inject[Kind.COMM] = {"plane": self.plane}

    def _new_group(self, out, args: tuple) -> None:
        self.plane.new_group(*args)

    def _agree(self, out, args: tuple) -> None:
        """(ids, group): if any of the ids is poisoned on any member of the group, it is on
        every member, with that member's Fault. A collective whose operand failed on one member
        still completes (that member takes part with zeros), so the others' results would be
        wrong without being poisoned: this runs before what must not see such a result (an
        in-place update of replicas, a read)."""
        ids, group = args
        mine = next((self.poison[i] for i in ids if i in self.poison), None)
        fault = self.plane.agree(mine, group)
        if fault is not None and mine is None:
            self._fail(tuple(ids), fault)

    def memory(self) -> dict[str, int]:
        """Bytes of tensor memory in use and at peak (torch's allocator on a GPU: allocated and
        reserved; a server's client: the bytes of its own tensors), and the process's resident
        size now and at peak: the whole process, so memory held outside the tensor table (a
        leak) shows too."""
        rss = {"rss_bytes": _rss(),
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.slot:  # a server's client: its own tensors; the device's too, beside them
            device = {"device_bytes": torch.cuda.memory_allocated(self.device)} \
                if self.device.type == "cuda" else {}
            return {"memory_bytes": self._held_bytes(), **device, **rss}
        if self.device.type == "cuda":
            return {"memory_bytes": torch.cuda.memory_allocated(self.device),
                    "peak_bytes": torch.cuda.max_memory_allocated(self.device),
                    "reserved_bytes": torch.cuda.memory_reserved(self.device),
                    "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device), **rss}
        return {"memory_bytes": self._held_bytes(), **rss}

    def _execute_within(self, batch: list[tuple], limit: int) -> None:
        """A batch of a server's client with a quota: checked before each value leaves (a
        read, a sync) and at the end, so nothing made past the quota is ever seen."""
        before = set(self.env)
        start = 0
        for i, ins in enumerate(batch):
            if ins[0] in _WAITING and i > start:
                self._execute(batch[start:i])
                self._enforce_quota(limit, before)
                start = i
        self._execute(batch[start:])
        self._enforce_quota(limit, before)

    def _enforce_quota(self, limit: int, before: set[int]) -> None:
        """A server's client may hold at most ``limit`` bytes here: past it, what the last
        batch made (the ids not in ``before``) is dropped and poisoned with a MemoryError that
        its reads raise, and what the client held before stays as it was."""
        held = self._held_bytes()
        if held <= limit:
            return
        fresh = [i for i in self.env if i not in before]
        fault = Fault(fresh[0] if fresh else -1, "quota", self.rank,
                      f"MemoryError: this client's tensors on worker {self.rank} would hold "
                      f"{held / 1e9:.3f} GB, over the server's quota of {limit / 1e9:.3f} GB per "
                      "client; what the last instructions made was dropped (free tensors, or "
                      "ask for a larger quota: python -m gtmpi.server --quota-gb)")
        for i in fresh:
            self._fail(i, fault)

    def _held_bytes(self) -> int:
        """Bytes of the storages behind the tensors held here, each storage once."""
        held = []
        for t in list(self.env.values()):  # one step under the GIL: a monitor reads it too
            if isinstance(t, Graph):
                held += [t.output, *t.leaves]
            elif t is not None:
                held.append(t)
        # meta tensors (a dry run) all have address 0: told apart by their storage object
        key = (lambda s: s._cdata) if self.device.type == "meta" else (lambda s: s.data_ptr())
        return sum({key(s): s.nbytes() for s in (t.untyped_storage() for t in held)}.values())


_SAID: set[str] = set()


_WAITING = frozenset({"read", "sync"})  # control words that wait for the device


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        print(message, file=sys.stderr, flush=True)


def _rss() -> int:
    """The process's resident size now (Linux; elsewhere its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
