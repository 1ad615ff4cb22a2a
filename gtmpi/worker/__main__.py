"""Entry point of a worker started by gtmpi.workers(n) (MPI Spawn from a plain process)."""
from mpi4py import MPI

from ..launch import join

parent = MPI.Comm.Get_parent()
if parent == MPI.COMM_NULL:
    raise SystemExit("python -m gtmpi.worker is started by gtmpi.workers(n), not by hand")
join(parent.Merge(high=True), parent)
