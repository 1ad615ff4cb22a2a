"""The port file and the TCP line protocol, for servers, clients and monitors.

A peer's first lines are JSON (its hello with the token, the answer). A server's client then
goes on in frames on the same connection (transport/frames.py) for its whole life: its end of
file is how the server learns, within a poll, that a client was killed (kill -9 included).

The port file holds where to reach the process and a secret token; it is written whole, readable
by its owner only, and every TCP peer must present the token first.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import tempfile
from typing import Any

TOKEN_BYTES = 24
LINE_MAX = 1 << 20  # a JSON line longer than this is a broken or hostile peer


def write_port_file(path: str, address: tuple[str, int], kind: str, **extra: Any) -> str:
    """Write ``path`` (mode 0600, replaced whole) and return the token it holds."""
    token = secrets.token_hex(TOKEN_BYTES)
    body = {"kind": kind, "host": address[0], "port": address[1], "token": token,
            "pid": os.getpid(), **extra}
    folder = os.path.dirname(os.path.abspath(path))
    fd, scratch = tempfile.mkstemp(dir=folder, prefix=".gtmpi-port-")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(scratch, path)
    except BaseException:
        os.unlink(scratch)
        raise
    return token


def read_port_file(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"gtmpi: no port file at {path}: is the server (or the run "
                                "with GTMPI_MONITOR) running, and is this its path?") from None
    except PermissionError:
        raise PermissionError(f"gtmpi: the port file {path} is not readable by this user: only "
                              "its owner may connect") from None


LOOPBACK = "127.0.0.1"


def listen(bind: str = LOOPBACK) -> tuple[socket.socket, tuple[str, int]]:
    """A listening TCP socket on the address ``bind`` (the loopback by default: only this host
    can reach it; ``0.0.0.0`` is every interface), and the address others reach it at."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((bind, 0))
    sock.listen(64)
    host = socket.gethostname() if bind in ("", "0.0.0.0") else bind
    return sock, (host, sock.getsockname()[1])


def token_matches(hello: Any, token: str) -> bool:
    """Whether a peer's first line holds the port file's token (compared in constant time)."""
    given = hello.get("token") if isinstance(hello, dict) else None
    return isinstance(given, str) and secrets.compare_digest(given.encode(), token.encode())


def dial(info: dict[str, Any], hello: dict[str, Any], timeout_s: float = 10.0) -> "Lines":
    """Connect to the process a port file names and present the token with ``hello``."""
    host = info["host"]
    try:
        sock = socket.create_connection((host, info["port"]), timeout=timeout_s)
    except OSError:
        if host == socket.gethostname():
            raise
        sock = socket.create_connection(("127.0.0.1", info["port"]), timeout=timeout_s)
    lines = Lines(sock)
    lines.send({"token": info["token"], **hello})
    return lines


class Lines:
    """JSON objects, one per line, over a TCP socket (blocking or not)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self.closed = False

    def send(self, obj: Any) -> bool:
        """False if the peer is gone."""
        try:
            self.sock.sendall(json.dumps(obj).encode() + b"\n")
            return True
        except OSError:
            self.closed = True
            return False

    def recv(self, timeout_s: float | None = None) -> Any:
        """The next object; None at end of file (or, with a timeout, if none came in time)."""
        while b"\n" not in self._buf:
            self.sock.settimeout(timeout_s)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                return None
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                return None
            self._buf += chunk
            if len(self._buf) > LINE_MAX:
                self.closed = True
                return None
        line, self._buf = self._buf.split(b"\n", 1)
        return self._decode(line)

    def _decode(self, line: bytes) -> Any:
        """A line's object; None, and the peer counted as gone, if it is not JSON."""
        try:
            return json.loads(line)
        except ValueError:  # not JSON, or not UTF-8: a broken or hostile peer
            self.closed = True
            return None

    def poll(self) -> list[Any]:
        """Every complete object that has arrived, without waiting; sets ``closed`` at end of
        file."""
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                try:
                    chunk = self.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    chunk = b""
                if not chunk:
                    self.closed = True
                    break
                self._buf += chunk
        finally:
            if not self.closed:
                self.sock.setblocking(True)
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            obj = self._decode(line)
            if self.closed and obj is None:
                self._buf = b""
                break
            out.append(obj)
        if len(self._buf) > LINE_MAX:
            self.closed = True
        return out

    def rest(self) -> bytes:
        """What arrived after the last whole line (a peer that goes on in frames: their
        start), handed over."""
        rest, self._buf = self._buf, b""
        return rest

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
