"""One rank's events while a trace runs, stamped with that rank's clock.

The hot paths append small tuples (the cheapest thing CPython does) to two lists:
  marks   worker: (t, name, out) as each instruction starts, and (t, None, None) after each
          batch; an instruction runs from its mark to the next one, so one clock read per
          instruction gives both its start and its end
  issues  rank 0: (issued, received, done, name, out, worker) per instruction: the client's
          part (shape inference, autograd) then the dispatcher's (placement, batching)
Every rarer event is one whole row in ``rows``. The lists are packed into numpy chunks as they
fill, so a long run holds tens of bytes per event, not Python objects.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..ops.table import OPS
from ..ops.table import Kind as OpKind
from .events import CLOCK_SHIFT_NS, EVENT_DTYPE, Flag, Kind, Lane

CHUNK = 1 << 16
_KIND_OF_CONTROL = {"upload": Kind.TRANSFER, "read": Kind.TRANSFER, "free": Kind.FREE}


class Recorder:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.marks: list[tuple] = []
        self.issues: list[tuple] = []
        self.rows: list[tuple] = []
        self._packed: dict[str, list[np.ndarray]] = {"marks": [], "issues": []}
        self._names: dict[str, int] = {}
        self._notes: dict[int, tuple] = {}  # mark index -> annotate()'s figures
        self._gpu: list[tuple[int, Any, Any]] = []  # (mark index, start event, end event)
        self._gpu_ref: tuple[Any, int] | None = None
        self._marks_before = 0  # marks already packed into chunks

    # recording -----------------------------------------------------------------------------

    def event(self, kind: Kind, lane: Lane, t0: int, t1: int, name: str, id: int = -1,
              peer: int = -1, nbytes: int = 0, count: int = 0, flags: int = 0,
              detail: str | None = None) -> None:
        self.rows.append((t0, t1, kind, lane, flags, name, id, peer, nbytes, count, detail))

    def annotate(self, nbytes: int = 0, peer: int = -1, count: int = 0, flags: int = 0,
                 detail: str | None = None, id: int | None = None) -> None:
        """Attach figures to the instruction marked last (a transfer's bytes and tensor, a
        fault)."""
        self._notes[self._marks_before + len(self.marks) - 1] = (nbytes, peer, count, flags,
                                                                 detail, id)

    def gpu_reference(self, event: Any, host_ns: int) -> None:
        """A CUDA event recorded on an idle device at host time ``host_ns``: CUDA events
        measure only intervals, and this one puts them on the host clock."""
        self._gpu_ref = (event, host_ns)

    def gpu_timed(self, start: Any, end: Any) -> None:
        """CUDA events around the kernel of the instruction marked last."""
        self._gpu.append((self._marks_before + len(self.marks) - 1, start, end))

    def compact(self) -> None:
        """Pack full lists into numpy chunks; called between batches, never per op."""
        if len(self.marks) >= CHUNK:
            self._marks_before += len(self.marks)
            self._packed["marks"].append(self._pack_marks())
            self.marks = []
        if len(self.issues) >= CHUNK:
            self._packed["issues"].append(self._pack_issues())
            self.issues = []

    def _pack_marks(self) -> np.ndarray:
        return np.array([(t, self._name(n), _first(o)) for t, n, o in self.marks],
                        np.int64).reshape(-1, 3)

    def _pack_issues(self) -> np.ndarray:
        return np.array([(a, b, c, self._name(n), _first(o), w) for a, b, c, n, o, w in self.issues],
                        np.int64).reshape(-1, 6)

    # packing -------------------------------------------------------------------------------

    def pack(self) -> dict:
        """Everything recorded, as one event table in this rank's clock, and its names."""
        marks = np.concatenate(self._packed["marks"] + [self._pack_marks()])
        issues = np.concatenate(self._packed["issues"] + [self._pack_issues()])
        parts = [self._spans(marks), self._issue_rows(issues), self._row_table()]
        events = np.concatenate(parts)
        events = events[np.argsort(events["t0"], kind="stable")]
        events["t0"] += CLOCK_SHIFT_NS
        events["t1"] += CLOCK_SHIFT_NS
        timed = (events["flags"] & Flag.GPU_TIMED) != 0
        events["gpu_t0"][timed] += CLOCK_SHIFT_NS
        events["gpu_t1"][timed] += CLOCK_SHIFT_NS
        return {"events": events, "names": list(self._names)}

    def take(self) -> dict:
        """pack(), then start over: the lists are emptied in place, as the executor may be
        appending to them in the middle of a batch."""
        packed = self.pack()
        self.marks.clear()
        self.issues.clear()
        self.rows.clear()
        self._packed = {"marks": [], "issues": []}
        self._notes, self._gpu, self._marks_before = {}, [], 0
        return packed

    def _name(self, name: str | None) -> int:
        if name is None:
            return -1
        index = self._names.get(name)
        if index is None:
            index = self._names[name] = len(self._names)
        return index

    def _spans(self, marks: np.ndarray) -> np.ndarray:
        """Each instruction from its mark to the next mark (the next start or the batch end)."""
        starts = np.flatnonzero(marks[:-1, 1] >= 0) if len(marks) else np.empty(0, np.int64)
        table = _empty(len(starts))
        table["t0"] = marks[starts, 0]
        table["t1"] = marks[starts + 1, 0]
        table["name"] = marks[starts, 1]
        table["id"] = marks[starts, 2]
        table["lane"] = Lane.WORKER
        names = list(self._names)
        kinds = np.array([_event_kind(n) for n in names] or [0], np.uint8)
        table["kind"] = kinds[table["name"]]
        row_of = {int(m): r for r, m in enumerate(starts)}
        for m, (nbytes, peer, count, flags, detail, id_) in self._notes.items():
            r = row_of.get(m)
            if r is not None:
                table[r]["bytes"], table[r]["peer"], table[r]["count"] = nbytes, peer, count
                table[r]["flags"] |= flags
                table[r]["detail"] = self._name(detail)
                if id_ is not None:
                    table[r]["id"] = id_
        if self._gpu:
            ref_event, ref_ns = self._gpu_ref
            ref_event.synchronize()
            for m, start, end in self._gpu:
                r = row_of.get(m)
                if r is None:
                    continue
                end.synchronize()
                table[r]["gpu_t0"] = ref_ns + int(ref_event.elapsed_time(start) * 1e6)
                table[r]["gpu_t1"] = ref_ns + int(ref_event.elapsed_time(end) * 1e6)
                table[r]["flags"] |= Flag.GPU_TIMED
        return table

    @staticmethod
    def _issue_rows(issues: np.ndarray) -> np.ndarray:
        n = len(issues)
        table = _empty(2 * n)
        client, dispatch = table[:n], table[n:]
        for part, kind, lane, t0, t1 in ((client, Kind.ISSUE, Lane.CLIENT, 0, 1),
                                         (dispatch, Kind.DISPATCH, Lane.DISPATCHER, 1, 2)):
            part["t0"], part["t1"] = issues[:, t0], issues[:, t1]
            part["kind"], part["lane"] = kind, lane
            part["name"], part["id"] = issues[:, 3], issues[:, 4]
        dispatch["peer"] = issues[:, 5]
        return table

    def _row_table(self) -> np.ndarray:
        table = _empty(len(self.rows))
        for r, (t0, t1, kind, lane, flags, name, id_, peer, nbytes, count, detail) in \
                enumerate(self.rows):
            table[r] = (t0, t1, kind, lane, flags, self._name(name), id_, peer, nbytes, count,
                        self._name(detail), -1, -1)
        return table


def _event_kind(name: str) -> Kind:
    """What an instruction of this name is, as a trace event."""
    op = OPS.get(name)
    if op is None:
        return _KIND_OF_CONTROL.get(name, Kind.CONTROL)
    if op.kind is OpKind.COMM:
        return Kind.TRANSFER if name in ("send", "recv") else Kind.COLLECTIVE
    return Kind.EXEC


def _first(out: Any) -> int:
    """The id an instruction is known by: its result, the first of several, or -1."""
    if type(out) is int:
        return out
    return out[0] if out else -1


def _empty(n: int) -> np.ndarray:
    table = np.zeros(n, EVENT_DTYPE)
    for field in ("peer", "detail", "gpu_t0", "gpu_t1"):
        table[field] = -1
    return table
