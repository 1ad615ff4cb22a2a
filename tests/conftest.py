"""Shared helpers. Importing gtmpi here is what turns ranks > 0 into workers when the suite
runs under ``mpiexec -n 3 python -m pytest --with-mpi``; rank 0 then runs every test."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import gtmpi

UNDER_MPI = not gtmpi.info()["embedded"]
HOME_DEVICE = torch.device(gtmpi.info()["workers"][min(gtmpi.info()["workers"])]["device"])


def to_gtmpi(t: torch.Tensor) -> gtmpi.Tensor:
    return gtmpi.tensor(t)


def assert_same(got, want: torch.Tensor, rtol: float | None = None, atol: float | None = None) -> None:
    """A gtmpi tensor equals a torch tensor: shape, dtype and values."""
    assert isinstance(got, gtmpi.Tensor), type(got)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if HOME_DEVICE.type == "cuda" and rtol is None and want.dtype in (torch.float32, torch.float64):
        rtol, atol = 1e-4, 1e-5  # GPU kernels round differently from the CPU reference
    torch.testing.assert_close(got.cpu_torch(), want, rtol=rtol, atol=atol, equal_nan=True)


def mpiexec() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def is_open_mpi(launcher: str) -> bool:
    out = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=30)
    return "Open MPI" in out.stdout + out.stderr or "OpenRTE" in out.stdout + out.stderr


def launcher_env() -> dict[str, str]:
    """Open MPI refuses to run as root without these; MPICH ignores them."""
    return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_rmaps_base_oversubscribe": "1", "UCX_NET_DEVICES": "lo"}


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
