"""Traces: every rank's events of a run in one HDF5 file, read by the gtmpi-trace CLI.

    GTMPI_TRACE=run.h5 mpiexec -n 3 python train.py     # the whole run
    gtmpi.trace.start("part.h5") ... gtmpi.trace.stop()  # a part of a program
    with gtmpi.trace.scope("forward"): ...               # a named span on the client's lane

GTMPI_TRACE_GPU_EVERY=k times every k-th op of a GPU worker with CUDA events (default 32;
1 times every op, 0 none). docs/trace-format.md describes the file.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from ..recording.events import Kind, Lane


def start(path: str, gpu_every: int | None = None) -> None:
    """Start recording on every rank; the file is written at stop() (or at exit, or when the
    run fails)."""
    from ..client.runtime import runtime
    runtime().start_trace(path, gpu_every)


def stop() -> str:
    """Stop recording, gather every rank's events, write the file; return its path."""
    from ..client.runtime import runtime
    return runtime().stop_trace()


def active() -> bool:
    from ..client.runtime import current
    rt = current()
    return rt is not None and rt.tracing is not None


@contextmanager
def scope(name: str) -> Iterator[None]:
    """A named span on the client's lane (signal scopes use it too); free when not tracing."""
    from ..client.runtime import current
    rt = current()
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        rec = rt.dispatcher.trace if rt is not None else None
        if rec is not None:
            rec.event(Kind.SCOPE, Lane.CLIENT, start, time.perf_counter_ns(), name)
