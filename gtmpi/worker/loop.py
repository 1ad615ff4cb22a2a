"""A worker's life: greet rank 0, execute batches in order, acknowledge them, exit on shutdown.

The loop never blocks in MPI: it probes, spins for a short window after each batch (the next
one usually follows at once), then sleeps with a growing interval, so an idle worker costs
almost no CPU. While sleeping it checks that rank 0 is still alive when they share a host.
"""
from __future__ import annotations

import os
import socket
import time

import torch
from mpi4py import MPI

from ..transport.mpi import Comms, HostLink
from ..transport.poll import MAX_SLEEP_S, SPIN_S, WATCH_EVERY_S
from ..transport.tags import Tag
from .executor import Executor

ACK_EVERY = 8  # while more batches wait, acknowledge every this many


def serve(comms: Comms, device: torch.device, local_index: int, host0: tuple[str, int]) -> None:
    rank = comms.base.Get_rank()
    link = HostLink(comms)
    executor = Executor(rank, device, link)
    link.reply(Tag.HELLO, {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                           "device": str(device), "local_index": local_index, "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None})
    status = MPI.Status()
    seq = 0
    last_work = time.perf_counter()
    next_watch = last_work + WATCH_EVERY_S
    sleep = 2e-5
    same_host = host0[0] == socket.gethostname()
    while True:
        msg = link.next_message(status)
        if msg is None:
            now = time.perf_counter()
            if now - last_work > SPIN_S:
                time.sleep(sleep)
                sleep = min(sleep * 2, MAX_SLEEP_S)
                if same_host and now > next_watch:
                    next_watch = now + WATCH_EVERY_S
                    _exit_if_gone(host0[1])
            continue
        if status.Get_tag() == Tag.SHUTDOWN:
            msg.recv()
            link.drain()
            link.reply(Tag.BYE, executor.stats)
            return
        executor.run(msg.recv())
        seq += 1
        if seq % ACK_EVERY == 0 or not link.more_waiting():
            link.ack(seq)
        last_work = time.perf_counter()
        sleep = 2e-5


def _exit_if_gone(pid: int) -> None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        os._exit(1)  # rank 0 is gone: nobody will ever send a shutdown
    except PermissionError:
        pass
