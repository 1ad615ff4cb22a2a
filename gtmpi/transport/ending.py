"""One line per ending job, naming the process that ended it.

When one rank dies or fails, the MPI launcher kills every other rank, and each of those
deaths looks alike from outside. So the first process of a host to *claim* the job's end
says why it ends, and the deaths that follow stay silent. A claim is a file created
exclusively in this user's private folder (mode 0700: no other user can make one) and named
for the job (rank 0's host and pid), so it holds among the processes of one host; it is
removed a few seconds later, once every death it explains has been seen, and what a job whose
processes were all killed at once left behind is cleared by the next job of that name.

Rank 0 claims before it ends the job itself (an uncaught exception, Ctrl-C, a dead worker it
noticed). A process killed by a signal cannot speak, so every rank starts a tiny watcher
process (this file, run as a script: it imports nothing of gtmpi) that blocks reading a pipe
whose only writer is its rank. A clean exit writes "bye" first; end-of-file without it means
the rank is gone. The watcher notes when it saw that (a file per rank), waits a moment for
the other watchers' notes, and speaks only if its rank went first: the launcher kills the
others only after the first death, so the earliest note names the culprit. Every watcher
also registers its rank's pid (a file per rank): a watcher that finds every other rank of its
host still alive when it sees its own gone has proof that its rank went first, which a note's
time alone is not on a loaded host (a later death's watcher may run first).
"""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import tempfile
import time

Job = tuple[str, int]  # rank 0's host and pid
FORGET_AFTER_S = 5.0


def _folder() -> str:
    """This user's private folder for the files of ending jobs (mode 0700): in the temporary
    folder, or in the home folder if another user holds that name there. Nobody else can make
    or read a claim that would silence a job's line."""
    for folder in (os.path.join(tempfile.gettempdir(), f"gtmpi-{os.getuid()}"),
                   os.path.join(os.path.expanduser("~"), ".gtmpi", f"run-{os.getuid()}")):
        try:
            os.makedirs(folder, 0o700, exist_ok=True)
            st = os.lstat(folder)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
            return folder
    raise OSError("gtmpi: no private folder for the job's end files")


def _path(job: Job) -> str:
    return os.path.join(_folder(), f"end-{job[0]}-{job[1]}")


def clear(job: Job) -> None:
    """Remove what an earlier job whose rank 0 had this pid left (its processes all killed at
    once, as SLURM does): rank 0 calls it before any rank of its job knows the job's name."""
    try:
        folder, stem = os.path.split(_path(job))
        names = os.listdir(folder)
    except OSError:
        return
    forget(*(os.path.join(folder, name) for name in names
              if name == stem or name.startswith((stem + ".", stem + "-pid."))))


def claim(job: Job, message: str) -> bool:
    """Be the one who says why ``job`` ends: print ``message`` (if any) unless another process
    of this host said it first. Returns whether this one did."""
    try:
        fd = os.open(_path(job), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        pass  # no private folder to write to: speak anyway
    else:
        os.write(fd, message.encode())
        os.close(fd)
    if message:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    return True


def claimed(job: Job) -> bool:
    try:
        return os.path.exists(_path(job))
    except OSError:
        return False


class DeathNotice:
    """Started by every rank: its watcher speaks if the rank dies first without saying
    goodbye."""

    def __init__(self, rank: int, job: Job, peers: tuple[int, ...] = ()):
        """``peers`` (rank 0's: the workers of its host): all of them still alive when the
        watcher sees its rank gone proves that its rank went first (a worker cannot know that
        of the other workers, so its notes are ordered by time alone)."""
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(rank), str(os.getpid()),
             socket.gethostname(), job[0], str(job[1]), ",".join(map(str, peers))],
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


SETTLE_S = 0.3  # how long a watcher waits for the notes of deaths that follow its rank's


def _watch(rank: int, pid: int, host: str, job: Job, peers: tuple[int, ...]) -> None:
    try:  # first in line when its rank dies, ahead of the launcher killing the others
        os.setpriority(os.PRIO_PROCESS, 0, -15)
    except OSError:
        pass  # not allowed here: the order of the notes is then the scheduler's
    try:
        registered = f"{_path(job)}-pid.{rank}"
        with open(registered, "w") as f:
            f.write(str(pid))
    except OSError:
        return  # nowhere private to note a death: the launcher's own lines say it
    if sys.stdin.buffer.read() == b"bye":
        forget(registered)
        return
    seen = time.monotonic_ns()  # one clock for every process of the host
    # the time a watcher wakes is the scheduler's to choose: on a loaded host a later death
    # may be seen first. Peers all alive now are proof that this rank went first.
    # rank 0's pid is known without its registration, which may come too late: a worker that
    # went with rank 0 (killed at once after starting) must not count itself first
    peers = {*peers, *_registered(job), *((job[1],) if host == job[0] else ())} - {pid}
    certain = bool(peers) and all(alive(p) for p in peers)
    mine = f"{_path(job)}.{rank}"
    try:
        with open(mine, "w") as f:
            f.write(f"{seen} {int(certain)}")
    except OSError:
        pass
    time.sleep(SETTLE_S)
    if rank != 0 and host == job[0]:
        _await_rank0(job)
    if not claimed(job) and first(job) == rank:
        who = "rank 0" if rank == 0 else f"worker rank {rank}"
        claim(job, f"gtmpi: {who} (pid {pid} on {host}) died; the job is ending")
    time.sleep(FORGET_AFTER_S)
    forget(mine, registered, _path(job))


def forget(*paths: str) -> None:
    """Remove these files, those already gone or not ours to remove left as they are."""
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def _registered(job: Job) -> set[int]:
    """The pids of the ranks of this host whose watchers registered them."""
    folder, stem = os.path.split(f"{_path(job)}-pid.")
    pids = set()
    for name in os.listdir(folder):
        if name.startswith(stem):
            try:
                with open(os.path.join(folder, name)) as f:
                    pids.add(int(f.read()))
            except (OSError, ValueError):
                continue
    return pids


RANK0_NOTE_S = 3.0  # how long a worker's watcher waits for a dead rank 0's note


def _await_rank0(job: Job) -> None:
    """Rank 0 is dead but its watcher has not noted it yet (a loaded host schedules watchers
    late): wait for that note, so that the earliest death is chosen among all of them, not
    among the watchers that happened to run first."""
    note = f"{_path(job)}.0"
    deadline = time.monotonic() + RANK0_NOTE_S
    while not claimed(job) and not alive(job[1]) and not os.path.exists(note) and \
            time.monotonic() < deadline:
        time.sleep(0.02)


def first(job: Job, dead: tuple[int, ...] = (), wait_s: float = 0.0) -> int | None:
    """The rank whose death was seen first, from the watchers' notes; one proven first by
    its peers ahead of all. Waits up to ``wait_s`` for the notes of the ranks in ``dead``
    (rank 0 may find a worker gone before its watcher has written the note)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            notes = _notes(job)
        except OSError:
            return None
        if set(dead) <= set(notes) or time.monotonic() >= deadline:
            return min(notes, key=lambda r: (notes[r], r)) if notes else None
        time.sleep(0.02)


def _notes(job: Job) -> dict[int, tuple[int, int]]:
    folder, stem = os.path.split(_path(job))
    notes = {}
    for name in os.listdir(folder):
        if name.startswith(stem + "."):
            try:
                with open(os.path.join(folder, name)) as f:
                    seen, certain = (f.read().split() + ["0"])[:2]
                notes[int(name.rsplit(".", 1)[1])] = (-int(certain), int(seen))
            except (OSError, ValueError):
                continue
    return notes


if __name__ == "__main__":
    _watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], (sys.argv[4], int(sys.argv[5])),
           tuple(int(p) for p in sys.argv[6].split(",") if p))
