"""What was live at a GPU worker's memory peak, from GTMPI_MEMORY_HISTORY (worker/profiler.py).

    python -m gtmpi.trace.memory DIR_OR_PICKLE [--top K] [--frames N] [--from FRACTION]

A worker's peak of allocated bytes (what torch.cuda.max_memory_allocated reports) is replayed
from its recorded allocations and frees; the blocks live at that moment are summed by where
they were allocated (the innermost N Python frames outside torch itself), those allocated
while a CUDA graph was being captured marked as such (they stay in the graphs' pool). The
course of the allocated bytes over the run is given in tenths, so a peak reached once (at a
capture) is told from one of every step. The same reading works for any process's snapshot
(torch.cuda.memory._dump_snapshot), torch's own runs included.
"""
from __future__ import annotations

import argparse
import glob
import os
import pickle
from collections import defaultdict
from typing import Any


def _where(frames: list[dict], depth: int) -> tuple[str, bool]:
    """(the innermost ``depth`` frames outside torch, whether a graph capture made it)."""
    own = [f for f in frames if f["filename"].endswith(".py") and "/torch/" not in f["filename"]]
    captured = any("graphs.py" in f["filename"] and "captur" in f["name"] for f in frames)
    where = " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
                       for f in own[:depth])
    return where or "(no Python frame)", captured


def peak(events: list[dict], start: float = 0.0) -> tuple[int, dict[int, dict], list[int]]:
    """(the index of the event after which the most bytes were allocated, from the fraction
    ``start`` of the run on, the blocks live then by address, the allocated bytes after each
    event)."""
    course = list(_replay(events))
    at = max(range(int(len(course) * start), len(course)), key=course.__getitem__)
    live: dict[int, dict] = {}
    for _ in _replay(events[:at + 1], live):
        pass
    return at, live, course


def _replay(events: list[dict], live: dict[int, dict] | None = None):
    """The allocated bytes after each event; ``live`` gets the blocks still allocated."""
    live = {} if live is None else live
    now = 0
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            now += e["size"]
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            now -= live.pop(e["addr"])["size"]
        yield now


def report(snapshot: dict[str, Any], top_k: int = 25, depth: int = 2, start: float = 0.0) -> str:
    lines = []
    for device, events in enumerate(snapshot.get("device_traces", [])):
        if not events:
            continue
        at, live, course = peak(events, start)
        top = course[at]
        since = f" from {start:.0%} of the run on" if start else ""
        lines.append(f"device {device}: {len(events):,} events, peak{since} {top / 1e9:.3f} GB at "
                     f"event {at:,} ({at / len(events):.0%} of the run), {len(live):,} blocks")
        tenth = max(1, len(course) // 10)
        lines.append("  highest allocated per tenth of the run (GB): " + " ".join(
            f"{max(course[i:i + tenth]) / 1e9:.2f}" for i in range(0, len(course), tenth)))
        sums: dict[tuple[str, bool], list[int]] = defaultdict(lambda: [0, 0])
        for e in live.values():
            entry = sums[_where(e.get("frames", []), depth)]
            entry[0] += e["size"]
            entry[1] += 1
        captured = sum(b for (_, c), (b, _) in sums.items() if c)
        lines.append(f"  live at the peak: {captured / 1e9:.3f} GB allocated in graph captures, "
                     f"{(top - captured) / 1e9:.3f} GB outside")
        lines.append(f"  {'GB':>7} {'blocks':>6}  allocated at")
        for (where, cap), (size, n) in sorted(sums.items(), key=lambda kv: -kv[1][0])[:top_k]:
            lines.append(f"  {size / 1e9:7.3f} {n:6d}  {'[graph] ' if cap else ''}{where}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", help="GTMPI_MEMORY_HISTORY's folder, or one snapshot pickle")
    ap.add_argument("--top", type=int, default=25, help="allocation sites listed")
    ap.add_argument("--frames", type=int, default=2, help="Python frames naming a site")
    ap.add_argument("--from", dest="start", type=float, default=0.0, metavar="FRACTION",
                    help="the peak after this fraction of the run (0.5: of its second half, "
                    "past the captures of a replayed loop)")
    args = ap.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.path, "*.pickle"))) \
        if os.path.isdir(args.path) else [args.path]
    for path in paths:
        with open(path, "rb") as f:
            snapshot = pickle.load(f)
        print(f"== {os.path.basename(path)}")
        print(report(snapshot, args.top, args.frames, args.start))


if __name__ == "__main__":
    main()
