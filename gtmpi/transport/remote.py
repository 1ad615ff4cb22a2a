"""A client's end of a server (gtmpi/server): one intercommunicator to the server's whole job,
whose rank r is the job's rank r. The instruction stream, the replies and the uploads go to and
from the server's rank 0, which forwards them (the worker's rank rides in every tag, tags.py);
reads come from each worker straight to the client."""
from __future__ import annotations

import time
from typing import Any

from mpi4py import MPI

from .mpi import Comms, Sends, WorkerLink
from .poll import wait_for
from .rendezvous import Lines
from .tags import Tag


class ServerGone(RuntimeError):
    """The server this client joined shut down or went away."""


class ServerConnection:
    """The rounds of dispatcher.Rounds, the client's leaving, and news of the server's end."""

    def __init__(self, inter: MPI.Intercomm, lines: Lines, path: str, slot: int) -> None:
        # one communicator does for all: what the server sends comes from its rank 0, what a
        # worker sends from the worker's rank
        self.comms = Comms(inter, inter, inter, inter)
        self.lines = lines
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
            msg = self.comms.ctrl.improbe(0, Tag.ENDING)
            if msg is not None:
                self.dropped, why = msg.recv()  # (whether only this client goes, why)
                self._ended = f"the gtmpi server ({self.path}) " + (
                    why if self.dropped else f"is shutting down: {why}")
            else:
                self.lines.poll()
                if self.lines.closed and not self.left:
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
            self.comms.ctrl.Free()
            self.lines.close()
            return False

        def goodbye() -> bool | None:
            # any tag, so that what the server sent before its goodbye (the last acks) is
            # received first: a receive of the goodbye's tag alone may overtake them
            while (msg := self.comms.ctrl.improbe(0, MPI.ANY_TAG, status)) is not None:
                msg.recv()
                if status.Get_tag() == Tag.GOODBYE:
                    return True
            # a server shutting down still says goodbye within its grace; one gone cannot
            if self.lines.poll() or self.lines.closed or time.monotonic() > deadline:
                return False
            return None
        self._goodbye = wait_for(goodbye)
        self._sends.drain()
        while (msg := self.comms.ctrl.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG)) is not None:
            msg.recv()  # replies nobody waits for (acks)
        # freed, not disconnected: a disconnect is collective over the server's whole job
        self.comms.ctrl.Free()
        self.lines.close()
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
