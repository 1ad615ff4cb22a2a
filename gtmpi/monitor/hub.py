"""Rank 0's monitor hub: one listening TCP socket, in a thread of its own.

Peers present the port file's token, then say what they are:
  worker   a worker's pusher (push.py): a JSON line of its figures every interval
  monitor  ``gtmpi-trace top``: gets the job's figures as one JSON line every interval
  client   (a server's only) a program joining it: handed to the server's loop through
           ``arrivals``, which does the MPI part
  stop     (a server's only) asks the server to shut down
A peer without the token is told so and dropped.
"""
from __future__ import annotations

import queue
import selectors
import socket
import threading
import time
from typing import Any, Callable

from ..transport.rendezvous import Lines, listen, write_port_file

INTERVAL_S = 1.0  # how often workers push and monitors are sent the figures


class Hub:
    def __init__(self, port_file: str, kind: str, extra: Callable[[], dict] | None = None,
                 **about: Any) -> None:
        """``kind``: "server" or "run"; ``extra``: more figures for monitors (a server's
        clients), called from the hub's thread; ``about``: what the port file also says."""
        self.kind = kind
        self.extra = extra
        self._listener, self.address = listen()
        self.token = write_port_file(port_file, self.address, kind, **about)
        self.port_file = port_file
        self.workers: dict[int, dict] = {}  # rank -> its latest figures
        self.arrivals: queue.Queue = queue.Queue()  # (kind, Lines, hello) for the server's loop
        self.monitors = 0  # attached now
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gtmpi-monitor-hub", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def snapshot(self) -> dict[str, Any]:
        snap = {"kind": self.kind, "time": time.time(), "up_s": time.time() - self.started,
                "workers": {str(r): w for r, w in sorted(self.workers.items())},
                "monitors": self.monitors}
        if self.extra is not None:
            snap.update(self.extra())
        return snap

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        peers: dict[socket.socket, tuple[Lines, str | None]] = {}
        next_push = time.monotonic()
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=0.1):
                if key.data is None:
                    conn, _ = self._listener.accept()
                    peers[conn] = (Lines(conn), None)
                    sel.register(conn, selectors.EVENT_READ, conn)
                    continue
                lines, role = peers[key.data]
                for obj in lines.poll():
                    role = self._heard(lines, role, obj)
                    if role == "handed":
                        break
                if role == "handed" or lines.closed:
                    sel.unregister(key.data)
                    del peers[key.data]
                    if role == "monitor":
                        self.monitors -= 1
                    if role != "handed":
                        lines.close()
                else:
                    peers[key.data] = (lines, role)
            if time.monotonic() >= next_push:
                next_push = time.monotonic() + INTERVAL_S
                monitors = [ln for ln, role in peers.values() if role == "monitor"]
                if monitors:
                    line = self.snapshot()
                    for ln in monitors:
                        ln.send(line)
        for lines, _ in peers.values():
            lines.close()
        self._listener.close()

    def _heard(self, lines: Lines, role: str | None, obj: dict) -> str | None:
        """A line from a peer: its hello (checked), or a worker's figures."""
        if role == "worker":
            self.workers[int(obj["rank"])] = obj
            return role
        if role is not None:
            return role
        if not isinstance(obj, dict) or obj.get("token") != self.token:
            lines.send({"refused": "wrong token: read it from the port file"})
            lines.closed = True
            return None
        role = obj.get("role")
        if role == "worker":
            return role
        if role == "monitor":
            self.monitors += 1
            lines.send(self.snapshot())
            return role
        if role in ("client", "stop") and self.kind == "server":
            lines.sock.setblocking(True)
            self.arrivals.put((role, lines, obj))
            return "handed"
        lines.send({"refused": f"this port file is of a {self.kind}, which takes no {role}"})
        lines.closed = True
        return None
