"""torch.profiler on gtmpi: the same calls, recorded as a gtmpi trace of every rank.

    with gtmpi.profiler.profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
            schedule=gtmpi.profiler.schedule(wait=1, warmup=1, active=3),
            on_trace_ready=gtmpi.profiler.tensorboard_trace_handler("./bench_log")) as prof:
        for step in range(6):
            train_step()
            prof.step()

A program written for torch's profiler (nanoGPT's bench.py) runs unchanged: during the steps
its schedule records (every step, without one) the run is traced as GTMPI_TRACE traces it,
the client's, the dispatcher's and every worker's lanes; when they end, ``on_trace_ready``
gets the profiler, whose ``export_chrome_trace(path)`` writes those steps as Chrome
trace-event JSON (what TensorBoard and Perfetto open, as ``gtmpi-trace export`` writes it) and
whose ``key_averages().table()`` lists the workers' ops with counts and host times. The HDF5
trace stays on disk (``prof.trace_path``) for ``gtmpi-trace``. torch's options that shape what
torch records (shapes, memory, stacks, flops, modules) are accepted and change nothing: a
gtmpi trace always holds what it holds.
"""
from __future__ import annotations

import enum
import gzip
import json
import os
import socket
import tempfile
import time
from contextlib import ContextDecorator
from typing import Any, Callable, Iterable

from .trace import active, scope, start, stop


class ProfilerActivity(enum.Enum):
    CPU = 0
    CUDA = 1
    XPU = 2
    MTIA = 3


class ProfilerAction(enum.Enum):
    NONE = 0
    WARMUP = 1
    RECORD = 2
    RECORD_AND_SAVE = 3


def schedule(*, wait: int, warmup: int, active: int, repeat: int = 0,
             skip_first: int = 0) -> Callable[[int], ProfilerAction]:
    """torch's schedule: after ``skip_first`` steps, cycles of ``wait`` idle steps, ``warmup``
    steps and ``active`` recorded ones (the last of which saves), ``repeat`` times (0: for
    ever)."""
    if wait < 0 or warmup < 0 or active <= 0 or repeat < 0 or skip_first < 0:
        raise AssertionError("Invalid profiler schedule arguments")

    def action(step: int) -> ProfilerAction:
        if step < skip_first:
            return ProfilerAction.NONE
        step -= skip_first
        cycle = wait + warmup + active
        if repeat > 0 and step // cycle >= repeat:
            return ProfilerAction.NONE
        at = step % cycle
        if at < wait:
            return ProfilerAction.NONE
        if at < wait + warmup:
            return ProfilerAction.WARMUP
        return ProfilerAction.RECORD if at < cycle - 1 else ProfilerAction.RECORD_AND_SAVE
    return action


def tensorboard_trace_handler(dir_name: str, worker_name: str | None = None,
                              use_gzip: bool = False) -> Callable[["profile"], None]:
    """What torch's handler does: each saved window as ``<worker>.<ms>.pt.trace.json`` in
    ``dir_name`` (gzipped with ``use_gzip``)."""
    def handler(prof: "profile") -> None:
        os.makedirs(dir_name, exist_ok=True)
        name = worker_name or f"{socket.gethostname()}_{os.getpid()}"
        path = os.path.join(dir_name, f"{name}.{time.time_ns() // 1_000_000}.pt.trace.json"
                            + (".gz" if use_gzip else ""))
        prof.export_chrome_trace(path)
    return handler


class _Averages(list):
    """key_averages(): one row per op the workers ran (count, host time), with torch's table()."""

    def table(self, sort_by: str | None = None, row_limit: int = 100, **_: Any) -> str:
        rows = sorted(self, key=lambda r: -r["count"]) if sort_by == "count" else list(self)
        lines = [f"{'Name':<40} {'# of Calls':>10} {'Host Total (us)':>16} {'Host Avg (us)':>14}"]
        for r in rows[:row_limit]:
            lines.append(f"{r['op']:<40} {r['count']:>10} {r['total_us']:>16.1f} "
                         f"{r['mean_us']:>14.1f}")
        return "\n".join(lines)


class profile:
    """torch.profiler.profile: a context manager whose recorded steps are a gtmpi trace."""

    def __init__(self, *, activities: Iterable[ProfilerActivity] | None = None,
                 schedule: Callable[[int], ProfilerAction] | None = None,
                 on_trace_ready: Callable[["profile"], None] | None = None,
                 record_shapes: bool = False, profile_memory: bool = False,
                 with_stack: bool = False, with_flops: bool = False, with_modules: bool = False,
                 **_: Any) -> None:
        self.activities = set(activities or (ProfilerActivity.CPU, ProfilerActivity.CUDA))
        self.schedule = schedule
        self.on_trace_ready = on_trace_ready
        self.step_num = 0
        self.trace_path: str | None = None  # the last window's HDF5 trace
        self._recording = False
        self._action = ProfilerAction.RECORD

    def __enter__(self) -> "profile":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self._action = self.schedule(self.step_num) if self.schedule else ProfilerAction.RECORD
        self._enter(self._action)

    def stop(self) -> None:
        if self._recording:
            self._save()

    def step(self) -> None:
        """The end of a step: the schedule's window moves on (a window that ends is saved)."""
        if self.schedule is None:
            return
        before = self._action
        self.step_num += 1
        self._action = self.schedule(self.step_num)
        if self._recording and (before is ProfilerAction.RECORD_AND_SAVE or
                                self._action not in (ProfilerAction.RECORD,
                                                     ProfilerAction.RECORD_AND_SAVE)):
            self._save()
        self._enter(self._action)

    def _enter(self, action: ProfilerAction) -> None:
        if self._recording or action not in (ProfilerAction.RECORD,
                                             ProfilerAction.RECORD_AND_SAVE):
            return
        if active():
            raise RuntimeError("gtmpi.profiler: a gtmpi trace is recording already "
                               "(GTMPI_TRACE or gtmpi.trace.start): it holds these steps")
        handle, path = tempfile.mkstemp(prefix="gtmpi-profile-", suffix=".h5")
        os.close(handle)
        start(path)
        self._recording = True

    def _save(self) -> None:
        self.trace_path = stop()
        self._recording = False
        if self.on_trace_ready is not None:
            self.on_trace_ready(self)

    def _trace(self) -> Any:
        if self.trace_path is None:
            raise RuntimeError("gtmpi.profiler: no recorded window has ended yet")
        from .recording import fileformat
        return fileformat.read(self.trace_path)

    def export_chrome_trace(self, path: str) -> None:
        from .trace import chrome
        text = json.dumps(chrome.export(self._trace()))
        if path.endswith(".gz"):
            with gzip.open(path, "wt") as f:
                f.write(text)
        else:
            with open(path, "w") as f:
                f.write(text)

    def key_averages(self, group_by_input_shape: bool = False,
                     group_by_stack_n: int = 0) -> _Averages:
        from .trace import analysis
        return _Averages(analysis.op_rows(self._trace()))


class record_function(ContextDecorator):
    """A named span on the client's lane of the trace (gtmpi.trace.scope)."""

    def __init__(self, name: str, args: str | None = None) -> None:
        self.name = name
        self._scope: Any = None

    def __enter__(self) -> "record_function":
        self._scope = scope(self.name)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scope.__exit__(*exc)
