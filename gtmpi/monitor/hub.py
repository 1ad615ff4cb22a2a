"""Rank 0's monitor hub: one listening TCP socket, in a thread of its own.

Peers prove they know the port file's token, after the hub has proved it
(transport/rendezvous.py: dial), then say what they are:
  worker   a worker's pusher (push.py): a JSON line of its figures every interval
  monitor  ``gtmpi-trace top``: gets the job's figures as one JSON line every interval
  client   (a server's only) a program joining it: handed to the server's loop through
           ``arrivals``, which does the MPI part
  stop     (a server's only) asks the server to shut down
A peer without the token (or its proof) is told so and dropped; so is one that sends what
is not a JSON object line, or says nothing for HELLO_S. Nothing a peer sends, and no failure
to accept (out of file descriptors), ends the hub's thread: it logs and goes on listening.
"""
from __future__ import annotations

import os
import queue
import selectors
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

from ..transport.rendezvous import (LOOPBACK, Lines, listen, nonce, proof_matches, prove,
                                   write_port_file)

# how often workers push and monitors are sent the figures
INTERVAL_S = float(os.environ.get("GTMPI_MONITOR_INTERVAL_S", "1"))
HELLO_S = 5.0  # a peer that has not presented the token by then is dropped
ACCEPT_RETRY_S = 0.1  # after a failed accept (no file descriptor left): the backlog waits


class Hub:
    def __init__(self, port_file: str, kind: str, extra: Callable[[], dict] | None = None,
                 bind: str = LOOPBACK, **about: Any) -> None:
        """``kind``: "server" or "run"; ``extra``: more figures for monitors (a server's
        clients), called from the hub's thread; ``bind``: the address to listen on (the
        loopback: this host only); ``about``: what the port file also says."""
        self.kind = kind
        self.extra = extra
        self._listener, self.address = listen(bind)
        self.refused = 0  # peers dropped for what they sent, or for saying nothing
        self._accept_failing = False  # said once until an accept works again
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
        peers: dict[socket.socket, tuple[Lines, str | None, float]] = {}  # role, when it came
        next_push = time.monotonic()
        while not self._stop.is_set():
            try:
                next_push = self._turn(sel, peers, next_push)
            except Exception:  # a bug of the hub's own must not end it for every later peer
                print("gtmpi: the monitor hub met an error and goes on:\n" +
                      traceback.format_exc(), file=sys.stderr, flush=True)
                time.sleep(ACCEPT_RETRY_S)
        for lines, _, _ in peers.values():
            lines.close()
        self._listener.close()

    def _turn(self, sel: selectors.BaseSelector, peers: dict, next_push: float) -> float:
        """One wait for what comes, and what is due; returns when the figures go out next."""
        for key, _ in sel.select(timeout=0.1):
            if key.data is None:
                self._accept(sel, peers)
                continue
            lines, role, came = peers[key.data]
            for obj in lines.poll():
                try:
                    role = self._heard(lines, role, obj)
                except (KeyError, TypeError, ValueError, OverflowError):
                    lines.closed = True  # a worker's figures that are not figures
                    self.refused += 1
                if role == "handed" or lines.closed:
                    break
            if lines.closed and role is None:
                self.refused += 1
            if role == "handed" or lines.closed:
                self._drop(sel, peers, key.data, role)
            else:
                peers[key.data] = (lines, role, came)
        now = time.monotonic()
        for conn, (lines, role, came) in list(peers.items()):
            if role is None and now - came > HELLO_S:
                self.refused += 1
                self._drop(sel, peers, conn, role)
        if now >= next_push:
            next_push = now + INTERVAL_S
            monitors = [ln for ln, role, _ in peers.values() if role == "monitor"]
            if monitors:
                line = self.snapshot()
                for ln in monitors:
                    ln.send(line)
        return next_push

    def _accept(self, sel: selectors.BaseSelector, peers: dict) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError as e:  # out of file descriptors: the peer waits in the backlog
            if not self._accept_failing:
                self._accept_failing = True
                print(f"gtmpi: the monitor hub cannot accept a connection now ({e}); it goes "
                      "on listening", file=sys.stderr, flush=True)
            time.sleep(ACCEPT_RETRY_S)
            return
        self._accept_failing = False
        peers[conn] = (Lines(conn), None, time.monotonic())
        sel.register(conn, selectors.EVENT_READ, conn)

    def _drop(self, sel: selectors.BaseSelector, peers: dict, conn: socket.socket,
              role: str | None) -> None:
        lines = peers.pop(conn)[0]
        sel.unregister(conn)
        if role == "monitor":
            self.monitors -= 1
        if role != "handed":
            lines.close()

    def _heard(self, lines: Lines, role: str | None, obj: dict) -> str | None:
        """A line from a peer: its hello (checked), or a worker's figures."""
        if role == "worker":
            self.workers[int(obj["rank"])] = dict(obj)
            return role
        if role is not None:
            return role
        if lines.expect is None:  # first the peer's challenge: this hub proves it is itself
            ask = obj.get("nonce") if isinstance(obj, dict) else None
            if not isinstance(ask, str) or len(ask) > 64:
                lines.send({"refused": "a peer first asks the listener to prove it knows the "
                                       "port file's token"})
                lines.closed = True
                return None
            lines.expect = nonce()
            lines.send({"proof": prove(self.token, "listener", ask), "nonce": lines.expect})
            return None
        if not proof_matches(obj, self.token, "peer", lines.expect):
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
