"""A worker's life: greet rank 0, execute batches in order, acknowledge them, exit on shutdown.

The loop never blocks in MPI: between batches it waits with transport.poll.wait_for (a short
spin, since the next batch usually follows at once, then sleeps of growing length), so an idle
worker costs almost no CPU. While sleeping it checks that rank 0 is still alive when they
share a host.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Callable

import torch
from mpi4py import MPI

from ..transport.mpi import Comms, HostLink
from ..transport.ending import alive
from ..transport.poll import wait_for
from ..transport.tags import ACK_EVERY, Tag
from .dataplane import DataPlane
from .executor import Executor



def serve(comms: Comms, workers_comm: MPI.Intracomm, device: torch.device, local_index: int,
          host0: tuple[str, int], leaving: Callable[[], None] = lambda: None) -> None:
    """``leaving`` is called before the worker exits because rank 0 is gone: it did not die,
    and its death watcher must not say it did."""
    rank = comms.base.Get_rank()
    link = HostLink(comms)
    executor = Executor(rank, device, link)
    executor.plane = DataPlane(rank, device, workers_comm)
    link.reply(Tag.HELLO, {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                           "device": str(device), "local_index": local_index, "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None})
    status = MPI.Status()
    watchdog = _exit_if_gone(host0[1], leaving) if host0[0] == socket.gethostname() else None
    seq = 0
    while True:
        msg = wait_for(lambda: link.next_message(status), watchdog)
        if status.Get_tag() == Tag.SHUTDOWN:
            msg.recv()
            executor.close()
            executor.plane.finish()
            link.drain()
            link.reply(Tag.BYE, executor.stats)
            return
        seq += 1
        if executor.trace is None:
            executor.run(msg.recv())
        else:
            start = time.perf_counter_ns()
            batch = msg.recv()
            executor.received(start, seq, status.Get_count(MPI.BYTE), len(batch))
            executor.run(batch)
        if seq % ACK_EVERY == 0 or not link.more_waiting():
            link.ack(seq)


def _exit_if_gone(pid: int, leaving: Callable[[], None]):
    def check() -> None:
        if not alive(pid):
            leaving()
            os._exit(1)  # rank 0 is gone: nobody will ever send a shutdown
    return check
