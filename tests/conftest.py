"""Shared helpers. Importing gtmpi here is what turns ranks > 0 into workers when the suite
runs under ``mpiexec -n 3 python -m pytest --with-mpi``; rank 0 then runs every test."""
from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

import gtmpi

UNDER_MPI = not gtmpi.info()["embedded"]


def to_gtmpi(t: torch.Tensor) -> gtmpi.Tensor:
    return gtmpi.tensor(t)


def assert_same(got, want: torch.Tensor, rtol: float | None = None, atol: float | None = None) -> None:
    """A gtmpi tensor equals a torch tensor: shape, dtype and values."""
    assert isinstance(got, gtmpi.Tensor), type(got)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    torch.testing.assert_close(got.cpu_torch(), want, rtol=rtol, atol=atol, equal_nan=True)


def mpiexec() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
