"""A worker's control words: what is not an op of the table (uploads, reads, frees, syncs,
stats, traces, the data plane's set-up, agreements, the monitor). A mixin of
worker.executor.Executor, whose state it reads and writes."""
from __future__ import annotations

import math
import os
import resource
import sys
from typing import Any

import torch

from ..errors import Fault
from ..ops import settings
from ..ops.table import Kind
from ..recording import events
from ..recording.recorder import Recorder
from ..transport.buffers import UPLOAD_PIECE_BYTES, as_bytes, upload_pieces
from ..transport import wire
from ..transport.tags import Tag
from . import bounds

WAITING = frozenset({"read", "sync"})  # control words that wait for the device


def cuda_event() -> torch.cuda.Event:
    """A timing event recorded now on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class Control:
    def _upload(self, out: int, args: tuple) -> None:
        shape, dtype = args
        nbytes = math.prod(shape) * dtype.itemsize
        if self.slot:
            self._may_hold(nbytes)
        pieces = upload_pieces(nbytes)
        try:
            if self.device.type == "cuda" and pieces[-1][1] > UPLOAD_PIECE_BYTES:
                value = self._upload_in_pieces(shape, dtype, pieces)
            else:
                value = self._upload_whole(shape, dtype, pieces)
        except _NoRoom as e:
            # a model larger than this device: the tensor fails as an op would, and the program
            # reads torch's own error where it uses it; the job goes on
            self._fail(out, self._fault(out, "upload", e.__cause__))
            return
        self.stats["bytes_received"] += value.nbytes
        if self.trace is not None:
            self.trace.annotate(nbytes=value.nbytes, peer=0)
        self.env[out] = value

    def _may_hold(self, nbytes: int) -> None:
        """A server's client's upload, checked by what its instruction declares before
        anything is allocated or waited for: at most its quota, and at most this device's
        memory (a declared size is only the client's word)."""
        if self.device.type == "cuda":
            room = torch.cuda.get_device_properties(self.device).total_memory
        else:
            room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        limit = min(room, self.quota) if self.quota is not None else room
        if nbytes > limit:
            raise wire.Refused(f"an upload of {nbytes:,} bytes, over the {limit:,} this "
                               "worker may hold for a client")

    def _upload_whole(self, shape: torch.Size, dtype: torch.dtype, pieces: list) -> torch.Tensor:
        # pinned, so that the copy joins the stream without waiting for it: a copy from
        # pageable memory holds this host until the GPU has finished all it was given, and
        # the next step's graph is launched only after it (the GPU idles meanwhile). torch's
        # pinned-memory cache keeps the buffer until the copy is done.
        gpu = self.device.type == "cuda"
        host = self._allocate(pieces, lambda: torch.empty(shape, dtype=dtype, pin_memory=gpu))
        buf = as_bytes(host)
        for a, b in pieces:
            self.link.recv_upload(buf[a:b])
        if self.device.type == "cpu":
            return host
        try:  # a GPU, or a dry run's meta device
            return host.to(self.device, non_blocking=gpu)
        except torch.OutOfMemoryError as e:
            raise _NoRoom from e

    def _upload_in_pieces(self, shape: torch.Size, dtype: torch.dtype,
                          pieces: list) -> torch.Tensor:
        """A large upload received a piece at a time into two pinned buffers kept for it, each
        piece copied to the GPU while the next one arrives."""
        if not self.staging:
            self.staging = [(torch.empty(UPLOAD_PIECE_BYTES, dtype=torch.uint8, pin_memory=True),
                             torch.cuda.Event()) for _ in range(2)]
        value = self._allocate(pieces, lambda: torch.empty(shape, dtype=dtype,
                                                           device=self.device))
        dst = value.view(-1).view(torch.uint8)
        for i, (a, b) in enumerate(pieces):
            stage, copied = self.staging[i % len(self.staging)]
            copied.synchronize()  # the piece before last has left this buffer
            self.link.recv_upload(as_bytes(stage)[:b - a])
            dst[a:b].copy_(stage[:b - a], non_blocking=True)
            copied.record()
        return value

    def _allocate(self, pieces: list, make) -> torch.Tensor:
        """An upload's memory; where there is none, its messages are received all the same
        (rank 0 sends them whatever happens here), a piece at a time into one small buffer."""
        try:
            return make()
        except (RuntimeError, MemoryError) as e:  # torch's OutOfMemoryError is a RuntimeError
            scratch = as_bytes(torch.empty(max(pieces[0][1], 1), dtype=torch.uint8))
            for a, b in pieces:
                self.link.recv_upload(scratch[:b - a])
            raise _NoRoom from e

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
                ref = cuda_event()
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


_SAID: set[str] = set()


class _NoRoom(Exception):
    """An upload found no memory; its cause is the allocator's error."""


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
