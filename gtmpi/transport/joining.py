"""What an MPI launcher needs so that a server's job and its clients' jobs can join.

MPICH (hydra): nothing; each job must only be started by mpiexec. Open MPI 4: every job must
reach one PMIx server, ``ompi-server``, through ``mpiexec --ompi-server file:URI``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time

# Set by every launcher we know of (MPICH/hydra, Open MPI, PMIx, SLURM's srun).
LAUNCHER_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "SLURM_STEP_ID")


def is_open_mpi(launcher: str) -> bool:
    out = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=30)
    return "Open MPI" in out.stdout + out.stderr or "OpenRTE" in out.stdout + out.stderr


def joining_jobs(launcher: str, folder: str, env: dict[str, str] | None = None,
                 limit_s: float = 3600) -> tuple[list[str], subprocess.Popen | None]:
    """(arguments for every mpiexec of the server and its clients, the ompi-server process to
    stop afterwards or None). Under Open MPI this starts ``ompi-server`` (for at most
    ``limit_s``), writing its URI into ``folder``."""
    if not is_open_mpi(launcher):
        return [], None
    beside = os.path.join(os.path.dirname(launcher), "ompi-server")
    binary = beside if os.path.exists(beside) else shutil.which("ompi-server") or "ompi-server"
    uri = os.path.join(folder, "ompi-server.uri")
    proc = subprocess.Popen(["timeout", str(limit_s), binary, "--no-daemonize", "--report-uri",
                             uri], env=env, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (os.path.exists(uri) and open(uri).read().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{binary} did not start (status {proc.poll()})")
        time.sleep(0.1)
    return ["--ompi-server", f"file:{uri}"], proc
