"""A trace in progress, run by rank 0: switching recording on everywhere, measuring clocks,
collecting every rank's events and writing the file, also when the run fails."""
from __future__ import annotations

import atexit
import datetime
import importlib.metadata
import os
import platform
import socket
import sys
import time
from typing import Any, Callable

import numpy as np

from ..transport.tags import Tag
from . import fileformat
from .events import Flag, now
from .recorder import Recorder

COLLECT_TIMEOUT_S = 30.0
FIRST_SNAPSHOT_S = 0.25  # then at doubling intervals: a run may die early
# what each worker's attributes keep of its stats at the end: tensor memory in use and at peak
MEMORY_KEYS = ("memory_bytes", "peak_bytes", "reserved_bytes", "peak_reserved_bytes",
               "rss_bytes", "peak_rss_bytes")


class TraceRun:
    """Also writes the file at the start and snapshots while the run goes on (after 0.25 s, then
    at doubling intervals up to GTMPI_TRACE_SNAPSHOT_S seconds, default 30; 0 turns them off),
    both after sends and while rank 0 waits for workers: a run killed by a signal (the launcher
    ends every rank when one dies) still leaves the file of its last snapshot. Workers send
    their parts without stopping the stream; the file is rewritten once all parts of a round
    are in."""

    def __init__(self, rt: Any, path: str, gpu_every: int) -> None:
        self.rt = rt
        self.path = os.path.abspath(path)
        self.gpu_every = gpu_every
        self.stopping = False
        self.snapshot_s = float(os.environ.get("GTMPI_TRACE_SNAPSHOT_S", "30"))
        self._previous_hook: Callable | None = None
        self.memory: dict[int, dict] = {}  # worker_stats at the end, for each worker's memory
        self.pipeline: dict | None = None  # stages, micro-batches and schedule, if one ran

    def start(self) -> None:
        # Now, not when writing: h5py first imported inside an atexit handler crashes the
        # interpreter's shutdown.
        import h5py  # noqa: F401
        d = self.rt.dispatcher
        self._outer_watchdog = d.watchdog  # what stop() puts back, however far start gets
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        ranks = list(d.links)
        self.parts: dict[int, list[dict]] = {r: [] for r in ranks}  # events sent so far
        self.pending = dict.fromkeys(ranks, 0)  # parts asked for and not yet received
        self.wall_start = time.time()
        self.t0 = now()
        d.trace = self.recorder = Recorder(0)
        d.post("trace", ("start", self.gpu_every), ranks)
        self.clock_start = d.measure_clocks(ranks)
        # the first snapshot soon (a run may die early), then at doubling intervals
        self._interval = min(FIRST_SNAPSHOT_S, self.snapshot_s)
        self._next_snapshot = time.monotonic() + self._interval
        self._write(now(), "running: started", {}, {})
        if self.snapshot_s > 0:
            d.trace_tick = self._tick
            d.watchdog = self._watchdog
        self._previous_hook = sys.excepthook
        sys.excepthook = self._uncaught
        atexit.register(self._at_exit)

    def stop(self, failure: str | None = None, dead: tuple[int, ...] = ()) -> str:
        """Collect every reachable rank's events and write the file; return its path."""
        self.stopping = True
        d = self.rt.dispatcher
        d.trace_tick = None
        t_end = now()
        if sys.excepthook == self._uncaught:
            sys.excepthook = self._previous_hook
        atexit.unregister(self._at_exit)
        ranks = [r for r in d.links if r not in dead]
        missing = {r: "died" for r in dead}
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        d.watchdog = _deadline(deadline)
        clock_end = {}
        try:
            d.post("trace", ("collect",), ranks)  # recorded still: its send ends rank 0's lanes
            d.trace = None
            for rank in ranks:
                try:
                    for _ in range(self.pending[rank] + 1):  # snapshot parts first, in order
                        self.parts[rank].append(d.links[rank].wait_reply(Tag.TRACE, d.watchdog))
                    self.pending[rank] = 0
                except TimeoutError:
                    missing[rank] = f"no events within {COLLECT_TIMEOUT_S:.0f} s"
            reached = [r for r in ranks if r not in missing]
            clock_end = d.measure_clocks(reached) if reached else {}
            self.memory = d.ask_all("stats", Tag.STATS, (False,), reached) if reached else {}
        except TimeoutError:
            pass
        finally:
            d.trace = None
            d.watchdog = self._outer_watchdog
        status = "ok" if failure is None else f"failed: {failure}"
        self._write(t_end, status, missing, clock_end)
        return self.path

    def _watchdog(self) -> None:
        """Now and then while rank 0 waits for workers: their checks, then a snapshot's turn."""
        self._outer_watchdog()
        if self.rt.dispatcher.trace_tick is not None:
            self._tick()

    def _tick(self) -> None:
        """After each traced send: gather arrived parts; ask for a round, or write one."""
        d = self.rt.dispatcher
        d.trace_tick = None  # the sends below must not come back here
        try:
            if any(self.pending.values()):
                for rank, waiting in self.pending.items():
                    if waiting and (part := d.links[rank].poll_reply(Tag.TRACE)) is not None:
                        self.parts[rank].append(part)
                        self.pending[rank] -= 1
                if not any(self.pending.values()):
                    started = time.monotonic()
                    self._write(now(), "running: snapshot", {}, {})
                    # writing must stay a small share of the run, however big the trace grows
                    self._interval = min(2 * self._interval, self.snapshot_s)
                    self._next_snapshot = time.monotonic() + max(
                        self._interval, 50 * (time.monotonic() - started))
            elif time.monotonic() >= self._next_snapshot:
                d.post("trace", ("part",), list(self.pending))
                self.pending = dict.fromkeys(self.pending, 1)
        finally:
            d.trace_tick = self._tick

    def _write(self, t_end: int, status: str, missing: dict[int, str], clock_end: dict) -> None:
        tables = {0: [self.recorder.pack()]}
        tables.update({r: [p for p in parts if p is not None] for r, parts in self.parts.items()})
        strings, events = _merge(tables)
        for rank in events:
            events[rank] = _aligned(events[rank], self.t0, self.clock_start.get(rank),
                                    clock_end.get(rank))
        meta = self._meta(t_end, status, missing)
        fileformat.write(self.path, meta, strings, events, self._rank_info(clock_end))

    def _meta(self, t_end: int, status: str, missing: dict[int, str]) -> dict[str, Any]:
        versions = {"gtmpi": _installed_version(), "python": platform.python_version()}
        for module in ("torch", "numpy", "h5py", "mpi4py"):
            mod = sys.modules.get(module)
            if mod is not None:
                versions[module] = mod.__version__
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized():
            versions["mpi"] = mpi.Get_library_version().strip().splitlines()[0]
        config = os.environ.get("GTMPI_CONFIG") or os.environ.get("GT_CONFIG")
        return {
            "status": status,
            "start_time": datetime.datetime.fromtimestamp(self.wall_start, datetime.timezone.utc)
            .isoformat(timespec="microseconds"),
            "start_unix_ns": int(self.wall_start * 1e9),
            "duration_ns": t_end - self.t0,
            "world_size": len(self.rt.workers) + 1,
            "embedded": any(w.get("embedded") for w in self.rt.workers.values()),
            "command": list(getattr(sys, "orig_argv", sys.argv)),
            "config_path": config or "",
            "config_yaml": _text(config),
            "versions": versions,
            "gpu_every": self.gpu_every,
            "missing_ranks": {str(r): why for r, why in missing.items()},
            "pipeline": self.pipeline or {},
        }

    def _rank_info(self, clock_end: dict) -> dict[int, dict[str, Any]]:
        info = {0: {"role": "client+dispatcher", "host": socket.gethostname(),
                    "pid": os.getpid(), "device": "cpu"}}
        for rank, w in self.rt.workers.items():
            entry = {"role": "worker", "host": w["host"], "pid": w["pid"], "device": w["device"],
                     "gpu": w.get("gpu") or ""}
            for when, clocks in (("start", self.clock_start), ("end", clock_end)):
                if rank in clocks:
                    entry[f"clock_offset_{when}_ns"], entry[f"clock_rtt_{when}_ns"] = clocks[rank][:2]
            entry.update({k: v for k, v in self.memory.get(rank, {}).items() if k in MEMORY_KEYS})
            info[rank] = entry
        return info

    def _uncaught(self, kind, value, tb) -> None:
        previous = self._previous_hook
        self.rt.fail(f"{kind.__name__}: {value}")
        previous(kind, value, tb)

    def _at_exit(self) -> None:
        if not self.stopping:
            self.rt.stop_trace()


def _deadline(deadline: float) -> Callable[[], None]:
    def check() -> None:
        if time.monotonic() > deadline:
            raise TimeoutError
    return check


def _merge(tables: dict[int, list[dict]]) -> tuple[list[str], dict[int, np.ndarray]]:
    """One string table for all ranks; each part's indices remapped into it, a rank's parts
    joined into one table."""
    index: dict[str, int] = {}
    events = {}
    for rank, parts in sorted(tables.items()):
        joined = []
        for packed in parts:
            local = np.array([index.setdefault(s, len(index)) for s in packed["names"]] + [-1],
                             np.int32)
            table = packed["events"].copy()
            table["name"] = local[table["name"]]  # -1 indexes the appended -1: absent stays so
            table["detail"] = local[table["detail"]]
            joined.append(table)
        if joined:
            table = np.concatenate(joined)
            events[rank] = table[np.argsort(table["t0"], kind="stable")]
    return list(index), events


def _aligned(table: np.ndarray, t0: int, start: tuple | None, end: tuple | None) -> np.ndarray:
    """Times on rank 0's clock, as nanoseconds since the trace started there.

    ``start``/``end`` are (offset, round trip, rank-0 time) measured at both ends of the run;
    between them the offset is interpolated, so a clock drifting by a steady rate lines up.
    """
    table = table.copy()
    for field in ("t0", "t1"):
        table[field] -= _offset(table[field], start, end) + t0
    timed = (table["flags"] & Flag.GPU_TIMED) != 0
    for field in ("gpu_t0", "gpu_t1"):
        t = table[field][timed]
        table[field][timed] = t - _offset(t, start, end) - t0
    return table


def _offset(t: np.ndarray, start: tuple | None, end: tuple | None) -> np.ndarray | int:
    if start is None:
        return 0
    offset_start, _, mid_start = start
    if end is None or end[2] == mid_start:
        return offset_start
    offset_end, _, mid_end = end
    # the worker's clock reading at each measurement, to interpolate along its own timeline
    w_start, w_end = mid_start + offset_start, mid_end + offset_end
    rate = (offset_end - offset_start) / (w_end - w_start)
    return (offset_start + (t - w_start) * rate).astype(np.int64)


def _installed_version() -> str:
    try:
        return importlib.metadata.version("gtmpi")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _text(path: str | None) -> str:
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""
