"""torch's names on gtmpi tensors: torch functions called with gtmpi tensors (``torch.relu(t)``,
``F.relu(t)``) run gtmpi's op of the same name, through ``Tensor.__torch_function__``; one
that gtmpi lacks raises a TypeError that names it, instead of torch's "must be Tensor, not
Tensor"."""
from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

from .client.tensor import Tensor


def torch_function(package: ModuleType, functional: ModuleType) -> Callable[..., Any]:
    """Tensor.__torch_function__: a torch function's name looked up in gtmpi's ``package``,
    then in its nn ``functional`` (the other way round for torch.nn.functional's names), then
    among Tensor's methods."""
    def dispatch(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        module = getattr(func, "__module__", None) or ""
        order = (functional, package) if module.startswith("torch.nn.functional") else \
            (package, functional)
        for space in order:
            fn = getattr(space, name, None) if name else None
            if callable(fn):
                return fn(*args, **(kwargs or {}))
        method = getattr(Tensor, name, None) if name else None
        if callable(method) and args and isinstance(args[0], Tensor):
            return method(*args, **(kwargs or {}))
        raise TypeError(f"gtmpi: {module or 'torch'}.{name} has no gtmpi equivalent; call it on "
                        "torch tensors, or use gtmpi's ops (gtmpi.*, gtmpi.nn.functional.*) on "
                        "gtmpi tensors")
    return classmethod(dispatch)
