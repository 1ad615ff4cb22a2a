"""Figures computed from a trace: busy and idle time, op statistics, bytes moved, waits, gaps
and pipeline bubbles. Each returns plain rows, printed by the CLI and checked by the tests."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from ..recording.events import Flag, Kind, Lane
from ..ops.table import STEP_OPS
from ..recording.fileformat import Trace

# What counts as working, per lane; everything else on a lane's timeline is idle or waiting.
BUSY = {Lane.CLIENT: (Kind.ISSUE,),
        Lane.DISPATCHER: (Kind.DISPATCH, Kind.SEND),
        Lane.WORKER: (Kind.RECV, Kind.EXEC, Kind.TRANSFER, Kind.FREE, Kind.CONTROL,
                      Kind.COLLECTIVE, Kind.REPLAY)}


def union_ns(t0: np.ndarray, t1: np.ndarray) -> int:
    """Total length covered by the intervals [t0, t1] (overlaps counted once)."""
    begin, end = _merged(t0, t1)
    return int((end - begin).sum())


def select(table: np.ndarray, kinds: tuple = (), lane: Lane | None = None) -> np.ndarray:
    mask = np.ones(len(table), bool)
    if kinds:
        mask &= np.isin(table["kind"], [int(k) for k in kinds])
    if lane is not None:
        mask &= table["lane"] == lane
    return table[mask]


def duration_ns(trace: Trace) -> int:
    ends = [int(t["t1"].max()) for t in trace.events.values() if len(t)]
    return max([int(trace.meta.get("duration_ns", 0)), *ends, 1])


def rank_lanes(trace: Trace, rank: int) -> list[Lane]:
    role = trace.ranks.get(rank, {}).get("role")
    if role == "server":  # a server's trace (gtmpi/server/tracing.py): rank 0 forwards
        return [Lane.DISPATCHER]
    if role == "client":  # and each of its clients has a rank of its own
        return [Lane.CLIENT]
    return [Lane.CLIENT, Lane.DISPATCHER] if rank == 0 else [Lane.WORKER]


def busy_rows(trace: Trace) -> list[dict[str, Any]]:
    """Per rank and lane: busy, waiting and idle shares of the run."""
    total = duration_ns(trace)
    rows = []
    for rank, table in trace.events.items():
        info = trace.ranks.get(rank, {})
        for lane in rank_lanes(trace, rank):
            work = select(table, BUSY[lane], lane)
            waits = select(table, (Kind.WAIT,), lane)
            busy = union_ns(work["t0"], work["t1"])
            wait = union_ns(waits["t0"], waits["t1"])
            peak = info.get("peak_bytes", info.get("peak_rss_bytes"))
            rows.append({"rank": rank, "lane": lane.name.lower(), "device": info.get("device", ""),
                         "peak_mb": "" if peak is None else f"{peak / 1e6:.1f}",
                         "events": int((table["lane"] == lane).sum()),
                         "busy_pct": 100 * busy / total, "wait_pct": 100 * wait / total,
                         "idle_pct": max(0.0, 100 * (total - busy - wait) / total)})
    return rows


def op_names(trace: Trace) -> set[str]:
    """The ops that workers executed."""
    return {trace.name(int(i)) for r, t in trace.events.items() if r
            for i in np.unique(select(t, (Kind.EXEC,), Lane.WORKER)["name"])}


def op_rows(trace: Trace, ranks: list[int] | None = None) -> list[dict[str, Any]]:
    """Per op executed on workers: count and host time statistics (and sampled GPU time)."""
    times: dict[str, list[np.ndarray]] = defaultdict(list)
    gpu: dict[str, list[np.ndarray]] = defaultdict(list)
    for rank, table in trace.events.items():
        if ranks is not None and rank not in ranks:
            continue
        execs = select(table, (Kind.EXEC,), Lane.WORKER)
        for index in np.unique(execs["name"]):
            mine = execs[execs["name"] == index]
            name = trace.name(int(index))
            times[name].append(mine["t1"] - mine["t0"])
            timed = mine[mine["gpu_t0"] >= 0]
            gpu[name].append(timed["gpu_t1"] - timed["gpu_t0"])
    rows = []
    for name, parts in times.items():
        d = np.concatenate(parts).astype(np.float64)
        g = np.concatenate(gpu[name]).astype(np.float64)
        rows.append({"op": name, "count": len(d), "total_us": d.sum() / 1e3,
                     "mean_us": d.mean() / 1e3, "p50_us": np.percentile(d, 50) / 1e3,
                     "p99_us": np.percentile(d, 99) / 1e3, "gpu_timed": len(g),
                     "gpu_mean_us": g.mean() / 1e3 if len(g) else float("nan")})
    rows.sort(key=lambda r: -r["total_us"])
    return rows


def transfer_rows(trace: Trace) -> tuple[list[dict], list[dict]]:
    """Bytes moved: per kind of transfer, and per (source, destination) pair of ranks.

    Counted once, where they arrive or leave a worker: instruction batches (rank 0 to a
    worker), uploads, reads, and worker-to-worker transfers and collectives."""
    by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_pair: dict[tuple[int, int], int] = defaultdict(int)
    for rank, table in trace.events.items():
        if rank == 0:
            continue
        for e in select(table, (Kind.RECV, Kind.TRANSFER, Kind.COLLECTIVE), Lane.WORKER):
            name = trace.name(int(e["name"]))
            kind = "instructions" if e["kind"] == Kind.RECV else name
            by_kind[kind][0] += 1
            by_kind[kind][1] += int(e["bytes"])
            peer = int(e["peer"])
            if e["kind"] == Kind.COLLECTIVE:
                by_pair[(rank, -1)] += int(e["bytes"])
            elif kind in ("instructions", "upload"):
                by_pair[(peer, rank)] += int(e["bytes"])
            elif kind != "recv":  # read, send (a send's bytes are its receive's)
                by_pair[(rank, peer)] += int(e["bytes"])
    kinds = [{"kind": k, "count": c, "bytes": b} for k, (c, b) in sorted(by_kind.items())]
    pairs = [{"src": s, "dst": d, "bytes": b} for (s, d), b in sorted(by_pair.items())]
    return kinds, pairs


def collective_rows(trace: Trace) -> list[dict[str, Any]]:
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for rank, table in trace.events.items():
        for e in select(table, (Kind.COLLECTIVE,)):
            entry = counts[trace.name(int(e["name"]))]
            entry[0] += 1
            entry[1] += int(e["bytes"])
    return [{"collective": k, "count": c, "bytes": b} for k, (c, b) in sorted(counts.items())]


def comm_rows(trace: Trace) -> list[dict[str, Any]]:
    """Every collective and transfer the dispatcher inserted, by the program's line that caused
    it and kind: count (per worker taking part; a transfer once), bytes, and whether a signal or
    a read asked for it. Largest bytes first."""
    table = trace.events.get(0, np.zeros(0))
    rows: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    inserted = select(table, (Kind.DISPATCH,), Lane.DISPATCHER) if len(table) else table
    for e in inserted[(inserted["flags"] & Flag.INSERTED) != 0] if len(inserted) else []:
        if int(e["detail"]) < 0:
            continue  # an inserted instruction that moves nothing (a cut, an alias, a free)
        why, _, site = trace.name(int(e["detail"])).partition(" ")
        entry = rows[(site, trace.name(int(e["name"])), why)]
        entry[0] += max(int(e["count"]), 1)  # a replay's row stands for all it ran again
        entry[1] += int(e["bytes"])
    return sorted(({"where": k[0], "kind": k[1], "why": k[2], "count": c, "bytes": b}
                   for k, (c, b) in rows.items()), key=lambda r: -r["bytes"])


def wait_rows(trace: Trace) -> list[dict[str, Any]]:
    """Where rank 0 waited: reads, syncs, back-pressure; count and time."""
    table = trace.events.get(0, np.zeros(0))
    rows = []
    waits = select(table, (Kind.WAIT,)) if len(table) else table
    for index in np.unique(waits["name"]) if len(waits) else []:
        d = (waits[waits["name"] == index]["t1"] - waits[waits["name"] == index]["t0"]) / 1e3
        rows.append({"wait": trace.name(int(index)), "count": len(d), "total_us": d.sum(),
                     "mean_us": d.mean(), "p50_us": np.percentile(d, 50), "max_us": d.max()})
    return sorted(rows, key=lambda r: -r["total_us"])


def step_rows(trace: Trace, op: str | None = None) -> list[dict[str, Any]]:
    """Rank 0's time per training step: from one issue of ``op`` (by default the optimizer's
    update, the first of STEP_OPS issued, or replayed: a captured step's replay is recorded
    under its name) to the next (issues of it in a row, one per parameter
    group, start one step), its wall time, the time rank 0 waited for workers in it (reads,
    syncs, back-pressure) and the rest, rank 0's host time: the program's Python, autograd's
    record and gtmpi's issue and dispatch. Empty when ``op`` was never issued."""
    table = trace.events.get(0, np.zeros(0))
    if not len(table):
        return []
    issues = select(table, (Kind.ISSUE,), Lane.CLIENT)
    names = np.array([trace.name(int(n)) for n in issues["name"]], dtype=object)
    if op is None:
        op = next((o for o in STEP_OPS if (names == o).any()), None)
    mine = names == op
    first = mine & ~np.concatenate([[False], mine[:-1]])
    starts = issues["t0"][first]
    waits = select(table, (Kind.WAIT,))
    w0, w1 = _merged(waits["t0"], waits["t1"])
    rows = []
    for i, (t0, t1) in enumerate(zip(starts[:-1], starts[1:])):
        waited = int((np.clip(w1, t0, t1) - np.clip(w0, t0, t1)).sum())
        rows.append({"step": i, "op": op, "start_ms": t0 / 1e6, "wall_ms": (t1 - t0) / 1e6,
                     "wait_ms": waited / 1e6, "host_ms": (t1 - t0 - waited) / 1e6,
                     "issued": int(((issues["t0"] >= t0) & (issues["t0"] < t1)).sum())})
    return rows


def gap_rows(trace: Trace, min_gap_ns: int, top: int = 5) -> list[dict[str, Any]]:
    """Per worker: idle gaps between its work longer than ``min_gap_ns``, the longest first."""
    rows = []
    for rank, table in trace.events.items():
        if rank == 0:
            continue
        work = select(table, BUSY[Lane.WORKER], Lane.WORKER)
        t0, t1 = _merged(work["t0"], work["t1"])
        gaps = t0[1:] - t1[:-1] if len(t0) > 1 else np.zeros(0, np.int64)
        long = np.flatnonzero(gaps > min_gap_ns)
        longest = long[np.argsort(-gaps[long])][:top]
        rows.append({"rank": rank, "busy_ns": int((t1 - t0).sum()), "gaps": len(long),
                     "gap_ns": int(gaps[long].sum()),
                     "longest": [(int(t1[i]), int(gaps[i])) for i in longest]})
    return rows


def bubble_rows(trace: Trace) -> list[dict[str, Any]]:
    """Per pipeline stage (from the trace's metadata, written by gtmpi.pipeline): the share of
    the busy window (first op of any stage to the last) that the stage spent idle, beside the
    schedule's ideal (GPipe's and 1F1B's (p-1)/(m+p-1)); its share of all stages' compute, and
    how far its compute is from the stages' mean (``over``: +0.25 is a quarter more than the
    mean: work to move to the others for a balanced split). No rows for a run without a
    pipeline."""
    pipeline = trace.meta.get("pipeline") or {}
    stages = pipeline.get("stages") or []
    spans = {r: select(t, BUSY[Lane.WORKER], Lane.WORKER) for r, t in trace.events.items() if r}
    execs = [s for s in spans.values() if len(s)]
    if not stages or not execs:
        return []
    start = min(int(s["t0"].min()) for s in execs)
    end = max(int(s["t1"].max()) for s in execs)
    window = max(end - start, 1)
    p, m = len(stages), int(pipeline.get("micro_batches", 0))
    ideal = pipeline.get("ideal_bubble", (p - 1) / (m + p - 1) if m else float("nan"))
    rows = []
    for i, ranks in enumerate(stages):
        parts = [spans[r] for r in ranks if r in spans]
        t0 = np.concatenate([p["t0"] for p in parts]) if parts else np.zeros(0, np.int64)
        t1 = np.concatenate([p["t1"] for p in parts]) if parts else np.zeros(0, np.int64)
        busy = union_ns(np.clip(t0, start, end), np.clip(t1, start, end))
        rows.append({"stage": i, "ranks": list(ranks), "busy_ns": busy,
                     "bubble": 1 - busy / window, "ideal": ideal})
    total = sum(r["busy_ns"] for r in rows) or 1
    for r in rows:
        r["share"] = r["busy_ns"] / total
        r["over"] = r["share"] * len(rows) - 1
    return rows


def _merged(t0: np.ndarray, t1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The intervals' union as sorted, disjoint stretches."""
    if len(t0) == 0:
        return t0, t1
    order = np.argsort(t0, kind="stable")
    t0, t1 = t0[order], np.maximum.accumulate(t1[order])
    # a new stretch starts where an interval begins after everything before it has ended
    starts = np.concatenate([[True], t0[1:] > t1[:-1]])
    return t0[starts], np.concatenate([t1[:-1][starts[1:]], t1[-1:]])
