"""Who does what: rank 0 runs the user's program as client and dispatcher; every other rank
becomes a worker and never returns to the user's program.

Three ways to start:
  mpiexec/srun -n N   ranks 1..N-1 turn into workers when gtmpi is imported (start_role)
  plain python        the embedded default (client/embedded.py): one worker, no MPI at all
  gtmpi.workers(n)    a plain process spawns n workers (MPI Spawn) and merges with them
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
import traceback

import torch

from .client import runtime as session
from .client.embedded import stop_line, stop_on_sigterm, verbose
from .client.runtime import Runtime
from .transport import ending, poll
from .transport.joining import LAUNCHER_ENV
from .transport.tags import Tag
from .worker.device import local_worker_index, one_launch_queue, select_device, visible_gpus

END_GRACE_S = 3.0  # how long workers get to leave after an uncaught exception on rank 0



def start_role() -> None:
    """Called when gtmpi is imported: under an MPI launcher, ranks > 0 serve until shutdown."""
    if session.current() is not None:
        return
    from mpi4py import MPI  # initialized already, by gtmpi's own imports
    if MPI.COMM_WORLD.Get_size() == 1:
        # plain python, the embedded worker's process, a server's client: nobody else opens its
        # segment (a killed one left it behind; a job of several unlinks in join)
        _unlink_segments(MPI.COMM_WORLD)
    if not any(k in os.environ for k in LAUNCHER_ENV):
        return
    if MPI.Comm.Get_parent() != MPI.COMM_NULL:
        return  # a spawned worker: gtmpi.worker's __main__ joins explicitly
    if MPI.COMM_WORLD.Get_size() > 1 and os.environ.get("GTMPI_DRY_RUN"):
        _dry_run_alone(MPI.COMM_WORLD)
    elif MPI.COMM_WORLD.Get_size() > 1:
        join(MPI.COMM_WORLD.Dup())
    else:
        _check_one_of_many(MPI)


def _dry_run_alone(world: "MPI.Intracomm") -> None:
    """GTMPI_DRY_RUN under a launcher (the sbatch script's srun line kept as it was): rank 0
    plans the run on simulated workers, as under plain python; the other ranks would only
    idle, so they leave now, and rank 0 says so."""
    from mpi4py import MPI
    _unlink_segments(world)
    if world.Get_rank() != 0:
        MPI.Finalize()
        _leave()
    print(f"gtmpi: GTMPI_DRY_RUN={os.environ['GTMPI_DRY_RUN']}: a dry run on rank 0 alone; "
          f"this job's {world.Get_size() - 1} other rank(s) leave unused", file=sys.stderr,
          flush=True)


def _unlink_segments(base: "MPI.Intracomm") -> None:
    """MPICH's shared-memory segments (/dev/shm/mpich_shm_*) outlive a job killed before
    MPI_Finalize: a day of faults here left 977 of them, 2.4 GB of memory. Once every rank has
    attached its own (MPI_Init did), none is opened by name again, so they are unlinked now,
    and the memory goes with the job's last process however the job ends. Every rank takes part
    in the barrier, mapped segments or not (one alone on its node has none)."""
    try:
        with open("/proc/self/maps") as f:
            mapped = {line.split()[-1] for line in f if "/dev/shm/mpich_shm_" in line}
    except OSError:  # not Linux
        mapped = set()
    if base.Get_size() > 1:
        base.Barrier()
    for path in mapped:
        try:
            os.unlink(path)
        except OSError:  # another rank of the node unlinked it first
            pass


# The number of processes each launcher started, as it tells them.
_LAUNCHED = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def _check_one_of_many(MPI) -> None:
    """A launcher started several processes but MPI made each its own job of one: srun whose
    PMI plug-in does not match the MPI library. Each copy would run the whole program on its
    own embedded worker (on a GPU node, all on GPU 0), so stop, saying how to launch."""
    started = {k: v for k in _LAUNCHED if (v := os.environ.get(k, "")).isdigit() and int(v) > 1}
    if not started:
        return
    if os.environ.get("SLURM_PROCID", os.environ.get("PMI_RANK", "0")) != "0":
        raise SystemExit(1)  # the first copy says why; one line for the job
    library = MPI.Get_library_version()
    plugin = "pmix" if "Open MPI" in library else "pmi2"
    told = ", ".join(f"{k}={v}" for k, v in started.items())
    raise SystemExit(
        f"gtmpi: the launcher started several processes ({told}), but MPI sees each as a job of "
        f"one, so each would run the whole program alone. Under srun, give the PMI plug-in of "
        f"this MPI library ({library.splitlines()[0].strip()}): srun --mpi={plugin} ... "
        f"(`srun --mpi=list` shows what this Slurm has); or start the job with mpiexec.")


def _threads_per_rank(ranks_here: int) -> int | None:
    """As torchrun does: where several ranks share a host and the user did not set
    OMP_NUM_THREADS, torch's intra-op pool (one thread per core by default, in every process)
    would oversubscribe the cores; each rank gets its share instead, at least one. Returns the
    number set, or None where nothing was."""
    if ranks_here <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return None
    threads = max(1, (os.cpu_count() or 1) // ranks_here)
    torch.set_num_threads(threads)
    return threads


def join(base: "MPI.Intracomm", spawn_comm: "MPI.Intercomm | None" = None) -> None:
    """Collective over ``base``: rank 0 becomes the session, the others serve as workers.

    ``spawn_comm`` is the intercommunicator of gtmpi.workers(n). Processes joined by Spawn
    part before MPI_Finalize: the intracommunicators made from it are freed and it is
    disconnected (Open MPI 4 hangs in Disconnect of the merged intracommunicators, and in
    Finalize without any parting).
    """
    from mpi4py import MPI
    from .transport.mpi import Comms, Sends, WorkerLink

    _unlink_segments(base)
    comms = Comms.dup(base)
    rank, size = base.Get_rank(), base.Get_size()
    shm = base.Split_type(MPI.COMM_TYPE_SHARED)
    node_ranks = shm.allgather(rank)
    shm.Free()
    poll.spin_where_cores_spare(len(node_ranks))
    threads = _threads_per_rank(len(node_ranks))
    workers_comm = base.Split(0 if rank == 0 else 1)  # the data plane's rendezvous
    if rank == 0:
        workers_comm.Free()
        ending.clear((socket.gethostname(), os.getpid()))
    host0 = base.bcast((socket.gethostname(), os.getpid()) if rank == 0 else None, root=0)
    detach = [*comms[1:], base, spawn_comm] if spawn_comm is not None else []
    if detach and rank != 0:
        detach.insert(0, workers_comm)
    if rank != 0:
        _serve(comms, workers_comm, node_ranks, host0, detach)
        return
    sends = Sends()  # rank 0's, to every worker: each wait moves every large one
    links = {r: WorkerLink(comms, r, sends=sends) for r in range(1, size)}
    workers = {r: links[r].wait_reply(Tag.HELLO) for r in links}
    for w in workers.values():
        verbose(f"worker rank {w['rank']} on {w['host']} (pid {w['pid']}): {w['device']}")
    if threads is not None:
        verbose(f"OMP_NUM_THREADS is not set: torch runs {threads} thread(s) per process, "
                f"{len(node_ranks)} processes sharing this host's cores (set OMP_NUM_THREADS "
                "to choose)")
    if len(workers) > 1 and not (os.environ.get("GTMPI_CONFIG") or os.environ.get("GT_CONFIG")):
        verbose(f"{len(workers)} workers and no sharding config: all work runs on worker "
                f"{min(workers)} until a config or signal places tensors on the others "
                "(GTMPI_CONFIG=file.yaml or gtmpi.load_config)")

    job = (socket.gethostname(), os.getpid())
    notice = ending.DeathNotice(0, job, tuple(w["pid"] for w in workers.values()
                                              if w["host"] == job[0]))

    def abort(message: str) -> None:
        ending.claim(job, message)
        base.Abort(1)

    sys.excepthook = _end_on_uncaught(base, job, detach)  # first: a trace started with the session wraps it
    stop_on_sigterm()
    atexit.register(_close, detach, notice)
    rt = Runtime(links, workers, abort)
    session.set_runtime(rt)
    if spawn_comm is not None:
        rt.watch_idle()


def _serve(comms, workers_comm, node_ranks: list[int], host0: tuple[str, int], detach: list) -> None:
    """Run a worker until rank 0 says stop, then leave the process with status 0."""
    from mpi4py import MPI
    from .worker.loop import serve
    try:
        # Ctrl-C and SIGTERM (srun and mpiexec signal every rank) reach every rank: rank 0
        # decides, and ends the workers cleanly
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        rank = comms.base.Get_rank()
        notice = ending.DeathNotice(rank, host0)
        local_index = local_worker_index(os.environ, rank, node_ranks)
        one_launch_queue(os.environ)
        device = select_device(os.environ, local_index, visible_gpus())
        if device.type == "cuda":
            torch.cuda.set_device(device)
        serve(comms, workers_comm, device, local_index, host0, notice.clean_exit)
        notice.clean_exit()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        ending.claim(host0, "")
        comms.base.Abort(1)
    sys.stdout.flush()
    sys.stderr.flush()
    _part(detach)
    MPI.Finalize()
    _leave()


def _leave() -> None:
    """End a worker with status 0, never returning to the user's program. The C library's exit
    handlers run (os._exit would skip them): MPICH tells its process manager that the rank
    finalized from one of them, and hydra SIGKILLs every rank still running (rank 0 among
    them, while it finishes its own exit) when a rank leaves without saying so."""
    ctypes.CDLL(None).exit(0)


def _part(detach: list) -> None:
    if detach:
        for comm in detach[:-1]:
            comm.Free()
        detach[-1].Disconnect()


def _end_on_uncaught(comm, job: ending.Job, detach: list):
    """Any uncaught exception ends the whole job (otherwise the workers would wait for a
    shutdown that never comes) with the status of a Python program's uncaught exception, 1.
    Ctrl-C gets one line, not a traceback of wherever the program happened to be. The workers
    are told to stop and leave cleanly; only if they do not within END_GRACE_S is the job
    aborted (MPI_Abort lets the launcher kill every rank, and its status then tells of the
    kill, not of the program)."""
    def hook(kind, value, tb):
        stop = stop_line(kind, tb)
        if stop:
            ending.claim(job, f"{stop}; the job is ending")
        else:
            traceback.print_exception(kind, value, tb)
            sys.stderr.flush()
            ending.claim(job, "")  # the traceback says why: the workers' ends stay silent
        rt = session.current()
        if rt is None or rt.close(END_GRACE_S):
            comm.Abort(1)
        from mpi4py import MPI
        _part(detach)
        MPI.Finalize()  # the workers' own MPI_Finalize waits for this one
        _wait_gone(rt.workers, END_GRACE_S)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # the program's atexit handlers would run after MPI is finalized
    return hook


def _wait_gone(workers: dict[int, dict], timeout_s: float) -> None:
    """Wait (bounded) until the workers of this host have ended: a non-zero status from rank 0
    while any still runs makes the launcher kill it, and report the kill as the job's status."""
    here = socket.gethostname()
    pids = [w["pid"] for w in workers.values() if w["host"] == here and w["pid"] != os.getpid()]
    deadline = time.monotonic() + timeout_s
    while any(ending.alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)


def _close(detach: list, notice: ending.DeathNotice) -> None:
    rt = session.current()
    if rt is not None:
        missing = rt.close()
        if missing:
            print(f"gtmpi: workers {missing} did not confirm shutdown", file=sys.stderr)
        elif detach:
            _part(detach)
    notice.clean_exit()


def _launcher_on_path() -> None:
    """MPI Spawn from a plain process runs ``mpiexec`` from PATH (MPICH's hydra). It must be
    the one beside this Python (another first on PATH makes it hang), and it must run in a
    process group of its own: at a fault hydra SIGKILLs its process group, which would
    otherwise be the caller's, shell and all. So a two-line launcher that leaves the group and
    becomes that mpiexec goes first on PATH."""
    real = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(real):
        real = shutil.which("mpiexec")
        if real is None:
            return
    # one folder per user, Python and mpiexec, kept and reused: a folder per process was left
    # behind by every process that was killed (atexit does not run)
    text = (f"#!{sys.executable}\nimport os, sys\nos.setpgid(0, 0)\n"
            f"os.execv({real!r}, [{real!r}, *sys.argv[1:]])\n")
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"gtmpi-launcher-{os.getuid()}-{key}")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        seen = os.lstat(folder)
        ours = seen.st_uid == os.getuid() and stat.S_ISDIR(seen.st_mode) and \
            not seen.st_mode & 0o022
    except OSError:
        ours = False
    if not ours:
        folder = tempfile.mkdtemp(prefix="gtmpi-launcher-")  # not ours alone: never trusted
        atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, "mpiexec")
    if not os.path.exists(path):
        fd, scratch = tempfile.mkstemp(dir=folder)  # written whole, then renamed into place
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(scratch, 0o755)
        os.replace(scratch, path)
    os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


def spawn_workers(n: int) -> None:
    """Start n worker processes from a plain (non-mpiexec) process and join them."""
    if n < 1:
        raise ValueError(f"gtmpi.workers(n) needs n >= 1, got {n}")
    rt = session.current()
    planned = os.environ.get("GTMPI_DRY_RUN")
    if planned and rt is None:
        if int(planned) != n:
            print(f"gtmpi: GTMPI_DRY_RUN={planned}: gtmpi.workers({n}) starts no process; the "
                  f"dry run simulates {planned} worker(s)", file=sys.stderr, flush=True)
        return
    if rt is not None:
        have = len(rt.workers)
        if have == n:
            return
        raise RuntimeError(f"gtmpi: this session already has {have} worker(s); gtmpi.workers({n}) "
                           "must come before the first tensor op, and under mpiexec the job size "
                           "decides the number of workers")
    _launcher_on_path()
    from mpi4py import MPI
    inter = MPI.COMM_SELF.Spawn(sys.executable, args=["-m", "gtmpi.worker"], maxprocs=n)
    join(inter.Merge(high=False), inter)
