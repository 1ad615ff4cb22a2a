"""Whether the client's ops are recorded for autograd, and what records them.

Autograd (autograd/engine.py) sits above the client: it keeps the client's tensors in its
graph and runs the client's ops for their gradients. The client only asks whether to record
(the grad mode, here) and hands each op it runs to autograd, which registers itself with
set_autograd when gtmpi.autograd is imported (gtmpi's own import does), so that nothing in the
client imports autograd.
"""
from __future__ import annotations

import threading
from contextlib import ContextDecorator
from typing import Any, Callable, NamedTuple

import torch

_state = threading.local()


def is_grad_enabled() -> bool:
    """Ours and torch's: a program's ``with torch.no_grad():`` records nothing either."""
    return getattr(_state, "enabled", True) and torch.is_grad_enabled()


class _GradMode(ContextDecorator):
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self) -> None:
        self.prev = getattr(_state, "enabled", True)
        _state.enabled = self.enabled

    def __exit__(self, *exc: Any) -> None:
        _state.enabled = self.prev


def no_grad() -> _GradMode:
    """Context manager and decorator: ops inside record nothing (optimizer steps, evaluation)."""
    return _GradMode(False)


def enable_grad() -> _GradMode:
    return _GradMode(True)


def inference_mode(mode: bool = True) -> _GradMode:
    return _GradMode(not mode)


class set_grad_enabled(_GradMode):
    """As torch's: called, it sets the mode at once; as a context manager it also restores the
    mode before it on exit."""

    def __init__(self, mode: bool):
        super().__init__(bool(mode))
        self.prev = getattr(_state, "enabled", True)
        _state.enabled = self.enabled

    def __enter__(self) -> None:
        pass


class Autograd(NamedTuple):
    """What the client calls of autograd/engine.py."""
    record: Callable[..., None]    # (op, operands, kw, result, graph=None): link a result in
    backward: Callable[..., None]  # (tensor, gradient, retain_graph): Tensor.backward


_autograd: Autograd | None = None


def set_autograd(engine: Autograd) -> None:
    global _autograd
    _autograd = engine


def autograd() -> Autograd:
    if _autograd is None:
        raise RuntimeError("gtmpi: autograd is not loaded (import gtmpi, which loads it)")
    return _autograd
