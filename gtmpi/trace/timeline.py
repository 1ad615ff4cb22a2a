"""The timeline picture: one lane for the client, one for the dispatcher, one per worker;
ops coloured by their kind, messages drawn as lines between lanes."""
from __future__ import annotations

import math
import os

import numpy as np

from ..ops.table import OPS
from ..recording.events import Kind, Lane
from ..recording.fileformat import Trace, TraceError

FORMATS = (".png", ".svg", ".pdf")
_MAX_LINES = 2000  # messages drawn; beyond this the picture is all lines
_MAX_LABELS = 300  # names written on bars, the widest bars first
_LABEL_FRACTION = 60  # a bar gets its name where it spans at least this share of the picture
_LABELLED = [Kind.EXEC, Kind.SCOPE, Kind.CONTROL]  # events whose bars carry their names

# Colour per category: an executed op by its kind in the op table, anything else by event kind.
_COLOURS = {
    "elementwise": "#4e79a7", "matmul": "#e15759", "reduce": "#59a14f", "shape": "#9c755f",
    "index": "#b07aa1", "create": "#76b7b2", "inplace": "#edc948", "fused": "#ff7f0e",
    "general": "#17becf", "comm": "#d37295",
    "issue": "#bab0ac", "dispatch": "#8cd17d", "send": "#499894", "recv": "#86bcb6",
    "transfer": "#f28e2b", "collective": "#d37295", "wait": "#ff9d9a", "free": "#d4a6c8",
    "scope": "#fabfd2", "replay": "#b6992d", "control": "#79706e",
}


def lanes(trace: Trace, ranks: list[int] | None = None) -> list[tuple[int, Lane, str]]:
    """(rank, lane, label) for every lane drawn, top to bottom."""
    out = []
    for rank in trace.events:
        if ranks is not None and rank not in ranks:
            continue
        info = trace.ranks.get(rank, {})
        if info.get("role") == "server":
            out.append((0, Lane.DISPATCHER, "rank 0 server"))
        elif info.get("role") == "client":
            out.append((rank, Lane.CLIENT, f"client {info.get('slot')} {info.get('name', '')}"))
        elif rank == 0:
            out += [(0, Lane.CLIENT, "rank 0 client"), (0, Lane.DISPATCHER, "rank 0 dispatcher")]
        else:
            device = trace.ranks.get(rank, {}).get("device", "")
            out.append((rank, Lane.WORKER, f"rank {rank} worker {device}".rstrip()))
    return out


def category(trace: Trace, kind: int, name: int) -> str:
    if kind == Kind.EXEC:
        op = OPS.get(trace.name(name))
        return op.kind.value if op is not None else "control"
    return Kind(kind).name.lower()


def draw(trace: Trace, out: str, start_ms: float | None = None, end_ms: float | None = None,
         ranks: list[int] | None = None, ops: list[str] | None = None) -> list[str]:
    """Write the picture to ``out`` (format from its extension); return the lane labels."""
    if os.path.splitext(out)[1].lower() not in FORMATS:
        raise TraceError(f"{out}: the picture's name must end in {', '.join(FORMATS)}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shown = lanes(trace, ranks)
    lo = -np.inf if start_ms is None else start_ms * 1e6
    hi = np.inf if end_ms is None else end_ms * 1e6
    keep_names = None if ops is None else {i for i, s in enumerate(trace.strings) if s in ops}
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.55 * len(shown)))
    used: set[str] = set()
    y_of = {}
    wide = _label_width(trace, lo, hi)
    labels: list[tuple[int, int, int, int, int]] = []  # (width, t0, t1, lane, name)
    for y, (rank, lane, _) in enumerate(shown):
        y_of[(rank, lane)] = y
        table = trace.events[rank]
        table = table[(table["lane"] == lane) & (table["t1"] >= lo) & (table["t0"] <= hi)]
        if keep_names is not None:
            named = np.isin(table["kind"], [Kind.EXEC, Kind.ISSUE, Kind.DISPATCH])
            table = table[~named | np.isin(table["name"], list(keep_names))]
        cats = np.array([category(trace, k, n) for k, n in zip(table["kind"], table["name"])])
        for cat in np.unique(cats):
            mine = table[cats == cat]
            bars = np.stack([mine["t0"] / 1e6, np.maximum(mine["t1"] - mine["t0"], 1) / 1e6], 1)
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=_COLOURS.get(cat, "grey"),
                           linewidth=0)
            used.add(str(cat))
        long = table[np.isin(table["kind"], _LABELLED) & (table["t1"] - table["t0"] >= wide)]
        labels += [(int(e["t1"] - e["t0"]), int(e["t0"]), int(e["t1"]), y, int(e["name"]))
                  for e in long]
    for _, t0, t1, y, name in sorted(labels, reverse=True)[:_MAX_LABELS]:
        ax.text((max(t0, lo) + min(t1, hi)) / 2e6, y, trace.name(name), ha="center",
                va="center", fontsize=6, clip_on=True)
    for (x0, r0, l0), (x1, r1, l1) in messages(trace)[:_MAX_LINES]:
        if (r0, l0) in y_of and (r1, l1) in y_of and lo <= x0 <= hi:
            ax.plot([x0 / 1e6, x1 / 1e6], [y_of[(r0, l0)], y_of[(r1, l1)]], color="black",
                    linewidth=0.4, alpha=0.5)
    ax.set_yticks(range(len(shown)), [label for _, _, label in shown])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the trace started (rank 0's clock)")
    if start_ms is not None or end_ms is not None:
        ax.set_xlim(left=start_ms, right=end_ms)
    # beside the lanes, in as many columns as the figure's height needs: every category shows
    rows = max(4, int(fig.get_figheight() * 72 / 16) - 2)  # 'small' entries, about 16 pt each
    ax.legend(handles=[Patch(color=_COLOURS.get(c, "grey"), label=c) for c in sorted(used)],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small",
              ncol=math.ceil(len(used) / rows))
    ax.set_title(f"{os.path.basename(trace.path)}: {trace.meta.get('status', '')}")
    fig.tight_layout()
    fig.savefig(out, bbox_inches="tight")  # the legend too, wherever it ends
    plt.close(fig)
    return [label for _, _, label in shown]


def _label_width(trace: Trace, lo: float, hi: float) -> float:
    """The least duration (ns) of a bar that gets its name: a share of the span drawn."""
    first = min((int(t["t0"].min()) for t in trace.events.values() if len(t)), default=0)
    last = max((int(t["t1"].max()) for t in trace.events.values() if len(t)), default=1)
    return max(min(hi, last) - max(lo, first), 1) / _LABEL_FRACTION


def messages(trace: Trace) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    """Matched message ends ((time, rank, lane) sent, (time, rank, lane) received): instruction
    batches, uploads and reads between rank 0 and workers."""
    zero = trace.events.get(0)
    if zero is None:
        return []
    out = []
    sends = {(int(e["peer"]), int(e["id"])): int(e["t0"]) for e in zero[zero["kind"] == Kind.SEND]}
    uploads = {int(e["id"]): int(e["t0"]) for e in zero[zero["kind"] == Kind.TRANSFER]}
    reads: dict[int, list[int]] = {}
    for e in zero[(zero["kind"] == Kind.WAIT) & (zero["lane"] == Lane.CLIENT)]:
        if trace.name(int(e["name"])) == "read":
            reads.setdefault(int(e["id"]), []).append(int(e["t1"]))
    for rank, table in trace.events.items():
        if rank == 0:
            continue
        for e in table[np.isin(table["kind"], [Kind.RECV, Kind.TRANSFER])]:
            key, t = int(e["id"]), int(e["t0"])
            if e["kind"] == Kind.RECV and (rank, key) in sends:
                out.append(((sends[(rank, key)], 0, Lane.DISPATCHER), (t, rank, Lane.WORKER)))
            elif trace.name(int(e["name"])) == "upload" and key in uploads:
                out.append(((uploads[key], 0, Lane.DISPATCHER), (t, rank, Lane.WORKER)))
            elif trace.name(int(e["name"])) == "read" and reads.get(key):
                out.append(((int(e["t1"]), rank, Lane.WORKER),
                            (reads[key].pop(0), 0, Lane.CLIENT)))
    return out
