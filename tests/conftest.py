"""Shared helpers. Importing gtmpi here is what turns ranks > 0 into workers when the suite
runs under ``mpiexec -n 3 python -m pytest --with-mpi``; rank 0 then runs every test."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

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


def line_of(path: str, text: str) -> int:
    """The number of the line of file ``path`` that holds ``text`` (for messages naming it)."""
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if text in line and "line_of(" not in line:
                return n
    raise AssertionError(text)


def is_open_mpi(launcher: str) -> bool:
    out = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=30)
    return "Open MPI" in out.stdout + out.stderr or "OpenRTE" in out.stdout + out.stderr


def mpiexec() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def launcher_env() -> dict[str, str]:
    """Open MPI refuses to run as root without these; MPICH ignores them."""
    return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_rmaps_base_oversubscribe": "1", "UCX_NET_DEVICES": "lo"}


def run_job(tmp_path, body: str, limit_s: float, *, n: int | None = 3, args=(), env=None,
            module: bool = False, launcher_args=()) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``body`` as a user's script: under ``mpiexec -n n`` (plain python if n is None),
    bounded by ``limit_s``; return the finished process and its wall time.

    The job's workers use the CPU unless ``GTMPI_TEST_JOB_DEVICE`` says otherwise (``auto``
    on a machine with a GPU per worker runs the job's data plane on NCCL)."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(body))
    cmd = [sys.executable] + (["-m", "gtmpi"] if module else []) + [str(script), *args]
    if n is not None:
        cmd = [mpiexec(), "-n", str(n), *launcher_args] + cmd
    full_env = {k: v for k, v in os.environ.items() if k not in ("GTMPI_VERBOSE", "GTMPI_TRACE")}
    job_device = os.environ.get("GTMPI_TEST_JOB_DEVICE", "cpu")
    full_env.update({**launcher_env(), "GTMPI_DEVICE": job_device, **(env or {})})
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, env=full_env,
                          start_new_session=True)
    return proc, time.monotonic() - start


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


# the files that take longest with the embedded worker, longest first: tools/run-tests hands
# whole files to its pytest-xdist processes in collection order, and one of these last would
# run alone at the end while the other process idled (CI: about 2 minutes)
LONGEST_FIRST = ("test_server.py", "test_dryrun.py", "test_launch.py", "test_repeats.py",
                 "test_silent.py", "test_trace.py", "test_placement.py", "test_train.py",
                 "test_compile.py", "test_faults.py", "test_shapes.py", "test_sharded.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the MPI suite keeps its one order
        first = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: first.get(item.path.name, len(first)))
