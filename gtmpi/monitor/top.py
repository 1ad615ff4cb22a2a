"""``gtmpi-trace top PORTFILE``: a running job's workers and clients, refreshed in the terminal.

Rates are differences of the workers' counters between two of their pushes, so the first frame
comes after two intervals. Instruction kinds: compute (ops of the table that are not
collectives or transfers), collectives, transfers (worker-to-worker sends and receives) and
control (uploads, reads, frees, syncs, replays: words that are not ops). Busy is host time spent
executing batches, wait the part of it spent waiting for the device (reads, syncs), idle the
rest. Memory: a GPU worker's allocated and peak tensor memory, a CPU worker's tensor bytes (and
its process's peak resident size).
"""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from ..transport.rendezvous import dial, read_port_file


def _mb(n: Any) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f}"


def _rate(now: dict, before: dict | None, key: str, dt: float) -> float | None:
    if before is None or dt <= 0:
        return None
    return (now.get(key, 0) - before.get(key, 0)) / dt


def _f(x: float | None, fmt: str = ",.0f") -> str:
    return "-" if x is None else format(x, fmt)


def _slot_rates(now: dict, before: dict | None, dt: float) -> dict[str, float | None]:
    ops = _rate(now, before, "ops", dt)
    parts = {k: _rate(now, before, k, dt) for k in ("control", "collectives", "transfers")}
    compute = None if ops is None else max(0.0, ops - sum(v or 0 for v in parts.values()))
    busy = _rate(now, before, "exec_ns", dt)
    wait = _rate(now, before, "wait_ns", dt)
    # a batch that ended between two readings can still carry a little of the one before
    return {"ops": ops, "compute": compute, **parts,
            "busy": None if busy is None else min(100.0, busy / 1e7),
            "wait": None if wait is None else min(100.0, wait / 1e7)}


def render(snap: dict[str, Any], before: dict[str, dict]) -> str:
    """One frame: the job's workers, then (a server's) clients; ``before``: per worker, its
    latest earlier push (rates are taken against it)."""
    out = [f"gtmpi {snap['kind']}: up {snap['up_s']:,.0f} s, {len(snap['workers'])} worker(s), "
           f"{snap.get('monitors', 0)} monitor(s) attached   {time.strftime('%H:%M:%S')}", ""]
    head = (f"{'worker':>6} {'device':<8} {'instr/s':>9} {'compute':>8} {'collect':>8} "
            f"{'transfer':>8} {'control':>8} {'busy %':>6} {'wait %':>6} {'idle %':>6} "
            f"{'mem MB':>9} {'peak MB':>9}")
    out.append(head)
    per_client: dict[str, dict[str, float]] = {}
    for rank, w in snap["workers"].items():
        prev = before.get(rank)
        dt = w["time"] - prev["time"] if prev else 0.0
        # over the slots there now, each against its own earlier counters: a client that left
        # takes its counters with it, and summing all slots then and now made rates negative
        # and idle above 100%
        keys = ("ops", "control", "collectives", "transfers", "exec_ns", "wait_ns")
        total = {k: sum(s.get(k, 0) for s in w["slots"].values()) for k in keys}
        prev_total = None if prev is None else {
            k: sum(prev["slots"].get(slot, {}).get(k, 0) for slot in w["slots"]) for k in keys}
        r = _slot_rates(total, prev_total, dt)
        idle = None if r["busy"] is None else min(100.0, max(0.0, 100 - r["busy"]))
        peak = w.get("peak_bytes", w.get("peak_rss_bytes"))
        out.append(f"{rank:>6} {w['device']:<8} {_f(r['ops']):>9} {_f(r['compute']):>8} "
                   f"{_f(r['collectives']):>8} {_f(r['transfers']):>8} {_f(r['control']):>8} "
                   f"{_f(r['busy'], '.1f'):>6} {_f(r['wait'], '.1f'):>6} {_f(idle, '.1f'):>6} "
                   f"{_mb(w.get('memory_bytes')):>9} {_mb(peak):>9}")
        for slot, s in w["slots"].items():
            if slot == "0":
                continue
            ps = prev["slots"].get(slot) if prev else None
            c = per_client.setdefault(slot, {"ops": 0.0, "busy": 0.0, "held": 0, "tensors": 0})
            sr = _slot_rates(s, ps, dt)
            c["ops"] += sr["ops"] or 0
            c["busy"] += (sr["busy"] or 0) / max(1, len(snap["workers"]))
            c["held"] += s.get("held_bytes", 0)
            c["tensors"] += s.get("tensors", 0)
    clients = snap.get("clients")
    if clients is not None:
        quota = snap.get("quota_bytes")
        out += ["", f"clients ({len(clients)} connected; quota per worker: "
                f"{_mb(quota) + ' MB' if quota else 'none'})",
                f"{'slot':>4} {'name':<20} {'pid':>8} {'state':<8} {'instr/s':>9} {'busy %':>6} "
                f"{'held MB':>9} {'tensors':>8} {'rounds':>8} {'queued':>6}"]
        for c in clients:
            w = per_client.get(str(c["slot"]), {})
            out.append(f"{c['slot']:>4} {c['name'][:20]:<20} {c['pid'] or '-':>8} "
                       f"{c['state']:<8} {_f(w.get('ops')):>9} {_f(w.get('busy'), '.1f'):>6} "
                       f"{_mb(w.get('held')):>9} {w.get('tensors', 0):>8} {c['rounds']:>8} "
                       f"{c['queued_rounds']:>6}")
        if not clients:
            out.append("  (none)")
        for c in snap.get("left", [])[-5:]:
            out.append(f"  left: slot {c['slot']} {c['name']} (pid {c['pid']}): {c['state']}, "
                       f"{c['rounds']} rounds")
    return "\n".join(out)


def watch(port_file: str, frames: int | None = None, out: TextIO = sys.stdout) -> int:
    """Attach, show frames until Ctrl-C (or ``frames`` of them), detach. Status 2 if the job
    could not be reached."""
    try:
        lines = dial(read_port_file(port_file), {"role": "monitor"})
    except (OSError, ValueError) as e:
        print(f"gtmpi-trace top: error: {e}", file=sys.stderr)
        return 2
    clear = out.isatty()
    shown = 0
    latest: dict[str, dict] = {}  # per worker, its newest push
    before: dict[str, dict] = {}  # and the one before that
    try:
        while frames is None or shown < frames:
            snap = lines.recv(timeout_s=30)
            if snap is None:
                print("gtmpi-trace top: the job has ended" if lines.closed else
                      "gtmpi-trace top: no figures for 30 s", file=sys.stderr)
                return 0 if shown else 2
            if "refused" in snap:
                print(f"gtmpi-trace top: error: {snap['refused']}", file=sys.stderr)
                return 2
            for rank, w in snap["workers"].items():
                if rank not in latest or latest[rank]["time"] != w["time"]:
                    if rank in latest:
                        before[rank] = latest[rank]
                    latest[rank] = w
            if before:
                frame = render(snap, before)
                print(("\x1b[H\x1b[2J" if clear else "\n") + frame, file=out, flush=True)
                shown += 1
    except KeyboardInterrupt:
        pass
    finally:
        lines.close()
    return 0
