"""Signals: named scopes whose placement a config chooses (GT's interface, kept).

    gtmpi.load_config("configs/data_parallel.yaml")      # or GTMPI_CONFIG / GT_CONFIG
    with gtmpi.signal.context("weights"):
        model = Model()                                  # its tensors take 'weights'
    x = gtmpi.signal.tensor(batch, "data")               # a copy of batch, placed by 'data'
    gtmpi.signal.enter("data"); ...; gtmpi.signal.exit("data")

Tensors created inside a signal (creation ops, uploads) take its placement; ops computed inside
run on its workers, their results placed by each op's rule. Scopes nest: the inner one wins.
A signal the config does not name is a no-op with one warning, so every annotation can stay in
a script that runs anywhere.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Iterator

from ..placement.types import Placement, make
from .config import ConfigError, Signal, load, parse

__all__ = ["ConfigError", "context", "enter", "exit", "register", "tensor"]


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

    def backward(self) -> str | None:
        """The signal the backward pass of ops recorded now runs under."""
        return self.open[-1][1] if self.open else None


def _book() -> SignalBook:
    from ..client.runtime import runtime
    return runtime().signals


def register(config: dict) -> None:
    """Add the signals of a config given as a dict (as the YAML file would parse)."""
    _book().register(parse(config, "<dict>"))


def load_config(path: str | dict) -> None:
    """Add the signals of a YAML file (or a dict)."""
    book = _book()
    book.register(parse(path, "<dict>") if isinstance(path, dict) else load(path))


@contextmanager
def context(name: str, backward: str | None = None) -> Iterator[None]:
    from ..trace import scope
    book = _book()
    book.enter(name, backward)
    try:
        with scope(f"signal {name}"):
            yield
    finally:
        book.exit(name)


def enter(name: str, backward: str | None = None) -> None:
    _book().enter(name, backward)


def exit(name: str) -> None:
    _book().exit(name)


def tensor(x: Any, name: str) -> Any:
    """A copy of ``x`` placed by signal ``name`` (autograd flows back to ``x``)."""
    from ..client.tensor import Tensor, apply
    from ..client.creation import tensor as make
    if not isinstance(x, Tensor):
        x = make(x)
    copy = apply("clone", x)
    book = _book()
    s = book.signals.get(name)
    if s is None:
        book.enter(name)  # warns once
        book.exit(name)
        return copy
    book.placer.place(copy.id, copy._sig, book.placement(s), s.where("shard.axis"))
    return copy
