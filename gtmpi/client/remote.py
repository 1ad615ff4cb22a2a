"""A session that joins a gtmpi server (gtmpi/server) instead of starting workers.

    GTMPI_CONNECT=PATH python train.py                   (an unchanged script)
    gtmpi.connect(PATH)                                  (before the first tensor op)

The client keeps everything of a session but the workers: its ids, autograd, signals, configs,
placement and replayed programs are its own. It speaks TCP to the server's rank 0 alone
(transport/frames.py), so it is started as any program is: plain ``python`` or ``mpiexec -n 1``.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys

from ..dispatcher.dispatcher import SHARED_BATCH_MAX
from ..transport.frames import Channel
from ..transport.rendezvous import dial, read_port_file
from ..transport.remote import RemoteLink, ServerConnection, ServerGone
from .runtime import Runtime

CONNECT_TIMEOUT_S = 30.0


def start_remote(path: str) -> Runtime:
    """Connect to the server whose port file is ``path``: a Runtime whose links go through it."""
    info = read_port_file(path)
    if info.get("kind") != "server":
        raise RuntimeError(f"gtmpi: {path} is the port file of a {info.get('kind')}, not of a "
                           "server: use it with gtmpi-trace top")
    lines = dial(info, {"role": "client", "pid": os.getpid(), "host": socket.gethostname(),
                        "name": _program_name()})
    answer = lines.recv(timeout_s=CONNECT_TIMEOUT_S)
    if not answer or "refused" in answer or not isinstance(answer.get("welcome"), dict):
        lines.close()
        why = (answer or {}).get("refused", "no answer")
        raise ConnectionRefusedError(f"gtmpi: the server of {path} refused this client: {why}")
    welcome = answer["welcome"]
    # the rest of the connection is frames; what came after the welcome's line is their start
    conn = ServerConnection(Channel(lines.sock, already=lines.rest()), path, welcome["slot"])
    workers = {int(r): w for r, w in welcome["workers"].items()}
    links = {r: RemoteLink(conn, r) for r in workers}
    rt = Runtime(links, workers)
    rt.dispatcher.rounds = conn
    rt.dispatcher.batch_max = SHARED_BATCH_MAX
    inner = rt.dispatcher.watchdog

    def watchdog() -> None:
        conn.check()
        inner()
    rt.dispatcher.watchdog = watchdog
    atexit.register(_leave, rt)
    return rt


def _program_name() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def _leave(rt: Runtime) -> None:
    if rt.closed:
        return
    try:
        rt.close(timeout_s=10.0)
    except ServerGone as e:
        print(f"gtmpi: {e}", file=sys.stderr)


def connect(path: str) -> None:
    """Join the server whose port file is ``path``; before the first tensor op."""
    from . import runtime as session
    if session.current() is not None:
        raise RuntimeError("gtmpi: this session has already started; gtmpi.connect(path) must "
                           "come before the first tensor op (or set GTMPI_CONNECT=path)")
    session.set_runtime(start_remote(path))
