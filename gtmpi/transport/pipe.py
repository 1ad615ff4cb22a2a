"""The embedded default on a GPU: one worker process beside the user's, no MPI.

The user's process starts ``python -m gtmpi.worker.child`` with one end of a socket pair.
Messages are pickled tuples, in order; large tensor bytes travel raw right after a header:
  to the worker    ("batch", seq, instructions), ("upload",) + bytes, ("shutdown",)
  to rank 0        ("done", seq, results): a batch executed and what it produced, in order:
                   ("read", bytes), ("fault", Fault), ("reply", tag, object); before it, a
                   large read as ("read",) + bytes; at the end ("bye", stats)
One message a batch: each costs a few system calls and a wake-up of the other process.
The worker's end is run by gtmpi.worker.child; both ends are here, as in transport.local.

Both ends write whole messages, and a socket pair holds about 200 KB: were both ends to block
writing at once (an upload one way, a trace snapshot or a large read the other), neither would
read again. So rank 0 never blocks in a write: while the socket takes nothing, it receives what
the worker sends (_Writer). The worker may then block writing, but only until rank 0 reads.
"""
from __future__ import annotations

import os
import select
import socket
import struct
import subprocess
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import numpy as np

from ..errors import Fault
from ..recording.events import now
from . import early, poll
from .poll import WATCH_EVERY_S
from .tags import ACK_EVERY, Tag

INLINE_BYTES = 1 << 20  # reads up to this size travel inside the message that ends the batch


def start_child(device: Any) -> tuple["ChildLink", int, str]:
    """A worker process on ``device``, joined to this one: its link, process id, and how it
    was started (while gtmpi was imported, transport.early, or now and why). Not waited for:
    the program goes on while the child imports torch and takes its GPU (seconds: nanoGPT's
    model was built 4.5 s later than torch's own when this waited for its hello), what it is
    sent waits in the socket, and the first reply waited for waits for it too (a child that
    died starting says so there, as one that died later does)."""
    proc, ours, why_not = early.take(str(device))
    how = "started at import"
    if proc is None or ours is None:
        proc, ours = early.spawn(str(device))
        how = f"started now{f' (not the one started at import: {why_not})' if why_not else ''}"
    return ChildLink(Connection(ours.detach()), proc), proc.pid, how


class _Channel:
    """A Connection with a poller made once (Connection.poll builds a selector per call,
    tens of µs: too slow to spin on)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)

    def ready(self, timeout_s: float = 0.0) -> bool:
        return bool(self._poller.poll(timeout_s * 1000))

    def wait(self, watchdog: Callable[[], None] | None = None) -> None:
        """Return once a message has come: spin a little (the answer to what was just sent
        usually follows at once), then block in the kernel, which wakes at once when it
        comes (a sleep would add its own length), running the watchdog now and then."""
        end = time.perf_counter() + poll.SPIN_S
        while not self.ready():
            if time.perf_counter() > end:
                while not self.ready(WATCH_EVERY_S):
                    if watchdog is not None:
                        watchdog()
                return


class _Writer:
    """Writes messages in Connection's framing (what Connection.recv reads at the other end)
    without blocking: while the socket takes nothing, ``take`` receives what has come (the
    other end may be blocked writing to us) and the writing goes on once there is room."""

    def __init__(self, conn: Connection, take: Callable[[], None]):
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._take = take
        self._poller = select.poll()
        self._poller.register(self._sock.fileno(), select.POLLIN | select.POLLOUT)

    def send(self, obj: Any) -> None:
        self.send_bytes(ForkingPickler.dumps(obj))

    def send_bytes(self, data: Any) -> None:
        body = memoryview(data).cast("B")
        n = body.nbytes
        header = struct.pack("!i", n) if n <= 0x7fffffff else struct.pack("!iQ", -1, n)
        parts = [memoryview(header), body] if n else [memoryview(header)]
        while parts:
            try:
                sent = self._sock.sendmsg(parts, (), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                self._room()
                continue
            while sent:
                if sent >= parts[0].nbytes:
                    sent -= parts.pop(0).nbytes
                else:
                    parts[0], sent = parts[0][sent:], 0

    def _room(self) -> None:
        """Wait until the socket takes more; receive meanwhile."""
        for _, flags in self._poller.poll(WATCH_EVERY_S * 1000):
            if flags & select.POLLIN:
                self._take()

    def close(self) -> None:
        self._sock.close()


class ChildLink:
    """Rank 0's end (see dispatcher.Link)."""

    def __init__(self, conn: Connection, proc: subprocess.Popen):
        self.conn, self.proc = conn, proc
        self.channel = _Channel(conn)
        self._out = _Writer(conn, self._take)
        self._acked = 0
        self._reads: deque[np.ndarray | Fault] = deque()
        self._replies: dict[int, deque] = {}
        self._said_bye = False

    def send(self, batch: list, seq: int) -> None:
        self._write(("batch", seq, batch))

    def upload(self, data: np.ndarray) -> None:
        self._write(("upload",), data)

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

    def moving(self) -> bool:
        return False  # a pipe's writes block until they are taken

    def wait_reply(self, tag: Tag, watchdog: Callable[[], None] | None = None) -> Any:
        return self._wait(self._replies.setdefault(tag, deque()), watchdog)

    def poll_reply(self, tag: Tag) -> Any:
        self._take()
        waiting = self._replies.get(tag)
        return waiting.popleft() if waiting else None

    def measure_clock(self, rounds: int) -> tuple[int, int, int]:
        return 0, 0, now()  # one host: one monotonic clock

    def shutdown(self) -> None:
        self._write(("shutdown",))

    def _write(self, msg: tuple, data: np.ndarray | None = None) -> None:
        try:
            self._out.send(msg)
            if data is not None:
                self._out.send_bytes(data)
        except OSError:
            self._ended()

    def wait_bye(self, deadline: float) -> bool:
        try:
            while self.channel.ready(max(0.0, deadline - time.monotonic())):
                if self._receive()[0] == "bye":
                    self._said_bye = True
                    self.proc.wait(max(0.0, deadline - time.monotonic()))
                    self._out.close()
                    self.conn.close()
                    return True
        except (EOFError, OSError, subprocess.TimeoutExpired):
            pass
        return False

    # receiving ------------------------------------------------------------------------------
    def _receive(self) -> tuple:
        msg = self.conn.recv()
        kind = msg[0]
        if kind == "done":
            if msg[1] is not None:
                self._acked = msg[1]
            for result in msg[2]:
                self._result(result)
        elif kind == "read":
            self._reads.append(np.frombuffer(self.conn.recv_bytes(), np.uint8))
        return msg

    def _result(self, result: tuple) -> None:
        kind = result[0]
        if kind == "read":
            self._reads.append(np.frombuffer(result[1], np.uint8))
        elif kind == "fault":
            self._reads.append(result[1])
        else:
            self._replies.setdefault(result[1], deque()).append(result[2])

    def _take(self) -> None:
        """Receive what has arrived, without waiting."""
        if self._said_bye:
            return
        try:
            while self.channel.ready():
                self._receive()
        except (EOFError, OSError):
            self._ended()

    def _ended(self) -> None:
        raise RuntimeError(f"gtmpi: worker rank 1 (the embedded worker process, pid "
                           f"{self.proc.pid}) ended (exit status {self.proc.wait()})") from None

    def _wait(self, queue: deque, watchdog: Callable[[], None] | None) -> Any:
        """The next item of ``queue``, once the worker has sent it."""
        self._take()
        while not queue:
            self.channel.wait(watchdog)
            self._take()
        return queue.popleft()


class ParentLink:
    """The worker's end (see worker.executor.HostLink)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.channel = _Channel(conn)
        self.uploads: deque[bytes] = deque()
        self.results: list[tuple] = []  # for the message that ends the batch

    def recv_upload(self, buf: np.ndarray) -> None:
        buf[:] = np.frombuffer(self.uploads.popleft(), np.uint8)

    def send_read(self, data: np.ndarray) -> None:
        if data.nbytes <= INLINE_BYTES:
            self.results.append(("read", data.tobytes()))
            return
        self.done(None)  # what came before it goes first; a copy into a pickle it is spared
        self.conn.send(("read",))
        self.conn.send_bytes(data)

    def send_read_fault(self, fault: Fault) -> None:
        self.results.append(("fault", fault))

    def reply(self, tag: int, obj: Any) -> None:
        self.results.append(("reply", tag, obj))

    reply_later = reply

    def done(self, seq: int | None) -> None:
        """Send what the batch produced (seq: the batch, acknowledged; None: not yet done)."""
        if self.results or seq is not None:
            self.conn.send(("done", seq, self.results))
            self.results = []

    def clock_pongs(self, rounds: int) -> None:
        pass

    def serve(self, executor: Any) -> None:
        """Execute batches in order until rank 0 says stop."""
        conn = self.conn
        done = 0
        while True:
            self.channel.wait()  # a trace times only the receipt
            start = time.perf_counter_ns()
            msg = conn.recv()
            kind = msg[0]
            if kind == "batch":
                if executor.trace is not None:
                    executor.received(start, msg[1], 0, len(msg[2]))
                executor.run(msg[2])
                done += 1
                self.done(msg[1] if done % ACK_EVERY == 0 or not self.channel.ready() else None)
            elif kind == "upload":
                self.uploads.append(conn.recv_bytes())
            elif kind == "shutdown":
                executor.close()  # its profiles written, its graphs gone before the process
                conn.send(("bye", executor.stats))
                return
