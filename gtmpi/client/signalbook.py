"""The session's signals: their placements, and the scopes open now (gtmpi.signal is the user's
face of it)."""
from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

from ..placement.types import Placement, make
from ..recording.events import Kind, Lane
from ..signals.config import ConfigError, Signal


class SignalBook:
    """The session's signals, and the scopes open now."""

    def __init__(self, placer: Any, worker_ranks: list[int]) -> None:
        self.placer = placer
        self.ranks = worker_ranks
        self.signals: dict[str, Signal] = {}
        self.open: list[tuple[str, str | None]] = []  # (name, backward signal) per scope
        self._warned: set[str] = set()

    def register(self, signals: dict[str, Signal]) -> None:
        for s in signals.values():
            for w in s.workers:
                if w >= len(self.ranks):
                    raise ConfigError(f"{s.where('shard.workers')}: worker {w} is out of range: "
                                      f"this job has {len(self.ranks)} worker(s) (0 to "
                                      f"{len(self.ranks) - 1})")
        self.signals.update(signals)

    def placement(self, s: Signal) -> Placement:
        mesh = tuple(self.ranks[w] for w in s.workers)
        if s.grid:
            return make(mesh, s.grid, list(s.axes))
        return Placement(mesh, "R") if s.axis is None else Placement(mesh, "S", s.axis)

    def enter(self, name: str, backward: str | None = None) -> None:
        s = self.signals.get(name)
        if s is None:
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(f"gtmpi: signal '{name}' is not in the config; its scope changes "
                              "nothing", stacklevel=4)
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
