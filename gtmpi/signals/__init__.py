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

import difflib
from contextlib import contextmanager
from typing import Any, Iterator

from .config import ConfigError, load, parse

__all__ = ["ConfigError", "context", "enter", "exit", "names", "place", "register", "tensor"]


def _book() -> Any:
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
    with _book().scope(name, backward):
        yield


def enter(name: str, backward: str | None = None) -> None:
    _book().enter(name, backward)


def exit(name: str) -> None:
    _book().exit(name)


def names() -> list[str]:
    """The signals the loaded configs define."""
    return sorted(_book().signals)


def place(x: Any, name: str) -> Any:
    """Move ``x`` itself (a tensor, or every parameter and buffer of a module) where signal
    ``name`` places it: the same objects, their values kept, now living there (a stage's
    weights onto its workers, a model built whole then laid out). Returns ``x``."""
    book = _book()
    book.used.add(name)
    s = book.signals.get(name)
    if s is None:
        close = difflib.get_close_matches(name, book.signals, n=1)
        raise ConfigError(f"no signal named {name!r} in the loaded config" +
                          (f" (did you mean '{close[0]}'?)" if close else ""))
    tensors = [x] if not hasattr(x, "parameters") else [*x.parameters(), *x.buffers()]
    for t in tensors:
        book.placer.place(t.id, t._sig, book.placement(s), s.where("shard.axis"))
    return x


def as_state(x: Any) -> Any:
    """A copy of ``x`` (a tensor already on the workers) placed as a config's 'parameters'
    signal places a module's state at its first use; None where that signal does not apply
    (the config has none, or a scope is open)."""
    book = _book()
    if "parameters" not in book.signals or book.open:
        return None
    return tensor(x, "parameters")


def tensor(x: Any, name: str) -> Any:
    """A copy of ``x`` placed by signal ``name`` (autograd flows back to ``x``). Host data
    (torch, numpy, lists) is uploaded straight to where the signal places it: each member its
    own piece."""
    from ..client.tensor import Tensor, apply
    from ..client.creation import tensor as make
    book = _book()
    if not isinstance(x, Tensor):
        with book.scope(name):
            return make(x)
    copy = apply("clone", x)
    s = book.get(name)  # warns once where it is missing
    if s is None:
        return copy
    book.placer.place(copy.id, copy._sig, book.placement(s), s.where("shard.axis"))
    return copy
