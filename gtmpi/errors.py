"""Errors that cross process boundaries, the exception a user sees, and where the program's
own line is (what a message or warning names)."""
from __future__ import annotations

import os
import sys
import sysconfig
from typing import NamedTuple

# where files are that are not the program's: gtmpi, Python's own, the installed libraries
NOT_USER = (os.path.dirname(os.path.abspath(__file__)),
            *{sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})


def user_stacklevel() -> int:
    """For warnings.warn, called by the function that warns: the stacklevel of the program's
    innermost line (a warning that names gtmpi's own line tells the user nothing)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(NOT_USER):
        frame, level = frame.f_back, level + 1
    return level


class Fault(NamedTuple):
    """Why a tensor could not be computed on a worker. Travels worker -> client (pickled)."""
    tensor_id: int  # the first result id of the instruction that failed
    op: str
    rank: int
    error: str      # "ExceptionType: message" from the worker
    skipped: str = ""  # an in-place op left undone because of it (its target kept its values)


class WorkerError(RuntimeError):
    """An op failed on a worker; raised at the read of a tensor that depends on it."""

    def __init__(self, fault: Fault, site: str | None):
        self.fault = fault
        self.site = site
        where = f" issued at {site}" if site else ""
        message = f"op '{fault.op}'{where} failed on worker rank {fault.rank}: {fault.error}"
        if fault.skipped:
            message += (f" (so the in-place '{fault.skipped}' that depended on it was skipped: "
                        "its target keeps its last good values)")
        super().__init__(message)


class WorkerIndexError(WorkerError, IndexError):
    """An op's index was out of range on a worker: an IndexError, as torch raises it."""


def worker_error(fault: Fault, site: str | None) -> WorkerError:
    """The exception for ``fault``: an IndexError too where the worker's was one."""
    cls = WorkerIndexError if fault.error.startswith("IndexError") else WorkerError
    return cls(fault, site)


class ReplayError(RuntimeError):
    """A replayable function did what a replay could not repeat (client/replay.py)."""


class Terminated(BaseException):
    """Raised in the program's main thread when the process gets SIGTERM (what SLURM sends at
    a time limit or a preemption, and mpiexec forwards): like Ctrl-C it is not an Exception,
    so only code that asks for it catches it (to save a checkpoint, say); uncaught, the job
    ends with one line naming the program's line, its trace written, status 1."""
