"""How rank 0 and the workers talk: MPI point-to-point (mpi.py) or in-process (local.py)."""
