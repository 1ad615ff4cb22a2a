"""Looking inside a running session."""
from __future__ import annotations

import sys
from typing import TextIO


def worker_stats() -> dict[int, dict]:
    """Per worker: ops executed, faults, tensor bytes received and sent, tensors held, memory."""
    from .client.runtime import runtime
    return runtime().worker_stats()


def print_worker_stats(file: TextIO | None = None) -> None:
    stats = worker_stats()
    out = file or sys.stdout
    print(f"{'rank':>4} {'device':<8} {'ops':>10} {'faults':>7} {'recv MB':>9} {'sent MB':>9} "
          f"{'tensors':>8} {'memory MB':>10}", file=out)
    for rank, s in sorted(stats.items()):
        print(f"{rank:>4} {s['device']:<8} {s['ops']:>10} {s['faults']:>7} "
              f"{s['bytes_received'] / 1e6:>9.2f} {s['bytes_sent'] / 1e6:>9.2f} "
              f"{s['tensors']:>8} {s['memory_bytes'] / 1e6:>10.2f}", file=out)
