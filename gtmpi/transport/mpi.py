"""MPI point-to-point between rank 0 and each worker.

Three communicators, each duplicated from the runtime's base communicator in the same order
on every rank, keep the three kinds of traffic from ever matching each other's receives:
  ctrl   rank 0 -> worker: pickled batches of instructions, shutdown
  reply  worker -> rank 0: small pickled objects (hello, acks, sync, stats, faults)
  data   both ways: raw tensor bytes (uploads and reads), never pickled

Under a server (gtmpi/server) everything of a client goes through the server's rank 0, which
speaks to the client over TCP (transport/frames.py): its batches, its uploads, and the workers'
replies and reads (a client's reads ride the reply communicator, see HostLink.for_slot).
"""
from __future__ import annotations

import os
import time
from collections import deque
from typing import Any, Callable, NamedTuple

import numpy as np
from mpi4py import MPI

from ..errors import Fault
from ..recording.events import now
from . import wire
from .poll import wait_for
from .tags import SLOT_STRIDE, Tag

_EMPTY = np.empty(0, np.uint8)
HEAVY_BYTES = 1 << 20  # a send this large makes waits spin until it has left (Sends.heavy)


class Comms(NamedTuple):
    base: MPI.Intracomm
    ctrl: MPI.Intracomm
    reply: MPI.Intracomm
    data: MPI.Intracomm

    @classmethod
    def dup(cls, base: MPI.Intracomm) -> "Comms":
        """Collective over ``base``: every rank must call it at the same point."""
        return cls(base, base.Dup(), base.Dup(), base.Dup())


class Sends:
    """Outstanding non-blocking sends, with the buffers they must keep alive."""

    def __init__(self) -> None:
        self._pending: list[tuple[MPI.Request, Any]] = []
        self._heavy: list[MPI.Request] = []  # those of HEAVY_BYTES or more

    def keep(self, req: MPI.Request, buf: Any = None) -> None:
        self._pending.append((req, buf))
        if getattr(buf, "nbytes", 0) >= HEAVY_BYTES:
            self._heavy.append(req)
        if len(self._pending) > 32:
            self._pending = [(r, b) for r, b in self._pending if not r.Test()]

    def heavy(self) -> bool:
        """Whether a large send is still under way. Its bytes move only while this process
        calls into MPI (Open MPI's shared memory hands them over a fragment of tens of KB at a
        time), so a wait that sleeps meanwhile moved GPT-3 6.7B's weights to one H200 at
        85 MB/s; one that spins, at the GB/s of a blocking send."""
        if self._heavy:
            self._heavy = [r for r in self._heavy if not r.Test()]
        return bool(self._heavy)

    def drain(self) -> None:
        """Wait for every send."""
        for req, _ in self._pending:
            wait_for(lambda req=req: True if req.Test() else None)
        self._pending.clear()


def _done_or_cancelled(req: MPI.Request, deadline: float) -> bool:
    """Wait for ``req``; past ``deadline``, cancel and free it (its sender may be a server's
    client that died). Whether it completed."""
    def settled() -> bool | None:
        if req.Test():
            return True
        if time.monotonic() > deadline:
            req.Cancel()
            req.Free()
            return False
        return None
    return wait_for(settled)


def _finished(req: MPI.Request) -> tuple[bool, Any] | None:
    """(True, the object) once a pickled receive is complete, else None."""
    done = req.test()
    return done if done[0] else None


def _bytes(msg: MPI.Message, status: MPI.Status) -> bytearray:
    """A matched message's bytes, as they came (decoding them is the receiver's choice)."""
    buf = bytearray(status.Get_count(MPI.BYTE))
    msg.Recv([buf, MPI.BYTE])
    return buf


class WorkerLink:
    """Rank 0's end of the conversation with one worker: directly, or through a server
    (``peer``, the server's rank; the worker's rank then rides in every tag, see tags.py)."""

    def __init__(self, comms: Comms, rank: int, peer: int | None = None,
                 sends: Sends | None = None):
        self.comms = comms
        self.rank = rank
        self.peer = rank if peer is None else peer
        self._o = 0 if peer is None else SLOT_STRIDE * rank
        # one for every worker's link (``sends``): any wait of rank 0's moves them all
        self._sends = sends if sends is not None else Sends()
        self._receiving: dict[Tag, MPI.Request] = {}  # replies whose bytes are still coming

    def send(self, batch: list, seq: int) -> None:
        self._sends.keep(self.comms.ctrl.isend(batch, self.peer, Tag.BATCH + self._o))

    def upload(self, data: np.ndarray) -> None:
        """Raw bytes for the next 'upload' instruction this worker executes."""
        self._sends.keep(self.comms.data.Isend([data, MPI.BYTE], self.peer, Tag.UPLOAD + self._o), data)

    def start_read(self, buf: np.ndarray) -> MPI.Request:
        """Post the receive before the 'read' instruction is sent, so the worker never waits.
        A read comes from the worker itself, through a server too: its rank on the data
        communicator is its own."""
        return self.comms.data.Irecv([buf, MPI.BYTE], self.rank, MPI.ANY_TAG)

    def finish_read(self, req: MPI.Request, watchdog: Callable[[], None]) -> Fault | None:
        status = MPI.Status()
        wait_for(lambda: True if req.Test(status) else None, watchdog, self._sends.heavy)
        if status.Get_tag() == Tag.READ_FAULT:
            return self.wait_reply(Tag.FAULT, watchdog)
        return None

    def moving(self) -> bool:
        """Whether large bytes to a worker are still under way (Sends.heavy)."""
        return self._sends.heavy()

    def poll_ack(self) -> int | None:
        latest = None
        while (msg := self.comms.reply.improbe(self.peer, Tag.ACK + self._o)) is not None:
            latest = msg.recv()
        return latest

    def wait_reply(self, tag: Tag, watchdog: Callable[[], None] | None = None) -> Any:
        req = self._receiving.pop(tag, None)
        if req is None:
            return wait_for(lambda: self.comms.reply.improbe(self.peer, tag + self._o), watchdog,
                            self._sends.heavy).recv()
        # begun by poll_reply: it is first
        return wait_for(lambda: _finished(req), watchdog, self._sends.heavy)[1]

    def poll_reply(self, tag: Tag) -> Any:
        """A reply if all of it has arrived, else None. Never waits: a big message moves only
        while its sender calls MPI, and a worker inside a collective does not until the other
        members get their part of it, which rank 0 may still have to send them."""
        req = self._receiving.get(tag)
        if req is None:
            msg = self.comms.reply.improbe(self.peer, tag + self._o)
            if msg is None:
                return None
            req = self._receiving[tag] = msg.irecv()
        done = _finished(req)
        if done is None:
            return None
        del self._receiving[tag]
        return done[1]

    def measure_clock(self, rounds: int) -> tuple[int, int, int]:
        """Ping-pong with a worker inside its 'clock' control word (see HostLink.clock_pongs):
        (its clock minus ours, round trip, our time) of the fastest round, whose midpoint
        is the best estimate of when the worker read its clock."""
        self.wait_reply(Tag.CLOCK)
        best = None
        for _ in range(rounds):
            sent = now()
            self.comms.ctrl.send(None, self.peer, Tag.CLOCK_PING + self._o)
            theirs = self.wait_reply(Tag.CLOCK)
            back = now()
            if best is None or back - sent < best[1]:
                mid = (sent + back) // 2
                best = (theirs - mid, back - sent, mid)
        return best

    def shutdown(self) -> None:
        self._sends.drain()
        self.comms.ctrl.send(None, self.peer, Tag.SHUTDOWN + self._o)

    def wait_bye(self, deadline: float) -> bool:
        def bye() -> bool | None:
            msg = self.comms.reply.improbe(self.peer, Tag.BYE + self._o)
            if msg is not None:
                msg.recv()
                return True
            return False if time.monotonic() > deadline else None
        return wait_for(bye)


# how long a server waits on a client that has stopped: the rest of a message begun, an
# upload's bytes, a read it does not take (a slow network may want longer; tests shorter)
CLIENT_TIMEOUT_S = float(os.environ.get("GTMPI_CLIENT_TIMEOUT_S", "10"))
UPLOAD_SEEN_S = 1.0  # a server's client's upload's first bytes, once its round runs


class ClientGone(RuntimeError):
    """A server's client did not send the bytes of an upload it counted."""


class Incoming(NamedTuple):
    """A message rank 0 sent a worker on ctrl, received: its tag (slot included), its object,
    and its size on the wire."""
    tag: int
    body: Any
    nbytes: int


class Inbox:
    """What a worker took from rank 0 before it got to it (HostLink.take_waiting), shared by
    the links of all its slots as the communicators are."""

    def __init__(self) -> None:
        self.ctrl: deque[Incoming] = deque()
        self.uploads: dict[int, deque[np.ndarray]] = {}  # by tag: the bytes, in order sent


class HostLink:
    """A worker's end of the conversation with rank 0 (see worker.executor.HostLink): of the
    ordinary session (slot 0), or of one client of a server (its slot rides in every tag)."""

    def __init__(self, comms: Comms, slot: int = 0, sends: Sends | None = None,
                 inbox: Inbox | None = None):
        self.comms = comms
        self.slot = slot
        self._o = SLOT_STRIDE * slot
        self._sends = sends if sends is not None else Sends()
        self.inbox = inbox if inbox is not None else Inbox()

    def for_slot(self, slot: int) -> "HostLink":
        """The same worker's link for a server's client ``slot`` (one queue of sends)."""
        return HostLink(self.comms, slot, self._sends, self.inbox)

    def next_message(self) -> Incoming | None:
        """The next message on ctrl, of any slot, received; None if none has come."""
        if self.inbox.ctrl:
            return self.inbox.ctrl.popleft()
        return self._take()

    def _take(self) -> Incoming | None:
        """A message's body is what it holds. A server's client's (a slot in its tag) is in the
        wire's plain layout (transport/wire.py), its body then the Refused that says why it is
        not one of gtmpi's; this job's own rank 0 is trusted with pickle, which is faster."""
        status = MPI.Status()
        msg = self.comms.ctrl.improbe(0, MPI.ANY_TAG, status)
        if msg is None:
            return None
        tag = status.Get_tag()
        if tag < SLOT_STRIDE:
            return Incoming(tag, msg.recv(), status.Get_count(MPI.BYTE))
        buf = _bytes(msg, status)
        try:
            body = wire.loads(buf)
        except wire.Refused as e:
            body = e
        return Incoming(tag, body, len(buf))

    def more_waiting(self) -> bool:
        return bool(self.inbox.ctrl) or self.comms.ctrl.iprobe(0, MPI.ANY_TAG)

    def take_waiting(self) -> None:
        """Receive now everything rank 0 has sent this worker (batches, upload bytes), to be
        handed out in order later: while the worker waits in the data plane. Messages left
        unreceived hold MPI's shared-memory cells of the sender (MPICH's), so rank 0's sends
        to every other worker would wait for this one, and the worker whose next batch holds
        the receive this one waits for would never get it."""
        while (got := self._take()) is not None:
            self.inbox.ctrl.append(got)
        status, data = MPI.Status(), self.comms.data
        while (msg := data.improbe(0, MPI.ANY_TAG, status)) is not None:
            buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            msg.Recv([buf, MPI.BYTE])
            self.inbox.uploads.setdefault(status.Get_tag(), deque()).append(buf)

    def recv_upload(self, buf: np.ndarray) -> None:
        tag = Tag.UPLOAD + self._o
        taken = self.inbox.uploads.get(tag)
        if taken:
            buf[:] = taken.popleft()
            return
        if not self.slot:  # large bytes move only while this worker calls into MPI too
            req = self.comms.data.Irecv([buf, MPI.BYTE], 0, tag)
            wait_for(lambda: True if req.Test() else None,
                     busy=(lambda: True) if buf.nbytes >= HEAVY_BYTES else None)
            return
        # a server's client that counted an upload it never sent would hold this worker, and
        # every client's work on it, for good. The server relays an upload's bytes before the
        # round that uses them, so their envelope is here within moments; past UPLOAD_SEEN_S
        # they never come, and only the bytes of one that is arriving are waited for longer
        seen = time.monotonic() + UPLOAD_SEEN_S
        if not wait_for(lambda: True if self.comms.data.Iprobe(0, tag) else
                        (False if time.monotonic() > seen else None)):
            raise ClientGone(f"an upload its client counted did not come within "
                             f"{UPLOAD_SEEN_S:.0f} s")
        req = self.comms.data.Irecv([buf, MPI.BYTE], 0, tag)
        if not _done_or_cancelled(req, time.monotonic() + CLIENT_TIMEOUT_S):
            raise ClientGone(f"the bytes of an upload did not come within "
                             f"{CLIENT_TIMEOUT_S:.0f} s")

    def send_read(self, data: np.ndarray) -> None:
        self._send_read(data, Tag.READ_OK)

    def send_read_fault(self, fault: Fault) -> None:
        self._send_read(_EMPTY, Tag.READ_FAULT)
        self.reply(Tag.FAULT, fault)

    def _send_read(self, data: np.ndarray, tag: Tag) -> None:
        # a server's client's read goes to the server, which relays it and always takes it
        # (the reply communicator, where the server looks for all of a slot's messages)
        comm = self.comms.reply if self.slot else self.comms.data
        comm.Send([data, MPI.BYTE], 0, tag + self._o)

    def reply(self, tag: int, obj: Any) -> None:
        if self.slot:  # a server's client: the wire's layout, which its client loads (wire.py)
            self.comms.reply.Send([wire.dumps(obj), MPI.BYTE], 0, tag + self._o)
        else:
            self.comms.reply.send(obj, 0, tag + self._o)

    def reply_later(self, tag: int, obj: Any) -> None:
        """A reply rank 0 will collect when it gets to it: never blocks this worker, however
        big (trace snapshots, while rank 0 may be waiting for this worker's next result)."""
        if self.slot:
            buf = wire.dumps(obj)
            self._sends.keep(self.comms.reply.Isend([buf, MPI.BYTE], 0, tag + self._o), buf)
        else:
            self._sends.keep(self.comms.reply.isend(obj, 0, tag + self._o))

    def clock_pongs(self, rounds: int) -> None:
        self.reply(Tag.CLOCK, None)  # ready: pings sent before this would reach the main loop
        for _ in range(rounds):
            status = MPI.Status()
            _bytes(wait_for(lambda: self.comms.ctrl.improbe(0, Tag.CLOCK_PING + self._o, status)),
                   status)  # what a ping says is when it came, not what it holds
            self.reply(Tag.CLOCK, now())

    def ack(self, seq: int) -> None:
        self.reply_later(Tag.ACK, seq)

    def drain(self) -> None:
        self._sends.drain()
