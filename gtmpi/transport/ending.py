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
the rank is gone. The launcher kills the others only after the first death, so the first exit
names the culprit. When a watcher wakes is the scheduler's choice (on a loaded host the
launcher's kills may all land before the first death's watcher runs), so the order is read
from the kernel instead: a rank registers (a file per rank) and makes an epoll over its pipe
and a pidfd of every other rank of its host registered before it, which its watcher then
waits in, adding the ranks that register later. epoll hands ready events over in the order
they happened, and a rank's pipe closes as it exits, before its parent (the launcher) hears
of it; so a rank killed by the launcher is seen exiting after the one that went first. Of two
ranks, at least the one that registered second watches the other from its start. Each
watcher notes its rank's standing (a file per rank): after a rank it watched; first, when
every other rank it did not watch still runs; or unknown, when the time it woke decides. It
waits a moment for the other watchers' notes, and speaks only if its rank leads.
"""
from __future__ import annotations

import os
import select
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
        """``peers``: other ranks of this host known now (rank 0's: the workers of its host);
        the watcher adds those that register later. The epoll is made here, not in the
        watcher: a rank may die (and the launcher kill the others) before its watcher has
        started, and the epoll's queue must already be recording the order of those exits."""
        host = socket.gethostname()
        try:
            with open(f"{_path(job)}-pid.{rank}", "w") as f:
                f.write(str(os.getpid()))
            registered = _registered(job)
        except OSError:
            registered = set()  # nowhere private to note a death: the watcher stays silent
        read, self._write = os.pipe()
        ready = select.epoll()
        ready.register(read, select.EPOLLIN)
        pidfds = _watch_exits(ready, {*peers, *registered, *((job[1],) if host == job[0] else ())}
                              - {os.getpid()})
        try:
            self._proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(rank), str(os.getpid()), host,
                 job[0], str(job[1]), str(ready.fileno()), str(read),
                 ",".join(f"{fd}:{pid}" for fd, pid in pidfds.items())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True,
                pass_fds=(ready.fileno(), read, *pidfds), start_new_session=True)
        finally:  # the watcher holds them now
            ready.close()
            for fd in (read, *pidfds):
                os.close(fd)

    def clean_exit(self) -> None:
        os.write(self._write, b"bye")
        os.close(self._write)


def _watch_exits(ready: select.epoll, pids: set[int]) -> dict[int, int]:
    """Add the exit of each of ``pids`` to ``ready``'s events (a pidfd is ready once its
    process has exited); returns the pidfds and their pids (none where the system has no pidfds)."""
    pidfds = {}
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            continue  # gone already, or no pidfds here
        ready.register(fd, select.EPOLLIN)
        pidfds[fd] = pid
    return pidfds


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
RESCAN_S = 0.5  # how often a watcher looks for ranks of its host that registered since
FIRST, UNKNOWN, AFTER = 0, 1, 2  # a dead rank's standing among the ranks its watcher watched


def _watch(rank: int, pid: int, host: str, job: Job, ready: select.epoll, pipe: int,
           watched: dict[int, int]) -> None:
    try:  # the time a watcher wakes orders deaths only where pidfds are missing
        os.setpriority(os.PRIO_PROCESS, 0, -15)
    except OSError:
        pass
    try:
        registered = f"{_path(job)}-pid.{rank}"
        os.stat(registered)
    except OSError:
        return  # nowhere private to note a death: the launcher's own lines say it

    def others() -> set[int]:
        return {*watched.values(), *_registered(job)} - {pid}

    standing = _await_exit(ready, pipe, watched, others)
    if standing is None:
        forget(registered)
        return
    mine = f"{_path(job)}.{rank}"
    try:
        with open(mine, "w") as f:
            f.write(f"{time.monotonic_ns()} {standing}")  # one clock for the host's processes
    except OSError:
        pass
    time.sleep(SETTLE_S)
    if rank != 0 and host == job[0]:
        _await_rank0(job)
    if not claimed(job) and first(job) == rank:
        who = "rank 0" if rank == 0 else f"worker rank {rank}"
        claim(job, f"gtmpi: {who} (pid {pid} on {host}) died; the job is ending")
    # all said: the launcher (and a shell's pipe) waits for every holder of the rank's stderr
    # to close it, so holding it through the wait below kept each failed job 5 s longer
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    time.sleep(FORGET_AFTER_S)
    forget(mine, registered, _path(job))


def _await_exit(ready: select.epoll, pipe: int, watched: dict[int, int], others) -> int | None:
    """Block until this watcher's rank (the writer of ``pipe``) exits: None if it said
    goodbye, else its standing among the exits of the ranks in ``watched`` (pidfd: pid) and
    of those that ``others()`` names (asked again now and then: ranks register as they start)."""
    said, after = b"", False
    while True:
        watched.update(_watch_exits(ready, others() - set(watched.values())))
        for fd, _ in ready.poll(RESCAN_S):  # in the order the events happened
            if fd != pipe:
                after = True  # that rank exited before this one
                ready.unregister(fd)
                continue
            chunk = os.read(pipe, 64)
            said += chunk
            if chunk:
                continue
            if said == b"bye":
                return None
            if after:
                return AFTER
            # one not watched (registered late, or no pidfds here) may have gone first unless
            # it still runs
            return FIRST if all(alive(p) for p in others() - set(watched.values())) else UNKNOWN


def forget(*paths: str) -> None:
    """Remove these files, those already gone or not ours to remove left as they are."""
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def _registered(job: Job) -> set[int]:
    """The pids of the ranks of this host that registered."""
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
    """The rank whose death was first, from the watchers' notes: by their standing, then by
    the time each watcher woke. Waits up to ``wait_s`` for the notes of the ranks in ``dead``
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
                    seen, standing = (f.read().split() + [str(UNKNOWN)])[:2]
                notes[int(name.rsplit(".", 1)[1])] = (int(standing), int(seen))
            except (OSError, ValueError):
                continue
    return notes


if __name__ == "__main__":
    _watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], (sys.argv[4], int(sys.argv[5])),
           select.epoll.fromfd(int(sys.argv[6])), int(sys.argv[7]),
           {int(fd): int(pid) for fd, pid in (p.split(":") for p in sys.argv[8].split(",") if p)})
