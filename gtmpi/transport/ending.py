"""One line per ending job, naming the process that ended it.

When one rank dies or fails, the MPI launcher kills every other rank, and each of those
deaths looks alike from outside. So the first process of a host to *claim* the job's end
says why it ends, and the deaths that follow stay silent. A claim is a file created
exclusively in the temporary folder and named for the job (rank 0's host and pid), so it
holds among the processes of one host; it is removed a few seconds later, once every death
it explains has been seen.

Rank 0 claims before it aborts the job (an uncaught exception, Ctrl-C, a dead worker it
noticed). A worker killed by a signal cannot speak, so each worker starts a tiny watcher
process (this file, run as a script: it imports nothing of gtmpi) that blocks reading a pipe
whose only writer is the worker. A clean exit writes "bye" first; end-of-file without it means
the worker is gone, and the watcher claims the end for it, or for rank 0 if rank 0 is gone
too (a worker leaves when it finds rank 0 dead).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

Job = tuple[str, int]  # rank 0's host and pid
FORGET_AFTER_S = 5.0


def _path(job: Job) -> str:
    return os.path.join(tempfile.gettempdir(), f"gtmpi-end-{job[0]}-{job[1]}")


def claim(job: Job, message: str) -> bool:
    """Be the one who says why ``job`` ends: print ``message`` (if any) unless another process
    of this host said it first. Returns whether this one did."""
    try:
        fd = os.open(_path(job), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        pass  # no temporary folder to write to: speak anyway
    else:
        os.write(fd, message.encode())
        os.close(fd)
    if message:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    return True


def claimed(job: Job) -> bool:
    return os.path.exists(_path(job))


def forget(job: Job) -> None:
    try:
        os.unlink(_path(job))
    except OSError:
        pass


class DeathNotice:
    """Started by a worker: its watcher speaks if the worker dies without saying goodbye."""

    def __init__(self, rank: int, job: Job):
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(rank), str(os.getpid()),
             socket.gethostname(), job[0], str(job[1])],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True,
            start_new_session=True)

    def clean_exit(self) -> None:
        self._proc.stdin.write(b"bye")
        self._proc.stdin.close()


def alive(pid: int) -> bool:
    """Whether a process of this host still runs (one we may not signal counts as alive; a
    zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _watch(rank: int, pid: int, host: str, job: Job) -> None:
    if sys.stdin.buffer.read() == b"bye":
        return
    if not claimed(job):
        if job[0] == host and not alive(job[1]):
            message = f"gtmpi: rank 0 (pid {job[1]} on {host}) died; the job is ending"
        else:
            message = f"gtmpi: worker rank {rank} (pid {pid} on {host}) died; the job is ending"
        claim(job, message)
    time.sleep(FORGET_AFTER_S)
    forget(job)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], (sys.argv[4], int(sys.argv[5])))
