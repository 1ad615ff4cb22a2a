"""The session's signals: their placements, and the scopes open now (gtmpi.signal is the user's
face of it)."""
from __future__ import annotations

import atexit
import difflib
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

from ..placement.types import Placement, make
from ..recording.events import Kind, Lane
from ..errors import user_stacklevel
from ..signals.config import ConfigError, Signal


class SignalBook:
    """The session's signals, and the scopes open now."""

    def __init__(self, placer: Any, worker_ranks: list[int]) -> None:
        self.placer = placer
        self.ranks = worker_ranks
        self.signals: dict[str, Signal] = {}
        self.open: list[tuple[str, str | None]] = []  # (name, backward signal) per scope
        self._warned: set[str] = set()
        self.used: set[str] = set()  # signals the program entered, placed by or placed with
        self._reporting = False
        self._said_idle = False
        self.checked = False  # check_used ran (at the first backward)

    def register(self, signals: dict[str, Signal]) -> None:
        signals = {n: s if s.workers else replace(s, workers=tuple(range(len(self.ranks))))
                   for n, s in signals.items()}
        needed = max((w for s in signals.values() for w in s.workers), default=-1) + 1
        for s in signals.values():
            for w in s.workers:
                if w >= len(self.ranks):
                    raise ConfigError(f"{s.where('shard.workers')}: worker {w} is out of range: "
                                      f"this job has {len(self.ranks)} worker(s) (0 to "
                                      f"{len(self.ranks) - 1}); the config needs {needed}: "
                                      f"launch {needed + 1} ranks (mpiexec -n {needed + 1}: rank "
                                      "0 runs the program)")
        self.signals.update(signals)
        self._zero(signals)
        idle = sorted(set(range(len(self.ranks))) -
                      {w for s in self.signals.values() for w in s.workers})
        if idle and len(self.ranks) > 1 and not self._said_idle:
            self._said_idle = True
            warnings.warn(f"gtmpi: the config places nothing on worker(s) "
                          f"{', '.join(map(str, idle))} of {len(self.ranks)}: they stay idle",
                          stacklevel=user_stacklevel())
        if not self._reporting:
            self._reporting = True
            atexit.register(self.report)

    def _zero(self, signals: dict[str, Signal]) -> None:
        """ZeRO by mesh: what is replicated over a signal's workers is data-parallel copies at
        its ``zero`` level (a config loaded later says it anew for its workers)."""
        levels: dict[tuple[int, ...], Signal] = {}
        for s in signals.values():
            if s.axis is not None or s.grid:
                continue
            mesh = self.placement(s).mesh
            other = levels.setdefault(mesh, s)
            if other.zero != s.zero:
                raise ConfigError(f"{s.where('zero')}: signal '{other.name}' replicates over "
                                  f"the same workers with zero: {other.zero}, and one level "
                                  "holds for what is replicated over them")
        for mesh, s in levels.items():
            if s.zero:
                self.placer.zero[mesh] = s.zero
            else:
                self.placer.zero.pop(mesh, None)

    def placement(self, s: Signal) -> Placement:
        mesh = tuple(self.ranks[w] for w in s.workers)
        if s.grid:
            return make(mesh, s.grid, list(s.axes))
        return Placement(mesh, "R") if s.axis is None else Placement(mesh, "S", s.axis)

    def get(self, name: str) -> Signal | None:
        """The signal ``name``, noted as used; None, with one warning, if no config has it."""
        self.used.add(name)
        s = self.signals.get(name)
        if s is None and name not in self._warned:
            self._warned.add(name)
            close = difflib.get_close_matches(name, self.signals, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            warnings.warn(f"gtmpi: signal '{name}' is not in the config{hint}; its scope "
                          "changes nothing", stacklevel=user_stacklevel())
        return s

    def unused(self) -> list[str]:
        """The config's signals the program never used; a part of a layout (``stage3.col``)
        counts only where its whole (``stage3``) went unused too: a pipeline's config gives
        every stage every part (the vocabulary's, the blocks'), and a stage holding none of
        those layers leaves them unused by design."""
        return sorted(name for name in set(self.signals) - self.used
                      if "." not in name or name.split(".")[0] not in self.used)

    def check_used(self) -> None:
        """At the first backward: a config none of whose signals has placed anything says so
        now, while the step that would have been parallel has not yet run (a batch made where
        no signal reaches, a misspelt name), rather than only at exit."""
        self.checked = True
        if self.signals and not self.used & set(self.signals):
            warnings.warn(f"gtmpi: the config's signal(s) {', '.join(sorted(self.signals))} "
                          "placed nothing before the first backward: everything runs on one "
                          "worker (gtmpi.debug.explain() says where each tensor was made)",
                          stacklevel=user_stacklevel())

    def report(self) -> None:
        """At exit: a misspelt name in a config leaves the program running on fewer workers
        than meant, which must not pass in silence."""
        unused = self.unused()
        if unused:
            wanted = sorted(self.used - set(self.signals))
            print(f"gtmpi: the config's signal(s) {', '.join(unused)} were never used by the "
                  "program" + (f"; it used {', '.join(wanted)}, which the config lacks"
                               if wanted else ""), file=sys.stderr)

    def enter(self, name: str, backward: str | None = None) -> None:
        s = self.get(name)
        if s is None:
            self.open.append((name, backward))
            return
        self.open.append((name, backward or s.backward))
        self.placer.enter(self.placement(s), s.where("shard.axis"))

    def exit(self, name: str) -> None:
        if not self.open or self.open[-1][0] != name:
            inner = self.open[-1][0] if self.open else None
            raise RuntimeError(f"gtmpi: signal.exit('{name}') does not match the innermost open "
                               f"signal ({inner!r})")
        self.open.pop()
        if name in self.signals:
            self.placer.exit()

    @contextmanager
    def scope(self, name: str, backward: str | None = None) -> Iterator[None]:
        """Inside the signal ``name``: a span of the client's lane while tracing."""
        start = time.perf_counter_ns()
        self.enter(name, backward)
        try:
            yield
        finally:
            self.exit(name)
            rec = self.placer.d.trace
            if rec is not None:
                rec.event(Kind.SCOPE, Lane.CLIENT, start, time.perf_counter_ns(), f"signal {name}")

    def backward(self) -> str | None:
        """The signal the backward pass of ops recorded now runs under."""
        return self.open[-1][1] if self.open else None
