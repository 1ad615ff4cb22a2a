"""Chrome trace-event JSON (opens in Perfetto and chrome://tracing): one process per rank,
one thread per lane, one complete ("X") event per trace event, flows for messages, and the
CUDA-event times of sampled GPU ops on a thread of their own."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..recording.events import Flag, Kind, Lane
from ..recording.fileformat import Trace
from .timeline import category, messages

GPU_TID = 3


def export(trace: Trace) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    for rank, table in trace.events.items():
        info = trace.ranks.get(rank, {})
        label = f"rank {rank} {info.get('role', '')} {info.get('host', '')} {info.get('device', '')}"
        out.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": label.strip()}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for lane in np.unique(table["lane"]):
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": int(lane),
                        "args": {"name": Lane(int(lane)).name.lower()}})
        for e in table:
            kind, name = int(e["kind"]), trace.name(int(e["name"]))
            args = {"id": int(e["id"]), "category": category(trace, kind, int(e["name"]))}
            for field in ("peer", "bytes", "count"):
                if e[field] > 0 or (field == "peer" and e[field] >= 0):
                    args[field] = int(e[field])
            if e["detail"] >= 0:
                args["detail"] = trace.name(int(e["detail"]))
            if e["flags"] & Flag.INSERTED:
                args["inserted"] = True
            out.append({"ph": "X", "name": name or Kind(kind).name.lower(),
                        "cat": Kind(kind).name.lower(), "pid": rank, "tid": int(e["lane"]),
                        "ts": e["t0"] / 1e3, "dur": max(int(e["t1"] - e["t0"]), 0) / 1e3,
                        "args": args})
            if e["flags"] & Flag.GPU_TIMED:
                out.append({"ph": "X", "name": name, "cat": "gpu", "pid": rank, "tid": GPU_TID,
                            "ts": e["gpu_t0"] / 1e3, "dur": (e["gpu_t1"] - e["gpu_t0"]) / 1e3})
        if (table["flags"] & Flag.GPU_TIMED).any():
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": GPU_TID,
                        "args": {"name": "gpu (sampled)"}})
    for flow, ((t0, r0, l0), (t1, r1, l1)) in enumerate(messages(trace)):
        out.append({"ph": "s", "id": flow, "name": "message", "cat": "flow", "pid": r0,
                    "tid": int(l0), "ts": t0 / 1e3})
        out.append({"ph": "f", "bp": "e", "id": flow, "name": "message", "cat": "flow",
                    "pid": r1, "tid": int(l1), "ts": t1 / 1e3})
    meta = {k: v for k, v in trace.meta.items() if isinstance(v, (str, int, float, bool))}
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": meta}
