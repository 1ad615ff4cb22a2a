"""A worker's figures, pushed to rank 0's hub every interval by a thread of its own (Pusher).

The thread reads the executors' counters without locks (the worker's loop keeps writing them):
a figure may be one batch old, never wrong by more. It costs the worker a wake-up and one small
TCP write per interval.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..transport.rendezvous import dial
from .hub import INTERVAL_S


class Pusher:
    """The pushing thread, stopped before its worker exits: a thread still inside torch as the
    interpreter finalizes aborts the process ("pure virtual method called", seen on a GPU
    worker whose job ended while it read the device's memory)."""

    def __init__(self, address: tuple[str, int], token: str, rank: int,
                 figures: Callable[[], dict[str, Any]]) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address, token, rank, figures),
                                        name="gtmpi-monitor-push", daemon=True)
        self._thread.start()

    def _run(self, address: tuple[str, int], token: str, rank: int,
             figures: Callable[[], dict[str, Any]]) -> None:
        try:
            lines = dial({"host": address[0], "port": address[1], "token": token},
                         {"role": "worker", "rank": rank})
        except OSError:
            return  # no hub (it ended): nothing to report to
        while not self._stopped.is_set():
            try:
                body = figures()
            except RuntimeError:  # a table changed size while it was read: next time
                self._stopped.wait(INTERVAL_S)
                continue
            if not lines.send({"rank": rank, "time": time.time(), **body}):
                return
            self._stopped.wait(INTERVAL_S)
        lines.close()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)


def figures(executors: dict[int, Any]) -> dict[str, Any]:
    """A worker's figures: its device memory (or, on a CPU, the tensors' bytes) and, per slot
    (0: the ordinary session or the server itself; others: a server's clients), counters of
    what ran: instructions by kind, host time busy in batches and waiting in them, tensors held."""
    first = executors[min(executors)]
    slots = {}
    for slot, ex in list(executors.items()):
        st = ex.stats
        busy = st["exec_ns"]
        started = ex.batch_start  # read after: a batch that ends between is counted next time
        if started is not None:
            busy += time.perf_counter_ns() - started
        comm = dict(ex.plane.stats) if ex.plane is not None else {}
        transfers = sum(v[0] for k, v in comm.items() if k in ("send", "recv"))
        collectives = sum(v[0] for k, v in comm.items() if k not in ("send", "recv"))
        slots[str(slot)] = {
            "ops": st["ops"], "control": st["control"], "collectives": collectives,
            "transfers": transfers, "batches": st["batches"], "faults": st["faults"],
            "exec_ns": busy, "wait_ns": st["wait_ns"],
            "bytes_moved": st["bytes_received"] + st["bytes_sent"]
            + sum(v[1] for v in comm.values()),
            "tensors": len(ex.env), "held_bytes": ex._held_bytes()}
    memory = first.memory()
    if first.device.type != "cuda":
        # a CPU worker's tensors are its slots' (a server's own slot 0 holds none)
        memory["memory_bytes"] = sum(s["held_bytes"] for s in slots.values())
    return {"device": str(first.device), **memory, "slots": slots}
