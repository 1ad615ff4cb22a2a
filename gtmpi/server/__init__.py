"""A server: one set of workers shared by many client programs.

    mpiexec -n N python -m gtmpi.server --port-file PATH

Rank 0 runs no program of its own: it waits for clients and forwards their work; ranks 1..N-1
are workers as in any run. A client (``gtmpi.connect(PATH)``, or ``GTMPI_CONNECT=PATH`` for an
unchanged script, started as plain ``python``) keeps its own session: its tensors, autograd,
signals, configs and placement are its own, and its dispatcher turns its ops into per-worker
batches as in an ordinary run. A client speaks to this process alone, over the TCP connection
it joined with (transport/frames.py), never over MPI: its batches, uploads, the workers' replies
and its reads all pass through here, relayed to and from the workers over the job's own
communicators. So a client leaves nothing behind in MPI (MPICH keeps about 80 KB of every
process a job ever connected to, in every rank), and it is started as any program is.

What the server guarantees:
- Isolation. Each client has a slot; a worker keeps every slot's tensors, programs, graphs and
  process groups apart (worker/loop.py), and a client's messages reach only its own slot,
  whatever ids they name. A per-client quota (``--quota-gb``) bounds the bytes a client's
  tensors hold on each worker; past it, what it made last is dropped with a MemoryError.
- Order. A client sends in rounds (dispatcher.end_round): a round has every part of each
  transfer and collective in it. The server hands a round to the workers whole, so every worker
  sees the clients' collectives in one order and none waits in one for a part held back.
- Fairness. Rounds go out one per client in turn, and while several clients have work a
  client's next round waits until the workers have acknowledged its last batch, so a client in
  a tight loop keeps the workers' queues short for the others (clients batch at most
  SHARED_BATCH_MAX instructions).
- Clients that go. A client leaves with LEAVE (at exit); one killed is seen by the end of its
  TCP connection. Either way its slot is dropped on every worker, freeing its memory, and the
  server carries on.
- No worker waits on a client. A client's uploads reach a worker through this process, and a
  round goes to the workers only once every upload sent before it is here (a client killed
  mid-send would otherwise leave a worker waiting for bytes that never come, and the other
  workers waiting for it in a collective). A worker's reads go to this process, which always
  takes them, so no worker waits on a client that does not read.
- Shutdown on request (``python -m gtmpi.server --stop --port-file PATH``) or SIGTERM: every
  client is told (ENDING), then the workers stop.
"""
from __future__ import annotations

import collections
import os
import signal
import sys
import time
from typing import Any

from mpi4py import MPI

from ..monitor.hub import Hub
from ..recording.events import now
from ..transport.frames import Channel
from ..transport.mpi import CLIENT_TIMEOUT_S, Sends
from ..transport import wire
from ..transport.rendezvous import LOOPBACK, Lines
from ..transport.tags import SLOT_STRIDE, Tag
from .tracing import ServerTrace

# a client's batches at the workers, unacknowledged, before its next round waits: several
# while no other client has work (the workers never idle between its rounds), one otherwise
# (another client's read then waits behind at most one batch of each)
INFLIGHT_ALONE = 4
INFLIGHT_SHARED = 1
# a message begun that moves no further for this long: its sender died; a client that takes
# nothing of what it was sent (a read) for this long: dropped
RECV_DEADLINE_S = TAKES_S = CLIENT_TIMEOUT_S
# the largest message a client may send but an upload (a batch of instructions is far smaller);
# an upload may be as large as the client's quota, if the server has one
MESSAGE_MAX = 64 << 20
UPLOAD_MAX = 1 << 62
GRACE_S = 2.0  # how long clients get, once told the server ends, before the workers stop


def printable(text: str) -> str:
    """``text`` with every character that is not printable (a newline, a terminal escape)
    written as its escape: a log line a client's words cannot break or forge."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


class Client:
    def __init__(self, slot: int, chan: Channel, hello: dict[str, Any]) -> None:
        self.slot = slot
        self.chan = chan
        # what the client says of itself goes into the server's log: one line each, whatever
        # it sent (a newline in a name would write a line of the client's choosing)
        self.name = printable(str(hello.get("name", "?"))[:80])
        pid = hello.get("pid")
        self.pid = pid if type(pid) is int else None
        self.host = printable(str(hello.get("host", "?"))[:80])
        # whole rounds not yet sent on: (their batches, when the last part arrived, how many
        # uploads the client had sent by then)
        self.rounds: collections.deque[tuple[list, int, int]] = collections.deque()
        self.current: list = []  # the round still arriving: (worker rank, batch bytes)
        self.uploads = 0  # uploads relayed to the workers
        self.unacked = 0
        self.state = "live"  # live, leaving (asked), dropping (slot being freed), gone
        self.killed = False
        self.drops = 0  # workers yet to confirm the slot dropped
        self.closing_by: float | None = None  # gone: its last words are flushed until then
        self.shut = False  # its connection shut for writing, all said
        self.joined = time.time()
        self.counts = {"rounds": 0, "batches": 0, "bytes_in": 0, "bytes_out": 0}

    def about(self) -> dict[str, Any]:
        return {"slot": self.slot, "name": self.name, "pid": self.pid, "host": self.host,
                "state": self.state, "queued_rounds": len(self.rounds),
                "unacked": self.unacked, "since": self.joined, **self.counts}


class Server:
    def __init__(self, port_file: str, quota_gb: float | None = None,
                 trace: str | None = None, bind: str = LOOPBACK) -> None:
        from ..client import runtime as session
        rt = session.current()
        if rt is None or not rt.workers or any(w.get("embedded") for w in rt.workers.values()):
            raise SystemExit("gtmpi.server: start it with mpiexec (or srun), with one rank for "
                             "the server and one per worker: mpiexec -n 3 python -m gtmpi.server "
                             "--port-file PATH")
        self.rt = rt
        d = rt.dispatcher
        self.ranks = sorted(d.links)
        self.comms = d.links[self.ranks[0]].comms
        self.clients: dict[int, Client] = {}
        self.closing: list[Client] = []  # gone, their last words (goodbye, why) still flushing
        self.gone: list[dict] = []  # the last 100 clients that left or were dropped (monitor)
        self._next_slot = 1
        self._max_slot = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) // SLOT_STRIDE - 1
        self._turn = 0
        self._out = Sends()  # to the workers
        self.ending: str | None = None
        self.hub = Hub(port_file, "server", extra=self._figures, bind=bind,
                       workers=len(self.ranks), ranks=self.ranks)
        self.quota = int(quota_gb * 1e9) if quota_gb else None
        self.trace = ServerTrace(trace, rt.workers) if trace else None
        d.post("serving", (self.quota,), self.ranks)
        d.post("monitor", (self.hub.address, self.hub.token), self.ranks)

    def _figures(self) -> dict[str, Any]:
        return {"clients": [c.about() for c in list(self.clients.values())],
                "left": self.gone[-20:], "quota_bytes": self.quota}

    # the loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        previous = signal.signal(signal.SIGTERM, lambda *_: self.stop("SIGTERM"))
        print(f"gtmpi.server: {len(self.ranks)} worker(s) ready; clients connect with "
              f"GTMPI_CONNECT={self.hub.port_file}", file=sys.stderr, flush=True)
        idle_since = None
        try:
            while True:
                moved = self._arrivals()
                for c in list(self.clients.values()):
                    try:
                        moved |= self._from_client(c)
                    except Exception as e:  # a bug met by a client's bytes: that client goes
                        self._expel(c, f"the server could not take its message ({type(e).__name__}: "
                                    f"{e})"[:300])
                        moved = True
                moved |= self._from_workers()
                moved |= self._schedule()
                moved |= self._to_clients()
                if self.ending is not None and self._ended():
                    return
                if moved:
                    idle_since = None
                    continue
                t = time.perf_counter()
                idle_since = idle_since or t
                time.sleep(0 if t - idle_since < 0.002 else 0.0005)
        except KeyboardInterrupt:
            self.stop("Ctrl-C")
            while not self._ended():
                self._from_workers()
                time.sleep(0.001)
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.hub.close()
            for c in [*self.clients.values(), *self.closing]:  # their last words, briefly
                deadline = time.monotonic() + 0.5
                while not c.chan.flush() and time.monotonic() < deadline:
                    time.sleep(0.001)
                c.chan.close()
            if self.trace is not None:
                print(f"gtmpi.server: trace written to {self.trace.write()}", file=sys.stderr,
                      flush=True)

    def stop(self, why: str) -> None:
        """Shut down: every client is told, and GRACE_S later the rest is dropped."""
        if self.ending is not None:
            return
        self.ending = why
        self._ending_at = time.monotonic() + GRACE_S
        print(f"gtmpi.server: shutting down ({why})", file=sys.stderr, flush=True)
        for c in self.clients.values():
            if c.state in ("live", "leaving"):
                self._to_client(c, Tag.ENDING, wire.dumps((False, why)))

    def _ended(self) -> bool:
        if time.monotonic() > self._ending_at:
            for c in list(self.clients.values()):
                if c.state in ("live", "leaving"):  # told, and not gone: never waited for
                    self._drop(c, killed=True)
        return not self.clients

    # clients arriving -------------------------------------------------------------------------

    def _arrivals(self) -> bool:
        moved = False
        while not self.hub.arrivals.empty():
            role, lines, hello = self.hub.arrivals.get()
            moved = True
            if role == "stop":
                lines.send({"stopping": True})
                lines.close()
                self.stop("asked by a stop request")
            elif self.ending is not None:
                lines.send({"refused": f"the server is shutting down ({self.ending})"})
                lines.close()
            else:
                self._admit(lines, hello)
        return moved

    def _admit(self, lines: Lines, hello: dict[str, Any]) -> None:
        slot = self._new_slot()
        if slot is None:
            lines.send({"refused": "the server has no free client slot"})
            lines.close()
            return
        # the workers make the slot before any of the client's batches reach them (one queue)
        for rank in self.ranks:
            self._to_worker(rank, self.comms.ctrl, Tag.ADMIT + SLOT_STRIDE * slot,
                            MPI.pickle.dumps(None))
        # a client gone by now is found so by its connection's end, and dropped as any other
        lines.send({"welcome": {"slot": slot, "workers": self.rt.workers,
                                "quota_bytes": self.quota}})
        chan = Channel(lines.sock, already=lines.rest(), limit=self._limit)
        chan.closed = chan.closed or lines.closed
        c = self.clients[slot] = Client(slot, chan, hello)
        if self.trace is not None:
            self.trace.joined(slot, c.name, c.pid, c.host)

    def _limit(self, tag: int) -> int:
        """The largest message a client may send with ``tag`` (its worker's rank in it)."""
        return (self.quota or UPLOAD_MAX) if tag % SLOT_STRIDE == Tag.UPLOAD else MESSAGE_MAX

    def _new_slot(self) -> int | None:
        for _ in range(self._max_slot):
            slot = self._next_slot
            self._next_slot = slot + 1 if slot < self._max_slot else 1
            if slot not in self.clients:
                return slot
        return None

    # clients' messages ------------------------------------------------------------------------

    def _from_client(self, c: Client) -> bool:
        if c.state not in ("live", "leaving"):
            return False
        moved = False
        while (taken := self._take(c)) is not None:
            moved = True
            buf, full_tag, why = taken
            rank, tag = divmod(full_tag, SLOT_STRIDE)
            # what goes on to a worker names one; the rest is for the server alone
            for_worker = tag in (Tag.BATCH, Tag.UPLOAD, Tag.CLOCK_PING)
            if buf is None or tag < 0 or (rank not in self.ranks if for_worker else rank != 0):
                self._expel(c, why or f"a message (tag {tag}) for rank {rank}, where no such "
                            "message goes")
                return True
            c.counts["bytes_in"] += len(buf)
            if tag == Tag.BATCH:
                c.current.append((rank, buf))
            elif tag == Tag.UPLOAD:
                c.uploads += 1
                if self.trace is not None:
                    self.trace.relayed(c.slot, "upload", len(buf), rank)
                # the upload instruction's batch may still be in a round held back: the bytes
                # wait at the worker, matched by their tag, until it runs
                self._to_worker(rank, self.comms.data, Tag.UPLOAD + SLOT_STRIDE * c.slot, buf)
            elif tag == Tag.ROUND:
                uploads = _count(buf)
                if uploads is None:
                    self._expel(c, "a round whose payload is not its count of uploads")
                    return True
                if c.current:
                    c.rounds.append((c.current, now(), uploads))
                    c.current = []
            elif tag == Tag.CLOCK_PING:  # a worker waits in its 'clock' word: now, not in turn
                self._to_worker(rank, self.comms.ctrl, Tag.CLOCK_PING + SLOT_STRIDE * c.slot, buf)
            elif tag == Tag.LEAVE:
                c.state = "leaving"
        if c.state == "leaving" and not c.rounds and not c.current:
            self._drop(c, killed=False)
        return moved

    def _take(self, c: Client) -> tuple[bytearray | None, int, str | None] | None:
        """The client's next message whole, as (its bytes, its tag, None); (None, -1, why) for
        one refused: larger than the client may send (refused from its header: no buffer for
        it is made), or begun and no further for RECV_DEADLINE_S (its sender died
        or stalls mid-message); None while nothing more has arrived. A message still arriving
        waits for a later turn of the loop: the other clients are served meanwhile."""
        c.chan.pump()
        if c.chan.frames:
            frame = c.chan.frames.popleft()
            return frame.body, frame.tag, None
        if c.chan.refused is not None:
            return None, -1, c.chan.refused
        if c.chan.stalled_for() > RECV_DEADLINE_S:
            return None, -1, (f"a message that stopped arriving (nothing more of it for "
                              f"{RECV_DEADLINE_S:.0f} s)")
        return None

    def _schedule(self) -> bool:
        """One whole round per client in turn, from clients not too far ahead whose uploads
        for it are all here."""
        busy = [c for c in self.clients.values() if c.rounds or c.unacked > 0]
        limit = INFLIGHT_ALONE if len(busy) <= 1 else INFLIGHT_SHARED
        live = [c for c in busy if c.rounds and c.unacked < limit and c.rounds[0][2] <= c.uploads]
        if not live:
            return False
        self._turn += 1
        start = self._turn % len(live)
        for c in live[start:] + live[:start]:
            batches, whole_at, _ = c.rounds.popleft()
            for rank, buf in batches:
                self._to_worker(rank, self.comms.ctrl, Tag.BATCH + SLOT_STRIDE * c.slot, buf)
                c.unacked += 1
                c.counts["batches"] += 1
            c.counts["rounds"] += 1
            if self.trace is not None:
                self.trace.forwarded(c.slot, whole_at, len(batches),
                                     sum(len(buf) for _, buf in batches))
        return True

    # workers' messages ------------------------------------------------------------------------

    def _from_workers(self) -> bool:
        moved = False
        status = MPI.Status()
        comm = self.comms.reply
        while (msg := comm.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)) is not None:
            moved = True
            buf = bytearray(status.Get_count(MPI.BYTE))
            msg.Recv([buf, MPI.BYTE])
            rank = status.Get_source()
            slot, tag = divmod(status.Get_tag(), SLOT_STRIDE)
            if slot == 0:
                if tag == Tag.DROPPED:
                    self._dropped(MPI.pickle.loads(buf))
                elif tag == Tag.BROKEN:
                    self._broken(rank, *MPI.pickle.loads(buf))
                continue  # acks of the server's own words
            c = self.clients.get(slot)
            if c is None:
                continue
            if tag == Tag.ACK:
                c.unacked -= 1
            if c.state in ("live", "leaving"):
                c.counts["bytes_out"] += len(buf)
                if tag in (Tag.READ_OK, Tag.READ_FAULT):  # as from the worker itself
                    self._to_client(c, tag, buf, source=rank)
                else:
                    self._to_client(c, tag + SLOT_STRIDE * rank, buf)
        return moved

    def _to_worker(self, rank: int, comm: MPI.Intracomm, tag: int, buf: Any) -> None:
        self._out.keep(comm.Isend([buf, MPI.BYTE], rank, tag), buf)

    def _to_client(self, c: Client, tag: int, buf: Any, source: int = 0) -> None:
        if not c.chan.closed:
            c.chan.send(source, tag, buf)

    # clients going ----------------------------------------------------------------------------

    def _to_clients(self) -> bool:
        """What the clients have not taken yet, sent on; a client whose connection ended is
        dropped, and one that takes nothing of what it was sent for TAKES_S is expelled."""
        moved = False
        for c in list(self.clients.values()):
            if c.state not in ("live", "leaving"):
                continue
            c.chan.flush()
            if c.chan.closed:
                self._drop(c, killed=True)
                moved = True
            elif c.chan.stalled_since is not None and \
                    time.monotonic() - c.chan.stalled_since > TAKES_S:
                self._expel(c, f"it did not take a read (or else what it was sent) within "
                            f"{TAKES_S:.0f} s")
                moved = True
        for c in list(self.closing):
            # its last words sent, the connection is shut for writing; what the client still
            # sends is read into nothing until it closes its end (closed with bytes unread,
            # the connection would reset, and the client could lose those last words)
            if c.chan.flush() and not c.shut:
                c.chan.shut_writes()
                c.shut = True
            c.chan.pump()
            if c.chan.closed or time.monotonic() > c.closing_by:
                c.chan.close()
                self.closing.remove(c)
        return moved

    def _drop(self, c: Client, killed: bool) -> None:
        """Free a client's slot on every worker, behind the rounds it was sent (a killed
        client's held-back rounds are dropped: they may lack their ends)."""
        c.killed = killed
        c.rounds.clear()
        c.current = []
        c.state = "dropping"
        c.drops = len(self.ranks)
        for rank in self.ranks:
            self._to_worker(rank, self.comms.ctrl, Tag.DROP + SLOT_STRIDE * c.slot,
                            MPI.pickle.dumps(None))

    def _broken(self, rank: int, slot: int, why: str) -> None:
        """A worker could not run a client's batch at all: the client is told, then dropped."""
        c = self.clients.get(slot)
        if c is None or c.state not in ("live", "leaving"):
            return
        self._expel(c, f"worker rank {rank} could not run a batch of this client ({why})")

    def _expel(self, c: Client, why: str) -> None:
        """Drop a client for what it sent, telling it why (its next read raises that)."""
        message = f"{why}; the server has dropped the client"
        print(f"gtmpi.server: client {c.slot} ({c.name}, pid {c.pid}): {printable(message)}",
              file=sys.stderr, flush=True)
        self._to_client(c, Tag.ENDING, wire.dumps((True, message)))
        self._drop(c, killed=True)

    def _dropped(self, slot: int) -> None:
        c = self.clients.get(slot)
        if c is None:
            return
        c.drops -= 1
        if c.drops:
            return
        del self.clients[slot]
        if c.killed:
            how = "gone (its connection ended)" if c.chan.closed else "dropped"
        else:
            self._to_client(c, Tag.GOODBYE, wire.dumps(None))
            how = "left"
        c.closing_by = time.monotonic() + 2.0  # what it was told last, then its connection ends
        c.chan.discard()
        self.closing.append(c)
        c.state = how.split()[0]
        if self.trace is not None:
            self.trace.left(slot, how)
        self.gone = [*self.gone[-99:], {**c.about(), "ended": time.time()}]
        print(f"gtmpi.server: client {slot} ({c.name}, pid {c.pid}) {how}; its tensors are "
              "freed", file=sys.stderr, flush=True)


def _count(buf: bytearray) -> int | None:
    """A ROUND's payload, the client's uploads sent all told; None if it is not one."""
    try:
        n = wire.loads(buf)
    except wire.Refused:
        return None
    return n if type(n) is int else None


def serve(port_file: str, quota_gb: float | None = None, trace: str | None = None,
          bind: str = LOOPBACK) -> None:
    """Run a server until it is stopped (rank 0 of an mpiexec job); the port file goes with it,
    however it ends."""
    try:
        Server(port_file, quota_gb, trace, bind).run()
    finally:
        try:
            os.unlink(port_file)
        except OSError:
            pass
