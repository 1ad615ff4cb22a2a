"""The embedded default: one worker executor inside the user's process, no MPI at all.

Both ends of the link are this one object. On a CPU a batch executes when it is sent, in the
caller's thread (the worker's kernels would only compete with the client for the cores). On a
GPU the batches run on a worker thread, so that the client issues the next ops while the
worker launches kernels: torch lets go of the GIL inside each op, and the switch interval is
shortened so that neither thread waits long for the other to let go of it. The dispatcher's
batching decides when work happens either way.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import Any, Callable

import numpy as np

from ..errors import Fault
from ..trace.events import now
from .tags import Tag

# Python hands the GIL to a waiting thread only after this long (default 5 ms): a worker thread
# back from a kernel launch would wait that long behind a client issuing ops.
SWITCH_INTERVAL_S = 2e-5


class LocalLink:
    def __init__(self, threaded: bool = False) -> None:
        self.executor = None  # set once the executor that uses this link exists
        self._uploads: deque[np.ndarray] = deque()
        self._reads: deque[np.ndarray | Fault] = deque()
        self._replies: dict[int, deque] = {}  # per tag, in order (trace parts can queue up)
        self._seq = 0  # the last batch executed
        self._batches: deque[tuple[list, int] | None] = deque()
        self._changed = threading.Condition()  # a batch queued, or one executed, or a reply
        self._failure: BaseException | None = None
        self._thread = None
        if threaded:
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            self._thread = threading.Thread(target=self._serve, name="gtmpi-worker", daemon=True)
            self._thread.start()

    # rank 0's end (see transport.mpi.WorkerLink) ------------------------------------------
    def send(self, batch: list, seq: int) -> None:
        if self._thread is None:
            self._run(batch, seq)
            return
        with self._changed:
            self._batches.append((batch, seq))
            self._changed.notify_all()

    def upload(self, data: np.ndarray) -> None:
        self._uploads.append(data)

    def start_read(self, buf: np.ndarray) -> np.ndarray:
        return buf

    def finish_read(self, buf: np.ndarray, watchdog: Callable[[], None]) -> Fault | None:
        result = self._wait(self._reads)
        if isinstance(result, Fault):
            return result
        buf[:] = result
        return None

    def poll_ack(self) -> int:
        self._check()
        return self._seq

    def wait_reply(self, tag: Tag, watchdog: Callable[[], None] | None = None) -> Any:
        return self._wait(self._replies.setdefault(tag, deque()))

    def poll_reply(self, tag: Tag) -> Any:
        waiting = self._replies.get(tag)
        return waiting.popleft() if waiting else None

    def measure_clock(self, rounds: int) -> tuple[int, int, int]:
        return 0, 0, now()  # one process, one clock

    def shutdown(self) -> None:
        if self._thread is not None:
            with self._changed:
                self._batches.append(None)
                self._changed.notify_all()
            self._thread.join()
        self.executor = None

    def wait_bye(self, deadline: float) -> bool:
        return True

    # the worker's end (see worker.executor.HostLink) --------------------------------------
    def recv_upload(self, buf: np.ndarray) -> None:
        buf[:] = self._uploads.popleft()

    def send_read(self, data: np.ndarray) -> None:
        self._reads.append(data)

    def send_read_fault(self, fault: Fault) -> None:
        self._reads.append(fault)

    def reply(self, tag: int, obj: Any) -> None:
        self._replies.setdefault(tag, deque()).append(obj)

    reply_later = reply

    def clock_pongs(self, rounds: int) -> None:
        pass

    # the worker thread ----------------------------------------------------------------------
    def _run(self, batch: list, seq: int) -> None:
        if self.executor.trace is not None:
            self.executor.received(time.perf_counter_ns(), seq, 0, len(batch))
        self.executor.run(batch)
        self._seq = seq

    def _serve(self) -> None:
        while True:
            with self._changed:
                while not self._batches:
                    self._changed.wait()
                item = self._batches.popleft()
            if item is None:
                return
            try:
                self._run(*item)
            except BaseException as e:  # the executor's own bug: the client must hear of it
                self._failure = e
            with self._changed:
                self._changed.notify_all()
            if self._failure is not None:
                return

    def _check(self) -> None:
        if self._failure is not None:
            raise RuntimeError("gtmpi: the embedded worker thread failed") from self._failure

    def _wait(self, queue: deque) -> Any:
        """The next item of ``queue``, once the worker has put one there."""
        if not queue and self._thread is not None:
            with self._changed:
                while not queue:
                    self._check()
                    self._changed.wait()
        return queue.popleft()
