"""gtmpi-trace: read a trace file written by GTMPI_TRACE=run.h5 or gtmpi.trace.start().

    gtmpi-trace summary run.h5                 busy/idle per rank, top ops, bytes, waits
    gtmpi-trace ops run.h5                     per-op count, total, mean, p50, p99
    gtmpi-trace idle run.h5                    idle gaps per worker, pipeline bubbles
    gtmpi-trace timeline run.h5 -o run.png     a picture (PNG, SVG or PDF)
    gtmpi-trace export run.h5 -o run.json      Chrome trace-event JSON for Perfetto
    gtmpi-trace comms run.h5                   collectives and transfers inserted, by line
    gtmpi-trace steps run.h5                   rank 0's host time per training step
    gtmpi-trace top PORTFILE                   a running server's (or GTMPI_MONITOR run's)
                                               workers and clients, live

A missing, truncated or foreign file is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence, TextIO

import numpy as np

from .recording import fileformat
from .trace import analysis
from .recording.fileformat import TraceError


def _ranks(text: str) -> list[int]:
    try:
        return [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks takes rank numbers like 0,2 (got {text!r})")


def _table(rows: list[dict], columns: list[tuple[str, str, str]], out: TextIO) -> None:
    """Rows as aligned columns: (key, header, format) each."""
    cells = [[format(r[k], f) if f else str(r[k]) for k, _, f in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(columns)]
    # text reads from the left, numbers line up on the right
    left = [bool(rows) and isinstance(rows[0][k], str) and k != "op" for k, _, _ in columns]
    print("  ".join(h.ljust(w) if lf else h.rjust(w)
                    for (_, h, _), w, lf in zip(columns, widths, left)).rstrip(), file=out)
    for c in cells:
        print("  ".join(v.ljust(w) if lf else v.rjust(w)
                        for v, w, lf in zip(c, widths, left)).rstrip(), file=out)
    if not rows:
        print("  (none)", file=out)


def summary(trace: fileformat.Trace, args: argparse.Namespace, out: TextIO) -> None:
    meta = trace.meta
    print(f"{trace.path}: {meta.get('status')}, {meta.get('world_size')} ranks, "
          f"{analysis.duration_ns(trace) / 1e6:.3f} ms, started {meta.get('start_time')}", file=out)
    if meta.get("missing_ranks"):
        print(f"missing ranks: {meta['missing_ranks']}", file=out)
    print("\nper rank (share of the run; peak MB: a GPU worker's most tensor memory allocated, "
          "a CPU worker's peak resident size)", file=out)
    _table(analysis.busy_rows(trace), [("rank", "rank", ""), ("lane", "lane", ""),
           ("device", "device", ""), ("events", "events", ""), ("busy_pct", "busy %", ".1f"),
           ("wait_pct", "wait %", ".1f"), ("idle_pct", "idle %", ".1f"),
           ("peak_mb", "peak MB", "")], out)
    print("\ntop ops by total time (workers)", file=out)
    _table(analysis.op_rows(trace)[:args.top], [("op", "op", ""), ("count", "count", ""),
           ("total_us", "total us", ".1f"), ("mean_us", "mean us", ".2f")], out)
    kinds, pairs = analysis.transfer_rows(trace)
    print("\nbytes moved by kind", file=out)
    _table(kinds, [("kind", "kind", ""), ("count", "count", ""), ("bytes", "bytes", "")], out)
    print("\nbytes moved by pair of ranks (dst -1: a collective's group)", file=out)
    _table(pairs, [("src", "src", ""), ("dst", "dst", ""), ("bytes", "bytes", "")], out)
    print("\ncollectives", file=out)
    _table(analysis.collective_rows(trace), [("collective", "collective", ""),
           ("count", "count", ""), ("bytes", "bytes", "")], out)
    print("\nwaits on rank 0", file=out)
    _table(analysis.wait_rows(trace), [("wait", "wait", ""), ("count", "count", ""),
           ("total_us", "total us", ".1f"), ("mean_us", "mean us", ".1f"),
           ("p50_us", "p50 us", ".1f"), ("max_us", "max us", ".1f")], out)


def ops(trace: fileformat.Trace, args: argparse.Namespace, out: TextIO) -> None:
    rows = analysis.op_rows(trace, args.ranks)
    columns = [("op", "op", ""), ("count", "count", ""), ("total_us", "total us", ".1f"),
               ("mean_us", "mean us", ".2f"), ("p50_us", "p50 us", ".2f"),
               ("p99_us", "p99 us", ".2f")]
    if any(r["gpu_timed"] for r in rows):
        columns += [("gpu_timed", "gpu timed", ""), ("gpu_mean_us", "gpu mean us", ".2f")]
    _table(rows, columns, out)
    if rows and not any(r["gpu_timed"] for r in rows):
        print("(no GPU times: the workers ran on CPUs, or GTMPI_TRACE_GPU_EVERY=0)", file=out)


def idle(trace: fileformat.Trace, args: argparse.Namespace, out: TextIO) -> None:
    total = analysis.duration_ns(trace)
    print(f"idle gaps longer than {args.min_gap_us:g} us, per worker", file=out)
    rows = analysis.gap_rows(trace, int(args.min_gap_us * 1e3))
    for r in rows:
        r["busy_pct"] = 100 * r["busy_ns"] / total
        r["gap_ms"] = r["gap_ns"] / 1e6
        r["longest_txt"] = ", ".join(f"{g / 1e3:.0f} us at {t / 1e6:.3f} ms"
                                     for t, g in r["longest"]) or "-"
    _table(rows, [("rank", "rank", ""), ("busy_pct", "busy %", ".1f"), ("gaps", "gaps", ""),
                  ("gap_ms", "gap ms", ".3f"), ("longest_txt", "longest", "")], out)
    bubbles = analysis.bubble_rows(trace)
    if not bubbles:
        print("\nno pipeline in this run (gtmpi.pipeline.Pipeline records its stages): no "
              "bubble fractions", file=out)
        return
    pipeline = trace.meta["pipeline"]
    print(f"\npipeline: {len(bubbles)} stages, {pipeline.get('micro_batches')} micro-batches, "
          f"{pipeline.get('schedule')}; bubble fraction per stage (idle share of the window "
          "from the first op to the last) against the schedule's with stages of equal cost; "
          "each stage's share of the compute, and how far from the mean it is (+: more than "
          "a balanced split gives it)", file=out)
    for b in bubbles:
        b["ranks_txt"] = ",".join(map(str, b["ranks"]))
    _table(bubbles, [("stage", "stage", ""), ("ranks_txt", "ranks", ""),
                     ("bubble", "bubble", ".3f"), ("ideal", "ideal", ".3f"),
                     ("share", "compute", ".3f"), ("over", "vs mean", "+.3f")], out)


def comms(trace: fileformat.Trace, args: argparse.Namespace, out: TextIO) -> None:
    _table(analysis.comm_rows(trace), [("bytes", "bytes", ""), ("count", "count", ""),
           ("kind", "kind", ""), ("why", "why", ""), ("where", "where", "")], out)


def steps(trace: fileformat.Trace, args: argparse.Namespace, out: TextIO) -> None:
    rows = analysis.step_rows(trace, args.op)
    if not rows:
        raise TraceError(f"{trace.path}: no two issues of {args.op or ' or '.join(analysis.STEP_OPS)} "
                         "to time a step between (--op names another op that a step issues once)")
    steady = rows[args.skip:] or rows
    host = np.array([r["host_ms"] for r in steady])
    wall = np.array([r["wall_ms"] for r in steady])
    print(f"{len(rows)} steps between issues of {rows[0]['op']}; from step {steady[0]['step']} "
          f"on, median per step: wall {np.median(wall):.3f} ms, rank 0's host time "
          f"{np.median(host):.3f} ms (p10 {np.percentile(host, 10):.3f}, p90 "
          f"{np.percentile(host, 90):.3f}), the rest waiting for workers", file=out)
    if args.all:
        _table(rows, [("step", "step", ""), ("start_ms", "start ms", ".3f"),
                      ("wall_ms", "wall ms", ".3f"), ("host_ms", "host ms", ".3f"),
                      ("wait_ms", "wait ms", ".3f"), ("issued", "ops issued", "")], out)


def timeline(trace: fileformat.Trace, args: argparse.Namespace, out: TextIO) -> None:
    from .trace.timeline import draw
    ops = [o for o in args.ops.split(",") if o] if args.ops else None
    if ops:
        ran = analysis.op_names(trace)
        unknown = [o for o in ops if o not in ran]
        if len(unknown) == len(ops):
            raise TraceError(f"--ops {args.ops}: no such op ran in {trace.path} (ops that ran: "
                             f"{', '.join(sorted(ran)) or 'none'})")
        if unknown:
            print(f"gtmpi-trace: no op named {', '.join(unknown)} ran in this trace; drawing "
                  "the others", file=sys.stderr)
    labels = draw(trace, args.output, args.start, args.end, args.ranks, ops)
    print(f"{args.output}: {len(labels)} lanes ({', '.join(labels)})", file=out)


def export(trace: fileformat.Trace, args: argparse.Namespace, out: TextIO) -> None:
    from .trace.chrome import export as chrome
    doc = chrome(trace)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    print(f"{args.output}: {len(doc['traceEvents'])} trace events", file=out)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gtmpi-trace", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True, metavar="command")

    def command(name: str, run, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        c.add_argument("trace", help="the trace file (HDF5)")
        c.set_defaults(run=run)
        return c

    c = command("summary", summary, "busy and idle share per rank, top ops, bytes moved per kind "
                "and per pair of ranks, collectives, waits")
    c.add_argument("--top", type=int, default=10, help="ops listed (default 10)")
    c = command("ops", ops, "per op: count, total, mean, p50 and p99 of host time, and the "
                "sampled GPU time")
    c.add_argument("--ranks", type=_ranks, help="only these worker ranks, e.g. 1,2")
    c = command("idle", idle, "per worker idle gaps, and the bubble fraction per pipeline stage")
    c.add_argument("--min-gap-us", type=float, default=100.0,
                   help="shortest gap listed, in microseconds (default 100)")
    command("comms", comms, "every collective and transfer gtmpi inserted, by the program's "
            "line that caused it: count, bytes, and whether a signal or a read asked for it")
    c = command("steps", steps, "rank 0's time per training step (between issues of the "
                "optimizer's update): wall, waiting for workers, and host time, the rest")
    c.add_argument("--op", help="the op issued once a step (default: the optimizer's update)")
    c.add_argument("--skip", type=int, default=10, help="steps left out of the median, the "
                   "first ones (default 10: start-up, recording)")
    c.add_argument("--all", action="store_true", help="a row per step")
    c = command("timeline", timeline, "a picture with a lane for the client, the dispatcher and "
                "each worker")
    c.add_argument("-o", "--output", required=True, help="picture file: .png, .svg or .pdf")
    c.add_argument("--start", type=float, help="from this many ms after the start")
    c.add_argument("--end", type=float, help="until this many ms after the start")
    c.add_argument("--ranks", type=_ranks, help="only these ranks, e.g. 0,2")
    c.add_argument("--ops", help="only these ops, e.g. matmul,add")
    c = command("export", export, "Chrome trace-event JSON for Perfetto or chrome://tracing")
    c.add_argument("-o", "--output", required=True, help="the JSON file to write")
    help = ("a running job's workers (and a server's clients), refreshed: attaches to a server "
            "or to a run started with GTMPI_MONITOR=PORTFILE; Ctrl-C detaches")
    c = sub.add_parser("top", help=help, description=help)
    c.add_argument("port_file", help="the server's --port-file, or the run's GTMPI_MONITOR")
    c.add_argument("--frames", type=int, help="stop after this many frames (default: Ctrl-C)")
    return p


def trace_main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "top":
        from .monitor.top import watch
        return watch(args.port_file, args.frames)
    try:
        trace = fileformat.read(args.trace)
        args.run(trace, args, sys.stdout)
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except TraceError as e:
        print(f"gtmpi-trace: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"gtmpi-trace: error: {e.filename or args.trace}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(trace_main())
