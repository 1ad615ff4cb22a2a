"""The event vocabulary of a trace: kinds, lanes, flags and the row layout of the file.

Every layer that records, stores or reads events uses these names; docs/trace-format.md is the
same table in prose.
"""
from __future__ import annotations

import os
import time
from enum import IntEnum

import numpy as np


class Kind(IntEnum):
    ISSUE = 1       # client: an op handed to the dispatcher (shape inference included)
    DISPATCH = 2    # dispatcher: an instruction received, placed and batched; peer = worker
    SEND = 3        # dispatcher: a batch sent; id = batch sequence number, count = instructions
    RECV = 4        # worker: a batch received and unpickled; bytes = message size
    EXEC = 5        # worker: one op executed; id = result id
    COLLECTIVE = 6  # worker: a collective between workers; detail = the group
    TRANSFER = 7    # tensor bytes moved: upload, read, or send/recv between workers; peer, bytes
    WAIT = 8        # client or dispatcher waiting: a read, a sync, back-pressure
    FREE = 9        # frees: batched by the dispatcher, executed by a worker; count = ids
    SCOPE = 10      # client: a named scope (gtmpi.trace.scope, signal scopes)
    REPLAY = 11     # a recorded instruction sequence replayed (hot paths)
    CONTROL = 12    # worker: a control word (sync, stats, clock, trace)


class Lane(IntEnum):
    CLIENT = 0
    DISPATCHER = 1
    WORKER = 2


class Flag(IntEnum):
    INSERTED = 1  # put into the stream by placement (a redistribution), not by the program
    GPU_TIMED = 2  # gpu_t0/gpu_t1 hold CUDA-event times
    FAULT = 4      # the op failed or consumed a poisoned operand


# One row of a rank's event table. Times are nanoseconds since the run's start on rank 0's
# clock (every rank aligned to it); -1 marks an absent value.
EVENT_DTYPE = np.dtype([
    ("t0", "i8"), ("t1", "i8"),
    ("kind", "u1"), ("lane", "u1"), ("flags", "u1"),
    ("name", "i4"),    # index into the string table: op, control word, scope, wait reason
    ("id", "i8"),      # tensor id, or batch sequence number
    ("peer", "i4"),    # the other rank of a send, receive or transfer
    ("bytes", "i8"),
    ("count", "i4"),
    ("detail", "i4"),  # index into the string table: a collective's group, a fault message
    ("gpu_t0", "i8"), ("gpu_t1", "i8"),
])

# Events are stamped with time.perf_counter_ns: CLOCK_MONOTONIC underneath, shared by the
# processes of one host and never stepped by NTP; ranks on different hosts are aligned by
# offsets measured over MPI. GTMPI_TRACE_CLOCK_SHIFT_NS shifts this rank's clock, so that a
# one-host test looks like hosts with clocks of their own and alignment is tested, not assumed.
CLOCK_SHIFT_NS = int(float(os.environ.get("GTMPI_TRACE_CLOCK_SHIFT_NS", "0")))


def now() -> int:
    """This rank's clock, as the events it records are stamped (shift included)."""
    return time.perf_counter_ns() + CLOCK_SHIFT_NS
