"""MPI tags. Each purpose also has its own communicator (see transport/mpi.py), so a tag
only has to be unique within its communicator; they are all distinct anyway, for traces."""
from enum import IntEnum

ACK_EVERY = 8  # while more batches wait, a worker acknowledges every this many (any link)


class Tag(IntEnum):
    # ctrl communicator, rank 0 -> worker: pickled lists of instructions
    BATCH = 1
    SHUTDOWN = 2
    CLOCK_PING = 3  # only while the worker runs a 'clock' control word
    # reply communicator, worker -> rank 0: small pickled objects
    HELLO = 10
    ACK = 11      # payload: the sequence number of the last batch executed
    SYNC = 12
    STATS = 13
    FAULT = 14    # follows a READ_FAULT on the data communicator
    BYE = 15
    CLOCK = 16    # the worker's clock, answering a CLOCK_PING (the first one: "ready")
    TRACE = 17    # the worker's recorded events
    GRAPH = 18    # whether a program's CUDA graph was captured (None) or why not
    # data communicator: raw tensor bytes, never pickled
    UPLOAD = 20      # rank 0 -> worker
    READ_OK = 21     # worker -> rank 0
    READ_FAULT = 22  # worker -> rank 0, empty; the Fault follows on the reply communicator
