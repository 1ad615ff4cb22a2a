"""The embedded default: a plain ``python`` process with one worker and no MPI."""
from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
import traceback
from types import TracebackType

import torch

from ..errors import Terminated
from ..transport.local import LocalLink
from ..transport.early import discard as discard_early
from ..transport.pipe import start_child
from ..worker.device import select_device, visible_gpus
from ..worker.executor import Executor
from ..errors import NOT_USER
from .runtime import Runtime, current, set_default_start


def verbose(message: str) -> None:
    if os.environ.get("GTMPI_VERBOSE", "0") not in ("", "0"):
        print(f"gtmpi: {message}", file=sys.stderr, flush=True)


def start_embedded() -> Runtime:
    """One worker without MPI: inside this process on a CPU; on a GPU a child process, so that
    the worker launches kernels while this process issues the next ops (a thread would share
    the GIL with the client: measured no faster than running both in series)."""
    if os.environ.get("GTMPI_CONNECT"):
        from .remote import start_remote
        return start_remote(os.environ["GTMPI_CONNECT"])
    if os.environ.get("GTMPI_DRY_RUN"):
        from .dryrun import start_dry_run
        return start_dry_run(int(os.environ["GTMPI_DRY_RUN"]),
                             os.environ.get("GTMPI_DRY_RUN_GPU", "H100"))
    device = select_device(os.environ, 0, visible_gpus())
    choice = os.environ.get("GTMPI_EMBEDDED_PROCESS", "auto")
    if choice == "1" or (choice == "auto" and device.type == "cuda"):
        link, pid, how = start_child(device)
        atexit.register(_close)
        where = f"a worker process (pid {pid}, {how})"
    else:
        discard_early()
        link, pid = LocalLink(), os.getpid()
        link.executor = Executor(1, device, link)
        where = "this process"
    sys.excepthook = _quiet_interrupt(sys.excepthook)
    stop_on_sigterm()
    info = {"rank": 1, "host": socket.gethostname(), "pid": pid, "device": str(device),
            "local_index": 0, "torch": torch.__version__, "embedded": True}
    verbose(f"embedded worker in {where}: {device}")
    return Runtime({1: link}, {1: info})


def _close() -> None:
    rt = current()
    if rt is not None and rt.close():
        print("gtmpi: the worker process did not confirm shutdown", file=sys.stderr)


def _quiet_interrupt(previous):
    """Ctrl-C or SIGTERM in a plain process gets one line naming the program's line, not a
    traceback through gtmpi's waits; Python then ends as it does on Ctrl-C (status 1 on
    SIGTERM)."""
    def hook(kind, value, tb):
        line = stop_line(kind, tb)
        if line:
            print(line, file=sys.stderr, flush=True)
        else:
            previous(kind, value, tb)
    return hook


def stop_line(kind: type, tb: TracebackType | None) -> str:
    """The one line that says a stop request ended the program (Ctrl-C, SIGTERM), or ''."""
    if issubclass(kind, KeyboardInterrupt):
        return f"gtmpi: interrupted (Ctrl-C){user_line(tb)}"
    if issubclass(kind, Terminated):
        return f"gtmpi: stopped (SIGTERM){user_line(tb)}"
    return ""


def stop_on_sigterm() -> None:
    """SIGTERM (a SLURM time limit or preemption, a forwarded kill of mpiexec) raises
    Terminated in the program, as SIGINT raises KeyboardInterrupt: the program may save a
    checkpoint, the trace is written, the job ends with one line. Neither is raised inside a
    finaliser (a dropped tensor's __del__), where Python would print it and drop it: the
    signal comes again 10 ms later (Ctrl-C once hung a test's job that way). A handler the
    program set first is left alone."""
    if threading.current_thread() is not threading.main_thread():
        return

    def raise_terminated(signum, frame):
        rt = current()
        if rt is not None and rt.death_pending:  # not a SIGTERM: a spawned worker died
            rt._watchdog()
        raise Terminated("SIGTERM")
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _outside_finalisers(raise_terminated))
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _outside_finalisers(signal.default_int_handler))


def _outside_finalisers(handler):
    def deliver(signum, frame):
        inner = frame
        for _ in range(4):  # __del__ itself, or what it calls
            if inner is None:
                break
            if inner.f_code.co_name == "__del__":
                threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
                return
            inner = inner.f_back
        handler(signum, frame)
    return deliver


def user_line(tb: TracebackType | None) -> str:
    """' at file:line' of the program's innermost frame, if any: outside gtmpi, the libraries
    it runs on (Python's own, installed packages) and generated code."""
    where = ""
    for frame, line in traceback.walk_tb(tb):
        name = frame.f_code.co_filename
        if not name.startswith("<") and not name.startswith(NOT_USER):
            where = f" at {name}:{line}"
    return where


set_default_start(start_embedded)
