"""Frames on a server's client connection (gtmpi/transport/frames.py), over a socket pair."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from conftest import UNDER_MPI
from gtmpi.transport.frames import HEADER, Channel

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="no MPI in it; run once, from the serial suite")


def _pair(limit=None) -> tuple[Channel, Channel]:
    a, b = socket.socketpair()
    return Channel(a), Channel(b, limit=limit)


def _until(cond, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_thousands_of_small_frames_in_one_chunk_come_in_order():
    ours, theirs = _pair()
    for i in range(5000):
        ours.send(i % 3, i, i.to_bytes(4, "little"))
    def moved() -> bool:
        ours.flush()
        theirs.pump()
        return len(theirs.frames) == 5000
    _until(moved)
    got = [(f.source, f.tag, int.from_bytes(f.body, "little")) for f in theirs.frames]
    assert got == [(i % 3, i, i) for i in range(5000)]


def test_a_large_frame_passes_a_socket_that_takes_it_in_pieces():
    ours, theirs = _pair()
    data = np.arange(4_000_000, dtype=np.float32)  # 16 MB: far more than a socket buffer
    through = ours.send(1, 21, data)
    assert ours.queued > 0 and ours.sent < through  # nothing waited for the reader
    while not theirs.frames:
        ours.flush()
        theirs.pump()
    assert ours.sent == through and ours.queued == 0 and ours.stalled_since is None
    frame = theirs.frames.popleft()
    assert (frame.source, frame.tag) == (1, 21)
    assert np.array_equal(np.frombuffer(frame.body, np.float32), data)


def test_a_header_that_claims_a_gigabyte_costs_what_came_not_what_it_claims():
    a, b = socket.socketpair()
    theirs = Channel(b)
    a.sendall(HEADER.pack(0, 5, 1 << 30) + b"four")
    _until(lambda: (theirs.pump(), theirs._got == 4)[1])
    assert len(theirs._body) <= 1 << 20 and not theirs.frames
    a.close()


def test_a_frame_over_its_limit_is_refused_from_its_header_and_the_peer_still_told():
    ours, theirs = _pair(limit=lambda tag: 1000 if tag == 1 else 10)
    ours.send(0, 1, bytes(1000))
    ours.send(0, 2, bytes(11))
    ours.send(0, 1, bytes(5))
    _until(lambda: theirs.pump() or theirs.refused)
    assert len(theirs.frames) == 1 and len(theirs.frames[0].body) == 1000  # and no more
    assert theirs.refused == "a message of 11 bytes, over its limit of 10"
    theirs.send(0, 28, b"why")  # told, then what still comes is read into nothing
    theirs.discard()
    theirs.shut_writes()
    ours.send(0, 1, bytes(100_000))

    def both() -> bool:
        theirs.pump()
        ours.pump()
        return ours.flush() and bool(ours.frames)
    _until(both)
    assert bytes(ours.frames[0].body) == b"why"
    assert not theirs.frames and theirs.refused is None
    ours.close()
    _until(lambda: theirs.pump() or theirs.closed)


def test_a_frame_cut_short_is_seen_arriving_and_the_peers_end_is_seen():
    a, b = socket.socketpair()
    theirs = Channel(b)
    a.sendall(HEADER.pack(0, 1, 100) + bytes(10))
    _until(lambda: theirs.pump() or theirs.stalled_for() > 0.05)
    assert not theirs.frames and not theirs.closed
    a.sendall(bytes(90) + HEADER.pack(0, 2, 0) + b"\x01")  # the rest, an empty frame, a byte
    _until(lambda: theirs.pump() or len(theirs.frames) == 2)
    assert [len(f.body) for f in theirs.frames] == [100, 0]
    time.sleep(0.01)
    assert theirs.stalled_for() > 0  # a header's first byte is a frame begun
    a.close()
    _until(lambda: theirs.pump() or theirs.closed)


def test_what_the_first_lines_left_over_is_the_start_of_the_frames():
    a, b = socket.socketpair()
    whole = HEADER.pack(4, 5, 3) + b"abc" + HEADER.pack(6, 7, 2)
    theirs = Channel(b, already=whole)
    a.sendall(b"de")
    _until(lambda: theirs.pump() or len(theirs.frames) == 2)
    assert [(f.source, f.tag, bytes(f.body)) for f in theirs.frames] == [(4, 5, b"abc"),
                                                                          (6, 7, b"de")]
