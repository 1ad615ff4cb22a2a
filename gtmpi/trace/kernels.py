"""Sum up the kernel profiles of GTMPI_PROFILE (worker/profiler.py): per worker, the window's
time per step, how much of it the GPU computed, waited in NCCL kernels or sat idle, and the
kernels that took the time.

    python -m gtmpi.trace.kernels DIR [--steps N] [--top K] [--gaps G]

DIR holds one profile per worker (worker<rank>.json), and may hold torch.json, a plain torch
program's own steps profiled the same way (benchmarks/real.py's torch runs under
GTMPI_PROFILE), summed up beside them.

A step's time splits into: compute (some non-NCCL kernel running), NCCL alone (only a
collective or a send/receive running: moving bytes, or waiting for a peer, which a pipeline
stage does in its bubble) and idle (no kernel: the host had not launched the next one).

Each worker's window starts when that worker reaches its FIRST-th call, so a worker that
gets there early spends its first step waiting for the others (their profilers starting).
The split is therefore given twice: per step of the worker's own window, and as fractions of
the shared window, the time every worker was recording (what a pipeline's bubble is read
from).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections import defaultdict
from typing import Iterable


def load(path: str) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every GPU kernel in one Chrome trace, by start."""
    with open(path) as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    return sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                  if e.get("cat") == "kernel" and e.get("ph") == "X")


def union(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def family(name: str) -> str:
    """A kernel's short name: NCCL kernels by their collective, others by a readable cut."""
    m = re.match(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", name)
    if m:
        return f"nccl {m.group(1)}"
    short = re.sub(r"<.*", "", name.replace("void ", "")).split("(")[0]
    return short.rsplit("::", 1)[-1][:60] or name[:60]


def summarize(kernels: list[tuple[float, float, str]], steps: int) -> dict:
    if not kernels:
        return {"kernels": 0}
    span = max(e for _, e, _ in kernels) - kernels[0][0]
    nccl = [(s, e) for s, e, n in kernels if "nccl" in n.lower()]
    compute = [(s, e) for s, e, n in kernels if "nccl" not in n.lower()]
    busy, busy_compute = union((s, e) for s, e, _ in kernels), union(compute)
    by = defaultdict(lambda: [0, 0.0])
    for s, e, n in kernels:
        entry = by[family(n)]
        entry[0] += 1
        entry[1] += e - s
    per = 1000.0 * steps
    return {"kernels": len(kernels), "step_ms": span / per, "compute_ms": busy_compute / per,
            "nccl_only_ms": (busy - busy_compute) / per, "idle_ms": (span - busy) / per,
            "nccl_ms": sum(e - s for s, e in nccl) / per,
            "top": sorted(((name, count / steps, total / count, total / per)
                           for name, (count, total) in by.items()),
                          key=lambda r: -r[3])}


def gaps(kernels: list[tuple[float, float, str]], count: int) -> list[tuple[float, str, str]]:
    """The ``count`` longest stretches with no kernel running: (µs, the family of the kernel
    that ended last before it, the family of the one that starts it), longest first. Idle time
    inside a CUDA graph is the GPU waiting for a dependency or for the next node's launch; a
    gap that follows the same kernel every step points at what it waits for."""
    found, end, last = [], None, ""
    for s, e, n in kernels:  # by start
        if end is not None and s > end:
            found.append((s - end, last, family(n)))
        if end is None or e > end:
            end, last = e, family(n)
    return sorted(found, key=lambda g: -g[0])[:count]


def shared_window(profiles: list[list[tuple[float, float, str]]]) -> tuple[float, float]:
    """The time every profile was recording: from the latest first kernel to the earliest
    last one."""
    return (max(k[0][0] for k in profiles if k), min(max(e for _, e, _ in k) for k in profiles if k))


def fractions(kernels: list[tuple[float, float, str]], lo: float, hi: float) -> dict:
    """Compute, NCCL alone and idle as fractions of [lo, hi] (kernels clipped to it)."""
    inside = [(max(s, lo), min(e, hi), n) for s, e, n in kernels if e > lo and s < hi]
    busy = union((s, e) for s, e, _ in inside)
    compute = union((s, e) for s, e, n in inside if "nccl" not in n.lower())
    span = hi - lo
    return {"compute": compute / span, "nccl_only": (busy - compute) / span,
            "idle": (span - busy) / span}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory")
    p.add_argument("--steps", type=int, default=int(
        (os.environ.get("GTMPI_PROFILE_REPLAYS", "10:4").partition(":")[2]) or 4),
        help="steps in the window (GTMPI_PROFILE_REPLAYS's COUNT)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--gaps", type=int, default=0,
                   help="also list each worker's this many longest idle gaps, with the kernels "
                        "around them")
    args = p.parse_args(argv)
    files = sorted(glob.glob(os.path.join(args.directory, "worker*.json")),
                   key=lambda f: int(re.sub(r"\D", "", os.path.basename(f)) or 0)) + \
        glob.glob(os.path.join(args.directory, "torch.json"))
    if not files:
        print(f"no worker*.json nor torch.json in {args.directory}", file=sys.stderr)
        return 1
    lines = {}
    profiles = {os.path.basename(path)[:-5]: load(path) for path in files}
    lo, hi = shared_window(list(profiles.values()))
    if hi > lo:
        print(f"shared window {(hi - lo) / 1000:.2f} ms")
    for worker, recorded in profiles.items():
        s = summarize(recorded, args.steps)
        if not s["kernels"]:
            print(f"{worker}: no kernels recorded")
            continue
        print(f"{worker}: {s['step_ms']:.2f} ms per step = compute {s['compute_ms']:.2f} + "
              f"NCCL alone {s['nccl_only_ms']:.2f} + idle {s['idle_ms']:.2f} "
              f"(NCCL kernels {s['nccl_ms']:.2f} ms in all; {s['kernels'] / args.steps:.0f} "
              "kernels per step)")
        shared = fractions(recorded, lo, hi) if hi > lo else None
        if shared:
            print(f"  of the shared window: compute {shared['compute']:.3f}, NCCL alone "
                  f"{shared['nccl_only']:.3f}, idle {shared['idle']:.3f}")
            s["shared"] = {k: round(v, 4) for k, v in shared.items()}
        print(f"  {'kernel':60s} {'per step':>8s} {'avg µs':>8s} {'ms/step':>8s}")
        for name, count, avg, total in s["top"][:args.top]:
            print(f"  {name:60s} {count:8.1f} {avg:8.1f} {total:8.2f}")
        if args.gaps:
            print(f"  longest idle gaps: {'µs':>8s}  after -> before")
            for length, before, after in gaps(recorded, args.gaps):
                print(f"  {'':19s}{length:8.1f}  {before} -> {after}")
        lines[worker] = {k: v if k == "shared" else round(v, 3) for k, v in s.items()
                         if k not in ("top", "kernels")}
    print(json.dumps({"kernel_profile": args.directory, "steps": args.steps, **lines}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
