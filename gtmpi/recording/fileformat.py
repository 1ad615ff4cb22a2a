"""The trace file: one HDF5 file per run, written by rank 0 alone (h5py here is serial), read
with plain h5py. docs/trace-format.md documents this layout:

  /                     attributes: format, version, status, times, world size, command, ...
  /strings              the string table (variable-length UTF-8); events hold indices into it
  /ranks/<r>/events     rank r's events (EVENT_DTYPE), sorted by t0, on rank 0's clock
  /ranks/<r>            attributes: role, host, pid, device, clock offsets and round trips
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .events import EVENT_DTYPE

FORMAT = "gtmpi-trace"
VERSION = 1


class TraceError(Exception):
    """The file is missing, unreadable, truncated or not a gtmpi trace (one line, no traceback)."""


@dataclass
class Trace:
    path: str
    meta: dict[str, Any]
    strings: list[str]
    events: dict[int, np.ndarray]             # rank -> event table
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its attributes

    def name(self, index: int) -> str:
        return self.strings[index] if 0 <= index < len(self.strings) else ""


def write(path: str, meta: dict[str, Any], strings: list[str], events: dict[int, np.ndarray],
          ranks: dict[int, dict[str, Any]]) -> None:
    """Write the whole file next to its final name, then rename: a run killed while writing
    never leaves a half-written file under the trace's name."""
    import h5py
    tmp = f"{path}.part{os.getpid()}"
    with h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["version"] = VERSION
        for key, value in meta.items():
            f.attrs[key] = _attr(value)
        f.create_dataset("strings", data=np.array(strings, dtype=object),
                         dtype=h5py.string_dtype("utf-8"))
        group = f.create_group("ranks")
        for rank, table in sorted(events.items()):
            g = group.create_group(str(rank))
            g.create_dataset("events", data=table, compression="gzip", compression_opts=1,
                             shuffle=True, chunks=True if len(table) else None)
            for key, value in ranks.get(rank, {}).items():
                g.attrs[key] = _attr(value)
    os.replace(tmp, path)


def read(path: str) -> Trace:
    import h5py
    if not os.path.exists(path):
        raise TraceError(f"{path}: no such file")
    if not h5py.is_hdf5(path):
        raise TraceError(f"{path}: not an HDF5 file (or truncated)")
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise TraceError(f"{path}: an HDF5 file, but not a gtmpi trace")
            version = int(f.attrs.get("version", -1))
            if version > VERSION:
                raise TraceError(f"{path}: trace format version {version} is newer than this "
                                 f"gtmpi-trace reads ({VERSION})")
            meta = {k: _value(v) for k, v in f.attrs.items()}
            strings = [s.decode() if isinstance(s, bytes) else str(s) for s in f["strings"][()]]
            events, ranks = {}, {}
            for key, g in f["ranks"].items():
                table = g["events"][()]
                if table.dtype != EVENT_DTYPE:
                    raise TraceError(f"{path}: rank {key}'s events have an unknown layout")
                events[int(key)] = table
                ranks[int(key)] = {k: _value(v) for k, v in g.attrs.items()}
    except TraceError:
        raise
    except (OSError, KeyError, ValueError) as e:
        raise TraceError(f"{path}: damaged gtmpi trace ({type(e).__name__}: {e})") from None
    return Trace(path, meta, strings, dict(sorted(events.items())), dict(sorted(ranks.items())))


def _attr(value: Any) -> Any:
    """Scalars and strings as themselves; lists and dicts as JSON text."""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    return value


def _value(value: Any) -> Any:
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except ValueError:
            return value
    if isinstance(value, np.generic):
        return value.item()
    return value
