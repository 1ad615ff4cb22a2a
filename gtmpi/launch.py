"""Who does what: rank 0 runs the user's program as client and dispatcher; every other rank
becomes a worker and never returns to the user's program.

Three ways to start:
  mpiexec/srun -n N   ranks 1..N-1 turn into workers when gtmpi is imported (start_role)
  plain python        the embedded default: one executor inside the process, no MPI at all
  gtmpi.workers(n)    a plain process spawns n workers (MPI Spawn) and merges with them
"""
from __future__ import annotations

import atexit
import ctypes
import os
import socket
import sys
import traceback

import torch

from .client import runtime as session
from .client.runtime import Runtime
from .transport.local import LocalLink
from .transport.pipe import start_child
from .transport.tags import Tag
from .worker.device import local_worker_index, select_device, visible_gpus
from .worker.executor import Executor

# Set by every launcher we know of (MPICH/hydra, Open MPI, PMIx, SLURM's srun).
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "SLURM_STEP_ID")


def verbose(message: str) -> None:
    if os.environ.get("GTMPI_VERBOSE", "0") not in ("", "0"):
        print(f"gtmpi: {message}", file=sys.stderr, flush=True)


def start_role() -> None:
    """Called when gtmpi is imported: under an MPI launcher, ranks > 0 serve until shutdown."""
    if session.current() is not None or not any(k in os.environ for k in _MPI_ENV):
        return
    from mpi4py import MPI
    if MPI.Comm.Get_parent() != MPI.COMM_NULL:
        return  # a spawned worker: gtmpi.worker's __main__ joins explicitly
    if MPI.COMM_WORLD.Get_size() > 1:
        join(MPI.COMM_WORLD.Dup())


def join(base: "MPI.Intracomm", spawn_comm: "MPI.Intercomm | None" = None) -> None:
    """Collective over ``base``: rank 0 becomes the session, the others serve as workers.

    ``spawn_comm`` is the intercommunicator of gtmpi.workers(n). Processes joined by Spawn
    part before MPI_Finalize: the intracommunicators made from it are freed and it is
    disconnected (Open MPI 4 hangs in Disconnect of the merged intracommunicators, and in
    Finalize without any parting).
    """
    from mpi4py import MPI
    from .transport.mpi import Comms, WorkerLink

    comms = Comms.dup(base)
    rank, size = base.Get_rank(), base.Get_size()
    shm = base.Split_type(MPI.COMM_TYPE_SHARED)
    node_ranks = shm.allgather(rank)
    shm.Free()
    workers_comm = base.Split(0 if rank == 0 else 1)  # the data plane's rendezvous
    if rank == 0:
        workers_comm.Free()
    host0 = base.bcast((socket.gethostname(), os.getpid()) if rank == 0 else None, root=0)
    detach = [*comms[1:], base, spawn_comm] if spawn_comm is not None else []
    if detach and rank != 0:
        detach.insert(0, workers_comm)
    if rank != 0:
        _serve(comms, workers_comm, node_ranks, host0, detach)
        return
    links = {r: WorkerLink(comms, r) for r in range(1, size)}
    workers = {r: links[r].wait_reply(Tag.HELLO) for r in links}
    for w in workers.values():
        verbose(f"worker rank {w['rank']} on {w['host']} (pid {w['pid']}): {w['device']}")

    def abort(message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        base.Abort(1)

    sys.excepthook = _abort_on_uncaught(base)  # first: a trace started with the session wraps it
    atexit.register(_close, detach)
    session.set_runtime(Runtime(links, workers, abort))


def _serve(comms, workers_comm, node_ranks: list[int], host0: tuple[str, int], detach: list) -> None:
    """Run a worker until rank 0 says stop, then leave the process with status 0."""
    from mpi4py import MPI
    from .worker.loop import serve
    from .worker.watcher import DeathNotice
    try:
        rank = comms.base.Get_rank()
        notice = DeathNotice(rank)
        local_index = local_worker_index(os.environ, rank, node_ranks)
        device = select_device(os.environ, local_index, visible_gpus())
        if device.type == "cuda":
            torch.cuda.set_device(device)
        serve(comms, workers_comm, device, local_index, host0)
        notice.clean_exit()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
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


def _abort_on_uncaught(comm):
    def hook(kind, value, tb):
        traceback.print_exception(kind, value, tb)
        sys.stderr.flush()
        comm.Abort(1)  # otherwise the workers would wait for a shutdown that never comes
    return hook


def _close(detach: list) -> None:
    rt = session.current()
    if rt is not None:
        missing = rt.close()
        if missing:
            print(f"gtmpi: workers {missing} did not confirm shutdown", file=sys.stderr)
        elif detach:
            _part(detach)


def start_embedded() -> Runtime:
    """One worker without MPI: inside this process on a CPU; on a GPU a child process, so that
    the worker launches kernels while this process issues the next ops (a thread would share
    the GIL with the client: measured no faster than running both in series)."""
    device = select_device(os.environ, 0, visible_gpus())
    choice = os.environ.get("GTMPI_EMBEDDED_PROCESS", "auto")
    if choice == "1" or (choice == "auto" and device.type == "cuda"):
        link, pid = start_child(device)
        atexit.register(_close, [])
        where = f"a worker process (pid {pid})"
    else:
        link, pid = LocalLink(), os.getpid()
        link.executor = Executor(1, device, link)
        where = "this process"
    info = {"rank": 1, "host": socket.gethostname(), "pid": pid, "device": str(device),
            "local_index": 0, "torch": torch.__version__, "embedded": True}
    verbose(f"embedded worker in {where}: {device}")
    return Runtime({1: link}, {1: info})


def spawn_workers(n: int) -> None:
    """Start n worker processes from a plain (non-mpiexec) process and join them."""
    if n < 1:
        raise ValueError(f"gtmpi.workers(n) needs n >= 1, got {n}")
    rt = session.current()
    if rt is not None:
        have = len(rt.workers)
        if have == n:
            return
        raise RuntimeError(f"gtmpi: this session already has {have} worker(s); gtmpi.workers({n}) "
                           "must come before the first tensor op, and under mpiexec the job size "
                           "decides the number of workers")
    # MPI Spawn goes through the launcher of the MPI that mpi4py uses; a different mpiexec
    # first on PATH makes it hang, so put the one beside this Python first.
    bindir = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(bindir, "mpiexec")):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    from mpi4py import MPI
    inter = MPI.COMM_SELF.Spawn(sys.executable, args=["-m", "gtmpi.worker"], maxprocs=n)
    join(inter.Merge(high=False), inter)
