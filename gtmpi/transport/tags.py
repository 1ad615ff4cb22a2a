"""MPI tags. Each purpose also has its own communicator (see transport/mpi.py), so a tag
only has to be unique within its communicator; they are all distinct anyway, for traces."""
from enum import IntEnum

ACK_EVERY = 8  # while more batches wait, a worker acknowledges every this many (any link)

# A server's clients (gtmpi/server) share its workers: a message for or from one client's part
# of a worker carries the client's slot in its tag, SLOT_STRIDE * slot + the Tag, and between a
# client and the server the worker's rank in the same way. Slot 0 is the ordinary session.
SLOT_STRIDE = 32


class Tag(IntEnum):
    # ctrl communicator, rank 0 -> worker: pickled lists of instructions
    BATCH = 1
    SHUTDOWN = 2
    CLOCK_PING = 3  # only while the worker runs a 'clock' control word
    DROP = 4        # server -> worker: forget a client's slot (its tensors, programs, groups)
    ADMIT = 5       # server -> worker: a new client's slot
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
    DROPPED = 19  # a worker has forgotten a client's slot
    DEVICE = 29   # answers a 'device' control word: timings and properties of the device
    # data communicator: raw tensor bytes, never pickled
    UPLOAD = 20      # rank 0 -> worker (a server's client: through the server)
    READ_OK = 21     # worker -> rank 0 (a server's client's: on the reply communicator, slot in the tag)
    READ_FAULT = 22  # as READ_OK, empty; the Fault follows on the reply communicator
    BROKEN = 23      # reply communicator, worker -> server: a client's batch was not gtmpi's
    # between a server and one client (frames on their TCP connection), client -> server
    ROUND = 24       # the messages sent since the last ROUND go to the workers together
                     # (payload: how many uploads the client has sent, all told)
    LEAVE = 25       # the client is done: its tensors may go
    # server -> client
    GOODBYE = 27     # answers LEAVE: nothing of the client is left
    ENDING = 28      # (dropped, why): the server drops this client, or shuts down


# ends a Tag.GRAPH reply where a worker puts a capture off: the program is captured again at a
# later replay (a few times at most), while an autograd record it reads is made outside a graph
# (its producer's graph comes a replay later; a record cannot be copied in, so a graph bound to
# that one would never launch again)
GRAPH_LATER = "(tried again later)"
