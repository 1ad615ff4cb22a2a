"""How a process tells it was started by an MPI launcher."""
from __future__ import annotations

# Set by every launcher we know of (MPICH/hydra, Open MPI, PMIx, SLURM's srun).
LAUNCHER_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "SLURM_STEP_ID")
