"""The port file and the TCP line protocol, for servers, clients and monitors.

A peer's first lines are JSON (the proofs, its hello, the answer). A server's client then
goes on in frames on the same connection (transport/frames.py) for its whole life: its end of
file is how the server learns, within a poll, that a client was killed (kill -9 included).

The port file holds where to reach the process and a secret token; it is written whole, readable
by its owner only. Neither side sends the token: each proves it knows it (an HMAC of a nonce
the other chose), the listener first, so that whatever answers at a port file's address (a
stale file's port taken over, anyone on a --bind network) learns nothing and is sent nothing
before it has proved it is the process that wrote the file:

    peer -> listener   {"nonce": Np}
    listener -> peer   {"proof": hmac(token, "listener:" + Np), "nonce": Nl}
    peer -> listener   {"proof": hmac(token, "peer:" + Nl), ...its hello}
"""
from __future__ import annotations

import hashlib
import hmac
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


def prove(token: str, side: str, nonce: str) -> str:
    """What ``side`` ("listener" or "peer") answers to ``nonce``: only a holder of the token
    can make it."""
    return hmac.new(token.encode(), f"{side}:{nonce}".encode(), hashlib.sha256).hexdigest()


def proof_matches(obj: Any, token: str, side: str, nonce: str | None) -> bool:
    """Whether ``obj`` holds ``side``'s proof for ``nonce`` (compared in constant time)."""
    given = obj.get("proof") if isinstance(obj, dict) else None
    return isinstance(given, str) and nonce is not None and \
        hmac.compare_digest(given.encode(), prove(token, side, nonce).encode())


def nonce() -> str:
    return secrets.token_hex(16)


def dial(info: dict[str, Any], hello: dict[str, Any], timeout_s: float = 10.0) -> "Lines":
    """Connect to the process a port file names, have it prove it knows the file's token,
    prove it back, and say ``hello``. Raises ConnectionRefusedError, having sent nothing of
    the token's, where what answers is not that process."""
    host = info["host"]
    try:
        sock = socket.create_connection((host, info["port"]), timeout=timeout_s)
    except OSError:
        if host == socket.gethostname():
            raise
        sock = socket.create_connection(("127.0.0.1", info["port"]), timeout=timeout_s)
    lines = Lines(sock)
    ours = nonce()
    lines.send({"nonce": ours})
    answer = lines.recv(timeout_s=timeout_s)
    if not proof_matches(answer, info["token"], "listener", ours) or \
            not isinstance(answer.get("nonce"), str):
        lines.close()
        raise ConnectionRefusedError(
            f"gtmpi: what answers at {host}:{info['port']} did not prove it knows this port "
            "file's secret: it is not the process that wrote the file (a stale port file "
            "whose port another process took, or a file not its own); nothing was sent to it")
    lines.send({"proof": prove(info["token"], "peer", answer["nonce"]), **hello})
    return lines


class Lines:
    """JSON objects, one per line, over a TCP socket (blocking or not)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self.closed = False
        self.expect: str | None = None  # a listener's: the nonce it asked the peer to prove

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
