"""The embedded default on a GPU: one worker process beside the user's, no MPI.

The user's process starts ``python -m gtmpi.worker.child`` with one end of a socket pair.
Messages are pickled tuples, in order, and tensor bytes travel raw right after their header:
  to the worker    ("batch", seq, instructions), ("upload",) + bytes, ("shutdown",)
  to rank 0        ("ack", seq), ("read",) + bytes, ("fault", Fault), ("reply", tag, object),
                   ("bye", stats)
The worker's end is run by gtmpi.worker.child; both ends are here, as in transport.local.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Callable

import numpy as np

from ..errors import Fault
from ..trace.events import now
from .poll import SPIN_S, WATCH_EVERY_S
from .tags import Tag

ACK_EVERY = 8  # while more batches wait, the worker acknowledges every this many


def start_child(device: Any) -> tuple["ChildLink", int]:
    """A worker process on ``device``, joined to this one; its link and process id."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "gtmpi.worker.child", str(theirs.fileno()),
                             str(device)], pass_fds=(theirs.fileno(),))
    theirs.close()
    link = ChildLink(Connection(ours.detach()), proc)
    hello = link.wait_reply(Tag.HELLO)
    return link, hello["pid"]


def _readable(conn: Connection, watchdog: Callable[[], None] | None = None) -> None:
    """Return once ``conn`` has a message: spin a little (the answer to what was just sent
    usually follows at once), then block in the kernel, which wakes at once when it comes
    (a sleep would add its own length), running the watchdog now and then."""
    end = time.perf_counter() + SPIN_S
    while not conn.poll():
        if time.perf_counter() > end:
            while not conn.poll(WATCH_EVERY_S):
                if watchdog is not None:
                    watchdog()
            return


class ChildLink:
    """Rank 0's end (see dispatcher.Link)."""

    def __init__(self, conn: Connection, proc: subprocess.Popen):
        self.conn, self.proc = conn, proc
        self._acked = 0
        self._reads: deque[np.ndarray | Fault] = deque()
        self._replies: dict[int, deque] = {}
        self._said_bye = False

    def send(self, batch: list, seq: int) -> None:
        self.conn.send(("batch", seq, batch))

    def upload(self, data: np.ndarray) -> None:
        self.conn.send(("upload",))
        self.conn.send_bytes(data)

    def start_read(self, buf: np.ndarray) -> np.ndarray:
        return buf

    def finish_read(self, buf: np.ndarray, watchdog: Callable[[], None]) -> Fault | None:
        result = self._wait(self._reads, watchdog)
        if isinstance(result, Fault):
            return result
        buf[:] = result
        return None

    def poll_ack(self) -> int:
        self._take()
        return self._acked

    def wait_reply(self, tag: Tag, watchdog: Callable[[], None] | None = None) -> Any:
        return self._wait(self._replies.setdefault(tag, deque()), watchdog)

    def poll_reply(self, tag: Tag) -> Any:
        self._take()
        waiting = self._replies.get(tag)
        return waiting.popleft() if waiting else None

    def measure_clock(self, rounds: int) -> tuple[int, int, int]:
        return 0, 0, now()  # one host: one monotonic clock

    def shutdown(self) -> None:
        self.conn.send(("shutdown",))

    def wait_bye(self, deadline: float) -> bool:
        try:
            while self.conn.poll(max(0.0, deadline - time.monotonic())):
                if self._receive()[0] == "bye":
                    self._said_bye = True
                    self.proc.wait(max(0.0, deadline - time.monotonic()))
                    self.conn.close()
                    return True
        except (EOFError, OSError, subprocess.TimeoutExpired):
            pass
        return False

    # receiving ------------------------------------------------------------------------------
    def _receive(self) -> tuple:
        msg = self.conn.recv()
        kind = msg[0]
        if kind == "ack":
            self._acked = msg[1]
        elif kind == "read":
            self._reads.append(np.frombuffer(self.conn.recv_bytes(), np.uint8))
        elif kind == "fault":
            self._reads.append(msg[1])
        elif kind == "reply":
            self._replies.setdefault(msg[1], deque()).append(msg[2])
        return msg

    def _take(self) -> None:
        """Receive what has arrived, without waiting."""
        if self._said_bye:
            return
        try:
            while self.conn.poll():
                self._receive()
        except (EOFError, OSError):
            raise RuntimeError(f"gtmpi: worker rank 1 (the embedded worker process, pid "
                               f"{self.proc.pid}) ended (exit status {self.proc.wait()})") from None

    def _wait(self, queue: deque, watchdog: Callable[[], None] | None) -> Any:
        """The next item of ``queue``, once the worker has sent it."""
        self._take()
        while not queue:
            _readable(self.conn, watchdog)
            self._take()
        return queue.popleft()


class ParentLink:
    """The worker's end (see worker.executor.HostLink)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.uploads: deque[bytes] = deque()

    def recv_upload(self, buf: np.ndarray) -> None:
        buf[:] = np.frombuffer(self.uploads.popleft(), np.uint8)

    def send_read(self, data: np.ndarray) -> None:
        self.conn.send(("read",))
        self.conn.send_bytes(data)

    def send_read_fault(self, fault: Fault) -> None:
        self.conn.send(("fault", fault))

    def reply(self, tag: int, obj: Any) -> None:
        self.conn.send(("reply", tag, obj))

    reply_later = reply

    def clock_pongs(self, rounds: int) -> None:
        pass

    def serve(self, executor: Any) -> None:
        """Execute batches in order until rank 0 says stop."""
        conn = self.conn
        done = 0
        while True:
            _readable(conn)  # a trace times only the receipt
            start = time.perf_counter_ns()
            msg = conn.recv()
            kind = msg[0]
            if kind == "batch":
                if executor.trace is not None:
                    executor.received(start, msg[1], 0, len(msg[2]))
                executor.run(msg[2])
                done += 1
                if done % ACK_EVERY == 0 or not conn.poll():
                    conn.send(("ack", msg[1]))
            elif kind == "upload":
                self.uploads.append(conn.recv_bytes())
            elif kind == "shutdown":
                conn.send(("bye", executor.stats))
                return
