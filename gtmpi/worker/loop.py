"""A worker's life: greet rank 0, execute batches in order, acknowledge them, exit on shutdown.

The loop never blocks in MPI: between batches it waits with transport.poll.wait_for (a short
spin, since the next batch usually follows at once, then sleeps of growing length), so an idle
worker costs almost no CPU. While sleeping it checks that rank 0 is still alive when they
share a host.

Under a server (gtmpi/server) the worker serves several clients: each has a slot, carried in
the tags of its messages, and an executor of its own (its tensors, programs, CUDA graphs and
process groups), so that no client can reach another's tensors whatever ids it sends. Slot 0 is
the ordinary session, and the server's own.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable

import torch
from mpi4py import MPI

from ..transport import wire
from ..transport.mpi import Comms, HostLink
from ..transport.ending import alive
from ..transport.poll import wait_for
from ..transport.tags import ACK_EVERY, SLOT_STRIDE, Tag
from .bounds import IndexGuard
from .dataplane import DataPlane
from .executor import Executor
from .meeting import GRACE_S, Meeting


class Slots:
    """The executors of one worker, by slot: the session's (0), and one per client of a server,
    made when the client is admitted."""

    def __init__(self, rank: int, device: torch.device, link: HostLink,
                 workers_comm: MPI.Intracomm) -> None:
        self.rank, self.device, self.link, self.workers_comm = rank, device, link, workers_comm
        self.executors: dict[int, Executor] = {}
        self.seq: dict[int, int] = {}  # batches executed per slot (what its acks count)
        self.broken: set[int] = set()  # slots whose batches this worker could not run
        self.meeting: Meeting | None = None  # a server's, made at its first client
        self.dropping: set[int] = set()  # slots being freed: their waits end at once
        self.current: int | None = None  # the slot whose batch runs now
        self._waited: dict[int, float] = {}  # slot -> since when a partner waits for it here
        self._next_judge = 0.0
        self._add(0, link).executors = self.executors  # slot 0's monitor reports every slot

    def _add(self, slot: int, link: HostLink) -> Executor:
        ex = self.executors[slot] = Executor(self.rank, self.device, link)
        client = None
        if slot:
            if self.meeting is None:
                self.meeting = Meeting(self.workers_comm, self.rank)
            self.meeting.admit(slot)
            client = (self.meeting, slot, lambda: self._dropped(slot))
        ex.plane = DataPlane(self.rank, self.device, self.workers_comm, self.link.take_waiting,
                             client)
        if slot:
            ex.slot, ex.quota = slot, self.executors[0].client_quota
            # one client's bad index must not end the worker, whatever GTMPI_INDEX_GUARD says
            if self.device.type == "cuda" and ex.index_guard is None:
                ex.index_guard = IndexGuard(self.device)
        self.seq[slot] = 0
        return ex

    def admit(self, slot: int) -> None:
        """A new client of the server."""
        self._add(slot, self.link.for_slot(slot))

    def run(self, slot: int, ex: Executor, batch: Any) -> bool:
        """A client's batch. One this worker cannot run at all (not instructions as gtmpi's
        dispatcher makes them: a bug, or a hostile client) must not end the server: the
        client's later batches are skipped here, and the server is told, which drops it.
        Nothing of a batch that is not instructions runs (transport/wire.py)."""
        try:
            if isinstance(batch, wire.Refused):
                raise batch
            wire.check(batch, ex.client_words)
            ex.run(batch)
            return True
        except Exception as e:  # an op's own failure never gets here: it poisons its result
            self.broken.add(slot)
            self.link.reply(Tag.BROKEN, (slot, f"{type(e).__name__}: {e}"[:500]))
            return False

    def judge(self) -> None:
        """Break each client that a partner has waited for here for GRACE_S (a collective or
        transfer of its, past this worker's count) while this worker held none of its work:
        this worker was never sent its part (worker/meeting.py). Looked at every 0.1 s, idle
        or waiting in another client's collective."""
        now = time.monotonic()
        if self.meeting is None or now < self._next_judge:
            return
        self._next_judge = now + 0.1
        waited = self.meeting.waited_for()
        self._waited = {slot: since for slot, since in self._waited.items() if slot in waited}
        held = {m.tag // SLOT_STRIDE for m in self.link.inbox.ctrl}
        for slot, what in waited.items():
            if slot == self.current or slot in self.broken or slot not in self.executors or \
                    slot in held:
                self._waited.pop(slot, None)
                continue
            if now - self._waited.setdefault(slot, now) > GRACE_S:
                self.broken.add(slot)
                self.link.reply(Tag.BROKEN, (slot, f"{what}, which worker rank {self.rank} was "
                                             "never sent: a collective or transfer sent to some "
                                             "of its members only"))

    def _dropped(self, slot: int) -> str | None:
        """Why a client's collective waits no longer: the server dropped the client (or is
        stopping), or its slot is being freed; None while neither. Takes what rank 0 sent, and
        judges the other clients meanwhile."""
        self.link.take_waiting()
        self.judge()
        if slot in self.dropping or any(
                m.tag in (Tag.DROP + SLOT_STRIDE * slot, Tag.SHUTDOWN) for m in self.link.inbox.ctrl):
            return "the server dropped the client while its workers waited for one another"
        return None

    def drop(self, slot: int) -> None:
        """A server's client has gone: everything it had here goes too."""
        ex = self.executors.pop(slot, None)
        self.seq.pop(slot, None)
        self.broken.discard(slot)
        if ex is not None:
            ex.close()
            self.dropping.add(slot)
            ex.plane.finish(everything=False)
            self.dropping.discard(slot)
            ex.env.clear()
            ex.poison.clear()
            ex.programs.clear()
            ex.ready.clear()
            ex.waits.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        # bytes a killed client sent for uploads it never asked for: received into nothing
        self.link.inbox.uploads.pop(Tag.UPLOAD + SLOT_STRIDE * slot, None)
        status, data = MPI.Status(), self.link.comms.data
        while (msg := data.improbe(0, Tag.UPLOAD + SLOT_STRIDE * slot, status)) is not None:
            msg.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE])
        if self.meeting is not None:
            self.meeting.forget(slot)
        self.link.reply(Tag.DROPPED, slot)


def serve(comms: Comms, workers_comm: MPI.Intracomm, device: torch.device, local_index: int,
          host0: tuple[str, int], leaving: Callable[[], None] = lambda: None) -> None:
    """``leaving`` is called before the worker exits because rank 0 is gone: it did not die,
    and its death watcher must not say it did."""
    rank = comms.base.Get_rank()
    link = HostLink(comms)
    slots = Slots(rank, device, link, workers_comm)
    executor = slots.executors[0]
    link.reply(Tag.HELLO, {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                           "device": str(device), "local_index": local_index, "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None})
    watchdog = _exit_if_gone(host0[1], leaving) if host0[0] == socket.gethostname() else None

    def next_message() -> Any:
        msg = link.next_message()
        if msg is None:
            slots.judge()
        return msg

    while True:
        msg = wait_for(next_message, watchdog)
        slot, tag = divmod(msg.tag, SLOT_STRIDE)
        if tag == Tag.SHUTDOWN:
            for other in [s for s in slots.executors if s]:
                slots.drop(other)
            executor.close()
            executor.plane.finish()
            link.drain()
            link.reply(Tag.BYE, executor.stats)
            return
        if tag == Tag.DROP:
            slots.drop(slot)
            continue
        if tag == Tag.ADMIT:
            slots.admit(slot)
            continue
        ex = slots.executors.get(slot)
        if ex is None or slot in slots.broken:  # a client dropped, or broken
            continue
        seq = slots.seq[slot] = slots.seq[slot] + 1
        batch = msg.body
        if ex.trace is not None:
            ex.received(time.perf_counter_ns(), seq, msg.nbytes, len(batch))
        if not slot:
            if isinstance(batch, wire.Refused):  # from this job's own rank 0: a bug of gtmpi's
                raise RuntimeError(f"gtmpi: worker {rank} was sent {batch}")
            ex.run(batch)
        else:
            slots.current = slot
            ran = slots.run(slot, ex, batch)
            slots.current = None
            if not ran:
                continue
        # a server's client is acknowledged every batch: the server paces each client by them
        if slot or seq % ACK_EVERY == 0 or not link.more_waiting():
            ex.link.ack(seq)


def _exit_if_gone(pid: int, leaving: Callable[[], None]):
    def check() -> None:
        if not alive(pid):
            leaving()
            os._exit(1)  # rank 0 is gone: nobody will ever send a shutdown
    return check
