"""The embedded worker's process started while the program is still importing gtmpi.

On a GPU the embedded default's worker is a process of its own (transport.pipe), which imports
torch and gtmpi and takes its GPU: seconds. Started at the program's first tensor op, those
seconds came after the program's own import of the same libraries, and the first question
that waits for the worker (nanoGPT asks ``torch.cuda.is_bf16_supported()`` before building its
model) waited for both in series: its model was built 7.7 s after the run began, against 4.3 s
under torch (one H100, 2026-12-07). Started here, first thing in ``import gtmpi`` and before
torch is imported, the two imports overlap.

Only stdlib is imported here (this runs before torch is). The process is a guess: it is
started only where a plain ``python script.py`` on a machine with an NVIDIA GPU will most
likely start the embedded default on it, and it is adopted only if the session starts that way
with the same environment (``take``); otherwise it is killed and, if needed, a worker is
started as before. ``GTMPI_EARLY_WORKER=0`` starts it at the first op instead.
"""
from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys

from .joining import LAUNCHER_ENV

CHILD_ENV = "GTMPI_EMBEDDED_CHILD"  # set in the worker's own process: it starts no other

_early: "tuple[subprocess.Popen, socket.socket, str, dict] | None" = None


def spawn(device: str) -> tuple[subprocess.Popen, socket.socket]:
    """``python -m gtmpi.worker.child FD DEVICE`` with one end of a socket pair; the other end
    is returned with the process."""
    ours, theirs = socket.socketpair()
    # a session of its own: a terminal's Ctrl-C (sent to the program's process group) is the
    # program's to decide on, from the child's first instant (the child ignores SIGINT only
    # once it has imported torch: a Ctrl-C meanwhile would have killed it)
    proc = subprocess.Popen([sys.executable, "-m", "gtmpi.worker.child", str(theirs.fileno()),
                             device], pass_fds=(theirs.fileno(),), start_new_session=True,
                            env={**os.environ, CHILD_ENV: "1"})
    theirs.close()
    return proc, ours


def _likely_device() -> str | None:
    """The device the embedded default will most likely give a worker process of its own, or
    None where it most likely will not start one."""
    env = os.environ
    if env.get("GTMPI_EARLY_WORKER", "1") == "0" or CHILD_ENV in env:
        return None
    choice = env.get("GTMPI_EMBEDDED_PROCESS", "auto")
    if choice not in ("auto", "1"):
        return None
    if any(k in env for k in (*LAUNCHER_ENV, "GTMPI_CONNECT", "GTMPI_DRY_RUN")):
        return None
    # a program run as a script (python train.py, python -m pkg.train), not a tool of gtmpi's
    # own, a test runner or an interactive session, which may never start a worker
    main = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not main.endswith(".py") or main.startswith(package + os.sep):
        return None
    gpu = (env.get("GTMPI_DEVICE", "auto").lower() != "cpu"
           and env.get("CUDA_VISIBLE_DEVICES", "0").strip() not in ("", "-1")
           and (os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")))
    if gpu:
        return "cuda:0"  # the embedded default's one worker always takes the first GPU
    return "cpu" if choice == "1" else None


def start() -> None:
    """Called first thing in ``import gtmpi``: start the worker's process if the session will
    most likely want it."""
    global _early
    device = _likely_device()
    if _early is not None or device is None:
        return
    proc, ours = spawn(device)
    _early = (proc, ours, device, dict(os.environ))
    atexit.register(discard)


def take(device: str) -> tuple[subprocess.Popen | None, socket.socket | None, str]:
    """The process started at import and its socket, if it was started for ``device`` and the
    environment is the one it inherited (a variable set since, GTMPI_COMPILE or
    CUDA_VISIBLE_DEVICES, must reach the worker as it would have); else Nones and why not (""
    where none was started), and that process is ended."""
    global _early
    if _early is None:
        return None, None, ""
    proc, ours, started_for, env = _early
    why = (f"it was started for {started_for}" if started_for != device else
           "the environment changed since" if env != dict(os.environ) else
           f"it ended (exit status {proc.returncode})" if proc.poll() is not None else "")
    if why:
        discard()
        return None, None, why
    _early = None
    return proc, ours, ""


def discard() -> None:
    """End a process started at import that no session took (gtmpi.workers(n) started the
    session, or the program ended without a tensor op)."""
    global _early
    if _early is None:
        return
    proc, ours, _, _ = _early
    _early = None
    ours.close()
    if proc.poll() is None:
        proc.kill()  # it serves nobody: its work so far is only imports
        proc.wait()
