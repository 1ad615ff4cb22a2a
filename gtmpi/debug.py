"""Looking inside a running session."""
from __future__ import annotations

import sys
from typing import Any, TextIO


def worker_stats(reset_peak: bool = False) -> dict[int, dict]:
    """Per worker: ops executed, ``faults`` (ops that failed there, not those that read what
    failed), in-place ops ``skipped`` because of one, tensor bytes
    received and sent, tensors held, memory (``memory_bytes`` in use: the tensors gtmpi holds;
    on a GPU torch's ``peak_bytes`` allocated and ``reserved_bytes`` and
    ``peak_reserved_bytes``), the whole process's resident size now and at peak
    (``rss_bytes``, ``peak_rss_bytes``), sends still in flight between workers
    (``sends_in_flight``, ``send_bytes_held``), collectives run, torch's kernel
    ``settings`` there (gtmpi.backends).
    ``reset_peak``: start the GPU peaks afresh after this reading, as
    torch.cuda.reset_peak_memory_stats does."""
    from .client.runtime import runtime
    return runtime().worker_stats(reset_peak)


def print_worker_stats(file: TextIO | None = None) -> None:
    stats = worker_stats()
    out = file or sys.stdout
    print(f"{'rank':>4} {'device':<8} {'ops':>10} {'faults':>7} {'recv MB':>9} {'sent MB':>9} "
          f"{'tensors':>8} {'memory MB':>10} {'RSS MB':>9}", file=out)
    for rank, s in sorted(stats.items()):
        print(f"{rank:>4} {s['device']:<8} {s['ops']:>10} {s['faults']:>7} "
              f"{s['bytes_received'] / 1e6:>9.2f} {s['bytes_sent'] / 1e6:>9.2f} "
              f"{s['tensors']:>8} {s['memory_bytes'] / 1e6:>10.2f} {s['rss_bytes'] / 1e6:>9.1f}",
              file=out)


def print_tape(tensor: Any = None, file: TextIO | None = None) -> None:
    """Print the autograd tape of the graph behind ``tensor`` (by default the graph that
    recorded the latest op), one line per op in the order it ran: its results and operands."""
    from .autograd.engine import tape
    out = file or sys.stdout
    if tensor is not None and tensor._node is None:
        print(f"tensor {tensor.id} has no autograd graph (a leaf, or computed without grad)",
              file=out)
        return
    nodes = tape(tensor._node if tensor is not None else None)
    if not nodes:
        print("no autograd graph is alive", file=out)
        return
    print(f"autograd tape: {len(nodes)} ops", file=out)
    for i, node in enumerate(nodes):
        results = ", ".join(f"t{id_} {list(sig[0])} {str(sig[1]).replace('torch.', '')}"
                            for id_, sig in node.results)
        operands = ", ".join(_operand(a) for a in node.operands)
        state = "  (freed by backward)" if node.freed else ""
        print(f"  #{i:<3} {node.op:<18} {results}  <-  {operands}{state}", file=out)


def _operand(a: Any) -> str:
    if hasattr(a, "_sig"):  # a tensor, or the Ghost of one its rule does not read
        kind = "leaf" if a.requires_grad and a._node is None else ""
        return f"t{a.id} {list(a.shape)}{' ' + kind if kind else ''}"
    text = repr(a)
    return text if len(text) <= 24 else text[:21] + "..."


def placement(t: Any) -> dict[str, Any]:
    """Where a tensor lives: its mesh (worker ranks), placement type, and each member's piece."""
    from .client.runtime import runtime
    p = runtime().dispatcher.placer.placement(t.id)
    shape = tuple(t.shape)
    types = [f"S({d})" if k == "S" else k for k, d in p.per_axis()]
    return {"mesh": list(p.mesh), "grid": list(p.shape()),
            "type": types[0] if len(types) == 1 else types,
            "shards": {rank: p.local_shape(shape, i) for i, rank in enumerate(p.mesh)}}


def strict_placement(on: bool = True) -> None:
    """From now on, raise at the program's line (a PlacementError) instead of gathering,
    re-splitting or moving a tensor between workers where no signal asked for it: a silent
    fallback to replication cannot pass for parallelism. ``GTMPI_PLACEMENT=strict`` sets it at
    start-up. Summing partial sums (a data-parallel gradient, a row-parallel output) is the math
    of a placement, not a fallback, and stays allowed."""
    from .client.runtime import runtime
    runtime().dispatcher.placer.strict = on


def explain(file: TextIO | None = None) -> dict[tuple[str, str, bool], tuple[int, int]]:
    """Every collective and transfer the dispatcher inserted so far, by the program's line that
    caused it: kind, count (per worker taking part; a transfer once) and bytes, and whether a
    signal or a read asked for it or the placement rules fell back to it. Printed as a table
    (largest bytes first) and returned as {(site, kind, asked): (count, bytes)}. Then how each
    replayed function runs: as a CUDA graph, or op by op and why (``graph_notes()``), how
    captured module calls ran (``captures()``), and what repeated runs replayed
    (``repeats()``)."""
    from .client.runtime import runtime
    inserted = {k: tuple(v) for k, v in runtime().dispatcher.placer.inserted.items()}
    out = file or sys.stdout
    print(f"{'bytes':>12} {'count':>7} {'kind':<15} {'why':<9} where", file=out)
    for (site, kind, asked), (count, nbytes) in sorted(inserted.items(),
                                                       key=lambda kv: -kv[1][1]):
        print(f"{nbytes:>12,} {count:>7} {kind:<15} {'asked' if asked else 'inserted':<9} {site}",
              file=out)
    for name, note in graph_notes().items():
        print(f"replayed {name}: {note}", file=out)
    for name, counts in captures().items():
        said = ", ".join(f"{n} {why}" for why, n in counts.most_common())
        print(f"captured {name}: {said}", file=out)
    said = repeats()
    if said is not None:
        print(said, file=out)
    return inserted


def auto_replay(on: bool = True) -> None:
    """Turn replaying repeated runs on or off from here on (on from the start unless
    GTMPI_AUTO_REPLAY=0): one worker's instructions are held in runs, and runs that repeat earlier ones
    are replayed, as CUDA graphs on a GPU (dispatcher/repeats.py). Off, the workers forget
    what they kept."""
    from .client.runtime import runtime
    runtime().dispatcher.auto_replay(on)


def repeats() -> str | None:
    """Unless GTMPI_AUTO_REPLAY=0: how many instructions went to the worker replayed as repeated
    runs, and why the others ran as written (dispatcher/repeats.py); None when it is off."""
    from .client.runtime import runtime
    found = runtime().dispatcher.repeats
    return None if found is None else found.report()


def captures() -> dict[str, Any]:
    """Per module whose outermost calls are captured (GTMPI_CAPTURE, nn/capture.py), by
    its class and where it was first called: how many calls were replayed, and how many ran
    as written and why (a Counter)."""
    from .client.runtime import runtime
    return dict(runtime().capture_notes)


def graph_notes() -> dict[str, str]:
    """Per replayed function (its name and where it was recorded) whose capture was tried: 'a
    CUDA graph on worker(s) ...', or 'replayed op by op, no CUDA graph: ' and why."""
    from .client.runtime import runtime
    return dict(runtime().dispatcher.graph_notes)
