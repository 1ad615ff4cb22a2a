"""Framed messages over one TCP connection: what a server and each of its clients say.

A server's clients used to join the server's MPI job (Connect/Accept). MPICH keeps about 80 KB
of every process it ever connected to, in every rank, for the job's life (measured: 74-95 KB
per client per server process, a plain Connect/Accept of a new process alike, whether the
communicator is freed or disconnected), and a client killed while it was being connected
crashed the connecting ranks. So a client speaks TCP to the server's rank 0 alone, on the
connection it joined with, and rank 0 relays to the workers over the job's own communicators.

A frame is a header (source, tag, length: little-endian int32, int32, uint64) and that many
bytes. The receiver refuses a frame larger than its limit from the header alone, before any
buffer for it is made. Sends never block: what the socket does not take now waits in order for
the next ``flush``.
"""
from __future__ import annotations

import socket
import struct
import time
from collections import deque
from typing import Any, Callable

HEADER = struct.Struct("<iiQ")
BODY_START = 1 << 20  # a body's first buffer; it doubles as its bytes come


class Frame:
    __slots__ = ("source", "tag", "body")

    def __init__(self, source: int, tag: int, body: bytearray) -> None:
        self.source, self.tag, self.body = source, tag, body


class Channel:
    """One end of a framed connection. ``limit(tag)`` is the largest body a frame of that tag
    may carry; at one larger the channel takes no more frames, ``refused`` saying why (it can
    still send: the peer is told)."""

    def __init__(self, sock: socket.socket, already: bytes = b"",
                 limit: Callable[[int], int] | None = None) -> None:
        self.sock = sock
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self.limit = limit
        self.frames: deque[Frame] = deque()
        self.closed = False
        self.refused: str | None = None
        self.discarding = False  # what comes is read and thrown away (see discard)
        self._head = bytearray(already)  # header bytes (and, at first, whatever came after)
        self._body: bytearray | None = None  # the body being received, and how much of it
        self._got = 0
        self._size = 0  # the body's size, as its header says
        self._last_byte = time.monotonic()  # when bytes last came
        self._out: deque[memoryview] = deque()
        self.queued = 0  # bytes not yet taken by the socket
        self._total = 0  # bytes ever queued
        self.stalled_since: float | None = None  # since when queued bytes have not moved
        self._parse()

    # receiving ------------------------------------------------------------------------------

    def pump(self) -> None:
        """Take whatever the socket has now, into whole frames; never waits."""
        while not self.closed and self.refused is None:
            try:
                if self.discarding:
                    if not self.sock.recv(65536):
                        self.closed = True
                        return
                elif self._body is None:
                    chunk = self.sock.recv(65536)
                    if not chunk:
                        self.closed = True
                        return
                    self._head += chunk
                    self._last_byte = time.monotonic()
                    self._parse()
                else:
                    if self._got == len(self._body):  # grown as its bytes come (_parse)
                        self._body.extend(bytes(min(len(self._body), self._size - self._got)))
                    n = self.sock.recv_into(memoryview(self._body)[self._got:])
                    if not n:
                        self.closed = True
                        return
                    self._got += n
                    self._last_byte = time.monotonic()
                    if self._finish():
                        self._parse()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.closed = True
                return

    def _parse(self) -> None:
        """Whole frames out of the header buffer (a loop: a chunk may hold thousands)."""
        while self._body is None and len(self._head) >= HEADER.size:
            source, tag, size = HEADER.unpack_from(self._head)
            if self.limit is not None and size > self.limit(tag):
                self.refused = f"a message of {size:,} bytes, over its limit of {self.limit(tag):,}"
                return
            self._source, self._tag, self._size = source, tag, size
            start = HEADER.size
            self._got = min(size, len(self._head) - start)
            # memory for what came, doubled as more comes: a header is only the sender's word,
            # and one that claims a gigabyte and sends four bytes must not cost a gigabyte
            self._body = bytearray(max(self._got, min(size, BODY_START)))
            self._body[:self._got] = self._head[start:start + self._got]
            del self._head[:start + self._got]
            self._finish()

    def _finish(self) -> bool:
        if self._body is None or self._got < self._size:
            return False
        self.frames.append(Frame(self._source, self._tag, self._body))
        self._body = None
        return True

    def stalled_for(self) -> float:
        """Seconds since the last byte of a frame begun and not yet whole (0 if none is): a
        large upload over a slow network moves on, a sender that died or stalls does not."""
        if self._body is None and not self._head:
            return 0.0
        return time.monotonic() - self._last_byte

    # sending --------------------------------------------------------------------------------

    def send(self, source: int, tag: int, body: Any) -> int:
        """Queue a frame and send what the socket takes now. Returns the number of bytes
        queued through the end of this frame (``sent`` reaches it when it is all gone)."""
        view = memoryview(body).cast("B")
        self._out.append(memoryview(HEADER.pack(source, tag, view.nbytes)))
        if view.nbytes:
            self._out.append(view)
        self.queued += HEADER.size + view.nbytes
        self._total += HEADER.size + view.nbytes
        self.flush()
        return self._total

    @property
    def sent(self) -> int:
        return self._total - self.queued

    def flush(self) -> bool:
        """Send what the socket takes now; whether nothing is left queued."""
        moved = False
        while self._out and not self.closed:
            head = self._out[0]
            try:
                n = self.sock.send(head)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.closed = True
                break
            moved = moved or n > 0
            self.queued -= n
            if n == head.nbytes:
                self._out.popleft()
            else:
                self._out[0] = head[n:]
                break
        if not self._out:
            self.stalled_since = None
        elif moved or self.stalled_since is None:
            self.stalled_since = time.monotonic()
        return not self._out

    def discard(self) -> None:
        """Take no more frames: what still comes is read into nothing. A connection closed
        with bytes unread ends in a reset, which can wipe out what the peer has not read yet
        (the last thing it was told)."""
        self.discarding = True
        self.refused = None
        self.frames.clear()
        self._head.clear()
        self._body = None

    def shut_writes(self) -> None:
        """Say all is sent (the peer reads its end once it has taken the rest)."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.closed = True
        self._out.clear()
        self.queued = 0
        try:
            self.sock.close()
        except OSError:
            pass
