"""A client's end of a server (gtmpi/server): one TCP connection to the server's rank 0
(transport/frames.py), which relays everything to and from the workers: the instruction stream,
the replies, the uploads and the reads. On it, ``FrameComm`` answers the few MPI calls a
worker's link makes (sends, matched probes, receives), so that ``WorkerLink`` talks to a worker
through the server as it does over MPI: the server's own messages and the workers' replies come
from source 0 with the worker's rank in the tag (tags.py), a worker's read from the worker's
rank."""
from __future__ import annotations

import time
from typing import Any

from mpi4py import MPI

from . import wire
from .frames import Channel, Frame
from .mpi import Comms, Sends, WorkerLink
from .poll import wait_for
from .tags import Tag


class _Sent:
    """A send: done once the socket has taken all of it (or the connection ended). Waiting
    for it takes in what comes meanwhile: a server expels a client that takes nothing of
    what it was sent for a while, as one sending a large upload over a slow network would."""

    def __init__(self, comm: "FrameComm", through: int) -> None:
        self.comm, self.through = comm, through

    def Test(self, status: MPI.Status | None = None) -> bool:
        self.comm.progress()
        return self.comm.chan.closed or self.comm.chan.sent >= self.through

    def Wait(self) -> None:
        wait_for(lambda: True if self.Test() else None)

    def Cancel(self) -> None:
        pass

    def Free(self) -> None:
        pass


class _Matched:
    """A frame taken by a matched probe, as MPI's Message."""

    def __init__(self, frame: Frame) -> None:
        self.frame = frame

    def recv(self) -> Any:
        """What the server sent, in the wire's layout: nothing in it runs as it loads, whoever
        answered at the port file's address (wire.Refused for anything else)."""
        return wire.loads(self.frame.body)

    def irecv(self) -> "_Received":
        return _Received(self.recv())

    def Recv(self, spec: Any) -> None:
        _copy(self.frame, spec)


class _Received:
    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def test(self) -> tuple[bool, Any]:
        return True, self.obj


class _Receive:
    """A posted receive of raw bytes into a buffer: matched when its frame is here."""

    def __init__(self, comm: "FrameComm", spec: Any, source: int, tag: int) -> None:
        self.comm, self.spec, self.source, self.tag = comm, spec, source, tag

    def Test(self, status: MPI.Status | None = None) -> bool:
        frame = self.comm.match(self.source, self.tag, status)
        if frame is None:
            return False
        _copy(frame, self.spec)
        return True


def _copy(frame: Frame, spec: Any) -> None:
    buf = memoryview(spec[0]).cast("B")
    buf[:len(frame.body)] = frame.body


def _matches(frame: Frame, source: int, tag: int) -> bool:
    return (source == MPI.ANY_SOURCE or frame.source == source) and \
        (tag == MPI.ANY_TAG or frame.tag == tag)


class FrameComm:
    """MPI's calls that WorkerLink and ServerConnection make, over a client's Channel."""

    def __init__(self, chan: Channel) -> None:
        self.chan = chan

    def match(self, source: int, tag: int, status: MPI.Status | None = None) -> Frame | None:
        """The first frame arrived from ``source`` with ``tag`` (either may be ANY), taken."""
        self.progress()
        for i, f in enumerate(self.chan.frames):
            if _matches(f, source, tag):
                del self.chan.frames[i]
                if status is not None:
                    status.Set_source(f.source)
                    status.Set_tag(f.tag)
                    status.Set_elements(MPI.BYTE, len(f.body))
                return f
        return None

    def progress(self) -> None:
        """What waits to be sent goes on (an upload's rest: the server holds the next round
        until it is whole), and what has come is taken in."""
        self.chan.flush()
        self.chan.pump()

    def improbe(self, source: int, tag: int, status: MPI.Status | None = None) -> _Matched | None:
        frame = self.match(source, tag, status)
        return None if frame is None else _Matched(frame)

    def iprobe(self, source: int, tag: int) -> bool:
        self.progress()
        return any(_matches(f, source, tag) for f in self.chan.frames)

    def isend(self, obj: Any, dest: int, tag: int) -> _Sent:
        """A client's messages go in the wire's plain layout: the server's processes load
        nothing else (wire.py)."""
        return _Sent(self, self.chan.send(0, tag, wire.dumps(obj)))

    def send(self, obj: Any, dest: int, tag: int) -> None:
        self.isend(obj, dest, tag).Wait()

    def Isend(self, spec: Any, dest: int, tag: int) -> _Sent:
        return _Sent(self, self.chan.send(0, tag, spec[0]))

    def Send(self, spec: Any, dest: int, tag: int) -> None:
        self.Isend(spec, dest, tag).Wait()

    def Irecv(self, spec: Any, source: int, tag: int) -> _Receive:
        return _Receive(self, spec, source, tag)

    def Free(self) -> None:
        self.chan.close()


class ServerGone(RuntimeError):
    """The server this client joined shut down or went away."""


class ServerConnection:
    """The rounds of dispatcher.Rounds, the client's leaving, and news of the server's end."""

    def __init__(self, chan: Channel, path: str, slot: int) -> None:
        # one connection does for all: what the server sends comes from its rank 0, a worker's
        # read from the worker's rank
        comm = FrameComm(chan)
        self.comms = Comms(comm, comm, comm, comm)
        self.chan = chan
        self.path = path
        self.slot = slot
        self.pending = False
        self.left = False
        self._goodbye: bool | None = None  # whether the server said goodbye, once asked
        self._ended: str | None = None
        self.dropped = False  # the server dropped this client (it sent what no worker could run)
        self.uploads = 0  # sent to the server: a round goes on once those before it are there
        self._sends = Sends()

    def end(self) -> None:
        self._sends.keep(self.comms.ctrl.isend(self.uploads, 0, Tag.ROUND))
        self.pending = False

    def check(self) -> None:
        """Raise ServerGone if the server said it ends, or its connection ended."""
        if self._ended is None:
            self.chan.flush()
            msg = self.comms.ctrl.improbe(0, Tag.ENDING)
            if msg is not None:
                self.dropped, why = msg.recv()  # (whether only this client goes, why)
                self._ended = f"the gtmpi server ({self.path}) " + (
                    why if self.dropped else f"is shutting down: {why}")
            elif self.chan.closed and not self.left:
                self._ended = f"the gtmpi server ({self.path}) is gone"
        if self._ended is not None:
            raise ServerGone(self._ended)

    def leave(self) -> None:
        """Done: the server frees this client's tensors on every worker (unless it dropped
        this client already)."""
        if self.left:
            return
        self.left = True
        if not self.dropped:
            self.comms.ctrl.send(None, 0, Tag.LEAVE)

    def wait_goodbye(self, deadline: float) -> bool:
        if self._goodbye is not None:
            return self._goodbye
        status = MPI.Status()
        if self.dropped:  # no goodbye comes: let go, which lets the server free its end
            self._goodbye = False
            self.chan.close()
            return False

        def goodbye() -> bool | None:
            # any tag, so that what the server sent before its goodbye (the last acks) is
            # received first: a receive of the goodbye's tag alone may overtake them
            while (msg := self.comms.ctrl.improbe(0, MPI.ANY_TAG, status)) is not None:
                msg.recv()
                if status.Get_tag() == Tag.GOODBYE:
                    return True
            # a server shutting down still says goodbye within its grace; one gone cannot
            if self.chan.closed or time.monotonic() > deadline:
                return False
            return None
        self._goodbye = wait_for(goodbye)
        self._sends.drain()
        while (msg := self.comms.ctrl.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG)) is not None:
            msg.recv()  # replies nobody waits for (acks)
        self.chan.close()
        return self._goodbye


class RemoteLink(WorkerLink):
    """One worker, reached through the server."""

    def __init__(self, conn: ServerConnection, rank: int) -> None:
        super().__init__(conn.comms, rank, peer=0)
        self.conn = conn

    def send(self, batch: list, seq: int) -> None:
        super().send(batch, seq)
        self.conn.pending = True

    def upload(self, data: Any) -> None:
        super().upload(data)
        self.conn.uploads += 1
        self.conn.pending = True

    def finish_read(self, req: Any, watchdog: Any) -> Any:
        if self.conn._ended is None and self.comms.ctrl.iprobe(0, Tag.ENDING):
            self.conn.check()  # told the server ends: say so now, not after its grace
        return super().finish_read(req, watchdog)

    def poll_ack(self) -> int | None:
        return None if self.conn._goodbye is not None else super().poll_ack()

    def shutdown(self) -> None:
        """The workers are the server's: this client only leaves."""
        self._sends.drain()
        self.conn.leave()

    def wait_bye(self, deadline: float) -> bool:
        return self.conn.wait_goodbye(deadline)
