"""Turns the client's instruction stream into batches for workers.

Where each tensor lives is decided here. Until a signal places a tensor elsewhere, every
tensor lives on the home worker (the first one), as a one-device program expects, and no
instruction pays for placement; afterwards every instruction goes through the placer
(dispatcher/placer.py).

Batching is the whole cost model: one MPI message carries up to BATCH_MAX instructions.
A batch is sent early while its worker is idle (latency: a GPU must never wait for the
client) and held back while the worker is busy (throughput: fewer, larger messages). A lone
cheap op waits for one more instruction even then: it usually comes at once (often the read
that wants its result), and sharing one message saves the worker a whole receive cycle.
Workers acknowledge executed batches; at most MAX_INFLIGHT batches are unacknowledged per
worker, so a client that runs ahead of its workers blocks instead of growing memory.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import numpy as np
import torch

from ..transport.buffers import as_bytes
from ..errors import Fault
from ..recording.events import Kind, Lane
from ..transport.poll import wait_for
from ..transport.tags import Tag

_clock = time.perf_counter_ns

BATCH_MAX = 256
MAX_INFLIGHT = 64
FREES_AHEAD = 64  # dropped ids that travel before the next instruction even if it is small
ACK_POLL_S = 5e-5  # how often a busy worker's acks are polled while ops are issued


class Link(Protocol):
    """Rank 0's end of a worker link (transport.mpi.WorkerLink or transport.local.LocalLink)."""

    def send(self, batch: list, seq: int) -> None: ...
    def upload(self, data: np.ndarray) -> None: ...
    def start_read(self, buf: np.ndarray) -> Any: ...
    def finish_read(self, handle: Any, watchdog: Callable[[], None]) -> Fault | None: ...
    def poll_ack(self) -> int | None: ...
    def wait_reply(self, tag: Tag, watchdog: Callable[[], None] | None = None) -> Any: ...
    def poll_reply(self, tag: Tag) -> Any: ...
    def measure_clock(self, rounds: int) -> tuple[int, int, int]: ...
    def shutdown(self) -> None: ...
    def wait_bye(self, deadline: float) -> bool: ...


class Dispatcher:
    def __init__(self, links: dict[int, Link], watchdog: Callable[[], None]):
        self.links = links
        self.watchdog = watchdog
        self.home = min(links)
        self._batch: dict[int, list] = {r: [] for r in links}
        self._frees_in = dict.fromkeys(links, 0)  # free instructions among each batch's
        self._seq = dict.fromkeys(links, 0)
        self._acked = dict.fromkeys(links, 0)
        self._last_poll = 0.0
        # Tensor.__del__ appends here; frees travel before the next large instruction (or at
        # the end of the next batch sent), after every instruction that could still use them.
        self.frees: list[int] = []
        self.trace = None  # a trace.Recorder while tracing: this rank's client and dispatcher lanes
        self.log = None  # a trace.InstructionLog: GT's text log of the instruction stream
        self.trace_tick: Callable[[], None] | None = None  # called after each traced send
        self.devices: dict[int, str] = {}  # rank -> its device, as the worker said
        from .placer import Placer
        self.placer = Placer(self)

    def submit(self, ins: tuple, urgent: bool = True, issued: int = 0, sigs: list | None = None,
               outs: list | None = None, host: torch.Tensor | None = None,
               key: tuple | None = None) -> None:
        """A tensor instruction from the client, routed to the workers that hold its operands.
        ``urgent`` marks work big enough that an idle worker should start on it now; ``issued``
        is when the client started on it (traces only); ``sigs`` and ``outs`` are the
        (shape, dtype) of its operands and results, which placing needs; ``host`` is an upload's
        data; ``key``, the operands' signature_key where the client made it."""
        rec = self.trace
        if rec is not None:
            received = _clock()
        if self.frees and (urgent or len(self.frees) >= FREES_AHEAD):
            # ahead of a large result (or of many small ones), in stream order, so that their
            # memory serves what comes next; otherwise at the end of the batch, which costs
            # a tiny op no instruction of its own
            self._route_frees()
        if self.placer.active:  # logged once placed: only then is its worker known
            rank = self.placer.submit(ins, sigs, outs, urgent, host, key)
            if self.log is not None:
                self.log.received(ins, rank)
        else:
            rank = self.home
            if self.log is not None:
                self.log.received(ins, rank)
            self.enqueue(rank, ins, urgent)
        if rec is not None:
            rec.issues.append((issued or received, received, _clock(), ins[0], ins[1], rank))

    def gradient_ready(self, tid: int, sig: tuple) -> None:
        """Backward has made all of a leaf's gradient ``tid``: partial sums may be summed."""
        if self.placer.active:
            self.placer.reduce_soon(tid, sig)

    def backward_done(self) -> None:
        if self.placer.active:
            self.placer.reduce_now()

    def enqueue(self, rank: int, ins: tuple, urgent: bool = True) -> None:
        """Into ``rank``'s next batch, which is sent early while the worker is idle."""
        batch = self._batch[rank]
        batch.append(ins)
        # a lone cheap op waits for the next (often the read of it); frees riding along with
        # it do not count
        alone = len(batch) - self._frees_in[rank] <= 1
        if len(batch) >= BATCH_MAX or ((urgent or not alone) and self._idle(rank)):
            self.flush(rank)

    def upload(self, ins: tuple, host: torch.Tensor) -> None:
        """A contiguous CPU tensor, to the workers the 'upload' instruction ``ins`` makes it on:
        the home worker, or each member of a signal's placement its own piece, straight from
        here (a worker never forwards another's bytes)."""
        if self.placer.active:
            self.submit(ins, host=host)
            return
        self.send_bytes(self.home, ins[1], host)
        self.submit(ins)

    def send_bytes(self, rank: int, tid: int, host: torch.Tensor) -> None:
        """Host bytes for the next 'upload' instruction ``rank`` executes."""
        data = as_bytes(host.contiguous())
        self.links[rank].upload(data)
        if self.trace is not None:
            t = _clock()
            self.trace.event(Kind.TRANSFER, Lane.DISPATCHER, t, t, "upload", tid, rank,
                             data.nbytes)

    def read(self, tensor_id: int, buf: np.ndarray, sig: tuple | None = None) -> Fault | None:
        """Fill ``buf`` with the raw bytes of a tensor (of ``sig``: shape, dtype), or return
        why it could not be made."""
        start = _clock()
        rank, rid = self.placer.read_source(tensor_id, sig) if self.placer.active else \
            (self.home, tensor_id)
        link = self.links[rank]
        handle = link.start_read(buf)
        self._batch[rank].append(("read", None, (rid,), 0, None))
        if self.log is not None:
            self.log.received(self._batch[rank][-1], rank)
        if self.placer.active:
            self.placer.release()
        self.flush(rank)
        fault = link.finish_read(handle, self.watchdog)
        if self.trace is not None:
            self.trace.event(Kind.WAIT, Lane.CLIENT, start, _clock(), "read", tensor_id,
                             rank, buf.nbytes)
        return fault

    def ask_all(self, word: str, tag: Tag, args: tuple = (),
                ranks: list[int] | None = None) -> dict[int, Any]:
        """Send a control word to every worker (or ``ranks``), in stream order, and gather
        their replies."""
        start = _clock()
        ranks = list(self.links) if ranks is None else ranks
        self.post(word, args, ranks)
        replies = {rank: self.links[rank].wait_reply(tag, self.watchdog) for rank in ranks}
        if self.trace is not None:
            self.trace.event(Kind.WAIT, Lane.CLIENT, start, _clock(), word, count=len(ranks))
        return replies

    def post(self, word: str, args: tuple, ranks: list[int]) -> None:
        """A control word to each of ``ranks``, sent now, behind everything issued before."""
        for rank in ranks:
            self._batch[rank].append((word, None, args, 0, None))
            self.flush(rank)

    def measure_clocks(self, ranks: list[int], rounds: int = 64) -> dict[int, tuple[int, int, int]]:
        """Per worker: (its clock minus ours, the round trip it was measured with, our time
        at the measurement), each from the fastest of ``rounds`` ping-pongs."""
        self.post("clock", (rounds,), ranks)
        return {rank: self.links[rank].measure_clock(rounds) for rank in ranks}

    def flush(self, rank: int) -> None:
        batch = self._batch[rank]
        rec = self.trace
        if self.frees and (rank == self.home or self.placer.active):
            self._route_frees()
        if not batch:
            return
        self._batch[rank] = []
        self._frees_in[rank] = 0
        if self._seq[rank] - self._acked[rank] >= MAX_INFLIGHT:
            start = _clock()
            wait_for(lambda: True if self._poll(rank) < MAX_INFLIGHT else None, self.watchdog)
            if rec is not None:
                rec.event(Kind.WAIT, Lane.DISPATCHER, start, _clock(), "backpressure", peer=rank)
        self._seq[rank] += 1
        if rec is None:
            self.links[rank].send(batch, self._seq[rank])
        else:
            start = _clock()
            self.links[rank].send(batch, self._seq[rank])
            rec.event(Kind.SEND, Lane.DISPATCHER, start, _clock(), "batch", self._seq[rank], rank,
                      count=len(batch))
            rec.compact()
            if self.trace_tick is not None:
                self.trace_tick()
        if self.log is not None:
            self.log.sent(batch, rank, self._seq[rank])

    def _route_frees(self) -> None:
        """The ids the client dropped, into the batches of the workers that hold them, behind
        every instruction that could still use them."""
        frees, self.frees = self.frees, []
        by_rank = self.placer.free(frees) if self.placer.active else {self.home: frees}
        for r, ids in by_rank.items():
            self._batch[r].append(("free", None, tuple(ids), 0, None))
            self._frees_in[r] += 1
            if self.trace is not None:
                t = _clock()
                self.trace.event(Kind.FREE, Lane.DISPATCHER, t, t, "free", peer=r, count=len(ids))
            if self.log is not None:
                self.log.received(self._batch[r][-1], r)

    def flush_all(self) -> None:
        for rank in self.links:
            self.flush(rank)

    def shutdown(self, timeout_s: float) -> list[int]:
        """Stop every worker; return the ranks that did not confirm within the timeout."""
        self.flush_all()
        for link in self.links.values():
            link.shutdown()
        deadline = time.monotonic() + timeout_s
        missing = [rank for rank, link in self.links.items() if not link.wait_bye(deadline)]
        for link in self.links.values():
            link.poll_ack()  # acks sent before the goodbye: receive them, leave nothing unmatched
        return missing

    def _poll(self, rank: int) -> int:
        """Collect acks; return the number of batches still unacknowledged."""
        acked = self.links[rank].poll_ack()
        if acked is not None:
            self._acked[rank] = acked
        return self._seq[rank] - self._acked[rank]

    def _idle(self, rank: int) -> bool:
        if self._seq[rank] == self._acked[rank]:
            return True
        now = time.perf_counter()
        if now - self._last_poll < ACK_POLL_S:
            return False
        self._last_poll = now
        return self._poll(rank) == 0
