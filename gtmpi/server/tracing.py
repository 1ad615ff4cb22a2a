"""A server's trace (``python -m gtmpi.server --trace FILE``): rank 0's forwarding, and one
lane per client, written when the server ends in the format of every gtmpi trace
(docs/trace-format.md), so ``gtmpi-trace summary`` and ``timeline`` read it.

Lanes: rank 0 ``server`` (Lane.DISPATCHER): each round forwarded (SEND; id = the client's slot,
peer = its lane, count = batches, bytes). One rank per client after the workers' ranks,
``client`` (Lane.CLIENT): its connection (SCOPE, from joining to leaving), each round's wait at
the server from arriving whole to being forwarded (WAIT "queued"), each upload relayed
(TRANSFER "upload"; reads go from the workers straight to the client, not through here). The
workers' own events are not in it: a client's GTMPI_TRACE records its part of them.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from typing import Any

from ..recording import fileformat
from ..recording.events import Kind, Lane, now
from ..recording.recorder import Recorder
from ..recording.session import _aligned, _merge


class ServerTrace:
    def __init__(self, path: str, workers: dict[int, dict]) -> None:
        self.path = path
        self.workers = workers
        self.first_lane = max(workers) + 1  # client slot s is rank first_lane + s - 1
        self.t0 = now()
        self.wall = time.time()
        self.server = Recorder(0)
        self.clients: dict[int, Recorder] = {}
        self.about: dict[int, dict[str, Any]] = {}

    def lane(self, slot: int) -> int:
        return self.first_lane + slot - 1

    def joined(self, slot: int, name: str, pid: Any, host: Any) -> None:
        rank = self.lane(slot)
        self.clients[rank] = Recorder(rank)
        self.about[rank] = {"role": "client", "slot": slot, "name": name, "pid": pid or -1,
                            "host": host or "", "device": "", "joined": now()}

    def forwarded(self, slot: int, whole_at: int, batches: int, nbytes: int) -> None:
        t = now()
        rank = self.lane(slot)
        self.server.event(Kind.SEND, Lane.DISPATCHER, t, t, "round", slot, rank, nbytes, batches)
        rec = self.clients.get(rank)
        if rec is not None:
            rec.event(Kind.WAIT, Lane.CLIENT, whole_at, t, "queued", slot, 0, nbytes, batches)

    def relayed(self, slot: int, what: str, nbytes: int, worker: int) -> None:
        rec = self.clients.get(self.lane(slot))
        if rec is not None:
            t = now()
            rec.event(Kind.TRANSFER, Lane.CLIENT, t, t, what, slot, worker, nbytes)

    def left(self, slot: int, how: str) -> None:
        rank = self.lane(slot)
        rec, about = self.clients.get(rank), self.about.get(rank)
        if rec is not None:
            rec.event(Kind.SCOPE, Lane.CLIENT, about.pop("joined"), now(),
                      f"client {slot}: {about['name']}", slot, detail=how)

    def write(self) -> str:
        end = now()
        for rank, about in self.about.items():  # still connected at the end
            if "joined" in about:
                self.left(about["slot"], "connected at the end")
        tables = {0: [self.server.pack()], **{r: [rec.pack()] for r, rec in self.clients.items()}}
        strings, events = _merge(tables)
        events = {r: _aligned(t, self.t0, None, None) for r, t in events.items()}
        for rank in self.about:
            events.setdefault(rank, _aligned(Recorder(rank).pack()["events"], self.t0, None, None))
        meta = {"status": "ok", "kind": "server",
                "start_time": datetime.datetime.fromtimestamp(self.wall, datetime.timezone.utc)
                .isoformat(timespec="microseconds"),
                "start_unix_ns": int(self.wall * 1e9), "duration_ns": end - self.t0,
                "world_size": len(self.workers) + 1, "embedded": False,
                "command": list(getattr(sys, "orig_argv", sys.argv)), "config_path": "",
                "config_yaml": "", "versions": {}, "gpu_every": 0, "missing_ranks": {},
                "pipeline": {}}
        ranks = {0: {"role": "server", "host": socket.gethostname(), "pid": os.getpid(),
                     "device": "cpu"}, **self.about}
        fileformat.write(self.path, meta, strings, events, ranks)
        return self.path
