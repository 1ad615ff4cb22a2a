"""The embedded default: one worker executor inside the user's process, no MPI at all.

Both ends of the link are this one object; a batch executes when it is sent, so the
dispatcher's batching still decides when work happens.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

import numpy as np

from ..errors import Fault
from ..recording.events import now
from .tags import Tag


class LocalLink:
    def __init__(self) -> None:
        self.executor = None  # set once the executor that uses this link exists
        self._uploads: deque[np.ndarray] = deque()
        self._read: np.ndarray | Fault | None = None
        self._replies: dict[int, deque] = {}  # per tag, in order (trace parts can queue up)
        self._seq = 0

    # rank 0's end (see transport.mpi.WorkerLink) ------------------------------------------
    def send(self, batch: list, seq: int) -> None:
        if self.executor.trace is not None:
            self.executor.received(time.perf_counter_ns(), seq, 0, len(batch))
        self.executor.run(batch)
        self._seq = seq

    def upload(self, data: np.ndarray) -> None:
        self._uploads.append(data)

    def start_read(self, buf: np.ndarray) -> np.ndarray:
        return buf

    def finish_read(self, buf: np.ndarray, watchdog: Callable[[], None]) -> Fault | None:
        result, self._read = self._read, None
        if isinstance(result, Fault):
            return result
        buf[:] = result
        return None

    def poll_ack(self) -> int:
        return self._seq

    def moving(self) -> bool:
        return False  # its uploads are handed over whole

    def wait_reply(self, tag: Tag, watchdog: Callable[[], None] | None = None) -> Any:
        return self._replies[tag].popleft()

    def poll_reply(self, tag: Tag) -> Any:
        waiting = self._replies.get(tag)
        return waiting.popleft() if waiting else None

    def measure_clock(self, rounds: int) -> tuple[int, int, int]:
        return 0, 0, now()  # one process, one clock

    def shutdown(self) -> None:
        self.executor = None

    def wait_bye(self, deadline: float) -> bool:
        return True

    # the worker's end (see worker.executor.HostLink) --------------------------------------
    def recv_upload(self, buf: np.ndarray) -> None:
        buf[:] = self._uploads.popleft()

    def send_read(self, data: np.ndarray) -> None:
        self._read = data

    def send_read_fault(self, fault: Fault) -> None:
        self._read = fault

    def reply(self, tag: int, obj: Any) -> None:
        self._replies.setdefault(tag, deque()).append(obj)

    reply_later = reply

    def clock_pongs(self, rounds: int) -> None:
        pass
